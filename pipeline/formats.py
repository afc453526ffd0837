"""The quantization formats: one table that the config, sensitivity, the plan, quantize, the checkpoint reader
and the GPU rules all read. Adding a format is one row here (plus its arithmetic where it is new).

Names:
- a *weight format* is what the config and the plan say (``int8_sq``, ``fp8``, ...), ``high_precision``
  for a layer kept in the checkpoint dtype;
- a *sensitivity column* is what the sensitivity table measures; ``int8_w8a8`` (plain per-tensor INT8
  activations, no smoothing) is a column only, the default decision column of no format;
- ``trtllm_quant_algo`` is TensorRT-LLM's QuantAlgo name in the checkpoint's ``config.json`` /
  ``quant_cfg.json`` (tensorrt_llm/quantization/mode.py), ``modelopt_preset`` the ModelOpt config
  (``modelopt.torch.quantization.<NAME>``) it starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HIGH_PRECISION = "high_precision"
FP16_BYTES = 2


@dataclass(frozen=True)
class Format:
    name: str
    bits: int  # weight bits (budgets, the plan's fused-group leader)
    modelopt_preset: str
    trtllm_quant_algo: str
    awq: bool  # AWQ calibration, group-wise INT4 weights with a pre-quant scale
    min_sm: int  # the oldest GPU generation TensorRT-LLM serves it on (80 Ampere, 89 Ada/Hopper)
    # tensors each quantized layer of the TensorRT-LLM checkpoint must carry besides its weight
    checkpoint_scales: tuple[str, ...]
    # the sensitivity-table column that predicts this format's error
    sensitivity_column: str

    def weight_bytes(self, out_features: int, in_features: int, group_size: int) -> int:
        return weight_bytes(self.name, out_features, in_features, group_size)


# Min SM: NVIDIA Model-Optimizer docs, guides/0_support_matrix (FP8 and W4A8 AWQ: Ada and later; INT8
# SmoothQuant and W4A16 AWQ: Ampere and later). Scales: what ModelOpt 0.47's TensorRT-LLM export writes
# (checked by reading exports back, tests/quant/test_checkpoint.py).
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("int8_sq", 8, "INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL", False, 80,
           ("weights_scaling_factor", "activation_scaling_factor"), "int8_sq"),
    Format("int8_wo", 8, "INT8_WEIGHT_ONLY_CFG", "W8A16", False, 80, ("weights_scaling_factor",), "int8_wo"),
    Format("fp8", 8, "FP8_DEFAULT_CFG", "FP8", False, 89,
           ("weights_scaling_factor", "activation_scaling_factor"), "fp8"),
    Format("int4_awq", 4, "INT4_AWQ_CFG", "W4A16_AWQ", True, 80,
           ("weights_scaling_factor", "prequant_scaling_factor"), "int4_awq"),
    # W4A8 AWQ's error is predicted by the INT4 AWQ column (the activations' FP8 step is not measured)
    Format("w4a8_awq", 4, "W4A8_AWQ_BETA_CFG", "W4A8_AWQ", True, 89,
           ("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor",
            "prequant_scaling_factor"), "int4_awq"),
)}

SENSITIVITY_COLUMNS = ("int8_w8a8", "int8_sq", "int8_wo", "fp8", "int4_awq")
LAYER_FORMATS = (HIGH_PRECISION, *FORMATS)  # what a plan may give a layer
NO_QUANT = "none"  # weight_format: none exports the unquantized baseline
# what ModelOpt 0.47's TensorRT-LLM export writes for stacked experts, tried on tiny Mixtrals: FP8, INT4 AWQ and
# W4A8 AWQ; INT8 SmoothQuant and INT8 weight-only fail in its to_quantized_weight (a per-expert scale of shape
# [experts, out] divides a weight of [experts, out, in] as if it were 2-D)
MOE_EXPORT_FORMATS = ("fp8", "int4_awq", "w4a8_awq")

# KV-cache formats: config name -> TensorRT-LLM kv_cache_quant_algo (None: not quantized)
KV_CACHE_ALGOS: dict[str, Optional[str]] = {"int8": "INT8", "fp8": "FP8", "none": None}

# vllm target: weight formats pipeline/engines/vllm/export.py writes -> vllm.device values whose kernels run
# them (vLLM 0.32, model_executor/kernels/linear): INT8 W8A8 (oneDNN on CPUs, CUTLASS on GPUs); INT4 W4A16
# (CPUWNA16LinearKernel on CPUs, Marlin on GPUs); FP8 W8A8 with a static input scale (CUTLASS from compute
# capability 8.9 and Marlin's W8A16 below it on GPUs; its CPU build fails it: a per-tensor weight scale is
# requantized through a static_scaled_fp8_quant op the CPU build lacks, and per-channel weight scales meet a
# per-tensor input scale in ChannelWiseTorchFP8ScaledMMLinearKernel, which narrows it as if per token: both
# found loading the export on this CPU); INT8 W8A16 (Marlin on GPUs; no CPU kernel: mixed_precision/cpu.py
# CPUWNA16LinearKernel takes uint4 / uint4b8 only, tests/engines/vllm/test_vllm_export.py asks vLLM). INT4 experts of an
# MoE model on a CPU need AMX as well (fused_moe/experts/cpu_moe.py CPUExpertsInt4): checked on the build machine,
# pipeline.engines.vllm.runtime.check_cpu_experts
VLLM_SERVABLE: dict[str, tuple[str, ...]] = {NO_QUANT: ("cpu", "cuda"), "int8_sq": ("cpu", "cuda"),
                                             "int4_awq": ("cpu", "cuda"), "fp8": ("cuda",), "int8_wo": ("cuda",)}


@dataclass(frozen=True)
class EdgePlatform:
    """A device TensorRT Edge-LLM builds for (the edge target, by build.target_sm)."""

    name: str
    jetpack: str  # the JetPack release the device commands are for
    edgellm_version: str
    weight_formats: tuple[str, ...]  # quantization.weight_format values it runs (none: FP16)
    kv_formats: tuple[str, ...]  # quantization.kv_cache values it runs (none: the engine's FP16 KV cache)


# edge target: TensorRT Edge-LLM 0.11.0's support matrix (tests/data/upstream/edgellm.json)
EDGE_INT4_ALIGN = 64  # its INT4 GEMM plugin takes an INT4 layer whose out and in features are multiples of 64
EDGE_PLATFORMS: dict[int, EdgePlatform] = {
    87: EdgePlatform("Jetson Orin", "7.2", "0.11.0", (NO_QUANT, "int8_sq", "int4_awq"), ("none",)),
}
VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM 0.32 v1/attention/backends/cpu_attn.py: kernel block sizes MultipleOf(32)
# vLLM 0.32 v1/attention/backends/mla/cpu_mla.py: multi-head latent attention on a CPU takes blocks of 16 only (the
# platform forces it), a latent KV of 576 (kv_lora_rank 512 + rope 64, DeepSeek-V2's) and the model's dtype
VLLM_CPU_MLA_BLOCK = 16
VLLM_CPU_MLA_LATENT = 576

# derived views, for the code that only needs one column
TRTLLM_QUANT_ALGO = {f.name: f.trtllm_quant_algo for f in FORMATS.values()}
FORMAT_OF_ALGO = {f.trtllm_quant_algo: f for f in FORMATS.values()}
AWQ_FORMATS = tuple(f.name for f in FORMATS.values() if f.awq)
DECISION_COLUMN = {f.name: f.sensitivity_column for f in FORMATS.values()}


def bits(fmt: str) -> int:
    return 16 if fmt == HIGH_PRECISION else FORMATS[fmt].bits


def weight_bytes(fmt: str, out_features: int, in_features: int, group_size: int) -> int:
    """Bytes a layer's weight takes in the exported checkpoint, scales included. ``fmt`` is a weight format,
    a sensitivity column, ``high_precision`` or ``none`` (both: FP16)."""
    params = out_features * in_features
    if fmt in ("int8_w8a8", "int8_wo"):
        return params + 4 * out_features  # per-channel fp32 scales
    if fmt == "int8_sq":
        return params + 4 * out_features + 4 * in_features  # + the SmoothQuant pre-quant scale
    if fmt == "fp8":
        return params + 4  # one per-tensor scale
    if fmt in AWQ_FORMATS:
        return params // 2 + FP16_BYTES * (params // group_size) + FP16_BYTES * in_features
    if fmt in (NO_QUANT, HIGH_PRECISION):
        return FP16_BYTES * params
    raise ValueError(f"unknown format {fmt!r}")
