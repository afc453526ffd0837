"""TensorRT-LLM 1.2's validity rules and the build decisions they govern, judged before anything runs.

Upstream often *silently* turns a feature off or clamps a value with a warning; here a config that would be
changed that way is refused, so the recorded settings are the engine's settings. Each rule names the
upstream file it was read from (``options.SRC_*``).

- ``RULES`` / ``rules_table``: the rules, by id (messages name the id: ``[rule_id] ...``).
- ``QuantFacts`` / ``facts_from_config``: what the rules judge: the checkpoint's quantization and mapping
  (read from the checkpoint by ``preflight.facts_from_checkpoint``, or, before quantize, from the config).
- ``validity_problems`` / ``enforce_rules``: every rule a config breaks for a GPU of a compute capability.
- ``paged_context_fmha`` / ``fp8_context_fmha`` / ``default_gemm_plugin`` / ``reduce_fusion`` /
  ``fp8_swiglu_fusion``: what trtllm-build is asked for; ``chunked_context``: what the Triton backend runs.
- ``cuda_graph_batch_sizes`` / ``cuda_graph_settings``: the CUDA-graph decision both GPU targets share (the
  ``cuda_graph_mode`` / ``cuda_graph_cache_size`` runtime parameters of the Triton ``tensorrtllm`` model).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Optional

from pipeline import targets
from pipeline.engines.trtllm.options import (
    SRC_BUILD_CMD,
    SRC_BUILDER,
    SRC_COMMON,
    SRC_KV_REUSE_DOC,
    SRC_LLM_ARGS,
    SRC_MODELOPT_MATRIX,
    SRC_PLUGIN,
    SRC_TRT_PORTABILITY,
    SUPPORTED_RELEASE,
)
from pipeline.errors import ConfigError
from pipeline.formats import KV_CACHE_ALGOS, TRTLLM_QUANT_ALGO

# QuantAlgo groups (checkpoint quantization.quant_algo / quant_cfg.json layer algos)
FP8_CONTEXT_FMHA_ALGOS = frozenset({"FP8", "W4A8_AWQ", "NVFP4"})  # builder.py: FP8 context FMHA workflow
NEEDS_SM89_ALGOS = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "W4A8_AWQ"})
NEEDS_SM80_ALGOS = frozenset({"W8A16", "W4A16", "W4A16_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
                              "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
                              "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN"})
# builder.py on SM 100-119: is_int8_weight_only / is_int4_weight_only / has_int8_kv_cache -> "INT8/INT4
# quantization is not supported on SM>=100."; has_act_and_weight_quant -> "SmoothQuant is not supported";
# has_per_channel_scaling / has_per_token_dynamic_scaling -> "Per-channel or per-token scaling is not
# supported". Mapped onto QuantAlgo through mode.py QuantMode.from_quant_algo: W4A8_AWQ is
# use_weight_only(use_int4_weights=True, per_group=True), so is_int4_weight_only() holds and it is rejected
# too (tests/data/upstream/serving_guidance.json, blackwell_quant_rejection).
BLACKWELL_REJECTED_ALGOS = frozenset({"W8A16", "W8A16_GPTQ", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W4A8_AWQ",
                                      "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_TENSOR_PLUGIN",
                                      "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
                                      "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "FP8_PER_CHANNEL_PER_TOKEN"})
# GEMM plugin off for these weights: TensorRT's own kernels run their quantized GEMMs (ModelOpt's reference
# TensorRT-LLM build: use_qdq = quant_algo in [FP8, W8A8_SQ_PER_CHANNEL] -> gemm_plugin None, strongly typed),
# and for FP8 the performance guide says "On FP8, it's recommended to be disabled"
# (docs/source/legacy/performance/performance-tuning-guide/useful-build-time-flags.md @ 2a9abd95).
GEMM_PLUGIN_OFF_ALGOS = frozenset({"FP8", "W8A8_SQ_PER_CHANNEL"})
# builder.py build(): reduce_fusion is kept only when tp_size > 1 and the architecture is one of these
# ("Overriding reduce_fusion to False" otherwise).
REDUCE_FUSION_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Gemma2ForCausalLM", "MedusaForCausalLM"})
# plugin.py: gemm_swiglu_plugin "is only supported for FP8 precision on Hopper"; the FP8 quantization guide
# recommends it "for large models running on Hopper" but says it "can slightly reduce accuracy in FP8 PTQ because
# one quantization scaling factor is discarded" (docs/source/legacy/performance/performance-tuning-guide/
# fp8-quantization.md @ cb4c622c). The accuracy gate measures the checkpoint, not that arithmetic, so the fusion
# is off unless the config asks for it (valid with FP8 weights on Hopper only; upstream advises it for large models).
SWIGLU_FUSION_SM = 90
# Jetson AGX Orin: TensorRT-LLM's v0.12.0-jetson branch only (tests/data/upstream/trtllm_jetson.json)
JETSON_ORIN_SM = 87
SRC_LONG_SEQUENCE_DOC = "docs/source/features/long-sequence.md ('if chunked context is enabled, please set the " \
                        "max_num_tokens to be an integer multiple of ... tokens_per_block')"
SRC_BACKEND_CHUNKED = "triton_backend/inflight_batcher_llm/src/model_instance_state.cc @ c8c6df08 " \
                      "(enable_chunked_context 'requires building the model with use_paged_context_fmha')"


@dataclass(frozen=True)
class Rule:
    text: str
    source: str


# The validity rules, checked before anything runs (``validity_problems`` / ``check_trtllm_build_argv``).
# Upstream often *silently* turns a feature off or clamps a value with a warning; here a config that would
# be changed that way is refused, so the recorded settings are the engine's settings.
RULES: dict[str, Rule] = {
    "trtllm_release_line": Rule("build.trtllm_version must be a 1.2.x release: 1.2 is the last TensorRT-LLM "
                                "line with trtllm-build, and the option table here is 1.2's; Jetson Orin (SM 87) "
                                "has only the v0.12.0-jetson branch", SRC_BUILD_CMD),
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
    "blackwell_int8": Rule("on Blackwell (SM 100-119) INT8 weight-only, INT4 weight-only (W4A8_AWQ included), "
                           "SmoothQuant, per-channel/per-token scaling and the INT8 KV cache are rejected",
                           SRC_BUILDER),
    "chunked_context_needs_paged_context_fmha": Rule("chunked context needs an engine built with paged context "
                                                     "FMHA", SRC_BACKEND_CHUNKED),
    "chunked_context_max_num_tokens": Rule("with chunked context, max_num_tokens must be a multiple of "
                                           "tokens_per_block", SRC_LONG_SEQUENCE_DOC),
    "fp8_swiglu_fusion": Rule("the FP8 GEMM + SwiGLU fusion needs FP8 weights on Hopper (SM 90); SM 100 rejects "
                              "it", SRC_PLUGIN),
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


def rules_table() -> list[dict]:
    """RULES as rows (id, rule, source): for the report and the docs."""
    return [{"id": k, **asdict(v)} for k, v in RULES.items()]


# ====================================================================================== facts
@dataclass(frozen=True)
class QuantFacts:
    """Quantization and mapping of the checkpoint the engine is built from (or, before quantize, the config's)."""

    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    layer_algos: frozenset = field(default_factory=frozenset)  # every weight algo in it (MIXED_PRECISION: per layer)
    tp_size: int = 1
    pp_size: int = 1
    origin: str = "config"
    architecture: Optional[str] = None  # the checkpoint's config.json (unknown before quantize)
    hidden_size: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def facts_from_config(cfg) -> QuantFacts:
    """What the checkpoint will say, from the config (used before quantize has run)."""
    q, b = cfg.quantization, cfg.build
    algo = TRTLLM_QUANT_ALGO.get(q.weight_format)
    return QuantFacts(algo, KV_CACHE_ALGOS[q.kv_cache], frozenset({algo} if algo else ()), b.tensor_parallel_size,
                      b.pipeline_parallel_size, "config")


# ====================================================================================== CUDA graphs
def cuda_graph_batch_sizes(build) -> list[int]:
    """The batch sizes to capture CUDA graphs for: the config's list, or the powers of two below
    max_batch_size plus max_batch_size itself. The pytorch target pads a batch up to the next captured size
    (CudaGraphConfig.enable_padding); the tensorrt engine's runtime pads nothing: it captures a graph for each
    batch it meets and keeps at most cuda_graph_cache_size of them (ExtendedRuntimePerfKnobConfig)."""
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
    """The GEMM plugin by weight format: off for FP8 and INT8 SmoothQuant weights (GEMM_PLUGIN_OFF_ALGOS cites
    why), else the plugin in the model dtype ("auto"): "On FP16 and BF16, it's recommended to be enabled", and
    it serves the GEMMs left unquantized (lm_head, layers kept in high precision) while quantized GEMMs use
    their own plugins."""
    if cfg.build.gemm_plugin is not None:
        return cfg.build.gemm_plugin
    return "disable" if facts.quant_algo in GEMM_PLUGIN_OFF_ALGOS else "auto"


def chunked_context(build, facts: QuantFacts, sm: Optional[int]) -> bool:
    """The Triton backend's ``enable_chunked_context``: the config's choice, else on wherever the engine has
    paged context FMHA (long prompts then run in max_num_tokens chunks instead of being refused)."""
    if build.chunked_context is not None:
        return build.chunked_context
    return paged_context_fmha(build, facts, sm)


def reduce_fusion(facts: QuantFacts) -> bool:
    """``--reduce_fusion``: on where the builder keeps it (tensor parallel, REDUCE_FUSION_ARCHITECTURES); it
    fuses the AllReduce with the following norm ("only beneficial for cases with tensor-parallelism")."""
    return facts.tp_size > 1 and facts.architecture in REDUCE_FUSION_ARCHITECTURES


def fp8_swiglu_fusion(build, facts: QuantFacts, sm: Optional[int]) -> bool:
    """``--gemm_swiglu_plugin fp8`` (with ``--use_fused_mlp enable``): only where the config asks for it
    (``build.fp8_swiglu_fusion: true``); the fusion drops one of gate/up's FP8 scales, arithmetic the accuracy gate
    never measured (see SWIGLU_FUSION_SM's comment). ``facts`` and ``sm`` are checked by ``validity_problems``."""
    return bool(build.fp8_swiglu_fusion)


def validity_problems(cfg, sm: Optional[int], facts: Optional[QuantFacts] = None) -> list[tuple[str, str]]:
    """Every rule of RULES the config breaks for a GPU of compute capability ``sm`` (None: GPU unknown, the
    GPU-dependent rules are skipped). Returns (rule id, message) pairs; empty when valid."""
    b = cfg.build
    facts = facts or facts_from_config(cfg)
    out: list[tuple[str, str]] = []
    if not b.trtllm_version.startswith(SUPPORTED_RELEASE) or JETSON_ORIN_SM in (b.target_sm, sm):
        out.append(("trtllm_release_line", _release_line_problem(b)))
    tpb = b.kv_cache.tokens_per_block
    if tpb < 1 or tpb & (tpb - 1):
        out.append(("tokens_per_block_pow2", f"build.kv_cache.tokens_per_block = {tpb} is not a power of two"))
    target = targets.get(b.target)
    if target.engine_per_rank:  # trtllm-build's own rules
        out += _paged_context_fmha_problems(b, facts, sm)
        out += _tensorrt_build_problems(b, facts, sm)
    if facts.kv_cache_quant_algo == "INT8" and "int8" not in target.kv_formats:
        out.append(("pytorch_int8_kv", "build.target: pytorch with an INT8 KV cache: TensorRT-LLM's LLM API supports "
                                       "kv_cache_config.dtype fp8 only. Use quantization.kv_cache: fp8 or none, or "
                                       "build.target: tensorrt"))
    if sm is not None:
        out += _gpu_problems(b, facts, sm)
    return out


def _release_line_problem(b) -> str:
    if "jetson" in b.trtllm_version.lower() or b.target_sm == JETSON_ORIN_SM:
        return (f"build.trtllm_version {b.trtllm_version!r} for a Jetson (SM {JETSON_ORIN_SM}). TensorRT-LLM's "
                f"Jetson support is the v0.12.0-jetson branch, not the 1.2 line this tool generates trtllm-build "
                f"flags and Triton configs for: its trtllm-build differs (no --kv_cache_type), its documented "
                f"quantization is INT4 weight-only / INT4-GPTQ through convert_checkpoint.py, and the Triton "
                f"tensorrtllm backend has no Jetson build (the branch runs engines with examples/run.py). Build on "
                f"the device following README4Jetson.md of that branch; this tool cannot target it yet")
    return f"build.trtllm_version is {b.trtllm_version!r}; use a 1.2.x release (e.g. 1.2.1)"


def _paged_context_fmha_problems(b, facts: QuantFacts, sm: Optional[int]) -> Iterator[tuple[str, str]]:
    """tensorrt target: paged context FMHA asked for where the builder would turn it off, and KV-cache block
    reuse without it."""
    kv, algo = facts.kv_cache_quant_algo, facts.quant_algo
    if kv == "INT8" and b.use_paged_context_fmha is True:
        yield ("int8_kv_paged_context_fmha",
               "build.use_paged_context_fmha: true with an INT8 KV cache: TensorRT-LLM turns paged context FMHA "
               "off for INT8 KV. Set it to false (or leave it unset), or use quantization.kv_cache: fp8")
    if kv == "FP8" and b.use_paged_context_fmha is True:
        if algo not in FP8_CONTEXT_FMHA_ALGOS:
            yield ("fp8_kv_paged_context_fmha",
                   f"build.use_paged_context_fmha: true with an FP8 KV cache needs FP8-family weights "
                   f"(FP8, W4A8_AWQ, NVFP4); the checkpoint has {algo}. Use weight_format fp8 or w4a8_awq, "
                   f"or set use_paged_context_fmha: false")
        if sm is not None and sm < 89:
            yield ("fp8_kv_paged_context_fmha",
                   f"build.use_paged_context_fmha: true with an FP8 KV cache needs SM >= 89 (FP8 context FMHA); "
                   f"this GPU is SM {sm}")
    if b.kv_cache.enable_block_reuse and not paged_context_fmha(b, facts, sm):
        why = ("it is off for an INT8 KV cache" if kv == "INT8" else
               "you turned it off (build.use_paged_context_fmha: false)" if b.use_paged_context_fmha is False
               else f"with an FP8 KV cache it needs FP8-family weights on SM >= 89 (weights {algo}, SM {sm})")
        yield ("block_reuse_needs_paged_context_fmha",
               f"build.kv_cache.enable_block_reuse: true needs paged context FMHA, and {why}. Set "
               f"build.kv_cache.enable_block_reuse: false, or change the KV cache / weight format")


def _tensorrt_build_problems(b, facts: QuantFacts, sm: Optional[int]) -> Iterator[tuple[str, str]]:
    """tensorrt target: the GEMM plugin against the weights, and the sizes trtllm-build would clamp or clip."""
    algo, tpb = facts.quant_algo, b.kv_cache.tokens_per_block
    if b.chunked_context and b.use_paged_context_fmha is False:
        yield ("chunked_context_needs_paged_context_fmha",
               "build.chunked_context: true with build.use_paged_context_fmha: false. Turn one of them around")
    if chunked_context(b, facts, sm) and b.max_num_tokens % tpb:
        yield ("chunked_context_max_num_tokens",
               f"build.max_num_tokens {b.max_num_tokens} is not a multiple of kv_cache.tokens_per_block {tpb}, "
               f"which chunked context needs (it is on with paged context FMHA). Use max_num_tokens "
               f"{max(tpb, b.max_num_tokens // tpb * tpb)} or {(b.max_num_tokens // tpb + 1) * tpb}, or set "
               f"build.chunked_context: false")
    if b.fp8_swiglu_fusion and algo != "FP8":
        yield ("fp8_swiglu_fusion", f"build.fp8_swiglu_fusion: true with {algo} weights; it needs weight_format fp8")
    if b.gemm_plugin == "fp8" and algo != "FP8":
        yield ("gemm_plugin_fp8", f"build.gemm_plugin: fp8 with {algo} weights; it needs FP8 weights "
                                  f"(weight_format: fp8). Use auto, or leave gemm_plugin unset")
    if b.max_num_tokens > b.max_batch_size * b.max_seq_len:
        yield ("max_num_tokens_bounds", f"build.max_num_tokens {b.max_num_tokens} exceeds max_batch_size x "
                                        f"max_seq_len = {b.max_batch_size * b.max_seq_len}")
    if b.max_num_tokens < tpb:
        yield ("max_num_tokens_bounds", f"build.max_num_tokens {b.max_num_tokens} is below tokens_per_block {tpb}")
    if b.max_input_len > b.max_seq_len:
        yield ("max_input_len_bounds", f"build.max_input_len {b.max_input_len} exceeds max_seq_len {b.max_seq_len}")


def _gpu_problems(b, facts: QuantFacts, sm: int) -> Iterator[tuple[str, str]]:
    """Both GPU targets: the weight formats, KV cache and dtype a GPU of compute capability ``sm`` cannot run."""
    kv, algos = facts.kv_cache_quant_algo, facts.layer_algos
    if 100 <= sm < 120:
        bad = sorted(a for a in algos if a in BLACKWELL_REJECTED_ALGOS)
        bad += ["INT8 KV cache"] if kv == "INT8" else []
        if bad:
            yield ("blackwell_int8", f"SM {sm} (Blackwell) rejects {', '.join(bad)} (INT8/INT4 weight-only, "
                                     f"W4A8 AWQ included, SmoothQuant and INT8 KV are not supported on SM >= 100). "
                                     f"Use fp8 weights and an fp8 KV cache")
    if targets.get(b.target).engine_per_rank and b.fp8_swiglu_fusion and sm != SWIGLU_FUSION_SM:
        yield ("fp8_swiglu_fusion", f"build.fp8_swiglu_fusion: true needs Hopper (SM 90); this GPU is SM {sm}")
    if sm < 89:
        bad = sorted(a for a in algos if a in NEEDS_SM89_ALGOS)
        if bad:
            yield ("fp8_needs_sm89", f"{', '.join(bad)} need SM >= 89 (Ada/Hopper or later); this GPU is SM {sm}. "
                                     f"Use int8_sq or int4_awq weights")
    if sm < 80:
        bad = sorted(a for a in algos if a in NEEDS_SM80_ALGOS)
        if bad:
            yield ("int8_int4_need_sm80", f"{', '.join(bad)} need SM >= 80 (Ampere or later); this GPU is SM {sm}")
        if b.dtype == "bfloat16":
            yield ("bf16_needs_sm80", f"build.dtype: bfloat16 needs SM >= 80; this GPU is SM {sm}. Use float16")


def enforce_rules(cfg, sm: Optional[int], facts: Optional[QuantFacts] = None, gpu_label: str = "") -> None:
    """validity_problems as one ConfigError naming each broken rule and its upstream source."""
    problems = validity_problems(cfg, sm, facts)
    if problems:
        where = f" on {gpu_label}" if gpu_label else (f" for SM {sm}" if sm is not None else "")
        lines = [f"  - [{rule}] {msg} (rule from {RULES[rule].source})" for rule, msg in problems]
        raise ConfigError(f"build.target {cfg.build.target}{where} breaks TensorRT-LLM 1.2's rules:\n"
                          + "\n".join(lines))
