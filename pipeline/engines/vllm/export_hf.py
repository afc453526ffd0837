"""ModelOpt's HF unified checkpoint rewritten as an HF folder vLLM loads (compressed-tensors): the vllm target's
export for the families quantize writes no TensorRT-LLM checkpoint of here (``Family.trtllm_checkpoint`` False:
Phi-3, Gemma 3, DeepSeek-V2).

The HF unified checkpoint is what the accuracy gate measured for them (pipeline.quant.hf_checkpoint reads it
back), so the export starts from it, as pipeline.engines.vllm.export starts from the TensorRT-LLM checkpoint, and
writes the same compressed-tensors formats with the same arithmetic (that module's ``Linear``, folding rules and
writer). What differs is the reading:

- a linear's tensors sit beside it under the model's own names (ModelOpt 0.47, unified_export_hf.py):
  ``weight`` (INT8 I8; FP8 F8_E4M3; INT4 two codes per byte, U8 [out / 2, in]), ``weight_scale`` (INT8 [out];
  FP8 one value; INT4 [out, in / group]), ``input_scale`` (one value) and ``pre_quant_scale`` ([in], SmoothQuant
  or AWQ; none where ModelOpt folded it into the norm before);
- ``Family.layout`` names what computes each linear's input: the norm before attention takes q/k/v's smoothing,
  the norm before the MLP gate/up's (Gemma 3: pre_feedforward_layernorm); a norm that scales by (1 + w) (Gemma)
  is written as (1 + w) * s - 1. o_proj's smoothing goes into v's output rows and down_proj's into up's; where
  q/k/v or gate/up are one linear on disk (Phi-3's qkv_proj, gate_up_proj; transformers' Phi3 puts q, k, v rows
  in that order and gate's before up's) those are the last rows: vLLM's Phi3ForCausalLM loads such a linear
  whole, so it stays one linear in one format here;
- the KV-cache scales (``k_proj.k_scale`` / ``v_proj.v_scale``: calibrated amax / 448, unclamped) are written
  as the other export writes them where vLLM serves an FP8 KV cache (``kv_scales``), an INT8 one's converted.

DeepSeek-V2 (``_mla_attention``, ``_moe``): multi-head latent attention, whose kv_b_proj is written in high
precision as vLLM runs it, and an MoE block of a router, routed experts and shared experts, all reading the
post-attention norm; every expert is written under its own name, as vLLM's DeepseekV2 loads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pipeline import artifacts, families
from pipeline.engines.vllm.export import (
    EXPORTABLE_ALGOS,
    FP8,
    INT4_AWQ,
    INT8_SQ,
    MAX_SHARD_BYTES,
    ExportFacts,
    Linear,
    Written,
    _fold_into_norm,
    _fold_into_rows,
    fold_head,
    fp8_kv_scale,
    into_new_folder,
    one_format,
)
from pipeline.errors import InputError, IntegrityError

SCALES = ("weight_scale", "input_scale", "pre_quant_scale")  # what the export reads beside a quantized weight
SKIPPED = ("weight_scale_2",)  # W4A8's second scale (refused by its algo)
KV_SCALES = ("k_scale", "v_scale")


def export_hf_for_vllm(hf_dir: Path, model_dir: Path, *, out_dir: Path, dtype: str = "bfloat16",
                       max_shard_bytes: int = MAX_SHARD_BYTES, kv_scales: bool = False) -> dict:
    """Write ``out_dir`` (a new folder) from the HF unified checkpoint ``hf_dir``: the weights, config.json with
    the quantization_config, the tokenizer files; ``kv_scales``: the KV-cache scales for vLLM's FP8 KV cache.
    Returns the export's facts."""
    return into_new_folder(Path(out_dir), lambda folder: _export(Path(hf_dir), Path(model_dir), out_dir=folder,
                                                                 dtype=dtype, max_shard_bytes=max_shard_bytes,
                                                                 kv_scales=kv_scales))


class _Checkpoint:
    """The HF unified checkpoint's tensors, read one at a time, with what has been read."""

    def __init__(self, hf_dir: Path):
        from pipeline.quant.checkpoint import layer_formats
        from pipeline.quant.hf_checkpoint import _files, quant_config

        qcfg = quant_config(hf_dir)
        self.format = layer_formats(qcfg, qcfg.get("quantized_layers"), str(hf_dir), artifacts.HF_QUANT_CONFIG_FILE)
        self.kv_algo = qcfg.get("kv_cache_quant_algo")
        self.where = _files(hf_dir)
        self.read: set[str] = {k for k in self.where if k.rsplit(".", 1)[-1] in SKIPPED}
        self.handles: dict[Path, object] = {}

    def has(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str):
        from safetensors import safe_open

        path = self.where[key]
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt")
        self.read.add(key)
        return self.handles[path].get_tensor(key)  # type: ignore[attr-defined]

    def kv_scales(self, h: str) -> Optional[tuple[float, float]]:
        """Layer ``h``'s KV-cache scales (K, V), marked read, or None where it has neither."""
        found = {k.rsplit(".", 1)[-1]: float(self.get(k).float().max()) for k in self.unread(f"{h}.")
                 if k.rsplit(".", 1)[-1] in KV_SCALES}
        if not found:
            return None
        if len(found) != 2:
            raise IntegrityError(f"{h}: a KV-cache scale without its pair: {sorted(found)}")
        return found["k_scale"], found["v_scale"]

    def unread(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.where if k not in self.read and k.startswith(prefix))

    def linear(self, name: str) -> Linear:
        """The linear ``name`` as the export writes it: codes and scales, or a float weight (an unquantized
        linear's own pre-quant scale, if it has one, folded into its columns: exact)."""
        import torch

        from pipeline.quant.checkpoint import unpack_int4
        from pipeline.quant.hf_checkpoint import SCALE_NAMES, check_unquantized, required_scales

        algo, group = self.format(name)
        weight = self.get(f"{name}.weight")
        scales = {k: self.get(f"{name}.{k}").float() for k in SCALES if self.has(f"{name}.{k}")}
        bias = self.get(f"{name}.bias").float() if self.has(f"{name}.bias") else None
        if algo is None:
            check_unquantized(name, weight, scales)
            lin = Linear(weight.float(), bias=bias)
            if "pre_quant_scale" in scales:
                lin.scale_columns(scales["pre_quant_scale"])
            return lin
        if algo not in EXPORTABLE_ALGOS:
            raise InputError(f"{name}: {algo} cannot be exported for vLLM (exportable: {', '.join(EXPORTABLE_ALGOS)})")
        stored = (torch.float8_e4m3fn,) if algo == FP8 else (torch.uint8, torch.int8) if algo == INT4_AWQ \
            else (torch.int8,)
        needed = [hf for hf, trt in SCALE_NAMES.items() if trt in required_scales(algo)]
        if weight.dtype not in stored or any(k not in scales for k in needed) or (algo == INT4_AWQ and not group):
            raise IntegrityError(f"{name}: {algo} needs {stored[0]} weights and {', '.join(needed)}"
                                 + (" with a group size" if algo == INT4_AWQ else "") + f"; found {weight.dtype}, "
                                 f"{sorted(scales)}")
        ws = scales["weight_scale"]
        if algo == INT4_AWQ:
            weight = unpack_int4(weight.view(torch.int8))  # [out, in] codes
            if tuple(ws.shape) != (weight.shape[0], weight.shape[1] // group):
                raise IntegrityError(f"{name}: INT4 group scales of shape {tuple(ws.shape)} do not fit a weight of "
                                     f"{tuple(weight.shape)} with group size {group}")
        elif algo == FP8:
            if ws.numel() != 1:
                raise IntegrityError(f"{name}: an FP8 weight takes one scale; found {tuple(ws.shape)}")
            ws = ws.reshape(())
        else:
            ws = ws.reshape(-1)
            ws = ws.expand(weight.shape[0]).clone() if ws.numel() == 1 else ws
        lin = Linear(weight, ws, algo=algo, group_size=group if algo == INT4_AWQ else None, bias=bias)
        if "input_scale" in scales and algo in (INT8_SQ, FP8):
            lin.input_scale = scales["input_scale"].reshape(())
        lin.prequant = scales.get("pre_quant_scale")
        return lin


def _attention(ckpt: _Checkpoint, h: str, hf, layout, facts: ExportFacts) -> tuple[list, dict[str, Linear]]:
    """A layer's q/k/v and o_proj (HF name -> Linear) with o_proj's smoothing folded into v's rows, and the norm
    groups (norm, members) whose smoothing goes into a norm."""
    import torch

    n_heads, n_kv, head_dim = hf.num_attention_heads, hf.num_key_value_heads, families.head_dim(hf)
    qkv = {f"{h}.{n}": ckpt.linear(f"{h}.{n}") for n in layout.qkv}
    o_name = f"{h}.{layout.o}"
    o = ckpt.linear(o_name)
    one_format(qkv, facts)
    v = list(qkv.values())[-1]  # v_proj, or a fused qkv_proj whose last rows are v's
    start = 0 if len(qkv) == 3 else (n_heads + n_kv) * head_dim
    _fold_into_rows(v, o, name=o_name, where="v_proj rows", facts=facts,
                    heads=(n_heads, n_kv, head_dim) if n_heads != n_kv else None,
                    rows=None if len(qkv) == 3 else torch.arange(start, start + n_kv * head_dim))
    return [(layout.attn_norm, qkv)], {**qkv, o_name: o}


def _mla_attention(ckpt: _Checkpoint, h: str, hf, facts: ExportFacts) -> tuple[list, dict[str, Linear]]:
    """Multi-head latent attention (DeepSeek-V2): q_proj (or q_a_proj, q_a_layernorm, q_b_proj) and
    kv_a_proj_with_mqa read the input norm; kv_b_proj reads kv_a_layernorm and gives each head its key's
    unrotated part, then its value; o_proj reads the values, so its smoothing folds into kv_b_proj's value rows
    (one KV head per query head: always foldable). vLLM 0.32 fuses q_a_proj with kv_a_proj_with_mqa
    (deepseek_v2.py ``fused_qkv_a_proj``), so those two share one format. kv_b_proj is written in high precision,
    its codes dequantized (its smoothing into its own columns): vLLM absorbs it into the query and output
    projections of its latent attention in the model's dtype (mla_attention.py ``split_kv_b_proj``, through
    ``get_and_maybe_dequant_weights``), and on a CPU it cannot even do that with an INT8 kv_b_proj, whose weight
    the oneDNN kernel has taken away by then ("'NoneType' object has no attribute 'device'", found here)."""
    import torch

    a = f"{h}.self_attn"
    first = {f"{a}.{n}": ckpt.linear(f"{a}.{n}")
             for n in ("q_a_proj" if hf.q_lora_rank else "q_proj", "kv_a_proj_with_mqa")}
    if hf.q_lora_rank:
        one_format(first, facts)
    groups: list = [("input_layernorm", first)]
    linears = dict(first)
    if hf.q_lora_rank:
        q_b = {f"{a}.q_b_proj": ckpt.linear(f"{a}.q_b_proj")}
        groups.append(("self_attn.q_a_layernorm", q_b))
        linears.update(q_b)
    kv_b, o = ckpt.linear(f"{a}.kv_b_proj"), ckpt.linear(f"{a}.o_proj")
    if kv_b.quantized:  # vLLM runs it in the model's dtype whatever the checkpoint holds (see _mla_attention)
        kv_b.dequantize()
        facts.mla_kv_b_dequantized.append(f"{a}.kv_b_proj")
    nope, v = hf.qk_nope_head_dim, hf.v_head_dim
    value_rows = (torch.arange(hf.num_attention_heads)[:, None] * (nope + v) + nope + torch.arange(v)).reshape(-1)
    _fold_into_rows(kv_b, o, name=f"{a}.o_proj", where="kv_b_proj value rows", facts=facts, rows=value_rows)
    groups.append(("self_attn.kv_a_layernorm", {f"{a}.kv_b_proj": kv_b}))
    return groups, {**linears, f"{a}.kv_b_proj": kv_b, f"{a}.o_proj": o}


def _gated_mlp(ckpt: _Checkpoint, gate_up: list[str], down_name: str, inter: int,
               facts: ExportFacts) -> tuple[dict[str, Linear], dict[str, Linear]]:
    """A gated MLP (``gate_up``: gate and up, or the one linear holding both, gate's rows first): (gate/up,
    {down}), down_proj's smoothing folded into up's rows, gate/up in one format (vLLM fuses them)."""
    import torch

    pair = {n: ckpt.linear(n) for n in gate_up}
    down = ckpt.linear(down_name)
    one_format(pair, facts)
    _fold_into_rows(list(pair.values())[-1], down, name=down_name, where="up_proj rows", facts=facts,
                    rows=None if len(pair) == 2 else torch.arange(inter, 2 * inter))
    return pair, {down_name: down}


def _moe(ckpt: _Checkpoint, h: str, hf, moe, facts: ExportFacts) -> tuple[list, dict[str, Linear]]:
    """An MoE layer: the router (kept in high precision, in the ignore list), every routed expert, and the
    shared experts where the family has them (DeepSeek-V2's ``mlp.shared_experts``, a dense gated MLP in vLLM).
    vLLM runs a layer's experts as one fused MoE with one scheme, so their gate/up and their down each get one
    format (all of them in high precision where those two differ); ModelOpt's HF export gives every linear that
    reads the post-attention norm one pre-quant scale, which folds into that norm, the router taking 1 / s."""
    block = f"{h}.{moe.experts.rsplit('.', 1)[0]}"
    leaf = moe.experts.rsplit(".", 1)[-1]
    gate_name, up_name = moe.fused
    router_name = f"{h}.{moe.router}"
    router = Linear(ckpt.get(f"{router_name}.weight").float())
    n = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_local_experts", None) or hf.num_experts
    pairs, downs = {}, {}
    for e in range(n):
        x = f"{block}.{leaf}.{e}"
        pair, down = _gated_mlp(ckpt, [f"{x}.{gate_name}", f"{x}.{up_name}"], f"{x}.{moe.down}", 0, facts)
        pairs.update(pair)
        downs.update(down)
    one_format(pairs, facts)
    one_format(downs, facts)
    if len({lin.algo for lin in (*pairs.values(), *downs.values())}) > 1:
        one_format({**pairs, **downs}, facts)
    members = {router_name: router, **pairs}
    linears = {router_name: router}
    for e in range(n):  # the HF order: an expert's gate, up, down
        x = f"{block}.{leaf}.{e}"
        linears.update({k: (pairs | downs)[k] for k in (f"{x}.{gate_name}", f"{x}.{up_name}", f"{x}.{moe.down}")})
    if getattr(hf, "n_shared_experts", None):
        s = f"{block}.shared_experts"
        pair, down = _gated_mlp(ckpt, [f"{s}.gate_proj", f"{s}.up_proj"], f"{s}.down_proj", 0, facts)
        members.update(pair)
        linears.update({**pair, **down})
    return [("post_attention_layernorm", members)], linears


def _export(hf_dir: Path, model_dir: Path, *, out_dir: Path, dtype: str, max_shard_bytes: int, kv_scales: bool) -> dict:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    fam = families.family(hf.model_type, "vllm")
    layout = fam.layout
    offset = 1.0 if layout.unit_offset_norms else 0.0  # a (1 + w) norm's effective scale is w + 1
    ckpt = _Checkpoint(hf_dir)
    out = Written(out_dir, max_shard_bytes, dtype)
    facts = out.facts

    def norm(name: str):
        return ckpt.get(f"{name}.weight").float() + offset

    out.add("model.embed_tokens.weight", ckpt.get("model.embed_tokens.weight")[:hf.vocab_size])
    final_norm = norm("model.norm")  # written last: lm_head's smoothing may fold into it
    for i in range(hf.num_hidden_layers):
        h = f"model.layers.{i}"
        kv = ckpt.kv_scales(h)
        if kv_scales and ckpt.kv_algo:
            if kv is None:
                raise IntegrityError(f"{hf_dir}: kv_cache_quant_algo {ckpt.kv_algo} but {h} has no KV-cache scales")
            out.put_kv_scales(f"{h}.self_attn", *(fp8_kv_scale(x, ckpt.kv_algo) for x in kv))
        groups, linears = (_mla_attention(ckpt, h, hf, facts) if getattr(hf, "kv_lora_rank", None)
                           else _attention(ckpt, h, hf, layout, facts))
        if fam.moe is not None and ckpt.has(f"{h}.{fam.moe.router}.weight"):  # a family may keep some layers dense
            mlp_groups, mlp = _moe(ckpt, h, hf, fam.moe, facts)
        else:
            pair, down = _gated_mlp(ckpt, [f"{h}.{n}" for n in layout.gate_up], f"{h}.{layout.down}",
                                    hf.intermediate_size, facts)
            mlp_groups, mlp = [(layout.mlp_norm, pair)], {**pair, **down}
        for name, members in groups + mlp_groups:
            out.add(f"{h}.{name}.weight", _fold_into_norm(norm(f"{h}.{name}"), members, name, facts) - offset)
        for name, lin in {**linears, **mlp}.items():
            out.put(name, lin, expert=f".{fam.moe.experts}." in name if fam.moe else False)
        for key in ckpt.unread(f"{h}."):  # the layer's other norms (q/k norms, Gemma's post-norms), as they are
            tensor = ckpt.get(key)
            if not tensor.is_floating_point() or key.rsplit(".", 1)[-1] != "weight":
                raise IntegrityError(f"{hf_dir}: {key} ({tensor.dtype}) is not a tensor the vLLM export knows")
            out.add(key, tensor)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    if ckpt.has("lm_head.weight"):
        head = ckpt.linear("lm_head")
        final_norm = fold_head(final_norm, head, hf.vocab_size, facts)
        out.put("lm_head", head)
        tied = False
    elif not tied:
        raise IntegrityError(f"{hf_dir}: no lm_head, and the model does not tie its word embeddings")
    out.add("model.norm.weight", final_norm - offset)
    leftover = ckpt.unread()
    if leftover:
        raise IntegrityError(f"{hf_dir}: tensors the vLLM export does not know: {leftover[:4]}")
    ckpt.handles.clear()
    return out.finish(model_dir, tied)
