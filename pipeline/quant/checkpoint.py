"""Read a TensorRT-LLM checkpoint back as float HF weights that compute what the engine will compute.

``CheckpointReader`` reads it a piece at a time (the embedding, one decoder layer, the final norm, lm_head),
each tensor only when a piece needs it, so a model bigger than memory can be run
a layer at a time; ``rebuild`` puts all the pieces into one fp32 HF model. Quantized linears come back as
dequantized fp32 weights plus a forward pre-hook that applies their input transform (pre-quant scale, fake
activation quantization).

Own code, written from what ModelOpt 0.47's exporter writes (modelopt/torch/export: quant_utils.py
``to_quantized_weight`` / ``pack_int4_in_uint8``, postprocess.py ``_split_model_config_for_tp``,
model_config_utils.py ``merge_qkv``) and checked on exports of SmolLM2 and tiny Llamas:

- INT8 weights (I8, W8A8_SQ_PER_CHANNEL / W8A16) with a per-output-channel ``weights_scaling_factor``
  (= amax / 127): W = I8 * scale[:, None];
- FP8 weights (F8_E4M3) with a per-tensor ``weights_scaling_factor``: W = fp8 * scale;
- INT4 AWQ (W4A16_AWQ, W4A8_AWQ): two signed 4-bit codes per byte, stored as I8 of shape [out / 2, in]:
  byte [r, i] holds row 2r in its low nibble and row 2r + 1 in its high nibble; ``weights_scaling_factor``
  [out, in / group] (= block amax / 7): W = code * scale of its group. W4A8 adds ``weights_scaling_factor_2``
  (the per-tensor FP8 scale the INT4 values are cast to: amax / 448) and an FP8 input;
- activations: per-tensor ``activation_scaling_factor`` (= amax / 127 for INT8, amax / 448 for FP8), after
  the ``prequant_scaling_factor`` (SmoothQuant or AWQ: the input is multiplied by it; the weight already
  holds 1/s);
- formats per layer: ``quantization.quant_algo`` with ``exclude_modules`` (fnmatch patterns), or
  ``MIXED_PRECISION`` with ``quant_cfg.json`` listing ``quantized_layers`` {module: {quant_algo, group_size}}
  (a module not listed is unquantized);
- tensor parallelism: ``rank{N}.safetensors`` per rank. Column-parallel linears (qkv, mlp.fc, mlp.gate,
  lm_head) are split on the output dim; each rank's qkv holds its own q | k | v slices (heads / tp each).
  Row-parallel ones (attention.dense, mlp.proj) are split on the input dim, with their AWQ group scales and
  pre-quant scales; per-channel INT8 scales, activation and FP8 scales are the same on every rank. The
  vocabulary embedding is split on the vocabulary (padded, as lm_head may be). Each rank is dequantized
  with its own scales, then the pieces are joined;
- names: attention.qkv (fused, split back into q/k/v), attention.dense -> o_proj, mlp.fc -> gate_proj,
  mlp.gate -> up_proj, mlp.proj -> down_proj, vocab_embedding, ln_f, input/post_layernorm, lm_head;
  attention.q_layernorm / k_layernorm -> self_attn.q_norm / k_norm (Qwen3's per-head norms), where present;
- biases (Qwen2's q/k/v): ``<linear>.bias`` beside the weight, unquantized, split over the ranks as the
  weight's output rows are (a fused qkv bias holds each rank's q | k | v slices); a row-parallel linear's bias
  is the same on every rank.
- mixture-of-experts layers (a family with ``moe`` in pipeline/families.py): ``mlp.router`` (fp32, unquantized,
  the same on every rank) -> the router; the experts stacked, one tensor per expert type: ``mlp.fc`` [experts,
  2 x intermediate, hidden] holding each expert's up (w3) rows then its gate (w1) rows, ``mlp.proj`` [experts,
  hidden, intermediate] its down (w2) (ModelOpt 0.47 layer_utils.py ``build_stacked_experts``). Their scales
  carry the expert as their first dim (weights_scaling_factor [experts, 1] for FP8, [experts, out, in / group] for INT4;
  prequant_scaling_factor [experts, in]; weights_scaling_factor_2 [experts, 1]); the activation scale is one for
  all the experts. Each expert is dequantized with its own scales. Under tensor parallelism every rank holds a
  slice of every expert: fc's up rows and gate rows each split on the intermediate dim (a rank's fc holds its
  up rows, then its gate rows), proj split on its input dim with its INT4 group scales and pre-quant scale.
It checks what it reads: layers the plan keeps in high precision must be unquantized, quantized ones must
carry the scales their format needs with consistent shapes and dtypes, the stored dtype must agree with the
format the config names, and shapes must match the model; a violation is an IntegrityError naming the layer.
A tensor no piece read (one this reader does not know) is an IntegrityError too. The KV-cache scales are read and
reported; the rebuilt model does not quantize its KV cache (the CPU runtime of the build stage does), so its perplexity
leaves that part out.
"""

from __future__ import annotations

import fnmatch
import json
import weakref
from pathlib import Path
from typing import Any, Callable

from pipeline import artifacts, families
from pipeline.errors import IntegrityError
from pipeline.formats import FORMAT_OF_ALGO

HF_OF = {"attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj",
         "mlp.proj": "mlp.down_proj"}
NORMS = {"input_layernorm": "input_layernorm", "post_layernorm": "post_attention_layernorm"}
# per-head RMSNorms on q and k (Qwen3), where a family has them (ModelOpt's build_attention_config)
HEAD_NORMS = {"attention.q_layernorm": "self_attn.q_norm", "attention.k_layernorm": "self_attn.k_norm"}
ROW_PARALLEL = ("attention.dense", "mlp.proj")
READABLE_ALGOS = tuple(FORMAT_OF_ALGO)
INT4_ALGOS = tuple(a for a, f in FORMAT_OF_ALGO.items() if f.awq)
SCALE_NAMES = ("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor",
               "prequant_scaling_factor")


def _fake_act(quant_algo: str, act_scale, prequant):
    """The input transform of a quantized linear: smoothing, then per-tensor INT8 or FP8 fake quantization."""
    from pipeline.quant import quant_math as qm

    def f(x):
        if prequant is not None:
            x = x * prequant.to(x.device)  # the layer may have been moved after the hook was made
        if act_scale is None:
            return x
        if quant_algo.startswith("W8A8"):
            return qm.int_fake_quant(x, act_scale * 127.0)
        if quant_algo in ("FP8", "W4A8_AWQ"):
            return qm.fp8_fake_quant(x, act_scale * 448.0)
        return x

    return f


def unpack_int4(packed):
    """[out / 2, in] bytes (as I8) -> [out, in] signed 4-bit codes (int8), undoing ModelOpt's pack_int4_in_uint8."""
    import torch

    b = packed.view(torch.uint8).to(torch.int16)
    codes = torch.stack([b & 0x0F, (b >> 4) & 0x0F], dim=1)  # [out / 2, 2, in]: rows 2r, 2r + 1
    codes = torch.where(codes >= 8, codes - 16, codes)
    return codes.reshape(packed.shape[0] * 2, packed.shape[1]).to(torch.int8)


def _dequantize(name: str, algo: str | None, *, w, s: dict, group_size: int | None,
                required: tuple[str, ...] | None = None):
    """One rank's weight as float32, from its codes and its scales (by their TensorRT-LLM names); checks the
    scales' shapes. ``required``: the scales it must carry (default: its format's ``checkpoint_scales``)."""
    import torch

    from pipeline.quant import quant_math as qm

    if algo is None:
        return w.float()
    needed = FORMAT_OF_ALGO[algo].checkpoint_scales if required is None else required
    missing = [k for k in needed if s.get(k) is None]
    if missing:
        raise IntegrityError(f"{name}: {algo} weight without {', '.join(missing)}")
    wsf = s["weights_scaling_factor"].float()
    if algo in INT4_ALGOS:
        if w.dtype != torch.int8:
            raise IntegrityError(f"{name}: {algo} weight must be packed INT4 in I8, found {w.dtype}")
        codes = unpack_int4(w)
        out_f, in_f = codes.shape
        if not group_size or in_f % group_size or tuple(wsf.shape) != (out_f, in_f // group_size):
            raise IntegrityError(f"{name}: INT4 group scales of shape {tuple(wsf.shape)} do not fit a weight of "
                                 f"[{out_f}, {in_f}] with group size {group_size}")
        wf = codes.float().mul_(wsf.repeat_interleave(group_size, dim=1))
        if algo == "W4A8_AWQ":  # the kernel casts the INT4 values to FP8 with a per-tensor scale
            wf = qm.fp8_fake_quant(wf, s["weights_scaling_factor_2"].float().reshape(()) * 448.0)
    elif algo == "FP8":
        if w.dtype != torch.float8_e4m3fn:
            raise IntegrityError(f"{name}: FP8 weight stored as {w.dtype}")
        if wsf.numel() != 1:
            raise IntegrityError(f"{name}: FP8 weights_scaling_factor must be one value, found {tuple(wsf.shape)}")
        wf = w.float().mul_(wsf.reshape(()))
    else:
        if w.dtype != torch.int8:
            raise IntegrityError(f"{name}: {algo} weight stored as {w.dtype}")
        if wsf.numel() != 1 and tuple(wsf.shape) != (w.shape[0],):
            raise IntegrityError(f"{name}: per-channel weights_scaling_factor of shape {tuple(wsf.shape)} does not "
                                 f"fit {w.shape[0]} output channels")
        wf = w.float().mul_(wsf[:, None] if wsf.numel() > 1 else wsf.reshape(()))
    pqs = s.get("prequant_scaling_factor")
    if pqs is not None and tuple(pqs.shape) != (wf.shape[1],):
        raise IntegrityError(f"{name}: prequant_scaling_factor of shape {tuple(pqs.shape)} does not fit an input "
                             f"width of {wf.shape[1]}")
    return wf


def _layer_formats(ckpt_dir: Path, qcfg: dict):
    """A function trtllm module name -> (quant_algo or None, group size), from config.json / quant_cfg.json."""
    layers = None
    if qcfg.get("quant_algo") == "MIXED_PRECISION":
        path = ckpt_dir / artifacts.QUANT_CFG_FILE
        if not path.is_file():
            raise IntegrityError(f"{ckpt_dir}: quant_algo MIXED_PRECISION without {artifacts.QUANT_CFG_FILE}")
        layers = json.loads(path.read_text()).get("quantized_layers") or {}
    return layer_formats(qcfg, layers, f"{ckpt_dir}", artifacts.QUANT_CFG_FILE)


def layer_formats(qcfg: dict, layers: dict | None, where: str, listed_in: str):
    """A function module name -> (quant_algo or None, group size): from ``qcfg``'s quant_algo, exclude_modules
    (fnmatch patterns) and group_size, or for MIXED_PRECISION from ``layers`` ({module or pattern: {quant_algo,
    group_size}}, read from ``listed_in``; a module not listed is unquantized). The same rules in both of
    ModelOpt's checkpoints: the TensorRT-LLM one (config.json, quant_cfg.json) and the HF unified one
    (hf_quant_config.json, which holds ``quantized_layers`` itself)."""
    algo = qcfg.get("quant_algo")
    if algo == "MIXED_PRECISION":
        listed = layers or {}
        for name, entry in listed.items():
            if entry.get("quant_algo") not in READABLE_ALGOS:
                raise IntegrityError(f"{name}: quant_algo {entry.get('quant_algo')} in {listed_in} cannot be "
                                     f"read back (readable: {', '.join(READABLE_ALGOS)})")

        def mixed(module: str):
            for pattern, entry in listed.items():
                if module == pattern or fnmatch.fnmatchcase(module, pattern):
                    return entry["quant_algo"], entry.get("group_size")
            return None, None

        return mixed
    if algo is not None and algo not in READABLE_ALGOS:
        raise IntegrityError(f"{where}: quant_algo {algo} cannot be read back "
                             f"(readable: {', '.join(READABLE_ALGOS)}, MIXED_PRECISION)")
    excluded = qcfg.get("exclude_modules") or []

    def one(module: str):
        if algo is None or any(fnmatch.fnmatchcase(module, p) for p in excluded):
            return None, None
        return algo, qcfg.get("group_size")

    return one


class CheckpointReader:
    """Reads a TensorRT-LLM checkpoint piece by piece, a tensor only when a piece that needs it is asked for.

    A rank file is opened for each tensor read and closed after: safetensors maps the whole file, and pages
    read through a mapping kept open would count in this process's resident memory, layer after layer
    (measured on a 2B checkpoint: held open for the length of each layer's read, +58 MB per layer, for good).
    Everything that does not need the tensors is checked on opening (the formats, the mapping, the rank files,
    tp against the heads). The pieces come as fp32: ``embedding()``, ``final_norm()``, ``load_layer(i, layer)``
    for each decoder layer, ``lm_head()``; ``finish()`` then refuses tensors nothing asked for and returns the
    facts. ``facts`` counts what has been read so far (a piece read twice is counted once).
    ``kept``: the HF names of the layers the plan keeps in high precision (checked when given)."""

    def __init__(self, ckpt_dir: Path, model_dir: Path, kept: set[str] | None = None):
        from safetensors import safe_open
        from transformers import AutoConfig

        self.ckpt_dir = ckpt_dir = Path(ckpt_dir)
        cfg = json.loads((ckpt_dir / "config.json").read_text())
        qcfg = cfg.get("quantization") or {}
        self._layer_format = _layer_formats(ckpt_dir, qcfg)
        mapping = cfg.get("mapping") or {}
        tp, pp = mapping.get("tp_size", 1), mapping.get("pp_size", 1)
        world = mapping.get("world_size", tp * pp)
        if pp != 1 or world != tp:
            raise IntegrityError(f"{ckpt_dir}: pipeline-parallel checkpoints (pp_size {pp}) cannot be read back; "
                                 f"export with pipeline parallel size 1")
        rank_files = [ckpt_dir / f"rank{r}.safetensors" for r in range(world)]
        absent = [p.name for p in rank_files if not p.is_file()]
        if absent:
            raise IntegrityError(f"{ckpt_dir}: world_size {world} but {', '.join(absent)} missing")
        self.hf_config = hf = AutoConfig.from_pretrained(model_dir)
        heads, kv = hf.num_attention_heads, hf.num_key_value_heads
        if heads % tp or kv % tp:
            raise IntegrityError(f"{ckpt_dir}: tp_size {tp} does not divide the model's {heads} heads / {kv} KV heads")
        self.tp, self.kept = tp, kept
        self._heads = heads, kv, families.head_dim(hf)
        self._embedding_split = cfg.get("embedding_sharding_dim", 0) if tp > 1 and cfg.get("use_parallel_embedding") \
            else None  # split on the (padded) vocabulary, or on the hidden dim; else each rank holds all of it
        self._files = rank_files
        self._keys = []
        for path in rank_files:
            with safe_open(str(path), framework="pt") as f:
                self._keys.append(set(f.keys()))
        self._consumed: set[str] = set()
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # linear -> its input transform hook
        self.facts = {"quant_algo": qcfg.get("quant_algo"), "kv_cache_quant_algo": qcfg.get("kv_cache_quant_algo"),
                      "kv_scales": 0, "quantized_linears": 0, "high_precision_linears": 0, "tp_size": tp,
                      "formats": {}}

    def _present(self, key: str, required: bool = True) -> bool:
        """Whether any rank holds ``key`` (all must when ``required``); marks it consumed."""
        held = [key in keys for keys in self._keys]
        if required and not all(held):
            raise IntegrityError(f"{self.ckpt_dir}: {key} missing from rank {held.index(False)}")
        self._consumed.add(key)
        return any(held)

    def _read(self, key: str, required: bool = True):
        """Each rank's ``key`` (None for a rank without it), or None when no rank has it."""
        if not self._present(key, required):
            return None
        return [_get(f, key) if key in keys else None for f, keys in zip(self._files, self._keys)]

    def _read_replicated(self, key: str):
        """A tensor every rank holds a copy of, read from rank 0."""
        self._present(key)
        return _get(self._files[0], key)

    def embedding(self):
        """The vocabulary embedding, fp32 [vocab, hidden] (the ranks' pieces joined, the padding cut off)."""
        import torch

        key = "transformer.vocab_embedding.weight"
        if self._embedding_split is None:
            embed = self._read_replicated(key).float()
        else:
            embed = torch.cat([e.float() for e in self._read(key)], dim=self._embedding_split)
        return embed[:self.hf_config.vocab_size]

    def final_norm(self):
        return self._read_replicated("transformer.ln_f.weight").float()

    def _read_linear(self, name: str, hf_names: list[str], kind: str, shapes: list[tuple]):
        """kind: qkv | column | row | vocab (column-parallel, padded). Dequantizes each rank, joins them, checks
        against the plan and the model's ``shapes``. Returns (fp32 weight per HF name, input transform or None,
        {HF name: fp32 bias} for those the checkpoint has one for)."""

        first_read = f"{name}.weight" not in self._consumed
        weights = self._read(f"{name}.weight")
        found = {k: self._read(f"{name}.{k}", required=False) or [None] * self.tp for k in SCALE_NAMES}
        scales = [{k: v[r] for k, v in found.items()} for r in range(self.tp)]
        fmt, group = self._layer_format(name)
        is_quant = self._stored_as_configured(name, fmt, weights[0].dtype)
        kept = self.kept
        if kept is not None and (hf_names[0] in kept) == is_quant:
            raise IntegrityError(f"{name}: the plan {'keeps' if hf_names[0] in kept else 'quantizes'} "
                                 f"{hf_names[0]} but the checkpoint stores it as {weights[0].dtype}")
        if fmt is None and any(v is not None for s in scales for v in s.values()):
            raise IntegrityError(f"{name}: unquantized weight with quantization scales beside it")
        parts = [_dequantize(name, fmt, w=w, s=s, group_size=group) for w, s in zip(weights, scales)]
        if kind == "qkv":
            heads, kv, head_dim, tp = *self._heads, self.tp
            q, k_, v = heads // tp * head_dim, kv // tp * head_dim, kv // tp * head_dim
            if any(p.shape[0] != q + 2 * k_ for p in parts):
                raise IntegrityError(f"{name}: per-rank fused q/k/v of {parts[0].shape[0]} rows, expected {q + 2 * k_} "
                                     f"({heads} heads, {kv} KV heads, head size {head_dim}, tp {tp})")
            split = [p.split([q, k_, v]) for p in parts]
            full = [_join([s[i] for s in split], 0) for i in range(3)]
        elif kind == "row":
            full = [_join(parts, 1)]
        else:
            full = [_join(parts, 0)]
            if kind == "vocab":
                full = [full[0][:self.hf_config.vocab_size]]
        for hf_name, part, shape in zip(hf_names, full, shapes):
            if tuple(part.shape) != tuple(shape):
                raise IntegrityError(f"{name}: shape {tuple(part.shape)} does not fit {hf_name} {tuple(shape)}")
        biased = self._read_bias(name, hf_names, kind, [w.shape[0] for w in full])
        if first_read:
            self._count(fmt, len(hf_names))
        if fmt is None:
            return full, None, biased
        prequant = _joined_prequant(name, [s["prequant_scaling_factor"] for s in scales], kind)
        asf = scales[0]["activation_scaling_factor"]
        return full, _fake_act(fmt, None if asf is None else asf.float().reshape(()), prequant), biased

    def _stored_as_configured(self, name: str, fmt: str | None, dtype) -> bool:
        """Whether ``name`` is stored quantized; an IntegrityError when that disagrees with its configured format."""
        is_quant = _is_quantized(dtype)
        if (fmt is not None) != is_quant:
            raise IntegrityError(f"{name}: the checkpoint's config says {fmt or 'unquantized'} but the weight is "
                                 f"stored as {dtype}")
        return is_quant

    def _count(self, fmt: str | None, linears: int) -> None:
        """``linears`` HF linears read for the first time, in format ``fmt`` (None: high precision)."""
        if fmt is None:
            self.facts["high_precision_linears"] += linears
        else:
            self.facts["quantized_linears"] += linears
            self.facts["formats"][fmt] = self.facts["formats"].get(fmt, 0) + linears

    def _read_bias(self, name: str, hf_names: list[str], kind: str, outputs: list[int]) -> dict:
        """{HF name: fp32 bias} of linear ``name`` (empty without one): each rank's piece split and joined as the
        weight's output rows are (``outputs`` per HF name); a row-parallel bias is the same on every rank."""

        biases = self._read(f"{name}.bias", required=False)
        if biases is None:
            return {}
        full = join_biases(name, biases, kind, [n // self.tp for n in outputs] if kind == "qkv" else None)
        if kind not in ("qkv", "row"):
            full = [full[0][:outputs[0]]]  # a padded vocabulary
        for hf_name, b, n in zip(hf_names, full, outputs):
            if tuple(b.shape) != (n,):
                raise IntegrityError(f"{name}: bias of shape {tuple(b.shape)} does not fit {hf_name}'s {n} outputs")
        return dict(zip(hf_names, full))

    def _read_experts(self, name: str, hf_p: str, *, names: list[list[str]], rows: list[int], shape_in: int,
                      kind: str):
        """A stacked expert tensor (``mlp.fc``, kind column, or ``mlp.proj``, kind row): per expert, its fp32
        weights split into ``rows`` (up | gate for fc) and named ``names[expert]`` (relative to the decoder layer
        ``hf_p``); returns ({name: weight}, {name: input transform}). The plan must give every expert one format,
        as the checkpoint does. Under tensor parallelism each rank holds every expert's slice (ModelOpt 0.47
        postprocess.py ``_split_model_config_for_tp``, ExpertConfig): fc's up and gate rows each split on the
        intermediate dim, a rank holding its up rows then its gate rows; proj split on its input (the
        intermediate dim) with its AWQ group scales and pre-quant scale. Each rank is dequantized with its own
        scales, then the pieces are joined."""

        first_read = f"{name}.weight" not in self._consumed
        ws = self._read(f"{name}.weight")
        found = {k: v for k in SCALE_NAMES if (v := self._read(f"{name}.{k}", required=False)) is not None}
        fmt, group = self._layer_format(name)
        is_quant = self._stored_as_configured(name, fmt, ws[0].dtype)
        if self.kept is not None and any((f"{hf_p}.{pair[0]}" in self.kept) == is_quant for pair in names):
            raise IntegrityError(f"{name}: the plan's formats for these experts differ from the checkpoint's "
                                 f"{ws[0].dtype}")
        experts, tp = len(names), self.tp
        if any(w.dim() != 3 or w.shape[0] != experts for w in ws):
            raise IntegrityError(f"{name}: expected {experts} stacked experts on each rank, found shapes "
                                 f"{[tuple(w.shape) for w in ws]}")
        if (kind == "column" and any(n % tp for n in rows)) or (kind == "row" and shape_in % tp):
            raise IntegrityError(f"{name}: the experts' intermediate size does not split over {tp} ranks")
        rank_rows = [n // tp for n in rows] if kind == "column" else rows
        rank_in = shape_in if kind == "column" else shape_in // tp
        weights: dict[str, Any] = {}  # name -> fp32 weight (torch is imported lazily: untyped here)
        transforms: dict[str, Callable] = {}  # name -> its input transform
        for e, expert_names in enumerate(names):
            pieces, owns = [], []
            for r in range(tp):
                own = {k: (v[r][e] if v[r].dim() >= 2 and v[r].shape[0] == experts else v[r]) for k, v in found.items()}
                part = _dequantize(f"{name}[{e}]", fmt, w=ws[r][e], s=own, group_size=group)
                if tuple(part.shape) != (sum(rank_rows), rank_in):
                    raise IntegrityError(f"{name}: expert {e} of shape {tuple(part.shape)} on rank {r} does not fit "
                                         f"{(sum(rank_rows), rank_in)}")
                pieces.append(part.split(rank_rows))
                owns.append(own)
            joined = [_join([piece[i] for piece in pieces], 0 if kind == "column" else 1) for i in range(len(rows))]
            weights.update(zip(expert_names, joined))
            if fmt is not None:
                asf = owns[0].get("activation_scaling_factor")
                prequant = _joined_prequant(f"{name}[{e}]", [o.get("prequant_scaling_factor") for o in owns], kind)
                transform = _fake_act(fmt, None if asf is None else asf.float().reshape(()), prequant)
                transforms.update({n: transform for n in expert_names})
        if first_read:
            self._count(fmt, experts * len(rows))
        return weights, transforms

    def _load_moe(self, p: str, hf_p: str, *, layer, moe, state: dict, transforms: dict) -> None:
        """An MoE layer's router and experts into ``state`` / ``transforms`` (HF names relative to the layer)."""
        import torch

        if f"{p}.mlp.router.weight" not in self._consumed:
            self._count(None, 1)
        routers = self._read(f"{p}.mlp.router.weight")
        if any(not torch.equal(r, routers[0]) for r in routers[1:]):
            raise IntegrityError(f"{p}.mlp.router: the router differs between ranks")
        if _is_quantized(routers[0].dtype) or any(
                self._present(f"{p}.mlp.router.{k}", required=False) for k in SCALE_NAMES):
            raise IntegrityError(f"{p}.mlp.router: the router is quantized; it must stay in high precision")
        state[f"{moe.router}.weight"] = routers[0].float()
        experts = layer.get_submodule(moe.experts)
        gate, up = moe.fused
        inter, hidden = getattr(experts[0], gate).weight.shape
        names = [[f"{moe.experts}.{e}.{up}", f"{moe.experts}.{e}.{gate}"] for e in range(len(experts))]  # up first
        weights, hooks = self._read_experts(f"{p}.mlp.fc", hf_p, names=names, rows=[inter, inter], shape_in=hidden,
                                            kind="column")
        downs = [[f"{moe.experts}.{e}.{moe.down}"] for e in range(len(experts))]
        weights2, hooks2 = self._read_experts(f"{p}.mlp.proj", hf_p, names=downs, rows=[hidden], shape_in=inter,
                                              kind="row")
        state.update({f"{n}.weight": w for n, w in {**weights, **weights2}.items()})
        transforms.update({**hooks, **hooks2})

    def load_layer(self, i: int, layer):
        """Decoder layer ``i`` into ``layer`` (an HF decoder layer, e.g. on the meta device): its parameters are
        replaced by fp32 CPU tensors from the checkpoint, and each quantized linear gets a forward pre-hook
        applying its input transform (pre-quant scale, fake activation quantization). The hooks stay on the
        layer: discard it when done, or pass it to ``load_layer`` again (which first removes the hooks it put
        there). Returns ``layer``."""
        p, hf_p = f"transformer.layers.{i}", f"model.layers.{i}"
        state = {f"{hf}.weight": self._read_replicated(f"{p}.{trt}.weight").float() for trt, hf in NORMS.items()}
        state.update({f"{hf}.weight": self._read_replicated(f"{p}.{trt}.weight").float()
                      for trt, hf in HEAD_NORMS.items()
                      if f"{p}.{trt}.weight" in self._keys[0]})
        transforms: dict[str, Callable] = {}  # HF name -> its input transform
        linears = [("attention.qkv", [f"self_attn.{m}_proj" for m in "qkv"], "qkv")]
        moe = families.FAMILIES[self.hf_config.model_type].moe
        if moe is not None and _has(layer, moe.experts):  # a family may keep some layers dense (mlp_only_layers)
            self._load_moe(p, hf_p, layer=layer, moe=moe, state=state, transforms=transforms)
            linears += [("attention.dense", [HF_OF["attention.dense"]], "row")]
        else:
            linears += [(trt, [hf], "row" if trt in ROW_PARALLEL else "column") for trt, hf in HF_OF.items()]
        for trt, hf_names, kind in linears:
            shapes = [layer.get_submodule(hf).weight.shape for hf in hf_names]
            full, transform, biases = self._read_linear(f"{p}.{trt}", [f"{hf_p}.{hf}" for hf in hf_names], kind,
                                                        shapes)
            state.update({f"{hf}.weight": w for hf, w in zip(hf_names, full)})
            state.update({f"{hf}.bias": biases[f"{hf_p}.{hf}"] for hf in hf_names if f"{hf_p}.{hf}" in biases})
            transforms.update({hf: transform for hf in hf_names if transform is not None})
        for k in ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor"):
            key = f"{p}.attention.{k}"
            first_read = key not in self._consumed
            if self._present(key, required=False) and first_read:
                self.facts["kv_scales"] += 1
        missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise IntegrityError(f"{self.ckpt_dir}: rebuilt model is missing {[f'{hf_p}.{m}' for m in missing[:3]]} "
                                 f"/ has extra {[f'{hf_p}.{u}' for u in unexpected[:3]]}")
        for name, module in layer.named_modules():
            old = self._hooks.pop(module, None)
            if old is not None:
                old.remove()
            if name in transforms:
                self._hooks[module] = _hook_input(module, transforms[name])
        return layer

    def lm_head(self, tied_embedding=None):
        """(fp32 lm_head weight [vocab, hidden], its input transform or None): the checkpoint's lm_head, or the
        embedding (``tied_embedding`` when given, else read again) when the model ties its word embeddings."""
        hf = self.hf_config
        if "lm_head.weight" in self._keys[0]:
            full, transform, bias = self._read_linear("lm_head", ["lm_head"], "vocab",
                                                      [(hf.vocab_size, hf.hidden_size)])
            if bias:
                raise IntegrityError(f"{self.ckpt_dir}: lm_head has a bias; no supported family has one")
            return full[0], transform
        if not getattr(hf, "tie_word_embeddings", False):
            raise IntegrityError(f"{self.ckpt_dir}: rebuilt model is missing ['lm_head.weight'] (no lm_head in the "
                                 f"checkpoint, and the model does not tie its word embeddings)")
        return (self.embedding() if tied_embedding is None else tied_embedding), None

    def finish(self) -> dict:
        """The facts, once every tensor of the checkpoint has been read; an IntegrityError names tensors nothing
        asked for (tensors this reader does not know, or pieces the caller never read)."""
        leftover = sorted(set().union(*self._keys) - self._consumed)
        if leftover:
            raise IntegrityError(f"{self.ckpt_dir}: tensors this reader does not know: {leftover[:4]}")
        return self.facts


def _is_quantized(dtype) -> bool:
    import torch

    return dtype in (torch.int8, torch.float8_e4m3fn)


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _joined_prequant(name: str, pqs: list, kind: str):
    """The ranks' pre-quant scales of one linear as one fp32 vector (None without one): a row-parallel linear's
    are split with its input and joined; a column-parallel one's must be the same on every rank."""
    import torch

    if pqs[0] is None:
        return None
    if kind == "row":
        return torch.cat([p.float() for p in pqs])
    if any(not torch.equal(p, pqs[0]) for p in pqs[1:]):
        raise IntegrityError(f"{name}: column-parallel prequant_scaling_factor differs between ranks")
    return pqs[0].float()


def join_biases(name: str, biases: list, kind: str, split: list[int] | None = None) -> list:
    """The ranks' biases of linear ``name`` (fp32), joined as its output rows are: with ``split`` (each rank's
    widths of a fused linear's parts) one bias per part, else one; a row-parallel bias is the same on every
    rank."""
    import torch

    biases = [b.float() for b in biases]
    if kind == "row":
        if any(not torch.equal(b, biases[0]) for b in biases[1:]):
            raise IntegrityError(f"{name}: the row-parallel bias differs between ranks")
        return [biases[0]]
    pieces = [b.split(split) if split else (b,) for b in biases]
    return [_join([p[i] for p in pieces], 0) for i in range(len(pieces[0]))]


def _join(parts: list, dim: int):
    """The ranks' pieces joined (one rank: its tensor as it is, no copy)."""
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _get(path: Path, key: str):
    """One tensor of a safetensors file, the file closed (unmapped) after."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def _hook_input(module, transform):
    """Registers ``transform`` on the module's input; returns the handle that removes it."""
    return module.register_forward_pre_hook(lambda mod, args: (transform(args[0]),))


def rebuild(ckpt_dir: Path, model_dir: Path, kept: set[str] | None = None, streamed: bool = False):
    """An HF model (fp32) whose linears compute what the checkpoint's quantized GEMMs compute, plus facts: all
    the pieces of a ``CheckpointReader`` put into one model (built on the meta device, so only the checkpoint's
    weights are ever allocated).

    ``streamed``: the decoder layers stay on the meta device and each is read from the checkpoint when a
    forward reaches it, then dropped (``model.streamed_layers``, a ``StreamedLayers``): the model holds the
    embedding, the final norm, lm_head and one decoder layer at a time. Every layer is read once here all
    the same, so a checkpoint that cannot be read fails now, not in the middle of a request.
    ``kept``: the HF names of the layers the plan keeps in high precision (checked when given)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    reader = CheckpointReader(ckpt_dir, model_dir, kept)
    with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) computed for real
        model = AutoModelForCausalLM.from_config(reader.hf_config, dtype=torch.float32,
                                                 attn_implementation=families.attn_implementation(
                                                     reader.hf_config.model_type))
    model.eval()
    embed = reader.embedding()
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": reader.final_norm()}
    for i, layer in enumerate(model.model.layers):
        reader.load_layer(i, layer)
        if streamed:
            StreamedLayers.drop(layer)
    if streamed:
        model.streamed_layers = StreamedLayers(reader.load_layer, model.model.layers)
    state["lm_head.weight"], head_transform = reader.lm_head(tied_embedding=embed)
    facts = reader.finish()
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, t in model.state_dict().items() if t.is_meta and not (streamed and ".layers." in n)]
    if missing or unexpected:
        raise IntegrityError(f"{reader.ckpt_dir}: rebuilt model is missing {missing[:3]} / has extra {unexpected[:3]}")
    if head_transform is not None:
        _hook_input(model.lm_head, head_transform)
    return model, facts


class StreamedLayers:
    """Decoder layers that hold their weights only while a forward runs through them: a pre-hook loads layer
    ``i`` (``load(i, layer)``: here ``CheckpointReader.load_layer``, fp32), a hook after it puts its parameters
    back on the meta device. Host memory: one decoder layer in fp32 besides what the model keeps; time: every
    forward reads the whole model again (from the page cache when it fits there)."""

    def __init__(self, load, layers):
        import functools

        self.load = load
        self.loads = 0  # layers read so far (a figure for the logs and the benchmark)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(functools.partial(self._load, i))
            layer.register_forward_hook(lambda module, args, output: self.drop(module))

    def _load(self, i: int, layer, args) -> None:
        self.load(i, layer)
        self.loads += 1

    @staticmethod
    def drop(layer) -> None:
        """Every parameter of ``layer`` back to the meta device, its fp32 tensors freed and the heap trimmed:
        layer-sized blocks freed below glibc's mmap threshold otherwise stay in the heap, fragmented (measured
        on SmolLM2: +7 MB of RSS per layer read, for good)."""
        import torch

        from pipeline.compute import trim_heap

        for module in layer.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and not p.is_meta:
                    module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                                  requires_grad=False)
        trim_heap()
