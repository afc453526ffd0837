"""The artifact contract: every file and folder one stage writes and another reads, and typed readers for them.

A work dir (``<work_root>/<config name>/``) holds one folder per stage, named after the stage; the runner
writes each folder's ``manifest.json`` and ``stage.log``. Anything a stage reads from another stage's folder
is named here, so a rename is one edit and a reader never guesses a path. ``provenance.json`` (publish)
and ``build_settings.json`` (build) are read through the pydantic models below, which check them once and
say what to rerun when they are missing or from another pipeline version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.errors import InputError

# ------------------------------------------------------------------ the work dir and its stages

MANIFEST_FILE = "manifest.json"
STAGE_LOG_FILE = "stage.log"
LOCK_FILE = ".lock"
STAGING_DIR = ".staging"  # stage outputs are written here, then renamed into place
TRASH_DIR = ".trash"  # a replaced output is moved here before deletion
HASH_CACHE_FILE = ".file_hashes.json"  # stat-keyed sha256 cache for large input files
MANIFEST_FORMAT_VERSION = 1

# stage (= its folder in the work dir) -> the invoke task that runs it, in pipeline order
STAGE_TASK: dict[str, str] = {
    "model": "download",
    "text": "download",
    "sensitivity": "sensitivity",
    "plan": "sensitivity",
    "quantize": "quantize",
    "build": "build",
    "publish": "publish",
    "verify": "verify",
    "bench": "bench",
    "report": "report",
}

# ------------------------------------------------------------------ model and text (invoke download)

MODEL_DIR = "hf_model"  # model/hf_model/: an HF-format folder
CALIBRATION_TOKENS_FILE = "calibration_tokens.safetensors"
EVALUATION_TOKENS_FILE = "evaluation_tokens.safetensors"
CALIBRATION_TEXT_FILE = "calibration_samples.jsonl"
EVALUATION_TEXT_FILE = "evaluation_samples.jsonl"
TOKENS_KEY = "input_ids"  # the tensor name inside the token files

# The tokenizer files a model folder may carry; every stage that copies a tokenizer copies these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# A tokenizer folder needs one of these to load.
TOKENIZER_CORE_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# ------------------------------------------------------------------ sensitivity and plan (invoke sensitivity)

SENSITIVITY_TABLE_JSON = "sensitivity_table.json"
SENSITIVITY_TABLE_MD = "sensitivity_table.md"
SENSITIVITY_HEATMAP_PNG = "sensitivity_heatmap.png"
PLAN_FILE = "plan.yaml"
PLAN_MD = "plan.md"
PLAN_ERRORS_PNG = "sensitivity_errors.png"

# ------------------------------------------------------------------ quantize

TRTLLM_CHECKPOINT_DIR = "trtllm_checkpoint"
HF_CHECKPOINT_DIR = "hf_checkpoint"
QUANT_CFG_FILE = "quant_cfg.json"  # MIXED_PRECISION checkpoints: per-layer formats, beside config.json
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
ACCURACY_FILE = "accuracy.json"
GENERATIONS_FILE = "generations.md"

# ------------------------------------------------------------------ build

BUILD_SETTINGS_FILE = "build_settings.json"
CPU_BUNDLE_DIR = "cpu_bundle"
ENGINE_DIR = "engine"
LLM_API_DIR = "llm_api"
VLLM_MODEL_DIR = "vllm_model"  # the vllm target: the export (HF folder, compressed-tensors) vLLM loads
VLLM_ENGINE_FILE = "vllm_engine.json"  # inside it: vLLM's engine arguments and environment, its version
LLM_API_OPTIONS_FILE = "llm_api_options.yaml"
LLM_API_CHECKPOINT_DIR = "checkpoint"
BUILD_PROVENANCE_FILE = "build_provenance.json"  # inside the engine / llm_api folder
CPU_CHECKPOINT_SUBDIR = "checkpoint"  # cpu_bundle/checkpoint: the TensorRT-LLM checkpoint
CPU_MODEL_SUBDIR = "model"  # cpu_bundle/model: config and tokenizer files
CPU_RUNTIME_FILE = "runtime.json"

# ------------------------------------------------------------------ publish, verify, bench, report

MODEL_REPOSITORY_DIR = "model_repository"  # publish/model_repository: snapshot of the version just published
DEFAULT_REPOSITORY_DIR = "model_repository"  # <work dir>/model_repository: the live repository
PROVENANCE_FILE = "provenance.json"
MODEL_CONFIG_FILE = "config.pbtxt"
TOKENIZER_DIR = "tokenizer"
SERVER_LOG_FILE = "tritonserver.log"
VERIFY_RESULTS_FILE = "verify_results.json"
BENCH_RESULTS_FILE = "bench_results.json"
REPORT_HTML = "index.html"
REPORT_MD = "index.md"
REPORT_SUMMARY_JSON = "summary.json"


def stage_dir(work_dir: Path, stage: str) -> Path:
    if stage not in STAGE_TASK:
        raise KeyError(f"unknown stage {stage!r}")
    return work_dir / stage


def published_repository(work_dir: Path) -> Path:
    """The snapshot publish wrote of the version it just published."""
    return work_dir / "publish" / MODEL_REPOSITORY_DIR


# ------------------------------------------------------------------ typed readers


class _Record(BaseModel):
    # Readers accept fields they do not know (a newer pipeline may add some) and check the ones they use.
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class KVCacheSettings(_Record):
    quant_algo: Optional[str]
    tokens_per_block: int
    free_gpu_memory_fraction: float
    enable_block_reuse: bool


class CudaGraphSettings(_Record):
    enabled: bool
    batch_sizes: list[int]
    enable_padding: bool
    cuda_graph_mode: bool
    cuda_graph_cache_size: int


class BuildSettings(_Record):
    """build_settings.json: what the build decided, the same shape for every target."""

    target: str
    artifact_dir: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_chunked_context: bool = False  # tensorrt: the Triton backend chunks long contexts
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: Optional[int] = None
    kv_cache: KVCacheSettings
    cuda_graphs: CudaGraphSettings
    trtllm_version: Optional[str]
    provenance: dict
    checkpoint_sha256: str


class PublishedQuantization(_Record):
    weight_format: str
    kv_cache: Optional[str]


class PublishedBuildInfo(_Record):
    target: str
    trtllm_version: Optional[str]
    world_size: int = 1  # GPUs (tensor x pipeline parallel ranks) one server of it needs
    server_ranks: int = 1  # tritonserver processes that serve it: world_size for an engine per rank, else 1
    tensorrt_llm_model: str = ""  # the engine model: the one every rank loads (serving/launch.py)


class Provenance(_Record):
    """provenance.json: what publish served, from what, at which repository digest."""

    config_name: str
    model_name: str
    version: int
    repository_digest: str
    models: list[str] = []
    quantization: PublishedQuantization
    build: PublishedBuildInfo


def _read_json(path: Path, rerun: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} is missing; run `invoke {rerun}` first") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is unreadable ({e}); run `invoke {rerun} --force`") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object; run `invoke {rerun} --force`")
    return data


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())


def read_build_settings(build_dir: Path) -> BuildSettings:
    path = build_dir / BUILD_SETTINGS_FILE
    try:
        return BuildSettings.model_validate(_read_json(path, "build"))
    except ValidationError as e:
        raise InputError(f"{path}: {_problems(e)}. It was written by another pipeline version; "
                         f"run `invoke build --force`") from None


def read_provenance(repository_dir: Path) -> Provenance:
    path = repository_dir / PROVENANCE_FILE
    if not path.is_file():
        raise InputError(f"No published build at {repository_dir} (no {PROVENANCE_FILE}). Run `invoke publish` "
                         f"(or `invoke all`) for this config first.")
    try:
        return Provenance.model_validate(_read_json(path, "publish"))
    except ValidationError as e:
        raise InputError(f"{path}: missing or mistyped field(s): {_problems(e)}. It was not written by this "
                         f"pipeline's publish stage, or by an older one: publish again.") from None
