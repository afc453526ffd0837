"""sensitivity stage: how much each linear layer's output changes when it is quantized.

For every linear layer (attention q/k/v/o, MLP gate/up/down, lm_head) and every requested format:

    error = ||ref(x) - q(x)||_2 / ||ref(x)||_2

over the calibration set, where ``ref`` is the layer in the reference dtype and ``q`` the same layer with
weights (and, for W8A8 formats, activations) fake-quantized exactly as ModelOpt will quantize them
(``pipeline.quant.quant_math``). For ``int8_sq`` the smoothing factors are the ones ModelOpt derives from the same
calibration data, including the averaging its TensorRT-LLM export applies to layers that share an input
and are fused (q/k/v, gate/up), so the table predicts the exported checkpoint. The embedding table is
reported separately (lookup, no matmul).

Cost and memory: one reference pass over the calibration set, decoder layer by decoder layer, loading each
layer's weights from the safetensors files and dropping them after (the full model is never in memory).
The layer runs a few samples at a time; its linears' inputs and outputs are recorded into whole-set
buffers that every layer reuses; then each linear is measured over the whole set at once (per-tensor
activation scales need the whole set's amax), its reference output being the forward pass's own, with one
quantized matmul per format in token chunks (INT8 x INT8 as exact integer matmuls). Peak memory is about
one decoder layer's linear activations over the calibration set, plus one layer's weights.

Mixture-of-experts layers (pipeline/families.py ``Family.moe``): the routing is followed (the router's top-k,
as transformers' MoE block computes it) so each expert is measured on the calibration tokens routed to it, its
per-sample figures counted for the samples those tokens came from; an expert's w1/w3 share smoothing as the
export fuses them; an expert the router sent no token is measured on all of its layer's tokens (its record says
0 routed tokens). The router itself is measured and recorded. ``expert_summary`` gives, per MoE layer, the tokens
routed to each expert and, per expert type, the largest and mean error over its experts. Not modelled: the
export's resmoothing across all the experts of a layer (it shares one pre-quant scale over them).

For int4_awq the AWQ-lite alpha search runs on the first AWQ_SEARCH_TOKENS calibration tokens (ModelOpt
searches on all of them), so that column is a close estimate, not bit-exact; the other formats are exact.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import console, families, targets
from pipeline.config import ComputeSection, QuantizationSection, SensitivitySection
from pipeline.errors import InputError
from pipeline.summaries import SensitivityFigures

log = logging.getLogger(__name__)

# Layers that read the same input and that ModelOpt's export fuses into one GEMM: they share one
# SmoothQuant scale (the mean of theirs), one input amax (the max) and, per tensor, one weight amax.
# The TensorRT-LLM checkpoint (tensorrt and cpu targets) fuses q/k/v only: it keeps mlp.gate and mlp.fc
# apart, each with its own pre-quant scale (checked on an export of SmolLM2). The HF unified checkpoint
# (pytorch target) fuses gate/up as well.
TRTLLM_FUSION_GROUPS = (("q_proj", "k_proj", "v_proj"),)
HF_UNIFIED_FUSION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fusion_groups_for(target: str) -> tuple[tuple[str, ...], ...]:
    return HF_UNIFIED_FUSION_GROUPS if targets.get(target).serves_hf_checkpoint else TRTLLM_FUSION_GROUPS


def format_groups(target: str, fusion_groups: list[list[str]]) -> list[list[str]]:
    """Layers the target runs as one GEMM, which the plan gives one format: the checkpoint's fusion groups, and
    for the vllm target gate/up too. It quantizes the TensorRT-LLM checkpoint (gate and up smoothed apart), but
    vLLM's Llama runs q/k/v as qkv_proj and gate/up as gate_up_proj (its packed_modules_mapping), one GEMM in
    one format each."""
    extra = [list(g) for g in HF_UNIFIED_FUSION_GROUPS] if targets.get(target).fuses_gate_up else []
    return [*fusion_groups, *(g for g in extra if g not in fusion_groups)]


CHUNK_ELEMENTS = 4 * 1024 * 1024  # output elements per quantized-matmul chunk (16 MB of fp32; lm_head: ~85 rows)
AWQ_SEARCH_TOKENS = 4096  # AWQ-lite's alpha search runs on the first tokens only (11 matmuls per layer)
AWQ_ALPHAS = tuple(round(0.1 * i, 1) for i in range(11))


@dataclass
class _Accum:
    """Per-sample sums of squared difference and squared reference, for one (layer, format)."""

    diff2: list[float]
    ref2: list[float]

    def result(self) -> dict:
        # samples with no rows (an expert the router sent none of the sample's tokens) have no error to average
        per_sample = [math.sqrt(d / r) for d, r in zip(self.diff2, self.ref2) if r > 0] or [0.0]
        total_ref = sum(self.ref2)
        return {
            "error": math.sqrt(sum(self.diff2) / total_ref) if total_ref > 0 else 0.0,
            "mean": sum(per_sample) / len(per_sample),
            "max": max(per_sample),
        }


def _model_facts(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)  # its family was checked by the stage (pipeline/stages.py)


@dataclass
class _LayerRecord:
    name: str
    block: int  # decoder layer index; -1 for lm_head
    module: str  # q_proj, ..., lm_head
    in_features: int
    out_features: int
    fused_with: list[str] = field(default_factory=list)
    activation: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)


class Analyser:
    """Measures each linear it is shown; keeps per-decoder-layer caches for fused groups."""

    def __init__(self, formats: tuple[str, ...], alpha: float, group_size: int, n_samples: int,
                 fusion_groups: tuple[tuple[str, ...], ...] = TRTLLM_FUSION_GROUPS):
        self.fusion_groups = fusion_groups
        self.formats = formats
        self.alpha = alpha
        self.group_size = group_size
        self.n = n_samples
        self.records: list[_LayerRecord] = []
        self.siblings: dict[str, Any] = {}  # short name -> nn.Linear of the current decoder layer (torch: lazy)
        self._cache: dict = {}  # per decoder layer: smoothing, quantized inputs of fused groups

    def start_layer(self, siblings: dict) -> None:
        self.siblings = siblings
        self._cache = {}

    # ---------------------------------------------------------- per linear
    def measure(self, name: str, block: int, *, short: str, x2, tokens_per_sample: int, weight, ref_rows,
                sample_of_row=None, routed_tokens: int | None = None) -> None:
        """x2: [N*T, in], the layer's input over the whole calibration set, sample after sample;
        ref_rows(a, b): rows a..b of its reference output. An expert sees only the rows routed to it:
        ``sample_of_row`` gives each row's calibration sample and ``routed_tokens`` how many were routed (0: none
        were, and it is measured on all its layer's tokens instead)."""
        import torch

        dev = x2.device
        ch_amax = torch.zeros(x2.shape[1], dtype=x2.dtype, device=dev)
        abs_sum = 0.0
        for a in range(0, x2.shape[0], _ROW_BLOCK):  # row blocks: no full-size temporaries
            blk = x2[a:a + _ROW_BLOCK].abs()
            torch.maximum(ch_amax, blk.amax(dim=0), out=ch_amax)
            abs_sum += float(blk.sum(dtype=torch.float64))
        mean_abs = abs_sum / x2.numel()
        rec = _LayerRecord(name, block, short, weight.shape[1], weight.shape[0],
                           fused_with=[m for m in self._group(short) if m != short])
        med = float(ch_amax.median())
        rec.activation = {"amax": float(ch_amax.max()), "mean_abs": mean_abs,
                          "outlier_ratio": float(ch_amax.max()) / med if med > 0 else float("inf")}
        if routed_tokens is not None:
            rec.activation["routed_tokens"] = routed_tokens
        if sample_of_row is None:
            sample_of_row = torch.arange(x2.shape[0], device=dev) // tokens_per_sample
        chunk = max(16, CHUNK_ELEMENTS // weight.shape[0])
        preps = {fmt: self._prepare(fmt, name, short=short, block=block, x2=x2, ch_amax=ch_amax,
                                    weight=weight) for fmt in self.formats}
        diff2 = {fmt: torch.zeros(self.n, dtype=torch.float64, device=dev) for fmt in self.formats}
        ref2 = torch.zeros(self.n, dtype=torch.float64, device=dev)
        for start in range(0, x2.shape[0], chunk):
            stop = min(start + chunk, x2.shape[0])
            ref = ref_rows(start, stop)
            rows = sample_of_row[start:stop]
            ref2.index_add_(0, rows, torch.linalg.vector_norm(ref, dim=1).double().pow_(2))
            for fmt, prep in preps.items():
                q = prep(start, stop).sub_(ref)
                diff2[fmt].index_add_(0, rows, torch.linalg.vector_norm(q, dim=1).double().pow_(2))
        for fmt in self.formats:
            acc = _Accum(diff2[fmt].tolist(), ref2.tolist())
            rec.errors[fmt] = acc.result()
        self.records.append(rec)

    def _group(self, short: str) -> tuple[str, ...]:
        """The linears fused with ``short`` (itself included): q/k/v, or an expert's w1/w3 (experts.3.w1)."""
        head, _, leaf = short.rpartition(".")
        for g in self.fusion_groups:
            members = tuple(f"{head}.{m}" if head else m for m in g)
            if leaf in g and all(m in self.siblings for m in members):
                return members
        return (short,)

    def _prepare(self, fmt: str, name: str, *, short: str, block: int, x2, ch_amax, weight):
        """A function (row a, row b) -> this layer's quantized output for those calibration rows."""
        import torch
        import torch.nn.functional as F

        from pipeline.quant import quant_math as qm

        group = self._group(short)
        weights = {m: self.siblings[m].weight for m in group} if len(group) > 1 else {short: weight}

        if fmt == "int8_wo":
            w_hat = qm.int_fake_quant(weight, qm.per_channel_amax(weight))
            return lambda a, b: F.linear(x2[a:b], w_hat)

        if fmt in ("int8_w8a8", "int8_sq"):
            key = (fmt, group)
            if key not in self._cache:
                if fmt == "int8_sq":
                    scales = {m: qm.smoothquant_scale(ch_amax, w, self.alpha) for m, w in weights.items()}
                    s_group = torch.stack(list(scales.values())).mean(dim=0) if len(group) > 1 else scales[short]
                    in_amax = torch.stack([(ch_amax * s).amax() for s in scales.values()]).max()
                else:
                    scales, s_group, in_amax = None, None, ch_amax.max()
                self._cache[key] = (scales, s_group, in_amax, _int8_input(x2, s_group, in_amax))
            scales, s_group, in_amax, x_int = self._cache[key]
            if fmt == "int8_sq":
                # ModelOpt folds 1/s into the weight; its export then resmooths fused layers to the mean s
                s_own = scales[short]
                fold = (lambda w: w * (1.0 / s_own)[None, :] * s_own / s_group) if len(group) > 1 else \
                    (lambda w: w * (1.0 / s_own)[None, :])
            else:
                fold = None
            return _int8_matmul(x_int, weight, fold, in_amax)

        if fmt == "fp8":
            in_amax = ch_amax.max()
            w_amax = torch.stack([qm.abs_amax(w) for w in weights.values()]).max()  # fused: one per-tensor amax
            w_hat = qm.fp8_fake_quant(weight, w_amax)
            return lambda a, b: F.linear(qm.fp8_fake_quant(x2[a:b], in_amax), w_hat)

        if fmt == "int4_awq":
            if weight.shape[1] % self.group_size:
                raise InputError(
                    f"{name}: AWQ group size {self.group_size} does not divide its input width "
                    f"{weight.shape[1]}; set quantization.awq_group_size to one that does (e.g. 64 or 32)"
                )
            key = ("awq", group)
            if key not in self._cache:
                sample = x2[:AWQ_SEARCH_TOKENS]
                act_scale = sample.abs().mean(dim=0).float()
                best = {}
                for m, w in weights.items():
                    ref = F.linear(sample, w)
                    wscale = qm.awq_weight_scale(w, self.group_size)
                    losses = {}
                    for alpha in AWQ_ALPHAS:
                        s = qm.awq_lite_scale(act_scale, wscale, alpha)
                        out = F.linear(sample * (1 / s), qm.group_fake_quant(w * s, self.group_size))
                        losses[alpha] = float((out - ref).pow(2).mean())
                    best[m] = qm.awq_lite_scale(act_scale, wscale, min(losses, key=losses.__getitem__))
                self._cache[key] = torch.stack(list(best.values())).mean(dim=0) if len(group) > 1 else best[short]
            s_group = self._cache[key]
            w_hat = qm.group_fake_quant(weight * s_group, self.group_size)
            inv = 1 / s_group
            return lambda a, b: F.linear(x2[a:b] * inv, w_hat)

        raise ValueError(f"unknown format {fmt}")


_ROW_BLOCK = 2048  # rows per block when a whole-calibration-set tensor is transformed
EXACT_K = 1024  # 128 * 127 * 1024 < 2**24: int8 products summed over this many channels are exact in fp32


def _int8_input(x2, pre_scale, in_amax):
    """The per-tensor INT8 input over all calibration rows (optionally smoothed first), as int8 values."""
    import torch

    x_scale = 127.0 / in_amax.float()
    out = torch.empty(x2.shape, dtype=torch.int8, device=x2.device)
    for a in range(0, x2.shape[0], _ROW_BLOCK):
        xs = x2[a:a + _ROW_BLOCK].float()
        if pre_scale is not None:
            xs = xs * pre_scale  # the pre-quant (smoothing) scale, applied first as ModelOpt does
        out[a:a + _ROW_BLOCK] = (xs * x_scale).round_().clamp_(-128, 127).to(torch.int8)
    return out, x_scale


def _int8_matmul(x_int, weight, fold, in_amax):
    """W8A8: per-channel INT8 weights (after the optional smoothing fold), per-tensor INT8 input.

    Computed as an exact integer matmul, then scaled: the same numbers as ModelOpt's fp32 fake-quant matmul
    up to fp32 rounding (tests check it). The int8 values are multiplied as fp32 (BLAS) over blocks of at most
    EXACT_K input channels, where every partial sum is an integer below 2**24 and so exact, the blocks summed
    in fp64. torch's own int8 matmul (``torch._int_mm``) has no fast CPU kernel without VNNI: on an AVX2
    machine it ran 1.1 GFLOP/s against fp32's 27.7 (a [4096, 576] x [576, 1536] product: 6.5 s against
    0.26 s), which made this stage take 45-80 s a decoder layer of SmolLM2. The weight is quantized in row
    blocks so a large lm_head never has more than one block of fp32 temporaries besides the result."""
    import torch

    x_q, x_scale = x_int
    out_f, in_f = weight.shape
    w_t = torch.empty((in_f, out_f), dtype=torch.float32, device=weight.device)  # int8 values, held as fp32
    w_scale = torch.empty(out_f, dtype=torch.float32, device=weight.device)
    step = max(1, (_ROW_BLOCK * 64) // in_f)
    for a in range(0, out_f, step):
        wb = weight[a:a + step].float()
        if fold is not None:
            wb = fold(wb)
        sc = 127.0 / wb.abs().amax(dim=1, keepdim=True)  # per output channel
        w_t[:, a:a + step] = (wb * sc).round_().clamp_(-127, 127).t()
        w_scale[a:a + step] = sc.reshape(-1)
    out_scale = 1.0 / (x_scale * w_scale)

    def run(a, b):
        xa = x_q[a:b].float()
        if in_f <= EXACT_K:
            return (xa @ w_t).mul_(out_scale)
        acc = torch.zeros((b - a, out_f), dtype=torch.float64, device=xa.device)
        for k in range(0, in_f, EXACT_K):
            acc += xa[:, k:k + EXACT_K] @ w_t[k:k + EXACT_K]
        return acc.float().mul_(out_scale)

    return run


def analyse(model_dir: Path, calibration_ids, *, section: SensitivitySection, quant: QuantizationSection,
            fusion_groups: tuple[tuple[str, ...], ...] = TRTLLM_FUSION_GROUPS, device: str = "cpu",
            dtype_name: Optional[str] = None) -> dict:
    """Run the analysis; return {"layers": [...], "embedding": {...}, "timing": {...}, "model": {...},
    "fusion_groups": [...]} (and "experts" for a mixture-of-experts model).

    fusion_groups: the layers the target's checkpoint fuses (``fusion_groups_for(build.target)``); an MoE
    family's expert gate/up pair is added to them.
    device / dtype_name: where the reference runs and in what (default: the CPU, sensitivity.reference_dtype);
    one decoder layer's weights and the calibration set's activations live there, the rest on disk."""
    import torch

    from pipeline.compute import trim_heap
    from pipeline.quant.streaming import WeightStore, skeleton

    t0 = time.perf_counter()
    dtype = getattr(torch, dtype_name or section.reference_dtype)
    config = _model_facts(model_dir)
    moe = families.FAMILIES[config.model_type].moe
    if moe is not None:
        fusion_groups = (*fusion_groups, moe.fused)
    config._attn_implementation = families.attn_implementation(config.model_type)
    store = WeightStore(model_dir)
    model = skeleton(config, dtype)
    ids = torch.as_tensor(calibration_ids, dtype=torch.long, device=device)
    n, t = ids.shape
    analyser = Analyser(section.formats, quant.smoothquant_alpha, quant.awq_group_size, n, fusion_groups)
    result: dict = {"model": {"model_type": config.model_type, "layers": config.num_hidden_layers,
                              "hidden_size": config.hidden_size},
                    "calibration": {"samples": n, "seq_len": t, "tokens": n * t}}

    with torch.no_grad():
        embed_name = "model.embed_tokens.weight"
        embed = store.get(embed_name, dtype, device)
        hidden = embed[ids]  # [N, T, H]
        scale = families.embedding_scale(config)
        if scale != 1.0:
            hidden.mul_(scale)
        result["embedding"] = _embedding_error(embed, ids)
        del embed

        positions = torch.arange(t, device=device).unsqueeze(0)
        rotary = families.position_kwargs(model, config, hidden, positions)
        masks = _window_masks(config, t, hidden)

        stash = _Stash(n * t)
        layers = console.track(model.model.layers, "sensitivity: decoder layers")
        for i, layer in enumerate(layers):
            prefix = f"model.layers.{i}"
            store.load_module(layer, prefix, dtype, device)
            linears = _record_linears(layer, stash, moe, config)
            out = torch.empty_like(hidden)
            for a in range(0, n, SAMPLES_PER_FORWARD):  # the reference forward, a few samples at a time
                stash.rows = (a * t, min(a + SAMPLES_PER_FORWARD, n) * t)
                y = layer(hidden[a:a + SAMPLES_PER_FORWARD], attention_mask=masks[families.layer_window(config, i)],
                          position_ids=positions, **rotary)
                out[a:a + SAMPLES_PER_FORWARD] = y[0] if isinstance(y, tuple) else y
            if moe is not None and any(short.startswith("experts.") for short in linears):  # some MoE layers are dense
                stash.run_unrouted_experts(layer.get_submodule(moe.experts))
            stash.stop_recording()
            hidden = out
            analyser.start_layer({short: lin for short, lin in linears.items()})
            for short, lin in linears.items():  # then every linear over the whole set at once
                out_buf = stash.output(short)
                rows, routed = stash.routed_rows(short)
                analyser.measure(f"{prefix}.{stash.path[short]}", i, short=short, x2=stash.input(short),
                                 tokens_per_sample=t, weight=lin.weight, ref_rows=lambda a, b, _o=out_buf: _o[a:b],
                                 sample_of_row=None if rows is None else rows // t, routed_tokens=routed)
            stash.clear_routed()
            layer.to("meta")
            trim_heap()
            log.info("layer %d/%d done (%.1f s)", i + 1, config.num_hidden_layers, time.perf_counter() - t0)
        del stash
        trim_heap()

        norm = model.model.norm
        store.load_module(norm, "model.norm", dtype, device)
        hidden = norm(hidden)
        head = store.get(store.head_name(), dtype, device)  # the embedding when they are tied
        _measure_lm_head(analyser, hidden, head)
        del head
    result["layers"] = [r.__dict__ for r in analyser.records]
    if moe is not None:
        result["experts"] = expert_summary(result["layers"], section.formats)
    result["fusion_groups"] = [list(g) for g in fusion_groups]
    result["timing"] = {"analysis_s": round(time.perf_counter() - t0, 2)}
    return result


def _window_masks(config, t: int, hidden) -> dict:
    """The attention mask of a decoder layer by its sliding window (``families.layer_window``): None (causal, as
    SDPA makes it) for the whole sample, or the additive causal mask where the family runs eager attention (which
    applies no causality of its own); a layer keeping to a window shorter than the sample gets the additive causal
    mask cut to it (transformers' sliding_window_overlay: key > query - window)."""
    import torch

    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    masks: dict = {None: None if config._attn_implementation == "sdpa" else
                   families.additive_mask(k <= q, q, k)[None, None].to(hidden.device, hidden.dtype)}
    window, _ = families.attention_window(config)
    if window:
        masks[window] = families.additive_mask(k <= q, q, k, window)[None, None].to(hidden.device, hidden.dtype)
    return masks


def _embedding_error(embed, ids) -> dict:
    """INT8 per-row quantization of the embedding rows the calibration set uses (reported, not planned)."""
    from pipeline.quant import quant_math as qm

    used = ids.unique()
    rows = embed[used]
    q = qm.int_fake_quant(rows, rows.abs().amax(dim=1, keepdim=True))
    return {"name": "model.embed_tokens", "rows_checked": int(used.numel()),
            "int8_per_row_error": float((rows - q).norm() / rows.norm()),
            "params": int(embed.numel())}


def _measure_lm_head(analyser: Analyser, hidden, head) -> None:
    """lm_head: its output (the logits, [tokens, vocab]) is never materialised whole, only by row chunks."""
    import torch.nn.functional as F

    x2 = hidden.reshape(-1, hidden.shape[-1])
    analyser.start_layer({})
    analyser.measure("lm_head", -1, short="lm_head", x2=x2, tokens_per_sample=hidden.shape[1], weight=head,
                     ref_rows=lambda a, b: F.linear(x2[a:b], head))


SAMPLES_PER_FORWARD = 4  # calibration samples per decoder-layer call in the reference pass


class _Stash:
    """Whole-calibration-set copies of one decoder layer's linear inputs and outputs.

    The buffers are allocated once and reused by every decoder layer (the shapes repeat), so the pass
    neither re-allocates nor page-faults per layer; layers reading the same tensor (q/k/v, gate/up) share
    one input buffer."""

    def __init__(self, rows: int):
        self.total_rows = rows
        # experts: each sees only the rows routed to it, so their inputs and outputs are lists of pieces, and the
        # calibration rows they came from are kept beside them
        self.pieces: dict[str, list] = {}
        self.expert_rows: dict[str, list] = {}  # expert prefix (experts.3) -> [row ids per forward]
        self.unrouted: set[str] = set()  # experts measured on all rows: the router sent them none
        self.route = None  # the current forward's routing: each expert's rows, in the order it takes them
        self.rows = (0, 0)
        self.buffers: dict[str, Any] = {}  # torch tensors (torch is imported lazily)
        self.input_of: dict[str, str] = {}  # linear -> input buffer key
        self.path: dict[str, str] = {}  # linear short name -> path inside the decoder layer
        self.handles: list = []

    def _buffer(self, key: str, cols: int, dtype, device):
        import torch

        buf = self.buffers.get(key)
        if buf is None or buf.shape[1] != cols or buf.dtype != dtype or buf.device != device:
            buf = self.buffers[key] = torch.empty(self.total_rows, cols, dtype=dtype, device=device)
        return buf

    def hook(self, short: str):
        import torch

        routed = short.startswith("experts.")

        def record(module, inputs, output):
            a, b = self.rows
            x = inputs[0]
            if not isinstance(output, torch.Tensor):  # a router kept as a weight (DeepSeek's gate): its logits
                output = torch.nn.functional.linear(x, module.weight.to(x.dtype))
            key = self.input_of.get(short)
            if key is None:  # first call: share the buffer of a sibling that read this very tensor object
                key = next((k for k, t in self._last.items() if t is x), f"in:{short}")
                self.input_of[short] = key
            if self._last.get(key) is not x:  # (holding the reference keeps its address from being reused)
                if routed:
                    self.pieces.setdefault(key, []).append(x.reshape(-1, x.shape[-1]))
                else:
                    self._buffer(key, x.shape[-1], x.dtype, x.device)[a:b] = x.reshape(-1, x.shape[-1])
                self._last[key] = x
            if routed:
                self.pieces.setdefault(f"out:{short}", []).append(output.reshape(-1, output.shape[-1]))
            else:
                self._buffer(f"out:{short}", output.shape[-1], output.dtype, output.device)[a:b] = \
                    output.reshape(-1, output.shape[-1])
        return record

    def start_routing(self, router, experts, top_k: int) -> None:
        """Follow the MoE block's routing, to know which calibration rows each expert's input holds. A router that
        gives logits (an nn.Linear: Mixtral, Qwen3-MoE): their softmax's top-k (transformers'
        MixtralSparseMoeBlock.forward), each expert taking its rows in the order ``torch.where`` lists them there
        (by top-k slot, then token). A router that gives the chosen experts itself (DeepSeek-V2's gate: (indices,
        weights)): each expert takes its rows in the order of the flattened indices' ``argsort``, as
        DeepseekV2MoE.moe sorts them (the same call on the same tensor, so the same order)."""
        import torch

        def route(module, inputs, out):
            if isinstance(out, tuple):
                chosen = out[0].reshape(-1, out[0].shape[-1])
                order = chosen.reshape(-1).argsort()
                experts_in_order, rows = chosen.reshape(-1)[order], order // chosen.shape[-1]
                self.route = {j: rows[experts_in_order == j] for j in range(len(experts))}
                return
            probs = torch.softmax(out.reshape(-1, out.shape[-1]), dim=-1, dtype=torch.float)
            chosen = torch.topk(probs, top_k, dim=-1).indices
            self.route = {j: torch.where((chosen == j).T)[1] for j in range(len(experts))}

        def rows_of(j: int):
            def before(module, inputs):
                a, _ = self.rows
                if self.route is None:  # an expert run on every row (run_unrouted_experts)
                    ids = torch.arange(a, a + inputs[0].shape[0], device=inputs[0].device)
                else:
                    ids = a + self.route[j]
                if ids.numel() != inputs[0].reshape(-1, inputs[0].shape[-1]).shape[0]:
                    raise RuntimeError(f"expert {j}: its input has {inputs[0].shape[0]} rows, the routing followed "
                                       f"here gives {ids.numel()}: the MoE block routes differently")
                self.expert_rows.setdefault(f"experts.{j}", []).append(ids)
            return before

        self.handles.append(router.register_forward_hook(route))
        self.handles += [e.register_forward_pre_hook(rows_of(j)) for j, e in enumerate(experts)]

    def run_unrouted_experts(self, experts) -> None:
        """An expert the router sent no calibration token is measured on all of its layer's tokens (the router's
        input), so every expert has a figure; its record says it had no routed tokens."""
        x_all = self.input("router")
        self.route = None
        for j, expert in enumerate(experts):
            if f"experts.{j}" in self.expert_rows:
                continue
            self.unrouted.add(f"experts.{j}")
            for a in range(0, self.total_rows, _ROW_BLOCK):
                self.rows = (a, min(a + _ROW_BLOCK, self.total_rows))
                expert(x_all[a:a + _ROW_BLOCK])

    def routed_rows(self, short: str):
        """An expert linear's calibration row ids and how many were routed to it; (None, None) for the others."""
        import torch

        if not short.startswith("experts."):
            return None, None
        expert = short.rsplit(".", 1)[0]
        rows = torch.cat(self.expert_rows[expert])
        return rows, 0 if expert in self.unrouted else int(rows.numel())

    def clear_routed(self) -> None:
        self.pieces, self.expert_rows, self.unrouted, self.route = {}, {}, set(), None

    def start_recording(self, linears: dict) -> None:
        self._last: dict[str, object] = {}  # input buffer key -> the tensor last copied into it
        self.input_of = {}
        self.handles = [lin.register_forward_hook(self.hook(short)) for short, lin in linears.items()]

    def stop_recording(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._last = {}

    def input(self, short: str):
        key = self.input_of[short]
        return self._joined(key) if key in self.pieces else self.buffers[key]

    def output(self, short: str):
        key = f"out:{short}"
        return self._joined(key) if key in self.pieces else self.buffers[key]

    def _joined(self, key: str):
        import torch

        if len(self.pieces[key]) > 1:
            self.pieces[key] = [torch.cat(self.pieces[key])]
        return self.pieces[key][0]


def _record_linears(layer, stash: _Stash, moe=None, config=None) -> dict:
    """The decoder layer's linears by short name (q_proj, ...; an MoE layer's router as ``router`` and its experts'
    as ``experts.3.w1``), with recording hooks installed."""
    import torch.nn as nn

    linears = {}
    for rel, m in layer.named_modules():
        if moe is not None and rel == moe.router:  # a Linear, or a module holding the router's weight (DeepSeek)
            short = "router"
        elif not isinstance(m, nn.Linear):
            continue
        elif moe is not None and rel.startswith(moe.experts + "."):
            short = "experts." + rel[len(moe.experts) + 1:]
        else:
            short = rel.rsplit(".", 1)[-1]
        linears[short] = m
        stash.path[short] = rel
    stash.start_recording(linears)
    if moe is not None and any(short.startswith("experts.") for short in linears):
        stash.start_routing(layer.get_submodule(moe.router), layer.get_submodule(moe.experts),
                            getattr(config, moe.top_k))
    return linears


def expert_summary(layers: list[dict], formats: tuple[str, ...]) -> list[dict]:
    """Per MoE layer: its router's name, the calibration tokens routed to each expert, and per expert type (w1,
    w2, w3) the largest and mean error over the layer's experts in each format, with the worst expert."""
    out: dict[int, dict] = {}
    for l in layers:
        if l["module"] == "router":
            out.setdefault(l["block"], {"layer": l["block"]})["router"] = l["name"]
        if not l["module"].startswith("experts."):
            continue
        _, j, kind = l["module"].split(".")
        entry = out.setdefault(l["block"], {"layer": l["block"]})
        entry.setdefault("routed_tokens", {})[int(j)] = l["activation"]["routed_tokens"]
        for fmt in formats:
            slot = entry.setdefault("by_type", {}).setdefault(kind, {}).setdefault(fmt, {"errors": {}})
            slot["errors"][int(j)] = l["errors"][fmt]["error"]
    for entry in out.values():
        entry["routed_tokens"] = [entry["routed_tokens"][j] for j in sorted(entry["routed_tokens"])]
        for kind in entry["by_type"].values():
            for fmt, slot in kind.items():
                errs = slot.pop("errors")
                worst = max(errs, key=errs.get)
                kind[fmt] = {"max": errs[worst], "mean": sum(errs.values()) / len(errs), "worst_expert": worst}
    return [out[b] for b in sorted(out)]


def run_analysis(model_dir: Path, calibration_file: Path, *, section: SensitivitySection,
                 quant: QuantizationSection, out_dir: Path, decision: str | None, target: str,
                 compute: Optional[ComputeSection] = None, memory_bound=None) -> SensitivityFigures:
    """The stage's work (runs in a child process): table JSON + Markdown + heatmap; returns the summary.
    ``memory_bound``: the compute.Bound the parent set (recorded; default: computed here)."""
    import json

    from safetensors.numpy import load_file

    from pipeline import artifacts
    from pipeline import compute as comp
    from pipeline.compute import return_freed_memory_to_the_os
    from pipeline.quant.plots import heatmap_png, table_markdown

    compute = compute or ComputeSection()
    device = comp.resolve_device(compute)
    dtype = comp.reference_dtype(device, section.reference_dtype)
    log.info("sensitivity on %s in %s", device, dtype)
    return_freed_memory_to_the_os()
    if section.end_to_end:
        raise InputError("sensitivity.end_to_end (error at the logits, one layer quantized at a time) is not "
                         "built yet; set it to false.")
    ids = load_file(str(calibration_file))[artifacts.TOKENS_KEY]
    table = analyse(model_dir, ids, section=section, quant=quant, fusion_groups=fusion_groups_for(target),
                    device=device, dtype_name=dtype)
    table["format_groups"] = format_groups(target, table["fusion_groups"])  # what the plan aligns
    # wall time goes to the manifest's summary, not into the table: an output that differed on every run
    # would change the inputs of every stage after this one
    timing = table.pop("timing")
    (out_dir / artifacts.SENSITIVITY_TABLE_JSON).write_text(json.dumps(table, indent=1))
    col = decision or section.formats[0]
    (out_dir / artifacts.SENSITIVITY_TABLE_MD).write_text(table_markdown(table, col))
    heatmap_png(table, section.formats, out_dir / artifacts.SENSITIVITY_HEATMAP_PNG)
    # nothing here reads section.threshold: it is the plan stage's input, so a threshold sweep reuses this table
    return {
        "layers": len(table["layers"]),
        "decision_column": col,
        "analysis_s": timing["analysis_s"],
        "calibration_tokens": table["calibration"]["tokens"],
        "embedding_int8_error": table["embedding"]["int8_per_row_error"],
        "compute": comp.compute_record(device, dtype, memory_bound or comp.host_memory_bound(compute)),
    }
