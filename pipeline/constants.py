"""Environment variables, defaults and source-tree paths (work-dir file names live in pipeline.artifacts)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_CONFIGS_DIR = REPO_ROOT / "engine_configs"
# The embedded default (SmolLM2-135M, INT8 SmoothQuant) served by vLLM's CPU build; the same plan on the cpu
# target (Triton + the reference runtime) is smollm2-135m-cpu.yaml, which the other SmolLM2 configs extend.
DEFAULT_CONFIG = ENGINE_CONFIGS_DIR / "smollm2-135m-vllm.yaml"
# The default where vLLM cannot run (no serving environment, or a CPU without AVX-512 or AMX): the same model
# and plan on the cpu target (commands.open_runner says so when it falls back)
CPU_DEFAULT_CONFIG = ENGINE_CONFIGS_DIR / "smollm2-135m-cpu.yaml"
# 1: the whole output on the console (`--verbose` sets it; child processes inherit it): pipeline/console.py
VERBOSE_ENV = "PIPELINE_VERBOSE"
DEFAULT_WORK_ROOT = Path("build")  # relative to the current directory; <work_root>/<config name>/

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

# Greedy checks of a served model (verify) and of a vLLM export (build): short prompts of different kinds.
CHECK_PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
