"""The vllm target: the quantized checkpoint exported as vLLM loads it (compressed-tensors), checked in vLLM, and
served by vLLM's OpenAI server and by Triton over vLLM's engine (pipeline/engines/vllm/,
triton_repo/tensorrt_llm_vllm). vLLM's CPU build serves it here; its CUDA build on GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from pipeline import artifacts
from pipeline.formats import HIGH_PRECISION, NO_QUANT, VLLM_CPU_BLOCK_MULTIPLE, VLLM_CPU_MLA_BLOCK, VLLM_SERVABLE
from pipeline.targets.base import (
    NEEDS_GPU,
    NEEDS_VLLM_CPU,
    NEEDS_VLLM_ENV,
    SERVER_TRITON_VLLM,
    SERVER_VLLM_OPENAI,
    Target,
    priority_parameters,
    watchdog_parameters,
)

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig
    from pipeline.records import BuildSettings

FRONTENDS = ("openai", "triton")  # vllm.frontends: vLLM's own OpenAI server, Triton over vLLM's engine
# (vllm.device, the first of vllm.frontends: the server the image runs) -> Dockerfile target
DOCKER_STAGES = {("cpu", "openai"): "vllm-cpu", ("cuda", "openai"): "vllm-gpu",
                 ("cpu", "triton"): "vllm-triton-cpu", ("cuda", "triton"): "vllm-triton-gpu"}


class VllmTarget(Target):
    name = "vllm"
    summary = "the checkpoint exported for vLLM (compressed-tensors), served by vLLM's OpenAI server and Triton"
    engine_label = "vLLM"
    artifact_dir = artifacts.VLLM_MODEL_DIR
    artifact_files = (artifacts.VLLM_ENGINE_FILE, "config.json")
    model_code = "tensorrt_llm_vllm"
    build_entry = "pipeline.engines.vllm.target:build_stage"
    preflight_entry = "pipeline.engines.vllm.runtime:preflight"
    verify_entry = "pipeline.serving.verify_vllm:verify_vllm"
    fuses_gate_up = True  # vLLM runs gate/up as one gate_up_proj (its packed_modules_mapping)
    # the gate's KV format; vLLM serves a quantized one as FP8 (vllm.kv_cache_dtype)
    kv_formats = ("int8", "fp8", "none")
    # max_running: vLLM's max_num_seqs as served (publish writes it into the served engine record), at most
    # build.max_batch_size, the build's (and its vLLM check's) max_num_seqs
    serving_settings = frozenset({"max_running", "priority_levels", "tenants"})

    default_frontends = FRONTENDS

    def frontends(self, cfg: "PipelineConfig") -> tuple[str, ...]:
        return tuple(cfg.vllm.frontends)

    def server(self, frontend: Optional[str] = None) -> str:
        super().server(frontend)  # one of FRONTENDS
        return SERVER_TRITON_VLLM if frontend == "triton" else SERVER_VLLM_OPENAI

    def on_cpu(self, cfg: "PipelineConfig") -> bool:
        return cfg.vllm.device == "cpu"

    def requirements(self, cfg: "PipelineConfig") -> tuple[str, ...]:
        # the build checks the export in vLLM too; vLLM's CPU build runs on AVX-512 or AMX only
        device = NEEDS_VLLM_CPU if self.on_cpu(cfg) else NEEDS_GPU
        return tuple(dict.fromkeys((*super().requirements(cfg), NEEDS_VLLM_ENV, device)))

    def docker_stage(self, cfg: "PipelineConfig") -> str:
        return DOCKER_STAGES[(cfg.vllm.device, cfg.vllm.frontends[0])]

    def alert_engine(self, cfg: "PipelineConfig") -> tuple[str, bool]:
        return ("vllm" if cfg.vllm.frontends[0] == "openai" else "triton"), cfg.vllm.device == "cuda"

    def missing_artifacts(self, artifact: Path) -> list[str]:
        lacking = super().missing_artifacts(artifact)
        if not any((artifact / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
            lacking.append("model.safetensors or its shards' index")
        return lacking

    def llm_model(self, triton: Any, settings: BuildSettings, *, serving_root: str, llm_model: str, preprocessing: str,
                  version: int, adaptive_target_ms: Optional[float]) -> tuple[dict[str, Any], int, str]:
        params = {"model_dir": self.artifact_dir, **priority_parameters(triton), **watchdog_parameters(triton)}
        return params, 1, "KIND_MODEL"  # one engine batches every request and places itself on its devices

    def apply_serving_settings(self, triton: Any, served: Path, tenants: Sequence[Any] = ()) -> None:
        """The served export's engine record with the triton section's max_running as vLLM's max_num_seqs: both
        frontends start vLLM from that record (Triton's vLLM model and ``pipeline.serving.launch vllm``). With
        tenants, the record carries them and the OpenAI server's flags load their admission (Triton's vLLM model
        reads them from its own parameter)."""
        self.call("pipeline.engines.vllm.engine_args:apply_served", triton, served / artifacts.VLLM_ENGINE_FILE,
                  [t.model_dump(exclude_none=True) for t in tenants])

    def serving_setting_note(self, key: str) -> str:
        return {
            "adaptive_batch": " (vLLM's scheduler fills its batch up to triton.max_running itself)",
            "prefill_chunk_tokens": " (vLLM always chunks prefills within build.max_num_tokens a step)",
        }.get(key, "")

    def kv_offloading_gib(self, cfg: "PipelineConfig") -> Optional[float]:
        return cfg.vllm.kv_offloading_gib  # --kv-offloading-size: the total over tensor-parallel ranks

    def host_kv_cache_gib(self, cfg: "PipelineConfig") -> int:
        return cfg.vllm.cpu_kv_cache_gib  # VLLM_CPU_KVCACHE_SPACE: process memory

    def tenant_pool_blocks(self, triton: Any, build: Any) -> Optional[int]:
        return None  # vLLM sizes its KV pool as its engine starts (vllm.cpu_kv_cache_gib, or the GPU's free memory)

    def serves_format(self, weight_format: str, setting: Callable[[str], Any]) -> bool:
        return setting("vllm.device") in VLLM_SERVABLE.get(weight_format, ())

    def check(self, cfg: "PipelineConfig") -> list[str]:
        """What vLLM cannot serve, refused before any work (facts: pipeline.formats.VLLM_SERVABLE)."""
        q, b, v = cfg.quantization, cfg.build, cfg.vllm
        servable = [f for f, where in VLLM_SERVABLE.items() if v.device in where]
        if q.weight_format not in servable:
            elsewhere = [d for d in VLLM_SERVABLE.get(q.weight_format, ()) if d != v.device]
            return [
                f"build.target: vllm cannot serve quantization.weight_format {q.weight_format} on vllm.device "
                f"{v.device}: the vLLM export writes compressed-tensors INT8 W8A8 (int8_sq) and INT4 W4A16 (int4_awq) "
                f"for any device, FP8 (fp8) and INT8 W8A16 (int8_wo) for cuda only (vLLM 0.32's CPU build has no "
                f"working kernel for them). Use weight_format {', '.join(servable)}"
                + (f", or vllm.device {elsewhere[0]}" if elsewhere else "")
                + f", or build.target tensorrt / cpu for {q.weight_format}"]
        named = [("plan.budget.wider_formats", f) for f in (cfg.plan.budget.wider_formats if cfg.plan.budget else ())]
        named += [(f"plan.rules {r.pattern!r}", r.format) for r in cfg.plan.rules if r.format is not None]
        unservable = [f"{where}: {f}" for where, f in named if f not in servable and f != HIGH_PRECISION]
        if unservable:
            return [f"{'; '.join(unservable)}: vLLM on {v.device} serves {', '.join(servable)}"]
        if b.pipeline_parallel_size != 1:
            return ["build.target: vllm shards with build.tensor_parallel_size; pipeline_parallel_size must be 1"]
        if v.device == "cpu":
            tpb = b.kv_cache.tokens_per_block
            if tpb % VLLM_CPU_BLOCK_MULTIPLE and tpb != VLLM_CPU_MLA_BLOCK:
                return [f"build.kv_cache.tokens_per_block {tpb}: vLLM's CPU attention takes blocks of a multiple of "
                        f"{VLLM_CPU_BLOCK_MULTIPLE} tokens ({VLLM_CPU_MLA_BLOCK} for a model with multi-head latent "
                        f"attention, whose CPU backend takes that only)"]
            if b.cuda_graphs.enabled:
                return ["build.cuda_graphs.enabled: there are no CUDA graphs on vllm.device cpu; set it false"]
            quantized = sorted({q.weight_format, *(f for _, f in named)} - {NO_QUANT, HIGH_PRECISION})
            if quantized and v.dtype == "float32":
                return [f"vllm.dtype float32 with {', '.join(quantized)} weights: vLLM's CPU INT8 and INT4 GEMMs "
                        f"take bfloat16 or float16 activations only; use vllm.dtype bfloat16"]
        return []
