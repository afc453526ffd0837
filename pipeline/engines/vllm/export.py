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

Formats (vLLM 0.32, ``model_executor/layers/quantization/compressed_tensors``): INT8 weights per output
channel, symmetric, with the checkpoint's static per-tensor INT8 input scale (``CompressedTensorsW8A8Int8``,
strategy channel / tensor, ``dynamic: false``: its CPU kernel is oneDNN's or the AMX one,
``kernels/linear/scaled_mm/cpu.py``); tensors ``weight`` (I8 [out, in]), ``weight_scale`` (F32 [out, 1],
W = code * scale) and ``input_scale`` (F32 [1], x_code = round(x / scale)). Layers the plan keeps in high
precision are the config's ``ignore`` list (q/k/v and gate/up decide together: vLLM fuses them and
ModelOpt's plan gives each group one format). Unquantized tensors are written in ``dtype``.

Memory: the checkpoint is read a tensor at a time and the export is written as it goes, in safetensors
shards of at most ``max_shard_bytes`` with an index (``model.safetensors.index.json``, the HF layout vLLM
reads), so the export holds one shard and one decoder layer, not the model. It is written into a sibling
``.partial`` folder and renamed into place at the end: a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline.errors import InputError, IntegrityError
from pipeline.fsutil import atomic_write_text, remove_tree

# TensorRT-LLM algos the export writes for vLLM; anything else is refused before export (config check)
EXPORTABLE_ALGOS = ("W8A8_SQ_PER_CHANNEL",)
WEIGHTS_FILE = "model.safetensors"  # one shard; more: model-00001.safetensors ... and the index
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 2**30  # a shard is written, and its tensors freed, once this much is pending
QUANT_METHOD = "compressed-tensors"
# the compressed-tensors scheme of every quantized linear (compressed_tensors.quantization.QuantizationArgs)
W8A8_STATIC_SCHEME = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                          "dynamic": False},
}


@dataclass
class Linear:
    """One HF linear on its way out: float weight, or INT8 codes with their scales."""

    weight: Any  # torch tensor: float [out, in], or int8 codes [out, in]
    weight_scale: Any = None  # fp32 [out] when quantized
    input_scale: Any = None  # fp32 scalar when quantized
    prequant: Any = None  # fp32 [in]: the input multiplier still to fold

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None

    def scale_rows(self, s) -> None:
        """Output rows times ``s`` (exact: for INT8 rows, their per-channel scales)."""
        if self.quantized:
            self.weight_scale = self.weight_scale * s
        else:
            self.weight = self.weight * s[:, None]

    def scale_columns(self, s) -> None:
        """Input columns times ``s``: only a float weight can take it."""
        assert not self.quantized
        self.weight = self.weight * s[None, :]

    def dequantize(self) -> None:
        """INT8 codes -> float weight (the smoothing folded in), the layer then in high precision."""
        self.weight = self.weight.float() * self.weight_scale[:, None]
        if self.prequant is not None:
            self.weight = self.weight * self.prequant[None, :]
        self.weight_scale = self.input_scale = self.prequant = None


@dataclass
class ExportFacts:
    quantized_linears: int = 0
    high_precision_linears: int = 0
    ignore: list[str] = field(default_factory=list)
    folded: dict[str, int] = field(default_factory=dict)  # where pre-quant scales went -> count
    unfoldable: list[str] = field(default_factory=list)  # quantized in the checkpoint, high precision here

    def as_dict(self) -> dict:
        return {"quantized_linears": self.quantized_linears, "high_precision_linears": self.high_precision_linears,
                "ignore": len(self.ignore), "smoothing_folded_into": self.folded,
                "dequantized_smoothing_not_foldable": self.unfoldable}


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

    def has(self, key: str) -> bool:
        return key in self.keys[0]

    def each(self, key: str) -> list:
        from pipeline.quant.checkpoint import _get

        self.read_keys.add(key)
        return [_get(path, key) for path in self.files]

    def one(self, key: str):
        return self.each(key)[0]

    def unread(self) -> list[str]:
        return sorted(set().union(*self.keys) - self.read_keys)


def _cat(parts: list, dim: int):
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_linear(ranks: _Ranks, name: str, algo: Optional[str], kind: str, split: Optional[list[int]] = None) -> list[Linear]:
    """The checkpoint linear ``name`` joined across ranks: kind column (split on outputs) or row (on inputs);
    ``split``: the per-rank output widths to cut it into (fused q/k/v), else one Linear."""
    import torch

    weights = ranks.each(f"{name}.weight")
    scales: dict[str, Any] = {k: ranks.each(f"{name}.{k}") if ranks.has(f"{name}.{k}") else None
                              for k in ("weights_scaling_factor", "activation_scaling_factor",
                                        "prequant_scaling_factor")}
    if algo is None:
        if any(v is not None for v in scales.values()):
            raise IntegrityError(f"{name}: unquantized weight with quantization scales beside it")
    elif algo not in EXPORTABLE_ALGOS:
        raise InputError(f"{name}: {algo} cannot be exported for vLLM (exportable: {', '.join(EXPORTABLE_ALGOS)})")
    elif weights[0].dtype != torch.int8 or scales["weights_scaling_factor"] is None \
            or scales["activation_scaling_factor"] is None:
        raise IntegrityError(f"{name}: {algo} needs I8 codes, weights_scaling_factor and activation_scaling_factor")

    def wsf_of(r: int, rows: int):
        w = scales["weights_scaling_factor"][r].float().reshape(-1)
        return w.expand(rows).clone() if w.numel() == 1 else w

    pieces = []  # per rank: list of (weight, wsf) per split part
    for r, w in enumerate(weights):
        wsf: Any = wsf_of(r, w.shape[0]) if algo else None
        if split:
            ws = w.split(split)
            ss = wsf.split(split) if algo else [None] * len(split)
            pieces.append(list(zip(ws, ss)))
        else:
            pieces.append([(w, wsf)])
    out = []
    for part in range(len(pieces[0])):
        ws = [p[part][0] for p in pieces]
        if kind == "row":
            weight = _cat(ws, 1)
            wsf = pieces[0][part][1]  # per-channel scales are the same on every rank of a row-parallel linear
        else:
            weight = _cat(ws, 0)
            wsf = _cat([p[part][1] for p in pieces], 0) if algo else None
        lin = Linear(weight if algo else weight.float(), wsf)
        if algo:
            lin.input_scale = scales["activation_scaling_factor"][0].float().reshape(())
            pqs = scales["prequant_scaling_factor"]
            if pqs is not None:
                lin.prequant = _cat([p.float() for p in pqs], 0) if kind == "row" else pqs[0].float()
        out.append(lin)
    return out


def _same(a, b) -> bool:
    import torch

    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def _fold_into_norm(norm, linears: dict[str, Linear], where: str, facts: ExportFacts):
    """The group's shared pre-quant scale into the RMSNorm before it; returns the new norm weight. A
    quantized member with another scale is dequantized (not foldable); float members take ``1/s``.
    ``linears``: HF name -> Linear."""
    s = next((l.prequant for l in linears.values() if l.quantized and l.prequant is not None), None)
    if s is None:
        return norm
    for name, lin in linears.items():
        if lin.quantized and not _same(lin.prequant, s):
            lin.dequantize()  # its own smoothing goes into its columns; it then takes 1/s below
            facts.unfoldable.append(name)
        if not lin.quantized:
            lin.scale_columns(1.0 / s)
        lin.prequant = None
    facts.folded[where] = facts.folded.get(where, 0) + 1
    return norm * s


def _fold_into_rows(target: Linear, lin: Linear, name: str, where: str, facts: ExportFacts,
                    heads: Optional[tuple] = None):
    """``lin``'s (HF ``name``) pre-quant scale into the output rows of ``target`` (which produces its input).
    ``heads``: (query heads, KV heads, head dim) when ``target`` is v_proj and each KV head feeds several
    query heads."""
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
    target.scale_rows(s)
    lin.prequant = None
    facts.folded[where] = facts.folded.get(where, 0) + 1


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


def export_for_vllm(ckpt_dir: Path, model_dir: Path, out_dir: Path, dtype: str = "bfloat16",
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write ``out_dir`` (a new folder): the weights (one file or shards and an index), config.json with the
    quantization_config, the tokenizer files. Returns the export's facts."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; the export writes a new folder")
    partial = out_dir.with_name(out_dir.name + ".partial")
    remove_tree(partial)
    partial.mkdir(parents=True)
    try:
        facts = _export(Path(ckpt_dir), Path(model_dir), partial, dtype, max_shard_bytes)
    except BaseException:
        remove_tree(partial)
        raise
    os.replace(partial, out_dir)
    return facts


def _export(ckpt_dir: Path, model_dir: Path, out_dir: Path, dtype: str, max_shard_bytes: int) -> dict:
    import torch
    from transformers import AutoConfig

    from pipeline.engines.build import copy_model_files
    from pipeline.quant.checkpoint import _layer_formats

    ckpt_cfg = json.loads((ckpt_dir / "config.json").read_text())
    layer_format = _layer_formats(ckpt_dir, ckpt_cfg.get("quantization") or {})
    hf = AutoConfig.from_pretrained(model_dir)
    n_heads, n_kv = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    ranks = _Ranks(ckpt_dir)
    tp = ranks.tp
    qkv_split = [n_heads // tp * head_dim, n_kv // tp * head_dim, n_kv // tp * head_dim]
    torch_dtype = getattr(torch, dtype)
    facts = ExportFacts()
    writer = ShardWriter(out_dir, max_shard_bytes)

    def put(hf_name: str, lin: Linear) -> None:
        if lin.prequant is not None:
            raise IntegrityError(f"{hf_name}: a pre-quant scale was left unfolded")  # a bug here, not bad input
        if lin.quantized:  # own copies: q/k/v are views of one fused tensor, and safetensors refuses shared storage
            writer.add(f"{hf_name}.weight", lin.weight.clone())
            writer.add(f"{hf_name}.weight_scale", lin.weight_scale.float().reshape(-1, 1).clone())
            writer.add(f"{hf_name}.input_scale", lin.input_scale.float().reshape(1).clone())
            facts.quantized_linears += 1
        else:
            writer.add(f"{hf_name}.weight", lin.weight.to(torch_dtype).clone())
            facts.ignore.append(hf_name)
            facts.high_precision_linears += 1

    emb = ranks.each("transformer.vocab_embedding.weight")
    split_dim = ckpt_cfg.get("embedding_sharding_dim", 0) if tp > 1 and ckpt_cfg.get("use_parallel_embedding") else None
    embed = (emb[0] if split_dim is None else _cat(emb, split_dim))[:hf.vocab_size]
    writer.add("model.embed_tokens.weight", embed.to(torch_dtype).contiguous())
    del emb, embed
    final_norm = ranks.one("transformer.ln_f.weight").float()  # written last: lm_head's smoothing may fold into it
    for i in range(hf.num_hidden_layers):
        p, h = f"transformer.layers.{i}", f"model.layers.{i}"
        q, k, v = _read_linear(ranks, f"{p}.attention.qkv", layer_format(f"{p}.attention.qkv")[0], "qkv", qkv_split)
        o, = _read_linear(ranks, f"{p}.attention.dense", layer_format(f"{p}.attention.dense")[0], "row")
        gate, = _read_linear(ranks, f"{p}.mlp.fc", layer_format(f"{p}.mlp.fc")[0], "column")
        up, = _read_linear(ranks, f"{p}.mlp.gate", layer_format(f"{p}.mlp.gate")[0], "column")
        down, = _read_linear(ranks, f"{p}.mlp.proj", layer_format(f"{p}.mlp.proj")[0], "row")
        ln_in = ranks.one(f"{p}.input_layernorm.weight").float()
        ln_post = ranks.one(f"{p}.post_layernorm.weight").float()
        ln_in = _fold_into_norm(ln_in, {f"{h}.self_attn.{m}_proj": l for m, l in zip("qkv", (q, k, v))},
                                "input_layernorm", facts)
        ln_post = _fold_into_norm(ln_post, {f"{h}.mlp.gate_proj": gate, f"{h}.mlp.up_proj": up},
                                  "post_attention_layernorm", facts)
        _fold_into_rows(up, down, f"{h}.mlp.down_proj", "up_proj rows", facts)
        _fold_into_rows(v, o, f"{h}.self_attn.o_proj", "v_proj rows", facts,
                        heads=(n_heads, n_kv, head_dim) if n_kv != n_heads else None)
        if len({l.quantized for l in (q, k, v)}) != 1 or gate.quantized != up.quantized:
            raise IntegrityError(f"{h}: vLLM fuses q/k/v and gate/up, which must share one format "
                                 f"(q/k/v {[l.quantized for l in (q, k, v)]}, gate/up {[gate.quantized, up.quantized]})")
        writer.add(f"{h}.input_layernorm.weight", ln_in.to(torch_dtype))
        writer.add(f"{h}.post_attention_layernorm.weight", ln_post.to(torch_dtype))
        for name, lin in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                          ("self_attn.o_proj", o), ("mlp.gate_proj", gate), ("mlp.up_proj", up),
                          ("mlp.down_proj", down)):
            put(f"{h}.{name}", lin)
        for key in ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor"):
            if ranks.has(f"{p}.attention.{key}"):
                ranks.read_keys.add(f"{p}.attention.{key}")  # the KV-cache scales: vLLM's own KV dtype decides
    tied = getattr(hf, "tie_word_embeddings", False)
    if ranks.has("lm_head.weight"):
        head, = _read_linear(ranks, "lm_head", layer_format("lm_head")[0], "column")
        head.weight = head.weight[:hf.vocab_size]
        if head.quantized:
            head.weight_scale = head.weight_scale[:hf.vocab_size]
            if head.prequant is not None:  # nothing before lm_head to fold into but the final norm
                final_norm = final_norm * head.prequant
                head.prequant = None
                facts.folded["norm"] = 1
        put("lm_head", head)
        tied = False
    elif not tied:
        raise IntegrityError(f"{ckpt_dir}: no lm_head, and the model does not tie its word embeddings")
    writer.add("model.norm.weight", final_norm.to(torch_dtype))
    leftover = ranks.unread()
    if leftover:
        raise IntegrityError(f"{ckpt_dir}: tensors the vLLM export does not know: {leftover[:4]}")

    files = writer.finish()
    copy_model_files(model_dir, out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update({"torch_dtype": dtype, "tie_word_embeddings": tied})
    config.pop("dtype", None)
    config.pop("quantization_config", None)
    if facts.quantized_linears:
        config["quantization_config"] = {
            "quant_method": QUANT_METHOD, "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], **W8A8_STATIC_SCHEME}},
            "ignore": facts.ignore,
        }
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    return {"dtype": dtype, "weights_bytes": sum((out_dir / f).stat().st_size for f in files), "weight_files": len(files),
            **facts.as_dict()}
