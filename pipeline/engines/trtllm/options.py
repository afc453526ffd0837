"""TensorRT-LLM 1.2's option names and allowed values, as this pipeline uses them, each entry with the upstream
file it was read from, and the checkers of what the pipeline passes against them.

- ``TRTLLM_BUILD_OPTIONS``: the trtllm-build options the tensorrt target passes (anything else is refused);
  ``trtllm_build_parser`` / ``check_trtllm_build_argv`` check an argument list against it and the
  argument-level rules (here, and in the tests' stand-in ``trtllm-build``).
- ``LLM_API_OPTIONS``: the LLM-API (``TorchLlmArgs``) fields the pytorch target writes;
  ``check_llm_api_options`` checks an options mapping against it.
- ``SRC_*``: the upstream sources this table and the validity rules (``rules.py``) cite.

Standard library only (the stand-in ``trtllm-build`` imports it); it never imports ``tensorrt_llm``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

TRTLLM_BUILD = "trtllm-build"
SUPPORTED_RELEASE = "1.2."  # the last TensorRT-LLM release line with trtllm-build; the table below is 1.2's

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
    "--reduce_fusion": _switch(),  # AllReduce + norm fusion; the builder keeps it only for TP > 1 on Llama-like
    "--gemm_swiglu_plugin": Opt("choice", ("fp8", "disable"), SRC_PLUGIN),  # FP8 gated-MLP fusion, Hopper only
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
    "scheduler_config": {  # SchedulerConfig (written only where the config sets a serving key: publish)
        # CapacitySchedulerPolicy values (a StrEnum: the YAML string is the value); STATIC_BATCH is not used
        "capacity_scheduler_policy": ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION"),
        "dynamic_batch_config": {  # DynamicBatchConfig: its three fields have no default upstream
            "nullable": True,
            "enable_batch_size_tuning": "bool",
            "enable_max_num_tokens_tuning": "bool",
            "dynamic_batch_moving_average_window": "int",
        },
    },
}
# DynamicBatchConfig's window when triton.adaptive_batch turns it on: the executor's own default
# (cpp/include/tensorrt_llm/executor/executor.h: kDefaultDynamicBatchMovingAverageWindow = 128).
DYNAMIC_BATCH_WINDOW = 128

# Runtime parameters of the Triton `tensorrtllm` model that the build decides (publish writes them).
# ExtendedRuntimePerfKnobConfig in llm_args.py: cuda_graph_mode (bool), cuda_graph_cache_size (int, "number
# of cuda graphs to be cached in the runtime").
TRITON_CUDA_GRAPH_PARAMETERS = ("cuda_graph_mode", "cuda_graph_cache_size")


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
    if v.get("gemm_swiglu_plugin") == "fp8" and v.get("use_fused_mlp") != "enable":
        problems.append("[fp8_swiglu_fusion] --gemm_swiglu_plugin fp8 needs --use_fused_mlp enable (the fusion is "
                        "of the fused gated MLP)")
    return problems


# ====================================================================================== LLM-API options
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
        else:
            problem = _llm_api_value_problem(name, kind, value)
            if problem:
                problems.append(problem)
    if not prefix:
        problems += _llm_api_cross_field_problems(opts)
    return problems


def _llm_api_value_problem(name: str, kind: Any, value: Any) -> Optional[str]:
    """What is wrong with one option's value (``kind``: a tuple of allowed values or a value type of
    LLM_API_OPTIONS), or None."""
    if isinstance(kind, tuple):
        if value not in kind:
            return f"{name} = {value!r}: allowed {list(kind)}"
    elif kind == "int":
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return f"{name} = {value!r}: a positive integer"
    elif kind == "bool":
        if not isinstance(value, bool):
            return f"{name} = {value!r}: true or false"
    elif kind == "fraction":
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
            return f"{name} = {value!r}: a number between 0 and 1"
    elif kind == "int_list":
        if not (isinstance(value, list) and value and all(isinstance(v, int) and v >= 1 for v in value)
                and value == sorted(set(value))):
            return f"{name} = {value!r}: positive, unique, ascending integers"
    return None


def _llm_api_cross_field_problems(opts: dict) -> list[str]:
    """The rules between top-level LLM-API options: tokens_per_block a power of two, CUDA-graph batch sizes
    within max_batch_size."""
    problems = []
    kvc = opts.get("kv_cache_config") or {}
    tpb = kvc.get("tokens_per_block")
    if isinstance(tpb, int) and tpb & (tpb - 1):
        problems.append(f"[tokens_per_block_pow2] kv_cache_config.tokens_per_block {tpb} is not a power of two")
    cgc, mbs = opts.get("cuda_graph_config"), opts.get("max_batch_size")
    if isinstance(cgc, dict) and isinstance(mbs, int) and max(cgc.get("batch_sizes") or [0]) > mbs:
        problems.append(f"cuda_graph_config.batch_sizes go beyond max_batch_size {mbs}")
    return problems
