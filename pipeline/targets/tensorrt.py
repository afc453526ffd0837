"""The tensorrt target: a TensorRT engine per GPU rank built by TensorRT-LLM 1.2's ``trtllm-build``, served by
Triton's C++ ``tensorrtllm`` backend (pipeline/engines/trtllm/). GPU only; the last release line with engines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pipeline import artifacts
from pipeline.targets.base import Target

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig
    from pipeline.records import BuildSettings


class TensorrtTarget(Target):
    name = "tensorrt"
    summary = "TensorRT engines (trtllm-build, TensorRT-LLM 1.2) served by Triton's tensorrtllm backend; GPU only"
    artifact_dir = artifacts.ENGINE_DIR
    artifact_files = ("config.json", "rank0.engine")
    triton_backend = "tensorrtllm"
    build_entry = "pipeline.engines.trtllm.targets:build_tensorrt_stage"
    preflight_entry = "pipeline.engines.trtllm.preflight:preflight"
    gpu_only = True
    engine_per_rank = True
    serving_settings = frozenset({"scheduler_policy", "kv_cache_free_gpu_memory_fraction"})
    pipeline_metrics = False  # the C++ backend exports TensorRT-LLM's families only
    records_trtllm_version = True

    def docker_stage(self, cfg: "PipelineConfig") -> str:
        return "gpu"

    def llm_model(self, triton: Any, settings: BuildSettings, *, serving_root: str, llm_model: str, preprocessing: str,
                  version: int, adaptive_target_ms: Optional[float]) -> tuple[dict[str, Any], int, str]:
        kv, graphs = settings.kv_cache, settings.cuda_graphs
        # Every key the backend reads is one of tests/data/upstream/tensorrtllm_backend_parameters.json. Three
        # are read without a guard, so a missing one fails the model's load: tokenizer_dir (its value only
        # matters to guided decoding), guided_decoding_backend and xgrammar_tokenizer_info_path (empty: no
        # guided decoding). Triton hands an empty string_value to the backend as "" (checked on Triton 2.51).
        # Multi-GPU runs in leader mode (one tritonserver per rank under mpirun: serving/launch.py), so no
        # orchestrator keys (executor_worker_path, participant_ids) are written.
        params = {
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": f"{serving_root}/{llm_model}/{version}/{self.artifact_dir}",
            "tokenizer_dir": f"{serving_root}/{preprocessing}/{version}/{artifacts.TOKENIZER_DIR}",
            "guided_decoding_backend": "",
            "xgrammar_tokenizer_info_path": "",
            "batch_scheduler_policy": triton.scheduler_policy or "guaranteed_no_evict",
            "max_beam_width": 1,
            "kv_cache_free_gpu_mem_fraction": (triton.kv_cache_free_gpu_memory_fraction
                                               or kv.free_gpu_memory_fraction),
            "enable_kv_cache_reuse": kv.enable_block_reuse,
            "enable_chunked_context": settings.enable_chunked_context,
            "cuda_graph_mode": graphs.cuda_graph_mode,
            "cuda_graph_cache_size": graphs.cuda_graph_cache_size,
            "exclude_input_in_output": True,
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        }
        return params, 1, "KIND_CPU"  # the backend drives the GPUs itself; one instance batches every request

    def serving_setting_note(self, key: str) -> str:
        return {
            "adaptive_batch": " (the tensorrtllm backend reads no dynamic-batch parameter: use build.target: pytorch)",
            "prefill_chunk_tokens": " (TensorRT-LLM's is build.chunked_context with build.max_num_tokens)",
            "priority_levels": "the tensorrtllm backend sets no executor request priority",
            "max_running": "the tensorrt target's limit is build.max_batch_size itself",
        }.get(key, "")
