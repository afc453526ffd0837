"""The cpu target: this project's reference runtime runs the exported quantized checkpoint on the CPU inside
Triton's Python backend (pipeline/engines/cpu_runtime.py, triton_repo/tensorrt_llm_cpu). A reference for
correctness and wiring, never a stand-in for TensorRT."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pipeline import artifacts
from pipeline.targets.base import Target, priority_parameters, watchdog_parameters

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig
    from pipeline.records import BuildSettings


class CpuTarget(Target):
    name = "cpu"
    summary = "the CPU reference runtime on the quantized checkpoint, in Triton's Python backend"
    artifact_dir = artifacts.CPU_BUNDLE_DIR
    artifact_files = (artifacts.CPU_RUNTIME_FILE, f"{artifacts.CPU_CHECKPOINT_SUBDIR}/config.json")
    tokenizer_subdir = artifacts.CPU_MODEL_SUBDIR
    model_code = "tensorrt_llm_cpu"
    build_entry = "pipeline.engines.build:build_stage"
    kv_formats = ("int8", "fp8", "none")
    serving_settings = frozenset({"adaptive_batch", "max_running", "prefill_chunk_tokens", "priority_levels",
                                  "tenants"})
    single_process = True
    reference_runtime = True
    report_note = ("Target `cpu`: the CPU reference runtime (pipeline.engines.cpu_runtime) serving the exported "
                   "quantized checkpoint. A reference for correctness and wiring, **not a TensorRT engine**; its "
                   "speed says nothing about a GPU's.")

    def docker_stage(self, cfg: "PipelineConfig") -> str:
        return "cpu"

    def llm_model(self, triton: Any, settings: BuildSettings, *, serving_root: str, llm_model: str, preprocessing: str,
                  version: int, adaptive_target_ms: Optional[float]) -> tuple[dict[str, Any], int, str]:
        params = {"bundle_dir": self.artifact_dir, "cpu_threads": triton.cpu_threads,
                  "adaptive_batch_target_ms": adaptive_target_ms or 0, "max_running": triton.max_running or 0,
                  "prefill_chunk_tokens": triton.prefill_chunk_tokens or 0, **priority_parameters(triton),
                  **watchdog_parameters(triton)}
        return params, 1, "KIND_CPU"  # one runtime batches every request (continuous batching): copies would not share

    def check(self, cfg: "PipelineConfig") -> list[str]:
        if cfg.triton.adaptive_batch and cfg.sla.p99_itl_ms is None:
            return [f"{ADAPTIVE_BATCH_WHAT}sla.p99_itl_ms is not set"]
        return []


# what triton.adaptive_batch does on the targets whose runtime has it (the message of every refusal starts so)
ADAPTIVE_BATCH_WHAT = ("triton.adaptive_batch: the cpu runtime keeps its step time at sla.p99_itl_ms (build.target: "
                       "cpu with sla.p99_itl_ms set), and the pytorch target turns on TensorRT-LLM's dynamic batch "
                       "tuning; ")
