"""The quantize stage's TensorRT-LLM checkpoint rewritten as an HF folder vLLM loads (compressed-tensors).

The TensorRT-LLM checkpoint is what the accuracy gate measured, so the export starts from it, not from the
original weights: every INT8 code and scale is carried over as it is. What changes is where the SmoothQuant
pre-quant scale ``s`` is applied. TensorRT-LLM multiplies a linear's input by ``s`` (the weight holds
``1/s``); vLLM has no such step, so ``s`` is folded into whatever computes that input, exactly:

- q/k/v read the input RMSNorm: its weight times ``s``;
- gate/up read the post-attention RMSNorm: its weight times ``s`` (both share it; a linear of the pair kept
  in high precision gets ``1/s`` folded into its columns instead);
- down_proj reads ``act(gate) * up``: up_proj's output rows times ``s`` (for INT8 rows, their per-channel
  scales: the codes do not change);
- o_proj reads the attention output, a mix of V rows: v_proj's output rows times ``s``, where ``s`` is the
  same for every query head sharing a KV head (always so without grouped-query attention). Where it is not,
  o_proj cannot be folded: it is written in high precision, its INT8 weight dequantized and ``s`` folded
  into its columns (it computes what the gate measured, less its activation rounding), and the export says
  so.

Formats (vLLM 0.32, ``model_executor/layers/quantization/compressed_tensors``):

- INT8 SmoothQuant (W8A8_SQ_PER_CHANNEL): INT8 weights per output channel, symmetric, with the checkpoint's
  static per-tensor INT8 input scale (``CompressedTensorsW8A8Int8``, strategy channel / tensor, ``dynamic:
  false``: its CPU kernel is oneDNN's or the AMX one, ``kernels/linear/scaled_mm/cpu.py``), format
  ``int-quantized``; tensors ``weight`` (I8 [out, in]), ``weight_scale`` (F32 [out, 1], W = code * scale)
  and ``input_scale`` (F32 [1], x_code = round(x / scale));
- INT8 weight-only (W8A16): INT8 weights per output channel, activations in ``dtype``
  (``CompressedTensorsWNA16``, strategy channel, 8 bits: Marlin on GPUs; vLLM 0.32 has no CPU kernel for it,
  ``kernels/linear/mixed_precision/cpu.py`` takes 4-bit types only), format ``pack-quantized``; tensors
  ``weight_packed`` (I32 [out, in / 4]: four codes per word, code + 128 in the 8 bits from bit 8j),
  ``weight_scale`` ([out, 1] in ``dtype``) and ``weight_shape``;
- FP8 (FP8): FP8 E4M3 weights and the checkpoint's static per-tensor FP8 input scale
  (``CompressedTensorsW8A8Fp8``, ``dynamic: false``: on GPUs CUTLASS from compute capability 8.9, Marlin's
  W8A16 below it; vLLM 0.32's CPU build fails it, see pipeline.formats.VLLM_SERVABLE), format
  ``float-quantized``; tensors ``weight`` (F8_E4M3 [out, in]: W = fp8 * scale), ``weight_scale``
  (F32 [out, 1]) and ``input_scale`` (F32 [1]: x_fp8 = x / scale). The checkpoint's one scale per tensor is
  written per output channel (strategy channel), which is exact: with strategy tensor vLLM runs a fused
  GEMM (q/k/v, gate/up) on its members' largest scale and rounds the others' FP8 values again
  (``requantize_with_max_scale``; its CPU build cannot even do that: no ``static_scaled_fp8_quant`` op,
  found loading a tensor-strategy export here). A fused GEMM takes one input scale, the largest
  (``input_scale.max()``): the export writes that, so the files hold what runs (INT8 W8A8 likewise);
- INT4 AWQ (W4A16_AWQ): INT4 weights in groups along the input, symmetric, activations in ``dtype``
  (``CompressedTensorsWNA16``, strategy group; on a CPU its ``CPUWNA16LinearKernel``, on GPUs Marlin),
  format ``pack-quantized``; tensors ``weight_packed`` (I32 [out, in / 8]: eight codes per word, code + 8 in
  the 4 bits from bit 4j, j along the input; compressed-tensors' ``pack_to_int32``), ``weight_scale``
  ([out, in / group] in ``dtype``: W = code * scale of its group) and ``weight_shape`` (I64 [2]: out, in).
  The codes and group scales are the checkpoint's; AWQ's pre-quant scale is folded like SmoothQuant's.

Mixture-of-experts layers (Mixtral, Qwen3-MoE; pipeline/families.py ``Family.moe``) are written as vLLM's
models load them from HF checkpoints: the router (``block_sparse_moe.gate`` / ``mlp.gate``) unquantized and in
the ``ignore`` list, and every expert's gate/up/down under its own name (``experts.E.w1`` ...), read one expert
at a time from the checkpoint's stacked tensors and joined across ranks. vLLM runs a layer's experts as one
fused MoE with one scheme (``compressed_tensors_moe.py`` ``get_moe_method``): INT4 AWQ experts as
``CompressedTensorsWNA16MoEMethod`` (the dense INT4 group; on a CPU only with AMX), FP8 experts as
``CompressedTensorsW8A8Fp8MoEMethod``, which takes static input scales only with per-tensor weight scales, so
FP8 experts are a group of their own with strategy ``tensor`` and ``weight_scale`` of shape [1] (exact: an
expert's gate and up share one scale in the checkpoint).

The KV cache (``kv_scales``: vLLM serves an FP8 E4M3 KV cache): each attention layer's calibrated scales as
``self_attn.k_scale`` / ``self_attn.v_scale`` (F32 [1]) and ``kv_cache_scheme`` (8-bit float, tensor,
symmetric) in the quantization_config. vLLM 0.32 loads them through every attention layer's
``CompressedTensorsKVCacheMethod`` (its quant config's ``get_cache_scale_mapper`` renames ``.k_scale`` to
``.attn.k_scale``); without them it runs the cache at scale 1.0 and only warns. K and V each get their own
(ModelOpt calibrates one quantizer each, which the gate measured; a checkpoint holding only the joint
``kv_cache_scaling_factor`` gives both that one). An FP8 scale is written as it is (ModelOpt's TensorRT-LLM
export: max(amax / 448, 1)); an INT8 one as its amax (scale x 127) over 448, so vLLM's FP8 cache clips where
the INT8 cache the gate measured clips.
The build's vLLM check reads back the scales vLLM serves with (tests/data/upstream/vllm_kv_cache_scales.json).

Quantized layers are one config group per format: the format with the most layers targets ``Linear``; the
others (a mixed plan) name their layers, which vLLM matches before the class. Layers the plan keeps in high
precision are the config's ``ignore`` list (q/k/v and gate/up decide
together: vLLM fuses them and ModelOpt's plan gives each group one format). Unquantized tensors are written
in ``dtype``.

Memory: the checkpoint is read a tensor at a time and the export is written as it goes, in safetensors
shards of at most ``max_shard_bytes`` with an index (``model.safetensors.index.json``, the HF layout vLLM
reads), so the export holds one shard and one decoder layer, not the model. It is written into a sibling
``.partial`` folder and renamed into place at the end: a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import families
from pipeline.errors import InputError, IntegrityError
from pipeline.fsutil import atomic_write_text, remove_tree
from pipeline.quant.checkpoint import _join, _joined_prequant

# TensorRT-LLM algos the export writes for vLLM; anything else is refused before export (config check)
INT8_SQ, INT8_WO, FP8, INT4_AWQ = "W8A8_SQ_PER_CHANNEL", "W8A16", "FP8", "W4A16_AWQ"
EXPORTABLE_ALGOS = (INT8_SQ, INT8_WO, FP8, INT4_AWQ)
PACKED_BITS = {INT8_WO: 8, INT4_AWQ: 4}  # weight-only formats: codes packed into int32 words
# FP8 experts: vLLM 0.32's FP8 MoE takes static input scales only with per-tensor weight scales
# (compressed_tensors_moe_w8a8_fp8.py refuses channel weights with a static input), so they are their own group
FP8_EXPERTS = "FP8 experts"
WEIGHTS_FILE = "model.safetensors"  # one shard; more: model-00001.safetensors ... and the index
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 2**30  # a shard is written, and its tensors freed, once this much is pending
QUANT_METHOD = "compressed-tensors"
# The FP8 KV-cache scheme vLLM 0.32 validates (CompressedTensorsKVCacheMethod.validate_kv_cache_scheme: float,
# 8 bits, symmetric, strategy tensor or attn_head); with it vLLM serves FP8 where kv_cache_dtype is auto
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
KV_CODE_MAX = {"FP8": 448.0, "INT8": 127.0}  # a checkpoint's KV scale = calibrated amax / this
KV_SCALE_KEYS = ("kv_cache_scaling_factor", "k_cache_scaling_factor", "v_cache_scaling_factor")


def fp8_kv_scale(scale: float, kv_algo: str) -> float:
    """The FP8 E4M3 KV-cache scale that clips where the checkpoint's calibrated KV cache clips: an FP8 scale as it
    is, an INT8 one's amax (scale x 127) over 448."""
    if kv_algo not in KV_CODE_MAX:
        raise IntegrityError(f"KV-cache scales of kv_cache_quant_algo {kv_algo}: the vLLM export knows "
                             f"{', '.join(KV_CODE_MAX)}")
    return float(scale) * KV_CODE_MAX[kv_algo] / KV_CODE_MAX["FP8"]


def _args(num_bits: int, kind: str, strategy: str, **extra) -> dict:
    """One compressed-tensors QuantizationArgs (symmetric, static)."""
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy, **extra, "dynamic": False}


def scheme(algo: str, group_size: int = 0) -> dict:
    """The compressed-tensors scheme of a linear in ``algo`` (compressed_tensors.quantization.QuantizationArgs)."""
    if algo == INT8_SQ:
        return {"weights": _args(8, "int", "channel"), "input_activations": _args(8, "int", "tensor")}
    if algo == FP8:  # the per-tensor weight scale written per channel (see the module's docstring)
        return {"weights": _args(8, "float", "channel"), "input_activations": _args(8, "float", "tensor")}
    if algo == FP8_EXPERTS:
        return {"weights": _args(8, "float", "tensor"), "input_activations": _args(8, "float", "tensor")}
    if algo == INT8_WO:
        return {"weights": _args(8, "int", "channel"), "input_activations": None}
    return {"weights": _args(4, "int", "group", group_size=group_size), "input_activations": None}


FORMAT_OF = {INT8_SQ: "int-quantized", INT8_WO: "pack-quantized", FP8: "float-quantized",
             FP8_EXPERTS: "float-quantized", INT4_AWQ: "pack-quantized"}  # compressed-tensors' format names


def pack_codes(codes, bits: int):
    """[out, in] signed ``bits``-bit codes (int8) -> [out, in * bits / 32] int32: code + 2^(bits-1) in bits
    bits*j.. of word i // (32 / bits) for input i = (32 / bits) * word + j (compressed-tensors'
    pack_to_int32 with packed_dim 1)."""
    import torch

    per_word = 32 // bits
    out_f, in_f = codes.shape
    if in_f % per_word:
        raise IntegrityError(f"{bits}-bit weight of input width {in_f}: not a multiple of {per_word}")
    u = (codes.to(torch.int32) + (1 << (bits - 1))).reshape(out_f, in_f // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    return (u << shifts).sum(dim=2, dtype=torch.int32)


@dataclass
class Linear:
    """One HF linear on its way out: float weight, or INT8 / FP8 / INT4 values with their scales."""

    weight: Any  # torch tensor: float [out, in]; int8 codes [out, in] (INT4 codes unpacked, in [-8, 7]); FP8 E4M3
    weight_scale: Any = None  # fp32, when quantized: INT8 [out]; FP8 a scalar; INT4 [out, in / group_size]
    input_scale: Any = None  # fp32 scalar: INT8 SmoothQuant's or FP8's static input scale
    prequant: Any = None  # fp32 [in]: the input multiplier still to fold
    algo: Optional[str] = None  # the checkpoint's quant_algo; None: high precision
    group_size: Optional[int] = None  # INT4
    bias: Any = None  # fp32 [out] (Qwen2's q/k/v), unquantized

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None

    def scale_rows(self, s) -> None:
        """Output rows times ``s`` (exact: for quantized rows, their per-channel or per-group scales), the bias
        with them."""
        if self.bias is not None:
            self.bias = self.bias * s
        if self.quantized:
            self.weight_scale = self.weight_scale * (s if self.weight_scale.dim() == 1 else s[:, None])
        else:
            self.weight = self.weight * s[:, None]

    def scale_columns(self, s) -> None:
        """Input columns times ``s``: only a float weight can take it."""
        assert not self.quantized
        self.weight = self.weight * s[None, :]

    def requantize_int4(self, column_factor) -> None:
        """INT4 only: the weight with its input columns times ``column_factor``, quantized again to INT4 in the
        same groups (round to nearest, scale = group amax / 7, as ModelOpt's INT4 quantizer)."""
        import torch

        out_f, in_f = self.weight.shape
        g = self.group_size
        w = self.weight.float() * self.weight_scale.repeat_interleave(g, dim=1) * column_factor[None, :]
        groups = w.reshape(out_f, in_f // g, g)
        scale = groups.abs().amax(dim=-1) / 7.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.weight = (groups / scale[..., None]).round().clamp(-8, 7).to(torch.int8).reshape(out_f, in_f)
        self.weight_scale = scale

    def dequantize(self) -> None:
        """Codes -> float weight (the smoothing folded in), the layer then in high precision."""
        dims = self.weight_scale.dim()
        scale = self.weight_scale if dims == 0 else self.weight_scale[:, None] if dims == 1 \
            else self.weight_scale.repeat_interleave(self.group_size, dim=1)
        self.weight = self.weight.float() * scale
        if self.prequant is not None:
            self.weight = self.weight * self.prequant[None, :]
        self.weight_scale = self.input_scale = self.prequant = self.algo = self.group_size = None


@dataclass
class ExportFacts:
    quantized_linears: int = 0
    high_precision_linears: int = 0
    ignore: list[str] = field(default_factory=list)
    folded: dict[str, int] = field(default_factory=dict)  # where pre-quant scales went -> count
    unfoldable: list[str] = field(default_factory=list)  # quantized in the checkpoint, high precision here
    requantized: list[str] = field(default_factory=list)  # INT4 requantized to share its fused group's scale
    input_rescaled: list[str] = field(default_factory=list)  # on its fused GEMM's larger static input scale
    unfused: list[str] = field(default_factory=list)  # quantized, but fused in vLLM with a layer in another format
    mla_kv_b_dequantized: list[str] = field(default_factory=list)  # latent attention's kv_b_proj, run in dtype

    def as_dict(self) -> dict:
        return {"quantized_linears": self.quantized_linears, "high_precision_linears": self.high_precision_linears,
                "ignore": len(self.ignore), "smoothing_folded_into": self.folded,
                "dequantized_smoothing_not_foldable": self.unfoldable,
                "int4_requantized_to_share_a_prequant_scale": self.requantized,
                "input_scale_raised_to_its_fused_gemms": self.input_rescaled,
                "dequantized_fused_with_another_format": self.unfused,
                "dequantized_kv_b_proj_of_latent_attention": self.mla_kv_b_dequantized}


class _Ranks:
    """The checkpoint's rank files, read a tensor at a time and joined across ranks."""

    def __init__(self, ckpt_dir: Path):
        from safetensors import safe_open

        cfg = json.loads((ckpt_dir / "config.json").read_text())
        mapping = cfg.get("mapping") or {}
        self.tp = mapping.get("tp_size", 1)
        if mapping.get("pp_size", 1) != 1:
            raise IntegrityError(f"{ckpt_dir}: pipeline-parallel checkpoints cannot be exported for vLLM")
        self.files = [ckpt_dir / f"rank{r}.safetensors" for r in range(self.tp)]
        self.keys = []
        for path in self.files:
            if not path.is_file():
                raise IntegrityError(f"{ckpt_dir}: tp_size {self.tp} but {path.name} is missing")
            with safe_open(str(path), framework="pt") as f:
                self.keys.append(set(f.keys()))
        self.read_keys: set[str] = set()
        self.experts = 0  # the model's experts per MoE layer (0: dense), for ``each(key, expert)``

    def has(self, key: str) -> bool:
        return key in self.keys[0]

    def each(self, key: str, expert: Optional[int] = None) -> list:
        """``key`` on every rank; with ``expert``, that expert's slice of a stacked expert tensor (one whose first
        dim counts the experts: weights and per-expert scales) or the tensor whole (the experts' one activation
        scale), read without loading the other experts."""
        from safetensors import safe_open

        from pipeline.quant.checkpoint import _get

        self.read_keys.add(key)
        if expert is None:
            return [_get(path, key) for path in self.files]
        out = []
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                stacked = f.get_slice(key)
                shape = stacked.get_shape()
                out.append(stacked[expert] if len(shape) >= 2 and shape[0] == self.experts else f.get_tensor(key))
        return out

    def one(self, key: str):
        return self.each(key)[0]

    def unread(self) -> list[str]:
        return sorted(set().union(*self.keys) - self.read_keys)


def _read_linear(ranks: _Ranks, name: str, *, fmt: tuple, kind: str, split: Optional[list[int]] = None,
                 expert: Optional[int] = None) -> list[Linear]:
    """The checkpoint linear ``name`` (``fmt``: its quant_algo and group size) joined across ranks: kind column
    (split on outputs) or row (on inputs); ``split``: the per-rank output widths to cut it into (fused q/k/v,
    an expert's up | gate), else one Linear; ``expert``: that expert of a stacked expert tensor."""
    import torch

    from pipeline.formats import FORMAT_OF_ALGO
    from pipeline.quant.checkpoint import unpack_int4

    algo, group_size = fmt
    weights = ranks.each(f"{name}.weight", expert)
    scales: dict[str, Any] = {k: ranks.each(f"{name}.{k}", expert) if ranks.has(f"{name}.{k}") else None
                              for k in ("weights_scaling_factor", "activation_scaling_factor",
                                        "prequant_scaling_factor")}
    if algo is None:
        if any(v is not None for v in scales.values()):
            raise IntegrityError(f"{name}: unquantized weight with quantization scales beside it")
    elif algo not in EXPORTABLE_ALGOS:
        raise InputError(f"{name}: {algo} cannot be exported for vLLM (exportable: {', '.join(EXPORTABLE_ALGOS)})")
    else:
        stored = torch.float8_e4m3fn if algo == FP8 else torch.int8
        needed = FORMAT_OF_ALGO[algo].checkpoint_scales
        if weights[0].dtype != stored or any(scales[k] is None for k in needed) \
                or (algo == INT4_AWQ and not group_size):
            raise IntegrityError(f"{name}: {algo} needs {stored} weights and {', '.join(needed)}"
                                 + (" with a group size" if algo == INT4_AWQ else ""))
    int4, fp8 = algo == INT4_AWQ, algo == FP8
    if int4:
        weights = [unpack_int4(w) for w in weights]  # [out, in] codes; group scales [out, in / group]

    def wsf_of(r: int, rows: int):
        w = scales["weights_scaling_factor"][r].float()
        if int4:
            if tuple(w.shape) != (rows, weights[r].shape[1] // group_size):
                raise IntegrityError(f"{name}: INT4 group scales of shape {tuple(w.shape)} do not fit a weight of "
                                     f"{tuple(weights[r].shape)} with group size {group_size}")
            return w
        if fp8:  # one scale for the whole weight, taken before the split: the same on every rank
            if w.numel() != 1 or not torch.equal(w, scales["weights_scaling_factor"][0].float()):
                raise IntegrityError(f"{name}: an FP8 weight takes one scale, the same on every rank; found "
                                     f"{[tuple(t.shape) for t in scales['weights_scaling_factor']]}")
            return w.reshape(())
        w = w.reshape(-1)
        return w.expand(rows).clone() if w.numel() == 1 else w

    pieces = []  # per rank: list of (weight, wsf) per split part
    for r, w in enumerate(weights):
        wsf: Any = wsf_of(r, w.shape[0]) if algo else None
        if split:
            ws = w.split(split)
            ss = [wsf] * len(split) if fp8 else wsf.split(split) if algo else [None] * len(split)
            pieces.append(list(zip(ws, ss)))
        else:
            pieces.append([(w, wsf)])
    out = []
    for part in range(len(pieces[0])):
        ws = [p[part][0] for p in pieces]
        if kind == "row":
            weight = _join(ws, 1)
            # per-channel INT8 and FP8 scales are the same on every rank of a row-parallel linear; INT4 group
            # scales are split with the input
            wsf = (_join([p[part][1] for p in pieces], 1) if int4 else pieces[0][part][1]) if algo else None
        else:
            weight = _join(ws, 0)
            wsf = (pieces[0][part][1] if fp8 else _join([p[part][1] for p in pieces], 0)) if algo else None
        lin = Linear(weight if algo else weight.float(), wsf, algo=algo, group_size=group_size if int4 else None)
        if algo in (INT8_SQ, FP8):
            lin.input_scale = scales["activation_scaling_factor"][0].float().reshape(())
        if algo and scales["prequant_scaling_factor"] is not None:
            lin.prequant = _joined_prequant(name, scales["prequant_scaling_factor"], kind)
        out.append(lin)
    # experts have no biases (Mixtral, Qwen3-MoE)
    for lin, bias in zip(out, [None] * len(out) if expert is not None else _read_bias(ranks, name, kind, split)):
        lin.bias = bias
    return out


def _read_bias(ranks: _Ranks, name: str, kind: str, split: Optional[list[int]]) -> list:
    """The linear's bias per output part (none: Nones), joined across ranks as its output rows are."""
    from pipeline.quant.checkpoint import join_biases

    if not ranks.has(f"{name}.bias"):
        return [None] * (len(split) if split else 1)
    return join_biases(name, ranks.each(f"{name}.bias"), kind, split)


def _same(a, b) -> bool:
    import torch

    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def one_format(linears: dict[str, Linear], facts: ExportFacts) -> None:
    """vLLM runs q/k/v and gate/up each as one GEMM in one format; the plan may give gate and up different
    ones (TensorRT-LLM keeps them apart). Then the quantized members are written in high precision (their
    weights dequantized, their own pre-quant scales folded into their columns): exact, and the export says so.
    A group with static input scales (INT8 W8A8, FP8) gets one, the largest.
    ``linears``: HF name -> Linear."""
    algos = {lin.algo for lin in linears.values()}
    if algos in ({FP8}, {INT8_SQ}):
        _share_input_scale(linears, facts)
    if len(algos) == 1:
        return
    for name, lin in linears.items():
        if lin.quantized:
            lin.dequantize()
            facts.unfused.append(name)


def _share_input_scale(linears: dict[str, Linear], facts: ExportFacts) -> None:
    """vLLM 0.32 quantizes a fused GEMM's input with one static scale: FP8 with its members' largest
    (``input_scale.max()``, compressed_tensors_w8a8_fp8.py), INT8 with the one loaded last (one ``input_scale``
    of shape [1] for the layer, compressed_tensors_w8a8_int8.py). The export writes the largest for every
    member, so the files hold what runs either way (gate and up read the same input: their calibrated scales
    normally agree, and q/k/v come fused from the checkpoint with one)."""
    import torch

    input_scale = max(float(lin.input_scale) for lin in linears.values())
    for name, lin in linears.items():
        if float(lin.input_scale) != input_scale:
            lin.input_scale = torch.tensor(input_scale)
            facts.input_rescaled.append(name)


def _fold_into_norm(norm, linears: dict[str, Linear], where: str, facts: ExportFacts):
    """The group's shared pre-quant scale into the RMSNorm before it; returns the new norm weight. A
    quantized member with another scale is dequantized (not foldable); float members take ``1/s``.
    ``linears``: HF name -> Linear."""
    s = next((l.prequant for l in linears.values() if l.quantized and l.prequant is not None), None)
    if s is None:
        return norm
    for name, lin in linears.items():
        if lin.quantized and not _same(lin.prequant, s) and lin.algo == INT4_AWQ and lin.prequant is not None:
            # AWQ searched a scale per linear, and vLLM fuses gate/up (and q/k/v) into one INT4 GEMM: this
            # one's weight takes the group's scale and is quantized again, as ModelOpt's own HF export does
            # for fused layers (the build's vLLM check measures the result against the gate)
            lin.requantize_int4(lin.prequant / s)
            lin.prequant = s
            facts.requantized.append(name)
        if lin.quantized and not _same(lin.prequant, s):
            lin.dequantize()  # its own smoothing goes into its columns; it then takes 1/s below
            facts.unfoldable.append(name)
        if not lin.quantized:
            lin.scale_columns(1.0 / s)
        lin.prequant = None
    facts.folded[where] = facts.folded.get(where, 0) + 1
    return norm * s


def _moe_shape(hf) -> tuple[Any, int, int]:
    """The family's MoE layout (None: dense), its experts per layer and an expert's intermediate size (Mixtral:
    num_local_experts, intermediate_size; Qwen3-MoE: num_experts, moe_intermediate_size)."""
    fam = families.FAMILIES.get(hf.model_type)
    if fam is None or fam.moe is None:
        return None, 0, 0
    return (fam.moe, getattr(hf, "num_local_experts", None) or hf.num_experts,
            getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)


def _attention(ranks: _Ranks, p: str, *, h: str, layer_format, qkv_split: list[int], heads: tuple,
               facts: ExportFacts) -> tuple[Any, dict[str, Linear]]:
    """A layer's q/k/v and o_proj (HF name -> Linear) with q/k/v's smoothing folded into the input norm (returned)
    and o_proj's into v_proj's rows where ``heads`` (query heads, KV heads, head dim) allow it."""
    q, k, v = _read_linear(ranks, f"{p}.attention.qkv", fmt=layer_format(f"{p}.attention.qkv"), kind="qkv",
                           split=qkv_split)
    o, = _read_linear(ranks, f"{p}.attention.dense", fmt=layer_format(f"{p}.attention.dense"), kind="row")
    qkv = {f"{h}.self_attn.{m}_proj": l for m, l in zip("qkv", (q, k, v))}
    one_format(qkv, facts)
    ln_in = _fold_into_norm(ranks.one(f"{p}.input_layernorm.weight").float(), qkv, "input_layernorm", facts)
    _fold_into_rows(v, o, name=f"{h}.self_attn.o_proj", where="v_proj rows", facts=facts,
                    heads=heads if heads[0] != heads[1] else None)
    if len({l.algo for l in (q, k, v)}) != 1:
        raise IntegrityError(f"{h}: vLLM fuses q/k/v, which must share one format ({[l.algo for l in (q, k, v)]})")
    return ln_in, {**qkv, f"{h}.self_attn.o_proj": o}


def _kv_scales(ranks: _Ranks, p: str) -> Optional[tuple[float, float]]:
    """A layer's KV-cache scales (K, V) in the checkpoint (one joint scale, or one each; the largest over ranks),
    or None where it has none."""
    found = {}
    for key in KV_SCALE_KEYS:
        if ranks.has(f"{p}.attention.{key}"):
            found[key] = max(float(t.float().max()) for t in ranks.each(f"{p}.attention.{key}"))
    if not found:
        return None
    joint = found.get("kv_cache_scaling_factor")
    return found.get("k_cache_scaling_factor", joint), found.get("v_cache_scaling_factor", joint)  # type: ignore[return-value]


def _dense_mlp(ranks: _Ranks, p: str, h: str, layer_format, facts: ExportFacts) -> dict[str, Linear]:
    """A dense MLP's gate/up/down (HF name -> Linear) with down_proj's smoothing folded into up_proj's rows;
    gate/up's is left for the norm."""
    gate, = _read_linear(ranks, f"{p}.mlp.fc", fmt=layer_format(f"{p}.mlp.fc"), kind="column")
    up, = _read_linear(ranks, f"{p}.mlp.gate", fmt=layer_format(f"{p}.mlp.gate"), kind="column")
    down, = _read_linear(ranks, f"{p}.mlp.proj", fmt=layer_format(f"{p}.mlp.proj"), kind="row")
    one_format({f"{h}.mlp.gate_proj": gate, f"{h}.mlp.up_proj": up}, facts)
    _fold_into_rows(up, down, name=f"{h}.mlp.down_proj", where="up_proj rows", facts=facts)
    if gate.algo != up.algo:
        raise IntegrityError(f"{h}: vLLM fuses gate/up, which must share one format ({[gate.algo, up.algo]})")
    return {f"{h}.mlp.gate_proj": gate, f"{h}.mlp.up_proj": up, f"{h}.mlp.down_proj": down}


def _moe_mlp(ranks: _Ranks, p: str, *, block: str, moe, inter: int, layer_format, norm,
             facts: ExportFacts) -> tuple[Any, dict[str, Linear], dict[str, Linear]]:
    """An MoE layer (``block``: its HF path, e.g. model.layers.3.block_sparse_moe): the router, kept in high
    precision (it is in the config's ignore list), and every expert's gate/up/down read one at a time from the
    stacked tensors (``inter``: an expert's intermediate rows per rank). vLLM runs a layer's experts as one
    fused MoE with one quantization scheme for all their projections (compressed_tensors_moe.py
    ``get_moe_method``: "All MoE projections need to have same quantization scheme"), so experts whose up/gate and
    down differ in format are written in high precision, exactly. Each expert's down smoothing folds into its
    up rows, and the up/gate smoothing into the norm (the router taking its inverse): exact, as ModelOpt 0.47
    gives a layer's AWQ experts one pre-quant scale per expert type (layer_utils.py
    ``update_experts_avg_prequant_scale``, their mean). Returns (norm, {router}, {experts' linears})."""
    router = Linear(ranks.one(f"{p}.mlp.router.weight").float())
    gate_name, up_name = moe.fused
    leaf = moe.experts.rsplit(".", 1)[-1]
    fc_fmt, proj_fmt = layer_format(f"{p}.mlp.fc"), layer_format(f"{p}.mlp.proj")
    ups, gates, downs = {}, {}, {}
    for e in range(ranks.experts):
        x = f"{block}.{leaf}.{e}"
        ups[f"{x}.{up_name}"], gates[f"{x}.{gate_name}"] = _read_linear(  # each rank: up rows, then gate rows
            ranks, f"{p}.mlp.fc", fmt=fc_fmt, kind="column", split=[inter, inter], expert=e)
        downs[f"{x}.{moe.down}"], = _read_linear(ranks, f"{p}.mlp.proj", fmt=proj_fmt, kind="row", expert=e)
    one_format({**gates, **ups}, facts)
    one_format(downs, facts)
    if fc_fmt[0] != proj_fmt[0]:
        one_format({**gates, **ups, **downs}, facts)  # formats differ: everything quantized goes high precision
    for up, (down_name, down) in zip(ups.values(), downs.items()):
        _fold_into_rows(up, down, name=down_name, where="expert up rows", facts=facts)
    router_name = f"{block}.{moe.router.rsplit('.', 1)[-1]}"
    norm = _fold_into_norm(norm, {router_name: router, **gates, **ups}, "post_attention_layernorm", facts)
    every = {**gates, **ups, **downs}
    experts = {name: every[name] for e in range(ranks.experts)  # the HF order: an expert's gate, up, down
               for name in (f"{block}.{leaf}.{e}.{gate_name}", f"{block}.{leaf}.{e}.{up_name}",
                            f"{block}.{leaf}.{e}.{moe.down}")}
    return norm, {router_name: router}, experts


def _fold_into_rows(target: Linear, lin: Linear, *, name: str, where: str, facts: ExportFacts,
                    heads: Optional[tuple] = None, rows=None):
    """``lin``'s (HF ``name``) pre-quant scale into the output rows of ``target`` (which produces its input):
    all of them, or ``rows`` (an index tensor, in the order of ``lin``'s inputs: a part of a linear fused on
    disk, as Phi-3's v rows in qkv_proj, or the value rows of multi-head latent attention's kv_b_proj).
    ``heads``: (query heads, KV heads, head dim) when ``target`` is v_proj and each KV head feeds several query
    heads."""
    import torch

    s = lin.prequant
    if s is None or not lin.quantized:
        return
    if heads is not None:
        n_heads, n_kv, head_dim = heads
        per_kv = s.reshape(n_kv, n_heads // n_kv, head_dim)
        if not bool((per_kv == per_kv[:, :1]).all()):
            lin.dequantize()  # a KV row feeds query heads that want different scales: not foldable
            facts.unfoldable.append(name)
            return
        s = per_kv[:, 0].reshape(-1)
    if rows is not None:
        s = torch.ones(target.weight.shape[0]).index_copy_(0, rows, s)
    target.scale_rows(s)
    lin.prequant = None
    facts.folded[where] = facts.folded.get(where, 0) + 1


def fold_head(final_norm, head: Linear, vocab: int, facts: ExportFacts):
    """lm_head cut to the vocabulary; a quantized one's pre-quant scale folded into the final norm (nothing
    else comes before it). Returns the final norm."""
    head.weight = head.weight[:vocab]
    if head.quantized:
        head.weight_scale = head.weight_scale[:vocab]
        if head.prequant is not None:
            final_norm = final_norm * head.prequant
            head.prequant = None
            facts.folded["norm"] = 1
    return final_norm


class ShardWriter:
    """Tensors written to safetensors shards as they come; ``finish`` names them and writes the index."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, Any] = {}
        self.pending_bytes = self.total_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor) -> None:
        self.pending[name] = tensor
        size = tensor.numel() * tensor.element_size()
        self.pending_bytes += size
        self.total_bytes += size
        if self.pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        from pipeline.compute import trim_heap

        if not self.pending:
            return
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.shards.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0
        trim_heap()  # the shard's tensors are freed: give the memory back

    def finish(self) -> list[str]:
        """The weight files: one ``model.safetensors``, or the shards and their index."""
        self.flush()
        if len(self.shards) == 1:
            os.replace(self.folder / self.shards[0][0], self.folder / WEIGHTS_FILE)
            return [WEIGHTS_FILE]
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {key: shard for shard, keys in self.shards for key in keys}}
        atomic_write_text(self.folder / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        return [shard for shard, _ in self.shards] + [INDEX_FILE]


def quantization_config(by_algo: dict[str, list[str]], group_sizes: set[int], ignore: list[str],
                        kv_scales: bool = False) -> dict:
    """config.json's quantization_config: one config group per format written (see the module's docstring), and
    the KV cache's scheme where ``kv_scales`` were written."""
    if len(group_sizes) > 1:
        raise IntegrityError(f"INT4 layers with several group sizes {sorted(group_sizes)}: one scheme takes one")
    algos = sorted((a for a in (*EXPORTABLE_ALGOS, FP8_EXPERTS) if by_algo.get(a)), key=lambda a: -len(by_algo[a]))
    groups = {}
    for i, algo in enumerate(algos):  # the most used format: Linear; the others by name, matched before the class
        targets = ["Linear"] if i == 0 else list(by_algo[algo])
        groups[f"group_{i}"] = {"targets": targets, **scheme(algo, next(iter(group_sizes), 0)),
                                "format": FORMAT_OF[algo]}
    fmt = "dense" if not algos else FORMAT_OF[algos[0]] if len(algos) == 1 else "mixed-precision"
    out = {"quant_method": QUANT_METHOD, "format": fmt, "quantization_status": "compressed", "config_groups": groups,
           "ignore": ignore}
    if kv_scales:
        out["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    return out


def _write_linear(writer: ShardWriter, hf_name: str, lin: Linear, dtype, per_tensor: bool = False) -> None:
    """``lin``'s tensors as compressed-tensors names them (see the module's docstring for each format);
    ``per_tensor``: an FP8 expert, its one weight scale written as one ([1])."""
    import torch

    if per_tensor:
        writer.add(f"{hf_name}.weight", lin.weight.clone())
        writer.add(f"{hf_name}.weight_scale", lin.weight_scale.float().reshape(1).clone())
        writer.add(f"{hf_name}.input_scale", lin.input_scale.float().reshape(1).clone())
        return

    if lin.algo in PACKED_BITS:
        writer.add(f"{hf_name}.weight_packed", pack_codes(lin.weight, PACKED_BITS[lin.algo]))
        scale = lin.weight_scale if lin.algo == INT4_AWQ else lin.weight_scale.reshape(-1, 1)  # group / channel
        writer.add(f"{hf_name}.weight_scale", scale.to(dtype).contiguous())
        writer.add(f"{hf_name}.weight_shape", torch.tensor(list(lin.weight.shape), dtype=torch.int64))
    elif lin.quantized:  # own copies: q/k/v are views of one fused tensor; safetensors refuses shared storage
        writer.add(f"{hf_name}.weight", lin.weight.clone())
        scale = lin.weight_scale.float().expand(lin.weight.shape[0]) if lin.algo == FP8 else lin.weight_scale.float()
        writer.add(f"{hf_name}.weight_scale", scale.reshape(-1, 1).clone())  # per output channel [out, 1]
        writer.add(f"{hf_name}.input_scale", lin.input_scale.float().reshape(1).clone())
    else:
        writer.add(f"{hf_name}.weight", lin.weight.to(dtype).clone())
    if lin.bias is not None:
        writer.add(f"{hf_name}.bias", lin.bias.to(dtype).clone())


def export_for_vllm(ckpt_dir: Path, model_dir: Path, *, out_dir: Path, dtype: str = "bfloat16",
                    max_shard_bytes: int = MAX_SHARD_BYTES, kv_scales: bool = False) -> dict:
    """Write ``out_dir`` (a new folder): the weights (one file or shards and an index), config.json with the
    quantization_config, the tokenizer files. ``kv_scales``: vLLM serves an FP8 E4M3 KV cache, so the
    checkpoint's calibrated KV-cache scales are written for it (see the module's docstring). Returns the
    export's facts."""
    return into_new_folder(Path(out_dir), lambda folder: _export(Path(ckpt_dir), Path(model_dir), out_dir=folder,
                                                                 dtype=dtype, max_shard_bytes=max_shard_bytes,
                                                                 kv_scales=kv_scales))


def into_new_folder(out_dir: Path, write) -> dict:
    """``write(folder)`` into a sibling ``.partial`` folder, renamed to ``out_dir`` once it returns; a failure
    leaves nothing behind. ``out_dir`` must not exist."""
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; the export writes a new folder")
    partial = out_dir.with_name(out_dir.name + ".partial")
    remove_tree(partial)
    partial.mkdir(parents=True)
    try:
        facts = write(partial)
    except BaseException:
        remove_tree(partial)
        raise
    os.replace(partial, out_dir)
    return facts


class Written:
    """The export's linears as they are written: each in its compressed-tensors form or, high precision, in the
    ignore list; ``finish`` writes the files' index, config.json and the tokenizer files."""

    def __init__(self, out_dir: Path, max_shard_bytes: int, dtype: str):
        import torch

        self.out_dir, self.dtype, self.torch_dtype = out_dir, dtype, getattr(torch, dtype)
        self.writer = ShardWriter(out_dir, max_shard_bytes)
        self.facts = ExportFacts()
        self.by_algo: dict[str, list[str]] = {}  # quant_algo -> the HF linears written in it
        self.group_sizes: set[int] = set()
        self.kv_scales: dict[str, tuple[float, float]] = {}  # attention module -> FP8 (K, V) scales written

    def put_kv_scales(self, attention: str, k: float, v: float) -> None:
        """An attention layer's FP8 KV-cache scales, as vLLM loads them (``attention``: e.g.
        ``model.layers.0.self_attn``)."""
        import torch

        if not (k > 0 and v > 0 and math.isfinite(k) and math.isfinite(v)):
            raise IntegrityError(f"{attention}: KV-cache scales must be positive and finite; found K {k}, V {v}")
        for kind, value in (("k", k), ("v", v)):
            self.writer.add(f"{attention}.{kind}_scale", torch.tensor([value], dtype=torch.float32))
        self.kv_scales[attention] = (k, v)

    def add(self, name: str, tensor) -> None:
        """A tensor that is not a linear's (embeddings, norms), in the serving dtype."""
        self.writer.add(name, tensor.to(self.torch_dtype).contiguous())

    def put(self, hf_name: str, lin: Linear, expert: bool = False) -> None:
        if lin.prequant is not None:
            raise IntegrityError(f"{hf_name}: a pre-quant scale was left unfolded")  # a bug here, not bad input
        per_tensor = expert and lin.algo == FP8
        _write_linear(self.writer, hf_name, lin, self.torch_dtype, per_tensor)
        if lin.quantized:
            self.by_algo.setdefault(FP8_EXPERTS if per_tensor else lin.algo or "", []).append(hf_name)
            self.facts.quantized_linears += 1
            if lin.algo == INT4_AWQ:
                self.group_sizes.add(int(lin.group_size or 0))
        else:
            self.facts.ignore.append(hf_name)
            self.facts.high_precision_linears += 1

    def finish(self, model_dir: Path, tied: bool) -> dict:
        """The weight files, config.json (the model's, with the quantization_config) and the tokenizer files;
        returns the export's facts."""
        from pipeline.engines.build import copy_model_files

        files = self.writer.finish()
        copy_model_files(model_dir, self.out_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config.update({"torch_dtype": self.dtype, "tie_word_embeddings": tied})
        config.pop("dtype", None)
        config.pop("quantization_config", None)
        if self.facts.quantized_linears or self.kv_scales:
            config["quantization_config"] = quantization_config(self.by_algo, self.group_sizes, self.facts.ignore,
                                                                bool(self.kv_scales))
        atomic_write_text(self.out_dir / "config.json", json.dumps(config, indent=2) + "\n")
        return {"dtype": self.dtype, "weights_bytes": sum((self.out_dir / f).stat().st_size for f in files),
                "weight_files": len(files), **self.facts.as_dict(),
                "kv_cache_scales": {a: list(kv) for a, kv in self.kv_scales.items()}}


def _export(ckpt_dir: Path, model_dir: Path, *, out_dir: Path, dtype: str, max_shard_bytes: int,
            kv_scales: bool) -> dict:
    from transformers import AutoConfig

    from pipeline.quant.checkpoint import HEAD_NORMS, _layer_formats

    ckpt_cfg = json.loads((ckpt_dir / "config.json").read_text())
    kv_algo = (ckpt_cfg.get("quantization") or {}).get("kv_cache_quant_algo")
    layer_format = _layer_formats(ckpt_dir, ckpt_cfg.get("quantization") or {})
    hf = AutoConfig.from_pretrained(model_dir)
    n_heads, n_kv = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = families.head_dim(hf)
    ranks = _Ranks(ckpt_dir)
    tp = ranks.tp
    qkv_split = [n_heads // tp * head_dim, n_kv // tp * head_dim, n_kv // tp * head_dim]
    moe, ranks.experts, expert_inter = _moe_shape(hf)
    out = Written(out_dir, max_shard_bytes, dtype)
    facts = out.facts

    emb = ranks.each("transformer.vocab_embedding.weight")
    split_dim = ckpt_cfg.get("embedding_sharding_dim", 0) if tp > 1 and ckpt_cfg.get("use_parallel_embedding") else None
    embed = (emb[0] if split_dim is None else _join(emb, split_dim))[:hf.vocab_size]
    out.add("model.embed_tokens.weight", embed)
    del emb, embed
    final_norm = ranks.one("transformer.ln_f.weight").float()  # written last: lm_head's smoothing may fold into it
    for i in range(hf.num_hidden_layers):
        p, h = f"transformer.layers.{i}", f"model.layers.{i}"
        ln_in, attention = _attention(ranks, p, h=h, layer_format=layer_format, qkv_split=qkv_split,
                                      heads=(n_heads, n_kv, head_dim), facts=facts)
        kv = _kv_scales(ranks, p)
        if kv_scales and kv_algo:
            if kv is None:
                raise IntegrityError(f"{ckpt_dir}: kv_cache_quant_algo {kv_algo} but layer {i} has no KV-cache scale")
            out.put_kv_scales(f"{h}.self_attn", *(fp8_kv_scale(x, kv_algo) for x in kv))
        ln_post = ranks.one(f"{p}.post_layernorm.weight").float()
        if moe is not None and ranks.has(f"{p}.mlp.router.weight"):  # a family may keep some layers dense
            ln_post, mlp, experts = _moe_mlp(ranks, p, block=f"{h}.{moe.experts.rsplit('.', 1)[0]}", moe=moe,
                                             inter=expert_inter // tp, layer_format=layer_format, norm=ln_post,
                                             facts=facts)
        else:
            mlp, experts = _dense_mlp(ranks, p, h, layer_format, facts), {}
            ln_post = _fold_into_norm(ln_post, {n: mlp[n] for n in (f"{h}.mlp.gate_proj", f"{h}.mlp.up_proj")},
                                      "post_attention_layernorm", facts)
        out.add(f"{h}.input_layernorm.weight", ln_in)
        out.add(f"{h}.post_attention_layernorm.weight", ln_post)
        for trt, hf_norm in HEAD_NORMS.items():  # Qwen3's per-head q/k RMSNorms, after the projections
            if ranks.has(f"{p}.{trt}.weight"):
                out.add(f"{h}.{hf_norm}.weight", ranks.one(f"{p}.{trt}.weight"))
        for name, lin in {**attention, **mlp}.items():
            out.put(name, lin)
        for name, lin in experts.items():
            out.put(name, lin, expert=True)
    tied = getattr(hf, "tie_word_embeddings", False)
    if ranks.has("lm_head.weight"):
        head, = _read_linear(ranks, "lm_head", fmt=layer_format("lm_head"), kind="column")
        final_norm = fold_head(final_norm, head, hf.vocab_size, facts)
        out.put("lm_head", head)
        tied = False
    elif not tied:
        raise IntegrityError(f"{ckpt_dir}: no lm_head, and the model does not tie its word embeddings")
    out.add("model.norm.weight", final_norm)
    leftover = ranks.unread()
    if leftover:
        raise IntegrityError(f"{ckpt_dir}: tensors the vLLM export does not know: {leftover[:4]}")
    return out.finish(model_dir, tied)
