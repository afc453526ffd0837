"""The GPU targets of the build stage: TensorRT engines (``trtllm-build``) and TensorRT-LLM LLM-API options.

TensorRT-LLM cannot be installed where this project is developed (its wheel comes from NVIDIA's own index and needs CUDA), so this module is
kept thin and checked by contract tests: everything it passes to TensorRT-LLM is checked against one table
of TensorRT-LLM 1.2's option names, allowed values and validity rules (below, each entry with the upstream
file it was read from), before anything runs. It never imports ``tensorrt_llm``: it finds the package with
``importlib.util.find_spec`` and reads versions from the installed distributions' metadata.

- ``check_target_requirements(cfg)``: a GPU (``nvidia-smi``), TensorRT-LLM 1.2.x (and ``trtllm-build`` for
  the tensorrt target), the version the profile pins, and the validity rules against the detected GPU. The
  build stage's ``preflight`` calls it before ``invoke build`` / ``invoke all`` download or quantize anything.
- ``build_tensorrt``: ``trtllm-build`` in a child process, log beside the engine, the engine directory
  checked against what was asked, TensorRT's timing cache reused across builds, provenance recorded.
- ``build_pytorch``: the LLM-API options file (``llm_api_options.yaml``) for the HF unified checkpoint.
- ``cuda_graph_batch_sizes`` / ``cuda_graph_settings``: the CUDA-graph decision both GPU targets share (the
  ``cuda_graph_mode`` / ``cuda_graph_cache_size`` runtime parameters of the Triton ``tensorrtllm`` model).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from pipeline import artifacts
from pipeline.errors import ConfigError, EnvironmentProblem, InputError, StageFailed

log = logging.getLogger(__name__)

BUILD_LOG_FILE = "trtllm-build.log"
TRTLLM_BUILD = "trtllm-build"
NVIDIA_SMI = "nvidia-smi"
SUPPORTED_RELEASE = "1.2."  # the last TensorRT-LLM release line with trtllm-build; the table below is its

# ====================================================================================== the option table
# TensorRT-LLM 1.2, read from NVIDIA/TensorRT-LLM. The index these were read from stores one or more
# versions of each file; the commit is the one it named for the version read (builder.py and llm_args.py:
# the 1.x version without auto-parallel and with the pydantic PluginConfig; the index did not name its commit).
SRC_BUILD_CMD = "tensorrt_llm/commands/build.py @ 65f1d1536e18aea3380e6e270e00895a709333eb"
SRC_PLUGIN = "tensorrt_llm/plugin/plugin.py @ c20322ffd3dc0740ca530c9fad989b22e64f6e06"
SRC_BUILDER = "tensorrt_llm/builder.py (1.x: build(), 'Logics to control paged_context_fmha and fp8_context_fmha')"
SRC_COMMON = "tensorrt_llm/_common.py @ 0fccc5b97dd7b23c438e740b3bf4dcde607266c4 (check_max_num_tokens)"
SRC_MODE = "tensorrt_llm/quantization/mode.py (QuantMode.from_quant_algo, is_int4_weight_only, ...)"
SRC_LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py (1.x: CudaGraphConfig, KvCacheConfig, TorchLlmArgs, " \
               "ExtendedRuntimePerfKnobConfig)"
SRC_KV_REUSE_DOC = "docs/source/advanced/kv-cache-reuse.md @ c3589f17f24f092f4aca4645e1c880faa5700397"
SRC_CLI_DOC = "docs: commands/trtllm-build (generated usage: --log_level choices)"
SRC_MODELOPT_MATRIX = "NVIDIA Model-Optimizer docs guides/0_support_matrix (FP8, W4A8 AWQ: Ada and later; " \
                      "INT8 SmoothQuant, W4A16 AWQ: Ampere and later)"
SRC_TRT_PORTABILITY = "TensorRT: an engine is built for the compute capability of the GPU it is built on " \
                      "(trtllm-build builds each rank on a local GPU: build.py build_and_save)"


@dataclass(frozen=True)
class Opt:
    """One trtllm-build option: ``int``, ``path``, ``choice`` (one of ``choices``) or ``flag`` (no value)."""

    kind: str
    choices: tuple[str, ...] = ()
    source: str = SRC_BUILD_CMD


_SWITCH = ("enable", "disable")  # PluginConfig booleans on the command line (plugin.py add_plugin_argument)


def _switch() -> Opt:
    return Opt("choice", _SWITCH, SRC_PLUGIN)


# The trtllm-build options this pipeline uses (a subset of the CLI; anything else is refused). There are no
# tensor/pipeline-parallel flags: parallelism comes from the checkpoint's mapping. The quantized KV cache
# comes from the checkpoint's kv_cache_quant_algo, not from a flag.
TRTLLM_BUILD_OPTIONS: dict[str, Opt] = {
    "--checkpoint_dir": Opt("path"),
    "--output_dir": Opt("path"),
    "--max_batch_size": Opt("int"),
    "--max_input_len": Opt("int"),
    "--max_seq_len": Opt("int"),
    "--max_beam_width": Opt("int"),
    "--max_num_tokens": Opt("int"),
    "--opt_num_tokens": Opt("int"),
    "--kv_cache_type": Opt("choice", ("continuous", "paged", "disabled")),  # KVCacheType, parsed by enum_type
    "--input_timing_cache": Opt("path"),  # "ignored if the file does not exist"
    "--output_timing_cache": Opt("path"),  # BuildConfig default 'model.cache' in the working directory
    "--profiling_verbosity": Opt("choice", ("layer_names_only", "detailed", "none")),
    "--strip_plan": Opt("flag"),
    "--workers": Opt("int"),  # build.py: min(torch.cuda.device_count(), workers) ranks built in parallel
    "--log_level": Opt("choice", ("internal_error", "error", "warning", "info", "verbose", "debug", "trace"),
                       SRC_CLI_DOC),
    # PluginConfig fields exposed on the command line (cli_plugin_args)
    "--gpt_attention_plugin": Opt("choice", ("auto", "float16", "float32", "bfloat16", "int32", "disable"),
                                  SRC_PLUGIN),
    "--gemm_plugin": Opt("choice", ("auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"),
                         SRC_PLUGIN),
    "--context_fmha": _switch(),
    "--remove_input_padding": _switch(),
    "--tokens_per_block": Opt("int", source=SRC_PLUGIN),  # default 32 in 1.2
    "--use_paged_context_fmha": _switch(),  # default enable in 1.2: "KV cache reuse and chunked context"
    "--use_fp8_context_fmha": _switch(),
    "--multiple_profiles": _switch(),
    "--use_fused_mlp": _switch(),
}

# TensorRT-LLM's LLM API (pytorch backend): the TorchLlmArgs fields this pipeline writes. Values: "int",
# "bool", "fraction" (0..1), "int_list", a tuple of allowed strings, or a nested table; a nested table that is
# "nullable" may be null (cuda_graph_config: null = no CUDA graphs).
LLM_API_OPTIONS: dict[str, Any] = {
    "max_batch_size": "int",
    "max_num_tokens": "int",
    "max_seq_len": "int",
    "max_input_len": "int",
    "tensor_parallel_size": "int",
    "pipeline_parallel_size": "int",
    "kv_cache_config": {  # KvCacheConfig
        # a free string upstream, but only "fp8" is honoured ("Cannot sync quant_config.kv_cache_quant_algo
        # with kv_cache_config.dtype of ..." for anything else): no INT8 KV cache on this target
        "dtype": ("auto", "fp8"),
        "free_gpu_memory_fraction": "fraction",
        "enable_block_reuse": "bool",
        "tokens_per_block": "int",
    },
    "cuda_graph_config": {  # CudaGraphConfig; batch_sizes given -> max_batch_size derived (must not differ)
        "nullable": True,
        "batch_sizes": "int_list",
        "enable_padding": "bool",
    },
}

# Runtime parameters of the Triton `tensorrtllm` model that the build decides (publish writes them).
# ExtendedRuntimePerfKnobConfig in llm_args.py: cuda_graph_mode (bool), cuda_graph_cache_size (int, "number
# of cuda graphs to be cached in the runtime").
TRITON_CUDA_GRAPH_PARAMETERS = ("cuda_graph_mode", "cuda_graph_cache_size")

# QuantAlgo groups (checkpoint quantization.quant_algo / quant_cfg.json layer algos)
FP8_CONTEXT_FMHA_ALGOS = frozenset({"FP8", "W4A8_AWQ", "NVFP4"})  # builder.py: FP8 context FMHA workflow
NEEDS_SM89_ALGOS = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "W4A8_AWQ"})
NEEDS_SM80_ALGOS = frozenset({"W8A16", "W4A16", "W4A16_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
                              "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
                              "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN"})
# builder.py on SM 100-119: is_int8_weight_only / is_int4_weight_only / has_int8_kv_cache -> "INT8/INT4
# quantization is not supported on SM>=100."; has_act_and_weight_quant -> "SmoothQuant is not supported";
# has_per_channel_scaling / has_per_token_dynamic_scaling -> "Per-channel or per-token scaling is not
# supported". Mapped onto QuantAlgo through mode.py (W4A8_AWQ also quantizes activations: not weight-only).
BLACKWELL_REJECTED_ALGOS = frozenset({"W8A16", "W8A16_GPTQ", "W4A16", "W4A16_AWQ", "W4A16_GPTQ",
                                      "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_TENSOR_PLUGIN",
                                      "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
                                      "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "FP8_PER_CHANNEL_PER_TOKEN"})


@dataclass(frozen=True)
class Rule:
    text: str
    source: str


# The validity rules, checked before anything runs (``validity_problems`` / ``check_trtllm_build_argv``).
# Upstream often *silently* turns a feature off or clamps a value with a warning; here a config that would
# be changed that way is refused, so the recorded settings are the engine's settings.
RULES: dict[str, Rule] = {
    "trtllm_release_line": Rule("build.trtllm_version must be a 1.2.x release: 1.2 is the last TensorRT-LLM "
                                "line with trtllm-build, and the option table here is 1.2's", SRC_BUILD_CMD),
    "trtllm_version_installed": Rule("the installed TensorRT-LLM must be the version the profile pins "
                                     "(an engine only loads under the version that built it)", SRC_BUILDER),
    "target_gpu": Rule("the GPU found must have the compute capability the profile targets (build.target_sm)",
                       SRC_TRT_PORTABILITY),
    "tokens_per_block_pow2": Rule("tokens_per_block must be a power of two", SRC_KV_REUSE_DOC),
    "int8_kv_paged_context_fmha": Rule("paged context FMHA does not work with an INT8 KV cache (the builder "
                                       "turns it off; the attention plugin asserts)", SRC_BUILDER),
    "block_reuse_needs_paged_context_fmha": Rule("KV-cache block reuse needs an engine built with paged context "
                                                 "FMHA", SRC_KV_REUSE_DOC),
    "fp8_kv_paged_context_fmha": Rule("paged context FMHA with an FP8 KV cache needs FP8-family weights (FP8, "
                                      "W4A8_AWQ, NVFP4) and SM >= 89 (FP8 context FMHA)", SRC_BUILDER),
    "paged_context_fmha_needs_paged_kv": Rule("paged context FMHA needs context FMHA and the paged KV cache",
                                              SRC_BUILDER),
    "fp8_needs_sm89": Rule("FP8 and W4A8 AWQ weights need SM >= 89 (Ada, Hopper and later)", SRC_MODELOPT_MATRIX),
    "int8_int4_need_sm80": Rule("INT8 SmoothQuant, INT8 and INT4 weight-only need SM >= 80 (Ampere and later)",
                                SRC_MODELOPT_MATRIX),
    "bf16_needs_sm80": Rule("bfloat16 needs SM >= 80 ('Pre SM 80 GPUs do not support bfloat16')", SRC_LLM_ARGS),
    "blackwell_int8": Rule("on Blackwell (SM 100-119) INT8 weight-only, INT4 weight-only, SmoothQuant, "
                           "per-channel/per-token scaling and the INT8 KV cache are rejected", SRC_BUILDER),
    "opt_num_tokens_multiple_profiles": Rule("--opt_num_tokens cannot be combined with --multiple_profiles "
                                             "enable", SRC_BUILD_CMD),
    "max_num_tokens_bounds": Rule("max_num_tokens must be <= max_batch_size * max_seq_len and >= tokens_per_block "
                                  "(upstream clamps it otherwise)", SRC_COMMON),
    "max_input_len_bounds": Rule("max_input_len must be <= max_seq_len (upstream clips it otherwise)", SRC_BUILDER),
    "gemm_plugin_fp8": Rule("gemm_plugin fp8 needs FP8 weights with their calibration in the checkpoint",
                            SRC_PLUGIN),
    "pytorch_int8_kv": Rule("the LLM API has no INT8 KV cache (kv_cache_config.dtype: auto or fp8)", SRC_LLM_ARGS),
    "checkpoint_matches_config": Rule("the checkpoint's quant_algo, kv_cache_quant_algo and mapping must be what "
                                      "the config asked quantize for", SRC_BUILD_CMD),
}


# ====================================================================================== facts
@dataclass(frozen=True)
class GPU:
    name: str
    sm: int  # compute capability x 10 (H100: 90)
    driver: str
    memory_mib: Optional[int] = None


@dataclass(frozen=True)
class Environment:
    """What this machine offers the GPU targets (versions read from package metadata, never by importing)."""

    gpus: tuple[GPU, ...]
    trtllm_version: Optional[str]
    tensorrt_version: Optional[str]
    cuda_version: Optional[str]
    trtllm_build: Optional[str]  # path of the trtllm-build command

    @property
    def gpu(self) -> Optional[GPU]:
        return self.gpus[0] if self.gpus else None


@dataclass(frozen=True)
class QuantFacts:
    """Quantization and mapping of the checkpoint the engine is built from (or, before quantize, the config's)."""

    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    layer_algos: frozenset = field(default_factory=frozenset)  # every weight algo in it (MIXED_PRECISION: per layer)
    tp_size: int = 1
    pp_size: int = 1
    origin: str = "config"

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def detect_gpus(timeout_s: float = 20.0) -> Optional[tuple[GPU, ...]]:
    """The GPUs ``nvidia-smi`` reports (name, SM, driver), or None when there is no driver / no GPU."""
    exe = shutil.which(NVIDIA_SMI)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("nvidia-smi failed: %s", e)
        return None
    if out.returncode != 0:
        log.warning("nvidia-smi exited %s: %s", out.returncode, (out.stderr or out.stdout).strip()[:300])
        return None
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not re.fullmatch(r"\d+\.\d+", parts[1]):
            continue
        major, minor = parts[1].split(".")
        mem = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
        gpus.append(GPU(parts[0], int(major) * 10 + int(minor), parts[2], mem))
    return tuple(gpus) or None


def detect_gpu() -> Optional[GPU]:
    gpus = detect_gpus()
    return gpus[0] if gpus else None


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def detect_environment() -> Environment:
    trtllm = None
    if importlib.util.find_spec("tensorrt_llm") is not None:
        trtllm = _dist_version("tensorrt_llm", "tensorrt-llm") or "unknown"
    return Environment(
        gpus=detect_gpus() or (),
        trtllm_version=trtllm,
        tensorrt_version=_dist_version("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt-cu12-libs",
                                       "tensorrt-cu13-libs"),
        # CUDA_VERSION is set by NVIDIA's CUDA container images (the Triton images are built on them)
        cuda_version=os.environ.get("CUDA_VERSION") or _dist_version("nvidia-cuda-runtime-cu12",
                                                                     "nvidia-cuda-runtime-cu13",
                                                                     "nvidia-cuda-runtime"),
        trtllm_build=shutil.which(TRTLLM_BUILD),
    )


def facts_from_config(cfg) -> QuantFacts:
    """What the checkpoint will say, from the config (used before quantize has run)."""
    from pipeline.quant.quantize import KV_ALGO, TRTLLM_QUANT_ALGO

    q, b = cfg.quantization, cfg.build
    algo = TRTLLM_QUANT_ALGO.get(q.weight_format)
    return QuantFacts(algo, KV_ALGO[q.kv_cache], frozenset({algo} if algo else ()), b.tensor_parallel_size,
                      b.pipeline_parallel_size, "config")


def facts_from_checkpoint(ckpt_dir: Path) -> QuantFacts:
    """quant_algo, kv_cache_quant_algo and mapping of a TensorRT-LLM checkpoint (config.json, quant_cfg.json)."""
    path = ckpt_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable TensorRT-LLM checkpoint config ({e}). Rerun `invoke quantize`.") \
            from None
    q = cfg.get("quantization") or {}
    algo = q.get("quant_algo")
    layer_algos = {algo} if algo and algo != "MIXED_PRECISION" else set()
    if algo == "MIXED_PRECISION":
        try:
            layers = json.loads((ckpt_dir / "quant_cfg.json").read_text()).get("quantized_layers", {})
        except (OSError, ValueError) as e:
            raise InputError(f"{ckpt_dir}: MIXED_PRECISION without a readable quant_cfg.json ({e})") from None
        layer_algos = {v.get("quant_algo") for v in layers.values() if v.get("quant_algo")}
    m = cfg.get("mapping") or {}
    return QuantFacts(algo, q.get("kv_cache_quant_algo"), frozenset(layer_algos), int(m.get("tp_size", 1)),
                      int(m.get("pp_size", 1)), str(path))


def facts_from_hf_checkpoint(hf_dir: Path) -> QuantFacts:
    """The same facts from an HF unified checkpoint (ModelOpt's hf_quant_config.json)."""
    path = hf_dir / "hf_quant_config.json"
    try:
        q = json.loads(path.read_text()).get("quantization") or {}
    except (OSError, ValueError) as e:
        raise InputError(
            f"{hf_dir}: no readable HF unified checkpoint ({path.name}: {e}). The pytorch target serves it: set "
            f"quantization.export_hf_checkpoint: true and rerun `invoke quantize`.") from None
    algo = q.get("quant_algo")
    layers = q.get("quantized_layers") or {}
    layer_algos = {v.get("quant_algo") for v in layers.values() if v.get("quant_algo")} if layers else \
        ({algo} if algo else set())
    return QuantFacts(algo, q.get("kv_cache_quant_algo"), frozenset(layer_algos), origin=str(path))


# ====================================================================================== CUDA graphs
def cuda_graph_batch_sizes(build) -> list[int]:
    """The batch sizes to capture CUDA graphs for: the config's list, or the powers of two below
    max_batch_size plus max_batch_size itself (batches are padded up to the next captured size)."""
    cg = build.cuda_graphs
    if not cg.enabled:
        return []
    if cg.batch_sizes:
        return list(cg.batch_sizes)
    m = build.max_batch_size
    return [1 << i for i in range(m.bit_length()) if (1 << i) < m] + [m]


def cuda_graph_settings(build) -> dict:
    """build_settings.json's ``cuda_graphs``: the shared decision, and the Triton ``tensorrtllm`` runtime
    parameters it sizes (``cuda_graph_mode``; ``cuda_graph_cache_size`` = one cached graph per batch size)."""
    sizes = cuda_graph_batch_sizes(build)
    on = bool(sizes)
    return {"enabled": on, "batch_sizes": sizes, "enable_padding": on and build.cuda_graphs.enable_padding,
            "cuda_graph_mode": on, "cuda_graph_cache_size": len(sizes)}


# ====================================================================================== validity rules
def paged_context_fmha(build, facts: QuantFacts, sm: Optional[int]) -> bool:
    """What ``--use_paged_context_fmha`` will be: the config's choice, else on wherever TensorRT-LLM 1.2's
    builder would keep it on (off with an INT8 KV cache; with an FP8 KV cache only for FP8-family weights
    on SM >= 89)."""
    if build.use_paged_context_fmha is not None:
        return build.use_paged_context_fmha
    kv = facts.kv_cache_quant_algo
    if kv == "INT8":
        return False
    if kv == "FP8" and (facts.quant_algo not in FP8_CONTEXT_FMHA_ALGOS or (sm is not None and sm < 89)):
        return False
    return True


def fp8_context_fmha(build, facts: QuantFacts, sm: Optional[int]) -> bool:
    """``--use_fp8_context_fmha``: FP8-family weights on SM >= 89; with paged context FMHA only together
    with an FP8 KV cache (builder.py turns it off otherwise, with a warning)."""
    if facts.quant_algo not in FP8_CONTEXT_FMHA_ALGOS or (sm is not None and sm < 89):
        return False
    return not paged_context_fmha(build, facts, sm) or facts.kv_cache_quant_algo == "FP8"


def default_gemm_plugin(cfg, facts: QuantFacts) -> str:
    """The GEMM plugin by weight format: FP8 weights use the FP8 cuBLASLt GEMM (its scales come from the
    checkpoint's calibration); every other format gets the plugin in the model dtype ("auto"), which serves
    the GEMMs left unquantized (lm_head, layers kept in high precision); quantized GEMMs use their own plugins."""
    if cfg.build.gemm_plugin is not None:
        return cfg.build.gemm_plugin
    return "fp8" if facts.quant_algo == "FP8" else "auto"


def validity_problems(cfg, sm: Optional[int], facts: Optional[QuantFacts] = None) -> list[tuple[str, str]]:
    """Every rule of RULES the config breaks for a GPU of compute capability ``sm`` (None: GPU unknown, the
    GPU-dependent rules are skipped). Returns (rule id, message) pairs; empty when valid."""
    b = cfg.build
    facts = facts or facts_from_config(cfg)
    kv, algo, algos = facts.kv_cache_quant_algo, facts.quant_algo, facts.layer_algos
    out: list[tuple[str, str]] = []

    def add(rule: str, msg: str) -> None:
        out.append((rule, msg))

    if not b.trtllm_version.startswith(SUPPORTED_RELEASE):
        add("trtllm_release_line", f"build.trtllm_version is {b.trtllm_version!r}; use a 1.2.x release (e.g. 1.2.1)")
    tpb = b.kv_cache.tokens_per_block
    if tpb < 1 or tpb & (tpb - 1):
        add("tokens_per_block_pow2", f"build.kv_cache.tokens_per_block = {tpb} is not a power of two")
    if b.target == "tensorrt":
        pcf = paged_context_fmha(b, facts, sm)
        if kv == "INT8" and b.use_paged_context_fmha is True:
            add("int8_kv_paged_context_fmha",
                "build.use_paged_context_fmha: true with an INT8 KV cache: TensorRT-LLM turns paged context FMHA "
                "off for INT8 KV. Set it to false (or leave it unset), or use quantization.kv_cache: fp8")
        if kv == "FP8" and b.use_paged_context_fmha is True:
            if algo not in FP8_CONTEXT_FMHA_ALGOS:
                add("fp8_kv_paged_context_fmha",
                    f"build.use_paged_context_fmha: true with an FP8 KV cache needs FP8-family weights "
                    f"(FP8, W4A8_AWQ, NVFP4); the checkpoint has {algo}. Use weight_format fp8 or w4a8_awq, "
                    f"or set use_paged_context_fmha: false")
            if sm is not None and sm < 89:
                add("fp8_kv_paged_context_fmha",
                    f"build.use_paged_context_fmha: true with an FP8 KV cache needs SM >= 89 (FP8 context FMHA); "
                    f"this GPU is SM {sm}")
        if b.kv_cache.enable_block_reuse and not pcf:
            why = ("it is off for an INT8 KV cache" if kv == "INT8" else
                   "you turned it off (build.use_paged_context_fmha: false)" if b.use_paged_context_fmha is False
                   else f"with an FP8 KV cache it needs FP8-family weights on SM >= 89 (weights {algo}, SM {sm})")
            add("block_reuse_needs_paged_context_fmha",
                f"build.kv_cache.enable_block_reuse: true needs paged context FMHA, and {why}. Set "
                f"build.kv_cache.enable_block_reuse: false, or change the KV cache / weight format")
        if b.gemm_plugin == "fp8" and algo != "FP8":
            add("gemm_plugin_fp8", f"build.gemm_plugin: fp8 with {algo} weights; it needs FP8 weights "
                                   f"(weight_format: fp8). Use auto, or leave gemm_plugin unset")
        if b.max_num_tokens > b.max_batch_size * b.max_seq_len:
            add("max_num_tokens_bounds", f"build.max_num_tokens {b.max_num_tokens} exceeds max_batch_size x "
                                         f"max_seq_len = {b.max_batch_size * b.max_seq_len}")
        if b.max_num_tokens < tpb:
            add("max_num_tokens_bounds", f"build.max_num_tokens {b.max_num_tokens} is below tokens_per_block {tpb}")
        if b.max_input_len > b.max_seq_len:
            add("max_input_len_bounds", f"build.max_input_len {b.max_input_len} exceeds max_seq_len {b.max_seq_len}")
    if b.target == "pytorch" and kv == "INT8":
        add("pytorch_int8_kv", "build.target: pytorch with an INT8 KV cache: TensorRT-LLM's LLM API supports "
                               "kv_cache_config.dtype fp8 only. Use quantization.kv_cache: fp8 or none, or "
                               "build.target: tensorrt")
    if sm is not None:
        if 100 <= sm < 120:
            bad = sorted(a for a in algos if a in BLACKWELL_REJECTED_ALGOS)
            bad += ["INT8 KV cache"] if kv == "INT8" else []
            if bad:
                add("blackwell_int8", f"SM {sm} (Blackwell) rejects {', '.join(bad)} (INT8/INT4 weight-only, "
                                      f"SmoothQuant and INT8 KV are not supported on SM >= 100). Use fp8 or "
                                      f"w4a8_awq weights and an fp8 KV cache")
        if sm < 89:
            bad = sorted(a for a in algos if a in NEEDS_SM89_ALGOS)
            if bad:
                add("fp8_needs_sm89", f"{', '.join(bad)} need SM >= 89 (Ada/Hopper or later); this GPU is SM {sm}. "
                                      f"Use int8_sq or int4_awq weights")
        if sm < 80:
            bad = sorted(a for a in algos if a in NEEDS_SM80_ALGOS)
            if bad:
                add("int8_int4_need_sm80", f"{', '.join(bad)} need SM >= 80 (Ampere or later); this GPU is SM {sm}")
            if b.dtype == "bfloat16":
                add("bf16_needs_sm80", f"build.dtype: bfloat16 needs SM >= 80; this GPU is SM {sm}. Use float16")
    return out


def check_checkpoint_matches(cfg, facts: QuantFacts) -> None:
    """The checkpoint must carry what the config asked quantize for (KV cache, weights, mapping)."""
    want = facts_from_config(cfg)
    problems = []
    if facts.kv_cache_quant_algo != want.kv_cache_quant_algo:
        problems.append(f"kv_cache_quant_algo is {facts.kv_cache_quant_algo} but quantization.kv_cache "
                        f"{cfg.quantization.kv_cache} means {want.kv_cache_quant_algo}")
    if facts.quant_algo not in (want.quant_algo, "MIXED_PRECISION"):
        problems.append(f"quant_algo is {facts.quant_algo} but quantization.weight_format "
                        f"{cfg.quantization.weight_format} means {want.quant_algo}")
    if facts.origin.endswith("config.json") and (facts.tp_size, facts.pp_size) != (want.tp_size, want.pp_size):
        problems.append(f"mapping tp_size={facts.tp_size} pp_size={facts.pp_size} but the build asks for "
                        f"tensor_parallel_size={want.tp_size} pipeline_parallel_size={want.pp_size}")
    if problems:
        raise InputError(f"build: the quantized checkpoint ({facts.origin}) does not match the config: "
                         + "; ".join(problems) + ". Rerun `invoke quantize` (or `invoke build --force`).")


def enforce_rules(cfg, sm: Optional[int], facts: Optional[QuantFacts] = None, gpu_label: str = "") -> None:
    problems = validity_problems(cfg, sm, facts)
    if problems:
        where = f" on {gpu_label}" if gpu_label else (f" for SM {sm}" if sm is not None else "")
        lines = [f"  - [{rule}] {msg} (rule from {RULES[rule].source})" for rule, msg in problems]
        raise ConfigError(f"build.target {cfg.build.target}{where} breaks TensorRT-LLM 1.2's rules:\n"
                          + "\n".join(lines))


# ====================================================================================== requirements
def check_target_requirements(cfg, before_work: bool = False) -> Optional[Environment]:
    """Check that this machine can build the config's GPU target; returns what it found (None for cpu).

    Order: the config against the rules for the GPU it names (ConfigError: fixable anywhere), then what the
    machine lacks (EnvironmentProblem, with exactly what is needed), then the rules against the GPU found."""
    b = cfg.build
    if b.target == "cpu":
        return None
    enforce_rules(cfg, b.target_sm, gpu_label=f"{b.target_gpu or 'the target GPU'} (SM {b.target_sm})"
                  if b.target_sm else "")
    env = detect_environment()
    missing = []
    if not env.gpus:
        why = "nvidia-smi is not on PATH (no NVIDIA driver)" if shutil.which(NVIDIA_SMI) is None else \
            "nvidia-smi reports no GPU"
        target = f" ({b.target_gpu + ', ' if b.target_gpu else ''}SM {b.target_sm})" if b.target_sm else ""
        missing.append(f"an NVIDIA GPU{target}: {why}")
    what = "TensorRT-LLM " + b.trtllm_version + (" with its trtllm-build command" if b.target == "tensorrt" else
                                                 " (its LLM API serves this target)")
    if env.trtllm_version is None:
        missing.append(f"{what}: the Python package tensorrt_llm is not installed")
    elif b.target == "tensorrt" and env.trtllm_build is None:
        missing.append(f"{what}: tensorrt_llm {env.trtllm_version} is installed but trtllm-build is not on PATH")
    if missing:
        raise EnvironmentProblem(
            f"build.target {b.target} cannot run on this machine; it needs:\n"
            + "\n".join(f"  - {m}" for m in missing)
            + f"\nRun it inside the Triton TensorRT-LLM container image that carries TensorRT-LLM {b.trtllm_version} "
              f"(tritonserver:<yy.mm>-trtllm-python-py3, or the tensorrtllm_backend build of {b.trtllm_version}), "
              f"on a GPU machine with the GPUs passed in (docker run --gpus all ...). Without a GPU, build the "
              f"CPU reference bundle instead: --set build.target=cpu."
            + (" Nothing has been downloaded or quantized." if before_work else ""))
    if env.trtllm_version != b.trtllm_version:
        raise EnvironmentProblem(
            f"this machine has TensorRT-LLM {env.trtllm_version}, but build.trtllm_version is {b.trtllm_version}: "
            f"an engine only loads under the TensorRT / TensorRT-LLM it was built with ('serialization version "
            f"mismatch'). Use the image with TensorRT-LLM {b.trtllm_version}, or set build.trtllm_version to "
            f"{env.trtllm_version} if that is what will serve it"
            + (" (it must be a 1.2.x release)." if not env.trtllm_version.startswith(SUPPORTED_RELEASE) else "."))
    gpu = env.gpu
    if b.target_sm is not None and gpu.sm != b.target_sm:
        raise ConfigError(
            f"[target_gpu] this machine's GPU is {gpu.name} (SM {gpu.sm}), but the profile targets "
            f"{b.target_gpu or 'another GPU'} (build.target_sm: {b.target_sm}); a TensorRT engine is built for the "
            f"GPU it is built on. Build on the target GPU, or use/derive a profile for this one "
            f"(--set build.target_sm={gpu.sm}) (rule from {RULES['target_gpu'].source})")
    enforce_rules(cfg, gpu.sm, gpu_label=f"{gpu.name} (SM {gpu.sm})")
    if len(env.gpus) < b.tensor_parallel_size * b.pipeline_parallel_size:
        log.warning("this machine has %d GPU(s); the engine's %d ranks build here one after another, but "
                    "serving needs %d GPUs", len(env.gpus), b.tensor_parallel_size * b.pipeline_parallel_size,
                    b.tensor_parallel_size * b.pipeline_parallel_size)
    return env


def preflight(loaded) -> None:
    """The build stage's preflight: for a GPU target, stop before any stage runs if this machine cannot
    build it (or the config breaks the rules for its GPU)."""
    if loaded.config.build.target != "cpu":
        check_target_requirements(loaded.config, before_work=True)


# ====================================================================================== trtllm-build argv
def trtllm_build_parser() -> argparse.ArgumentParser:
    """An argparse parser for the options of TRTLLM_BUILD_OPTIONS, typed and with the allowed values as
    trtllm-build declares them (used to check an argument list, here and by the tests' stand-in)."""
    p = argparse.ArgumentParser(prog=TRTLLM_BUILD, add_help=False, allow_abbrev=False, exit_on_error=False)
    for name, opt in TRTLLM_BUILD_OPTIONS.items():
        if opt.kind == "flag":
            p.add_argument(name, action="store_true")
        elif opt.kind == "int":
            p.add_argument(name, type=int)
        elif opt.kind == "choice":
            p.add_argument(name, choices=opt.choices)
        else:
            p.add_argument(name, type=str)
    return p


def check_trtllm_build_argv(args: list[str]) -> list[str]:
    """Problems with a trtllm-build argument list (without the program name): unknown options, values
    outside the table, repeats, and the argument-level rules. Empty when it is valid."""
    problems = []
    names = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    unknown = sorted({n for n in names if n not in TRTLLM_BUILD_OPTIONS})
    if unknown:
        problems.append(f"unknown option(s) {unknown} (not in TensorRT-LLM 1.2's trtllm-build table)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        problems.append(f"option(s) given more than once: {repeated}")
    try:
        ns, extra = trtllm_build_parser().parse_known_args(args)
    except argparse.ArgumentError as e:
        return problems + [str(e)]
    stray = [a for a in extra if not a.startswith("--")]
    if stray:
        problems.append(f"stray argument(s) {stray}")
    v = vars(ns)
    for req in ("checkpoint_dir", "output_dir"):
        if not v.get(req):
            problems.append(f"--{req} is required")
    for name, opt in TRTLLM_BUILD_OPTIONS.items():
        val = v.get(name[2:])
        if opt.kind == "int" and val is not None and val < 1:
            problems.append(f"{name} {val} must be a positive integer")
    tpb = v.get("tokens_per_block")
    if tpb is not None and tpb & (tpb - 1):
        problems.append(f"[tokens_per_block_pow2] --tokens_per_block {tpb} is not a power of two")
    if v.get("multiple_profiles") == "enable" and v.get("opt_num_tokens") is not None:
        problems.append("[opt_num_tokens_multiple_profiles] --opt_num_tokens is set while --multiple_profiles is "
                        "enabled (trtllm-build: 'They are not supposed to be working in the same time')")
    if v.get("use_paged_context_fmha") == "enable" and (v.get("context_fmha") == "disable"
                                                        or v.get("kv_cache_type") not in (None, "paged")):
        problems.append("[paged_context_fmha_needs_paged_kv] --use_paged_context_fmha enable needs --context_fmha "
                        "enable and --kv_cache_type paged")
    mbs, msl, mnt = v.get("max_batch_size"), v.get("max_seq_len"), v.get("max_num_tokens")
    if mbs and msl and mnt and mnt > mbs * msl:
        problems.append(f"[max_num_tokens_bounds] --max_num_tokens {mnt} > max_batch_size x max_seq_len {mbs * msl}")
    if mnt and tpb and mnt < tpb:
        problems.append(f"[max_num_tokens_bounds] --max_num_tokens {mnt} < --tokens_per_block {tpb}")
    mil = v.get("max_input_len")
    if mil and msl and mil > msl:
        problems.append(f"[max_input_len_bounds] --max_input_len {mil} > --max_seq_len {msl}")
    return problems


def timing_cache_path(cfg, gpu: GPU) -> Path:
    """TensorRT's timing cache for this GPU model and TensorRT-LLM version, shared by every build there."""
    base = cfg.build.timing_cache_dir
    if base is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtllm-pipeline" / "timing-cache"
    label = re.sub(r"[^A-Za-z0-9.]+", "-", gpu.name).strip("-") or "gpu"
    return Path(base) / f"{label}-sm{gpu.sm}-trtllm{cfg.build.trtllm_version}.cache"


def trtllm_build_argv(ckpt_dir: Path, engine_dir: Path, cfg, gpu: Optional[GPU], facts: QuantFacts,
                      input_timing_cache: Optional[Path] = None, output_timing_cache: Optional[Path] = None,
                      gpu_count: int = 1) -> list[str]:
    """The trtllm-build arguments (without the program name) for the config, checkpoint and GPU."""
    b = cfg.build
    sm = gpu.sm if gpu else b.target_sm
    switch = {True: "enable", False: "disable"}
    args = ["--checkpoint_dir", str(ckpt_dir), "--output_dir", str(engine_dir),
            "--max_batch_size", str(b.max_batch_size), "--max_input_len", str(b.max_input_len),
            "--max_seq_len", str(b.max_seq_len), "--max_num_tokens", str(b.max_num_tokens),
            "--max_beam_width", str(b.max_beam_width),
            "--kv_cache_type", "paged", "--tokens_per_block", str(b.kv_cache.tokens_per_block),
            "--gpt_attention_plugin", "auto", "--gemm_plugin", default_gemm_plugin(cfg, facts),
            "--context_fmha", "enable", "--remove_input_padding", "enable",
            "--use_paged_context_fmha", switch[paged_context_fmha(b, facts, sm)],
            "--use_fp8_context_fmha", switch[fp8_context_fmha(b, facts, sm)],
            "--multiple_profiles", switch[b.multiple_profiles],
            "--workers", str(max(1, min(facts.world_size, gpu_count))), "--log_level", "info"]
    if input_timing_cache is not None:
        args += ["--input_timing_cache", str(input_timing_cache)]
    if output_timing_cache is not None:
        args += ["--output_timing_cache", str(output_timing_cache)]
    problems = check_trtllm_build_argv(args)
    if problems:  # a bug here, not a user error: the argv is generated from a validated config
        raise StageFailed("internal: generated trtllm-build arguments break the option table: " + "; ".join(problems))
    return args


# ====================================================================================== tensorrt target
def check_engine_dir(engine_dir: Path, args: list[str], facts: QuantFacts, trtllm_version: str) -> dict:
    """The engine directory trtllm-build wrote must hold what was asked: config.json (version, the
    checkpoint's quantization and mapping, the build settings) and one non-empty rank{N}.engine per rank."""
    ns = vars(trtllm_build_parser().parse_known_args(args)[0])
    path = engine_dir / "config.json"
    try:
        ec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StageFailed(f"trtllm-build finished but {path} is missing or unreadable ({e})") from None
    problems = []
    if ec.get("version") != trtllm_version:
        problems.append(f"engine version {ec.get('version')!r} is not the installed TensorRT-LLM {trtllm_version}")
    pc, bc = ec.get("pretrained_config") or {}, ec.get("build_config") or {}
    q = pc.get("quantization") or {}
    if q.get("kv_cache_quant_algo") != facts.kv_cache_quant_algo:
        problems.append(f"kv_cache_quant_algo {q.get('kv_cache_quant_algo')} (checkpoint: {facts.kv_cache_quant_algo})")
    if q.get("quant_algo") != facts.quant_algo:
        problems.append(f"quant_algo {q.get('quant_algo')} (checkpoint: {facts.quant_algo})")
    world = int((pc.get("mapping") or {}).get("world_size", 1))
    if world != facts.world_size:
        problems.append(f"world_size {world} (checkpoint: {facts.world_size})")
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width"):
        if bc.get(key) != ns[key]:
            problems.append(f"build_config.{key} {bc.get(key)} (asked {ns[key]})")
    if str(bc.get("kv_cache_type", "")).upper() != "PAGED":
        problems.append(f"build_config.kv_cache_type {bc.get('kv_cache_type')} (asked paged)")
    plugin = bc.get("plugin_config") or {}
    if plugin.get("tokens_per_block") != ns["tokens_per_block"]:
        problems.append(f"plugin_config.tokens_per_block {plugin.get('tokens_per_block')} "
                        f"(asked {ns['tokens_per_block']})")
    if plugin.get("use_paged_context_fmha") is not (ns["use_paged_context_fmha"] == "enable"):
        problems.append(f"plugin_config.use_paged_context_fmha {plugin.get('use_paged_context_fmha')} "
                        f"(asked {ns['use_paged_context_fmha']})")
    engines = {}
    for rank in range(facts.world_size):
        f = engine_dir / f"rank{rank}.engine"
        size = f.stat().st_size if f.is_file() else 0
        if not size:
            problems.append(f"{f.name} missing or empty")
        engines[f.name] = size
    if facts.quant_algo == "MIXED_PRECISION" and not (engine_dir / "quant_cfg.json").is_file():
        problems.append("quant_cfg.json missing (MIXED_PRECISION)")
    if problems:
        raise StageFailed(f"the engine trtllm-build wrote in {engine_dir} is not what was asked: "
                          + "; ".join(problems[:8]))
    return {"engine_version": ec["version"], "engine_files": engines, "engine_bytes": sum(engines.values())}


def _run_logged(argv: list[str], log_path: Path, cwd: Path) -> int:
    """Run a command with its output in log_path; Ctrl-C stops it too."""
    with open(log_path, "a", encoding="utf-8") as log_f:
        log_f.write("$ " + " ".join(argv) + "\n")
        log_f.flush()
        proc = subprocess.Popen(argv, stdout=log_f, stderr=subprocess.STDOUT, cwd=cwd, stdin=subprocess.DEVNULL)
        try:
            return proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def _provenance(env: Environment, ckpt_hash: str, extra: dict) -> dict:
    gpu = env.gpu
    return {"tensorrt_llm": env.trtllm_version, "tensorrt": env.tensorrt_version, "cuda": env.cuda_version,
            "driver": gpu.driver, "gpu": gpu.name, "gpu_sm": gpu.sm, "gpu_count": len(env.gpus),
            "gpu_memory_mib": gpu.memory_mib, "checkpoint_sha256": ckpt_hash, **extra}


def build_tensorrt(ckpt_dir: Path, cfg, out_dir: Path) -> dict:
    """trtllm-build the TensorRT-LLM checkpoint into out_dir/engine (a child process, log beside it), check
    the engine directory, record provenance, write out_dir/build_settings.json; returns the stage summary."""
    from pipeline.engines.build import build_settings, checkpoint_sha256
    from pipeline.fsutil import atomic_write_json

    t0 = time.perf_counter()
    env = check_target_requirements(cfg)
    gpu = env.gpu
    facts = facts_from_checkpoint(ckpt_dir)
    check_checkpoint_matches(cfg, facts)
    enforce_rules(cfg, gpu.sm, facts, gpu_label=f"{gpu.name} (SM {gpu.sm})")
    ckpt_hash = checkpoint_sha256(ckpt_dir)

    engine_dir = out_dir / artifacts.ENGINE_DIR
    cache = timing_cache_path(cfg, gpu)
    cache.parent.mkdir(parents=True, exist_ok=True)
    reused = cache.is_file()
    cache_out = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")  # moved into place only after a good build
    args = trtllm_build_argv(ckpt_dir, engine_dir, cfg, gpu, facts, cache if reused else None, cache_out,
                             gpu_count=len(env.gpus))
    log_path = out_dir / BUILD_LOG_FILE
    log.info("trtllm-build on %s (SM %d), %d rank(s); timing cache %s (%s)", gpu.name, gpu.sm, facts.world_size,
             cache, "reused" if reused else "new")
    try:
        rc = _run_logged([env.trtllm_build, *args], log_path, cwd=out_dir)
        if rc != 0:
            from pipeline.child import log_tail

            raise StageFailed(f"trtllm-build exited with code {rc}. Last lines of {log_path}:\n{log_tail(log_path)}")
        engine = check_engine_dir(engine_dir, args, facts, env.trtllm_version)
        if cache_out.is_file():
            os.replace(cache_out, cache)
    finally:
        cache_out.unlink(missing_ok=True)
    build_s = round(time.perf_counter() - t0, 1)
    shown = [{str(ckpt_dir): "{checkpoint_dir}", str(engine_dir): "{output_dir}"}.get(a, a) for a in args]
    provenance = _provenance(env, ckpt_hash, {"engine_version": engine["engine_version"], "trtllm_build_argv": shown,
                                             "timing_cache": {"file": cache.name, "reused": reused}})
    atomic_write_json(engine_dir / artifacts.BUILD_PROVENANCE_FILE, provenance)
    settings = build_settings(cfg, "tensorrt", artifacts.ENGINE_DIR, facts.kv_cache_quant_algo, cuda_graph_settings(cfg.build),
                              env.trtllm_version, provenance, ckpt_hash)
    atomic_write_json(out_dir / artifacts.BUILD_SETTINGS_FILE, settings)
    return {"target": "tensorrt", "checkpoint_sha256": ckpt_hash, "quant_algo": facts.quant_algo,
            "kv_cache_quant_algo": facts.kv_cache_quant_algo, "gpu": gpu.name, "gpu_sm": gpu.sm,
            "trtllm_version": env.trtllm_version, "ranks": facts.world_size, "engine_bytes": engine["engine_bytes"],
            "paged_context_fmha": paged_context_fmha(cfg.build, facts, gpu.sm),
            "cuda_graphs": settings["cuda_graphs"], "timing_cache_reused": reused, "timing_s": build_s}


# ====================================================================================== pytorch target
def llm_api_options(cfg) -> dict:
    """The LLM-API options (TorchLlmArgs fields) for the config; checked against LLM_API_OPTIONS."""
    b, q = cfg.build, cfg.quantization
    if q.kv_cache == "int8":
        raise ConfigError(
            "[pytorch_int8_kv] quantization.kv_cache: int8 cannot be served by TensorRT-LLM's LLM API (pytorch "
            "target): kv_cache_config.dtype supports fp8 only. Use kv_cache: fp8 or none, or build.target: "
            f"tensorrt (rule from {RULES['pytorch_int8_kv'].source})")
    cg = cuda_graph_settings(b)
    opts = {
        "max_batch_size": b.max_batch_size,
        "max_num_tokens": b.max_num_tokens,
        "max_seq_len": b.max_seq_len,
        "max_input_len": b.max_input_len,
        "tensor_parallel_size": b.tensor_parallel_size,
        "pipeline_parallel_size": b.pipeline_parallel_size,
        "kv_cache_config": {"dtype": "fp8" if q.kv_cache == "fp8" else "auto",
                            "free_gpu_memory_fraction": b.kv_cache.free_gpu_memory_fraction,
                            "enable_block_reuse": b.kv_cache.enable_block_reuse,
                            "tokens_per_block": b.kv_cache.tokens_per_block},
        "cuda_graph_config": ({"batch_sizes": cg["batch_sizes"], "enable_padding": cg["enable_padding"]}
                              if cg["enabled"] else None),
    }
    problems = check_llm_api_options(opts)
    if problems:
        raise StageFailed("internal: generated LLM-API options break the option table: " + "; ".join(problems))
    return opts


def check_llm_api_options(opts: dict, table: Optional[dict] = None, prefix: str = "") -> list[str]:
    """Problems with LLM-API options against LLM_API_OPTIONS (names, types, allowed values); empty when valid."""
    table = LLM_API_OPTIONS if table is None else table
    problems = []
    if not isinstance(opts, dict):
        return [f"{prefix or 'options'} must be a mapping"]
    for key, value in opts.items():
        name = f"{prefix}{key}"
        kind = table.get(key)
        if kind is None or key == "nullable":
            problems.append(f"unknown option {name} (not a TensorRT-LLM 1.2 LLM-API field here)")
        elif isinstance(kind, dict):
            if value is None and kind.get("nullable"):
                continue
            problems += check_llm_api_options(value, kind, f"{name}.")
        elif isinstance(kind, tuple):
            if value not in kind:
                problems.append(f"{name} = {value!r}: allowed {list(kind)}")
        elif kind == "int":
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                problems.append(f"{name} = {value!r}: a positive integer")
        elif kind == "bool":
            if not isinstance(value, bool):
                problems.append(f"{name} = {value!r}: true or false")
        elif kind == "fraction":
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
                problems.append(f"{name} = {value!r}: a number between 0 and 1")
        elif kind == "int_list":
            if not (isinstance(value, list) and value and all(isinstance(v, int) and v >= 1 for v in value)
                    and value == sorted(set(value))):
                problems.append(f"{name} = {value!r}: positive, unique, ascending integers")
    if not prefix:
        kvc = opts.get("kv_cache_config") or {}
        tpb = kvc.get("tokens_per_block")
        if isinstance(tpb, int) and tpb & (tpb - 1):
            problems.append(f"[tokens_per_block_pow2] kv_cache_config.tokens_per_block {tpb} is not a power of two")
        cgc, mbs = opts.get("cuda_graph_config"), opts.get("max_batch_size")
        if isinstance(cgc, dict) and isinstance(mbs, int) and max(cgc.get("batch_sizes") or [0]) > mbs:
            problems.append(f"cuda_graph_config.batch_sizes go beyond max_batch_size {mbs}")
    return problems


def build_pytorch(hf_ckpt_dir: Path, cfg, out_dir: Path) -> dict:
    """out_dir/llm_api: the HF unified checkpoint and llm_api_options.yaml for TensorRT-LLM's LLM API;
    plus out_dir/build_settings.json. Nothing is compiled: the server loads the checkpoint with these options."""
    import yaml

    from pipeline.engines.build import build_settings, checkpoint_sha256
    from pipeline.fsutil import atomic_write_json, atomic_write_text

    t0 = time.perf_counter()
    env = check_target_requirements(cfg)
    gpu = env.gpu
    facts = facts_from_hf_checkpoint(hf_ckpt_dir)
    check_checkpoint_matches(cfg, facts)
    enforce_rules(cfg, gpu.sm, facts, gpu_label=f"{gpu.name} (SM {gpu.sm})")
    opts = llm_api_options(cfg)
    ckpt_hash = checkpoint_sha256(hf_ckpt_dir)
    dest = out_dir / artifacts.LLM_API_DIR
    shutil.copytree(hf_ckpt_dir, dest / artifacts.LLM_API_CHECKPOINT_DIR)
    header = (f"# TensorRT-LLM {env.trtllm_version} LLM-API options (pytorch backend), written by the pipeline's "
              f"build stage for {cfg.name}.\n# Serve {artifacts.LLM_API_CHECKPOINT_DIR}/ with them, e.g. trtllm-serve "
              f"{artifacts.LLM_API_CHECKPOINT_DIR} --extra_llm_api_options {artifacts.LLM_API_OPTIONS_FILE}\n")
    atomic_write_text(dest / artifacts.LLM_API_OPTIONS_FILE, header + yaml.safe_dump(opts, sort_keys=False))
    provenance = _provenance(env, ckpt_hash, {"llm_api_options": opts})
    settings = build_settings(cfg, "pytorch", artifacts.LLM_API_DIR, facts.kv_cache_quant_algo, cuda_graph_settings(cfg.build),
                              env.trtllm_version, provenance, ckpt_hash)
    atomic_write_json(out_dir / artifacts.BUILD_SETTINGS_FILE, settings)
    return {"target": "pytorch", "checkpoint_sha256": ckpt_hash, "quant_algo": facts.quant_algo,
            "kv_cache_quant_algo": facts.kv_cache_quant_algo, "gpu": gpu.name, "gpu_sm": gpu.sm,
            "trtllm_version": env.trtllm_version, "llm_api_options": opts,
            "timing_s": round(time.perf_counter() - t0, 1)}


def rules_table() -> list[dict]:
    """RULES as rows (id, rule, source): for the report and the docs."""
    return [{"id": k, **asdict(v)} for k, v in RULES.items()]
