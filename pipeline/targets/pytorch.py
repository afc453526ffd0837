"""The pytorch target: TensorRT-LLM's LLM API (its PyTorch backend, the upstream default) serving the HF unified
quantized checkpoint with an LLM-API options file, from a Python-backend Triton model (pipeline/engines/trtllm/,
triton_repo/tensorrt_llm_pytorch). GPU only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pipeline import artifacts
from pipeline.targets.base import Target, watchdog_parameters

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig
    from pipeline.records import BuildSettings


class PytorchTarget(Target):
    name = "pytorch"
    summary = "TensorRT-LLM's LLM API on the HF unified checkpoint, in Triton's Python backend; GPU only"
    artifact_dir = artifacts.LLM_API_DIR
    artifact_files = (artifacts.LLM_API_OPTIONS_FILE, f"{artifacts.LLM_API_CHECKPOINT_DIR}/config.json")
    model_code = "tensorrt_llm_pytorch"
    build_entry = "pipeline.engines.trtllm.targets:build_pytorch_stage"
    preflight_entry = "pipeline.engines.trtllm.preflight:preflight"
    gpu_only = True
    serves_hf_checkpoint = True
    fuses_gate_up = True  # the HF unified checkpoint fuses gate/up (pipeline/quant/sensitivity.py)
    kv_formats = ("fp8", "none")  # TensorRT-LLM's LLM API has an FP8 KV cache only
    serving_settings = frozenset({"adaptive_batch", "max_running", "scheduler_policy",
                                  "kv_cache_free_gpu_memory_fraction"})
    records_trtllm_version = True

    def check(self, cfg: "PipelineConfig") -> list[str]:
        q = cfg.quantization
        explicit = q.model_fields_set  # an unset one is chosen to fit (pipeline.autoconfig)
        if q.kv_cache == "int8" and "kv_cache" in explicit:
            return ["quantization.kv_cache: int8 is not supported by the pytorch target (TensorRT-LLM's LLM API has "
                    "FP8 KV only); use fp8 or none, or build.target: tensorrt"]
        if q.weight_format != "none" and not q.export_hf_checkpoint and "export_hf_checkpoint" in explicit:
            return ["build.target: pytorch serves the HF unified checkpoint: set quantization.export_hf_checkpoint: "
                    "true"]
        return []

    def docker_stage(self, cfg: "PipelineConfig") -> str:
        return "gpu"

    def llm_model(self, triton: Any, settings: BuildSettings, *, serving_root: str, llm_model: str, preprocessing: str,
                  version: int, adaptive_target_ms: Optional[float]) -> tuple[dict[str, Any], int, str]:
        params = {"checkpoint_dir": artifacts.LLM_API_CHECKPOINT_DIR, "llm_api_options": artifacts.LLM_API_OPTIONS_FILE,
                  **watchdog_parameters(triton)}
        return params, 1, "KIND_MODEL"  # the LLM API places itself on the GPUs

    def serving_setting_note(self, key: str) -> str:
        return {
            "prefill_chunk_tokens": " (TensorRT-LLM's is build.chunked_context with build.max_num_tokens)",
            "priority_levels": "the LLM API's generate_async takes no priority",
        }.get(key, "")
