"""Fake-quantization arithmetic, written to match NVIDIA ModelOpt 0.47's quantizers bit for bit on a CPU.

The sensitivity table must predict what the quantize stage (ModelOpt) will really produce, so these
functions follow ModelOpt's formulas (read from modelopt/torch/quantization/tensor_quant.py and
model_calib.py; tests/quant/test_quant_math.py checks them against ModelOpt's own TensorQuantizer and
smoothquant on the same inputs):

- integer: ``scale = maxbound / amax`` (maxbound 127 for INT8, 7 for INT4), values
  ``clamp(round(x * scale), -maxbound - 1, maxbound) / scale``, computed in fp32; an amax <= 2^-24 maps to 0.
  The range is not narrow (ModelOpt's default ``narrow_range: false``: ``_tensor_quant`` clamps to
  ``-max_bound - 1``; vLLM's INT8 kernels saturate to [-128, 127] as well, ``cvt.rni.sat.s8.f32``): -128 is
  reached only by a value beyond -amax, an activation larger than any the calibration saw (a weight's amax is
  its own largest value).
- FP8 E4M3: ``scale = 448 / amax``; ``(x * scale).clamp(+-448)`` cast to float8_e4m3fn and back, times ``1/scale``.
- SmoothQuant: per-input-channel activation amax ``a`` and weight amax ``w``;
  ``s = (w^(1-alpha) / a^alpha)`` (channels with a <= 2^-31 get 1), clamped to [1e-4, 1e4]; the input is
  multiplied by ``s`` and quantized per tensor with amax ``max(a * s)``; the weight becomes ``W / s``.
- AWQ-lite (INT4 weights, per group): per alpha in 0, 0.1, ..., 1 the scale
  ``x_mean^alpha / (w_mean^(1-alpha) + tiny)`` (clamped, normalised by ``sqrt(max * min)``); the alpha with
  the smallest output MSE wins.
"""

from __future__ import annotations

import torch

_TINY_AMAX = 1.0 / (1 << 24)
_SQ_EPS = 1.0 / (1 << 31)
FP8_MAX = 448.0


def int_fake_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """Symmetric integer fake quantization, the full range ([-128, 127] for 8 bits); amax broadcasts against x."""
    dtype = x.dtype
    x = x.float()
    amax = amax.float()
    max_bound = float(2 ** (num_bits - 1) - 1)
    # tensor / tensor, as ModelOpt does: `float / tensor` is computed as reciprocal * float in torch,
    # which differs in the last bit and flips values sitting on a rounding boundary
    scale = torch.tensor(max_bound, device=amax.device) / amax
    zero = amax <= _TINY_AMAX
    if bool(zero.any()):
        scale = torch.where(zero, torch.zeros_like(scale), scale)
    q = torch.clamp((x * scale).round_(), -max_bound - 1, max_bound)
    if bool(zero.any()):
        scale = torch.where(zero, torch.ones_like(scale), scale)
    return (q / scale).to(dtype)


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    amax = amax.float()
    safe = torch.where(amax <= _TINY_AMAX, torch.ones_like(amax), amax)
    scale = FP8_MAX / safe
    scale_inv = 1 / scale
    q = (x.float() * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale_inv).to(dtype)


def per_channel_amax(weight: torch.Tensor) -> torch.Tensor:
    """amax per output channel (ModelOpt weight quantizer axis=0): shape [out, 1]."""
    return weight.abs().amax(dim=1, keepdim=True)


def group_fake_quant(weight: torch.Tensor, group_size: int, num_bits: int = 4) -> torch.Tensor:
    """Block quantization along the input dim (ModelOpt block_sizes {-1: group_size}), amax per block."""
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {in_f}")
    blocks = weight.reshape(out_f, in_f // group_size, group_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    return int_fake_quant(blocks, amax, num_bits).reshape(out_f, in_f)


def input_channel_amax(weight: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """max |W| per input channel, [1, in]; computed in row blocks (a 49k-row lm_head needs no full copy)."""
    out = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    for a in range(0, weight.shape[0], rows):
        torch.maximum(out, weight[a:a + rows].abs().amax(dim=0, keepdim=True), out=out)
    return out


def abs_amax(t: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    return input_channel_amax(t.reshape(-1, t.shape[-1]), rows).amax()


def smoothquant_scale(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """ModelOpt's SmoothQuant pre-quant scale for one linear (per input channel)."""
    act_amax = act_amax.float()
    weight_scale = input_channel_amax(weight)
    scale = (weight_scale.pow(1 - alpha) / act_amax.pow(alpha)).squeeze()
    if float(scale.min()) <= _SQ_EPS:  # channels that never fire would get a huge scale: leave them alone
        scale = torch.where(act_amax.reshape(-1) <= _SQ_EPS, torch.ones_like(scale), scale)
    return scale.clamp(min=1e-4, max=1e4)


def awq_lite_scale(x_abs_mean: torch.Tensor, w_norm_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    scales = (x_abs_mean.pow(alpha) / (w_norm_mean.pow(1 - alpha) + torch.finfo(torch.float32).tiny))
    scales = scales.clamp(min=1e-4, max=1e4).view(-1)
    return (scales / (scales.max() * scales.min()).sqrt()).view(-1)


def awq_weight_scale(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over output channels of |W| normalised by its group's amax (ModelOpt's get_weight_scale)."""
    org_shape = weight.shape
    w = weight.contiguous().view(-1, group_size).abs()
    scale = w / (w.amax(dim=1, keepdim=True) + torch.finfo(weight.dtype).tiny)
    return scale.view(org_shape).mean(0).float()
