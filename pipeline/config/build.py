"""The ``build`` section (what every target builds) and the ``vllm`` section (the vllm target's engine arguments)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from pipeline import targets
from pipeline.config.base import Dtype, Frontend, SafeName, Strict


class PagedKVCache(Strict):
    tokens_per_block: int = Field(32, ge=1, le=1024)
    free_gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    enable_block_reuse: bool = True

    @field_validator("tokens_per_block")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two (e.g. 16, 32, 64, 128)")
        return v


class CudaGraphs(Strict):
    enabled: bool = True
    # None: powers of two up to max_batch_size (and max_batch_size itself), padded to the next size
    batch_sizes: Optional[tuple[int, ...]] = None
    enable_padding: bool = True


class BuildSection(Strict):
    # the registered build targets (pipeline/targets/): tensorrt, pytorch, cpu, vllm
    target: str = "cpu"
    dtype: Dtype = "float16"
    max_batch_size: int = Field(8, ge=1, le=4096)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_num_tokens: int = Field(8192, ge=1)
    max_beam_width: int = Field(1, ge=1, le=8)
    kv_cache: PagedKVCache = PagedKVCache()
    cuda_graphs: CudaGraphs = CudaGraphs()
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    multiple_profiles: bool = True
    # The TensorRT-LLM release the engine is built with and served by (engines only load under it).
    trtllm_version: str = "1.2.1"
    # GPU targets (pipeline/engines/trtllm/ checks these against TensorRT-LLM 1.2's option table and rules).
    # None: chosen by weight format (disable for FP8 and INT8 SmoothQuant weights, else auto = the checkpoint
    # dtype; pipeline/engines/trtllm/rules.py default_gemm_plugin cites why)
    gemm_plugin: Optional[Literal["auto", "float16", "bfloat16", "float32", "fp8", "disable"]] = None
    # None: on wherever TensorRT-LLM allows it (never with an INT8 KV cache); KV-cache reuse needs it
    use_paged_context_fmha: Optional[bool] = None
    # tensorrt target: context chunking in the Triton backend (enable_chunked_context). None: on wherever paged
    # context FMHA is on (it needs it); then max_num_tokens must be a multiple of kv_cache.tokens_per_block.
    chunked_context: Optional[bool] = None
    # tensorrt target: the FP8 GEMM + SwiGLU fusion of the gated MLP (--gemm_swiglu_plugin fp8 with
    # --use_fused_mlp), FP8 weights on Hopper only. Off by default: it drops one of gate/up's quantization scales
    # ("can slightly reduce accuracy", TensorRT-LLM's FP8 guide), and the accuracy gate measures the checkpoint,
    # not this arithmetic. true: a profile opts in for its speed (upstream advises it for large models), having
    # checked the served accuracy itself.
    fp8_swiglu_fusion: bool = False
    # TensorRT's timing cache, kept across builds (absolute, or relative to the current directory);
    # None: <user cache dir>/trtllm-pipeline/timing-cache. One file per GPU model and TensorRT-LLM version.
    timing_cache_dir: Optional[Path] = None
    # The GPU this profile is sized for; a build on another compute capability is refused (engines are
    # specific to the GPU architecture they were built on). sm = compute capability x 10 (H100: 90).
    target_gpu: Optional[str] = None
    target_sm: Optional[int] = Field(None, ge=70, le=130)

    @field_validator("target")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in targets.REGISTRY:
            raise ValueError(f"must be one of the registered build targets: {', '.join(targets.names())}")
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "BuildSection":
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be smaller than max_seq_len "
                f"({self.max_seq_len}): max_seq_len counts the prompt plus the generated tokens"
            )
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}): each sequence in a batch needs at least one token per step"
            )
        sizes = self.cuda_graphs.batch_sizes
        if sizes is not None:
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"cuda_graphs.batch_sizes {list(sizes)} must be positive, unique, ascending")
            if sizes[-1] > self.max_batch_size:
                raise ValueError(
                    f"cuda_graphs.batch_sizes {list(sizes)} go beyond max_batch_size ({self.max_batch_size})"
                )
        if targets.get(self.target).single_process and (self.tensor_parallel_size,
                                                         self.pipeline_parallel_size) != (1, 1):
            raise ValueError(f"the {self.target} target runs on one process: tensor/pipeline parallel sizes must be 1")
        return self


class VllmSection(Strict):
    """vllm target: the engine arguments the build section does not already say (pipeline/engines/vllm)."""

    device: Literal["cpu", "cuda"] = "cpu"  # where vLLM serves (its CPU build, or its CUDA build on GPUs)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # activations and unquantized weights
    # None: fp8 where quantization.kv_cache quantizes it (vLLM's KV caches are FP8, never INT8), else auto
    kv_cache_dtype: Optional[Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]] = None
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # cuda only
    cpu_kv_cache_gib: int = Field(1, ge=1)  # cpu only: the KV cache's size (VLLM_CPU_KVCACHE_SPACE)
    # The host-memory KV tier (vLLM 0.32's --kv-offloading-size, GiB): the TOTAL over the tensor-parallel ranks
    # (each rank gets its share), unlike the old per-GPU --swap-space it replaces (the V1 engine dropped it). On
    # CUDA vLLM holds it in one region under /dev/shm: `invoke deploy-manifests` sizes the pod's /dev/shm and
    # memory limit from it and `invoke explain` prints them. None: no offloading.
    kv_offloading_gib: Optional[float] = Field(None, gt=0)
    # the OpenAI server's model name (its "model" field); None: triton.model_name
    served_model_name: Optional[SafeName] = None
    # What serves the export in verify and bench (each is checked and swept): vLLM's own OpenAI server, and
    # Triton through the vLLM Python-backend model (the ensemble's inputs, as on every target). The first one
    # is what `invoke serve` starts.
    frontends: list[Frontend] = Field(default_factory=lambda: list[Frontend](["openai", "triton"]), min_length=1)

    @field_validator("frontends")
    @classmethod
    def _distinct_frontends(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"vllm.frontends lists one twice: {v}")
        return v
