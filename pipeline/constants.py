"""File names, environment variables and defaults used across the pipeline (one place to look)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_CONFIGS_DIR = REPO_ROOT / "engine_configs"
DEFAULT_CONFIG = ENGINE_CONFIGS_DIR / "smollm2-135m-cpu.yaml"
DEFAULT_WORK_ROOT = Path("build")  # relative to the current directory; <work_root>/<config name>/

# Work-dir layout. Each stage's artifacts live in <work_dir>/<stage>/ with its manifest inside.
MANIFEST_FILE = "manifest.json"
STAGE_LOG_FILE = "stage.log"
LOCK_FILE = ".lock"
STAGING_DIR = ".staging"  # stage outputs are written here, then renamed into place
TRASH_DIR = ".trash"  # a replaced output is moved here before deletion
HASH_CACHE_FILE = ".file_hashes.json"  # stat-keyed sha256 cache for large input files
MANIFEST_FORMAT_VERSION = 1

# download stage outputs
MODEL_DIR = "hf_model"  # inside the model stage dir: an HF-format folder
CALIBRATION_TOKENS_FILE = "calibration_tokens.safetensors"
EVALUATION_TOKENS_FILE = "evaluation_tokens.safetensors"
CALIBRATION_TEXT_FILE = "calibration_samples.jsonl"
EVALUATION_TEXT_FILE = "evaluation_samples.jsonl"
TOKENS_KEY = "input_ids"

# Hub
HF_TOKEN_ENV = "HF_TOKEN"
HF_OFFLINE_ENV = "HF_HUB_OFFLINE"
# What a Hub download fetches unless the config says otherwise: weights in safetensors, configs,
# tokenizer and generation files. Pickle weights are refused unless allow_pickle is set.
HUB_DEFAULT_INCLUDE = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
