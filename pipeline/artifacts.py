"""The artifact contract: every file and folder one stage writes and another reads.

A work dir (``<work_root>/<config name>/``) holds one folder per stage, named after the stage; the runner
writes each folder's ``manifest.json`` and ``stage.log``. Anything a stage reads from another stage's folder
is named here, so a rename is one edit and a reader never guesses a path. What the hand-off files hold
(build settings, provenance, the plan, accuracy, verify and bench results) is typed in ``pipeline.records``.
"""

from __future__ import annotations

from pathlib import Path

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
EDGE_BUNDLE_DIR = "edge_bundle"  # the edge target: what the device needs (pipeline/engines/edgellm/)
EDGE_ONNX_DIR = "onnx"  # edge_bundle/onnx: Edge-LLM's export (llm/model.onnx, its config and embedding)
EDGE_MANIFEST_FILE = "edge_manifest.json"  # which JetPack and Edge-LLM the device commands are for
EDGE_BUILD_SCRIPT = "build_engine.sh"  # run on the device: the engine build
EDGE_RUN_SCRIPT = "run.sh"  # run on the device: a few prompts through the engine
EDGE_CHECK_FILE = "export_check.json"  # what the build read back from the export here

# ------------------------------------------------------------------ publish, verify, bench, report

# `invoke optimize` (pipeline/optimize.py): <work dir>/optimize/candidates/<name>/ (each candidate's work dir) and
# <work dir>/optimize/results/ (the last choice's evidence; results.failed/ where a run chose nothing)
OPTIMIZE_DIR = "optimize"
OPTIMIZE_RESULTS_DIR = "results"
OPTIMIZE_RESULTS_FILE = "optimize_results.json"
OPTIMIZE_TABLE_FILE = "optimize.md"
OPTIMIZE_PLOT_FILE = "pareto.png"
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
