"""Read a TensorRT-LLM checkpoint back into a float HF model that computes what the engine will compute.

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
  mlp.gate -> up_proj, mlp.proj -> down_proj, vocab_embedding, ln_f, input/post_layernorm, lm_head.
It checks what it reads: layers the plan keeps in high precision must be unquantized, quantized ones must
carry the scales their format needs with consistent shapes and dtypes, the stored dtype must agree with the
format the config names, and shapes must match the model; a violation is an IntegrityError naming the layer.
The KV-cache scales are read and reported; the rebuilt model does not quantize its KV cache (the CPU runtime
of the build stage does), so its perplexity leaves that part out.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from pipeline import artifacts
from pipeline.errors import IntegrityError
from pipeline.formats import FORMAT_OF_ALGO

HF_OF = {"attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj",
         "mlp.proj": "mlp.down_proj"}
NORMS = {"input_layernorm": "input_layernorm", "post_layernorm": "post_attention_layernorm"}
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
            x = x * prequant
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


def _dequantize(name: str, algo: str | None, w, s: dict, group_size: int | None):
    """One rank's weight as float32, from its codes and its scales; checks the scales' shapes."""
    import torch

    from pipeline.quant import quant_math as qm

    if algo is None:
        return w.float()
    missing = [k for k in FORMAT_OF_ALGO[algo].checkpoint_scales if s.get(k) is None]
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
        wf = codes.float() * wsf.repeat_interleave(group_size, dim=1)
        if algo == "W4A8_AWQ":  # the kernel casts the INT4 values to FP8 with a per-tensor scale
            wf = qm.fp8_fake_quant(wf, s["weights_scaling_factor_2"].float().reshape(()) * 448.0)
    elif algo == "FP8":
        if w.dtype != torch.float8_e4m3fn:
            raise IntegrityError(f"{name}: FP8 weight stored as {w.dtype}")
        if wsf.numel() != 1:
            raise IntegrityError(f"{name}: FP8 weights_scaling_factor must be one value, found {tuple(wsf.shape)}")
        wf = w.float() * wsf.reshape(())
    else:
        if w.dtype != torch.int8:
            raise IntegrityError(f"{name}: {algo} weight stored as {w.dtype}")
        if wsf.numel() != 1 and tuple(wsf.shape) != (w.shape[0],):
            raise IntegrityError(f"{name}: per-channel weights_scaling_factor of shape {tuple(wsf.shape)} does not "
                                 f"fit {w.shape[0]} output channels")
        wf = w.float() * (wsf[:, None] if wsf.numel() > 1 else wsf.reshape(()))
    pqs = s.get("prequant_scaling_factor")
    if pqs is not None and tuple(pqs.shape) != (wf.shape[1],):
        raise IntegrityError(f"{name}: prequant_scaling_factor of shape {tuple(pqs.shape)} does not fit an input "
                             f"width of {wf.shape[1]}")
    return wf


def _layer_formats(ckpt_dir: Path, qcfg: dict):
    """A function trtllm module name -> (quant_algo or None, group size), from config.json / quant_cfg.json."""
    algo = qcfg.get("quant_algo")
    if algo == "MIXED_PRECISION":
        path = ckpt_dir / artifacts.QUANT_CFG_FILE
        if not path.is_file():
            raise IntegrityError(f"{ckpt_dir}: quant_algo MIXED_PRECISION without {artifacts.QUANT_CFG_FILE}")
        layers = json.loads(path.read_text()).get("quantized_layers") or {}
        for name, entry in layers.items():
            if entry.get("quant_algo") not in READABLE_ALGOS:
                raise IntegrityError(f"{name}: quant_algo {entry.get('quant_algo')} in {artifacts.QUANT_CFG_FILE} cannot be "
                                     f"read back (readable: {', '.join(READABLE_ALGOS)})")

        def fmt(module: str):
            for pattern, entry in layers.items():
                if module == pattern or fnmatch.fnmatchcase(module, pattern):
                    return entry["quant_algo"], entry.get("group_size")
            return None, None

        return fmt
    if algo is not None and algo not in READABLE_ALGOS:
        raise IntegrityError(f"{ckpt_dir}: quant_algo {algo} cannot be read back "
                             f"(readable: {', '.join(READABLE_ALGOS)}, MIXED_PRECISION)")
    excluded = qcfg.get("exclude_modules") or []

    def fmt(module: str):
        if algo is None or any(fnmatch.fnmatchcase(module, p) for p in excluded):
            return None, None
        return algo, qcfg.get("group_size")

    return fmt


def rebuild(ckpt_dir: Path, model_dir: Path, kept: set[str] | None = None):  # noqa: C901 - to split (see README)
    """An HF model (fp32) whose linears compute what the checkpoint's quantized GEMMs compute, plus facts.

    ``kept``: the HF names of the layers the plan keeps in high precision (checked when given)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt_dir = Path(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    qcfg = cfg.get("quantization") or {}
    algo = qcfg.get("quant_algo")
    layer_format = _layer_formats(ckpt_dir, qcfg)
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
    hf_config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa").eval()
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp or kv % tp:
        raise IntegrityError(f"{ckpt_dir}: tp_size {tp} does not divide the model's {heads} heads / {kv} KV heads")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    vocab = hf_config.vocab_size

    ranks = []
    for path in rank_files:
        with safe_open(str(path), framework="pt") as f:
            ranks.append({k: f.get_tensor(k) for k in f.keys()})
    modules = dict(model.named_modules())

    def pop_all(key: str, required: bool = True):
        found = [t.pop(key, None) for t in ranks]
        if required and any(x is None for x in found):
            rank = [i for i, x in enumerate(found) if x is None][0]
            raise IntegrityError(f"{ckpt_dir}: {key} missing from rank {rank}")
        return None if all(x is None for x in found) else found

    state = {}
    embed = pop_all("transformer.vocab_embedding.weight")
    if tp > 1 and cfg.get("use_parallel_embedding"):  # split on the (padded) vocabulary, or on the hidden dim
        embed = [torch.cat([e.float() for e in embed], dim=cfg.get("embedding_sharding_dim", 0))]
    state["model.embed_tokens.weight"] = embed[0].float()[:vocab]
    state["model.norm.weight"] = pop_all("transformer.ln_f.weight")[0].float()
    quantized: dict[str, object] = {}  # hf linear name -> input transform
    facts = {"quant_algo": algo, "kv_cache_quant_algo": qcfg.get("kv_cache_quant_algo"), "kv_scales": 0,
             "quantized_linears": 0, "high_precision_linears": 0, "tp_size": tp, "formats": {}}

    def read_linear(name: str, hf_names: list[str], kind: str) -> None:
        """kind: qkv | column | row. Dequantizes each rank, joins them, checks against the plan and the model."""
        weights = pop_all(f"{name}.weight")
        scales = [{k: t.pop(f"{name}.{k}", None) for k in SCALE_NAMES} for t in ranks]
        fmt, group = layer_format(name)
        is_quant = weights[0].dtype in (torch.int8, torch.float8_e4m3fn)
        if (fmt is not None) != is_quant:
            raise IntegrityError(f"{name}: the checkpoint's config says {fmt or 'unquantized'} but the weight is "
                                 f"stored as {weights[0].dtype}")
        if kept is not None and (hf_names[0] in kept) == is_quant:
            raise IntegrityError(f"{name}: the plan {'keeps' if hf_names[0] in kept else 'quantizes'} "
                                 f"{hf_names[0]} but the checkpoint stores it as {weights[0].dtype}")
        if fmt is None and any(v is not None for s in scales for v in s.values()):
            raise IntegrityError(f"{name}: unquantized weight with quantization scales beside it")
        parts = [_dequantize(name, fmt, w, s, group) for w, s in zip(weights, scales)]
        if kind == "qkv":
            q, k_, v = heads // tp * head_dim, kv // tp * head_dim, kv // tp * head_dim
            if any(p.shape[0] != q + 2 * k_ for p in parts):
                raise IntegrityError(f"{name}: per-rank fused q/k/v of {parts[0].shape[0]} rows, expected {q + 2 * k_} "
                                     f"({heads} heads, {kv} KV heads, head size {head_dim}, tp {tp})")
            split = [p.split([q, k_, v]) for p in parts]
            full = [torch.cat([s[i] for s in split]) for i in range(3)]
        elif kind == "row":
            full = [torch.cat(parts, dim=1)]
        else:
            full = [torch.cat(parts, dim=0)]
            if hf_names == ["lm_head"]:
                full = [full[0][:vocab]]
        for hf, part in zip(hf_names, full):
            if tuple(part.shape) != tuple(modules[hf].weight.shape):
                raise IntegrityError(f"{name}: shape {tuple(part.shape)} does not fit {hf} "
                                     f"{tuple(modules[hf].weight.shape)}")
            state[f"{hf}.weight"] = part
        if fmt is None:
            facts["high_precision_linears"] += len(hf_names)
            return
        facts["quantized_linears"] += len(hf_names)
        facts["formats"][fmt] = facts["formats"].get(fmt, 0) + len(hf_names)
        pqs = [s["prequant_scaling_factor"] for s in scales]
        if pqs[0] is None:
            prequant = None
        elif kind == "row":
            prequant = torch.cat([p.float() for p in pqs])
        else:
            if any(not torch.equal(p, pqs[0]) for p in pqs[1:]):
                raise IntegrityError(f"{name}: column-parallel prequant_scaling_factor differs between ranks")
            prequant = pqs[0].float()
        asf = scales[0]["activation_scaling_factor"]
        transform = _fake_act(fmt, None if asf is None else asf.float().reshape(()), prequant)
        for hf in hf_names:
            quantized[hf] = transform

    for i in range(hf_config.num_hidden_layers):
        p = f"transformer.layers.{i}"
        for trt, hf in NORMS.items():
            state[f"model.layers.{i}.{hf}.weight"] = pop_all(f"{p}.{trt}.weight")[0].float()
        read_linear(f"{p}.attention.qkv", [f"model.layers.{i}.self_attn.{m}_proj" for m in "qkv"], "qkv")
        for trt_mod, hf in HF_OF.items():
            read_linear(f"{p}.{trt_mod}", [f"model.layers.{i}.{hf}"], "row" if trt_mod in ROW_PARALLEL else "column")
        for k in ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor"):
            if pop_all(f"{p}.attention.{k}", required=False) is not None:
                facts["kv_scales"] += 1
    if "lm_head.weight" in ranks[0]:
        read_linear("lm_head", ["lm_head"], "column")
    leftover = sorted({k for t in ranks for k in t})
    if leftover:
        raise IntegrityError(f"{ckpt_dir}: tensors this reader does not know: {leftover[:4]}")
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise IntegrityError(f"{ckpt_dir}: rebuilt model is missing {missing[:3]} / has extra {unexpected[:3]}")
    for hf, transform in quantized.items():
        modules[hf].register_forward_pre_hook(lambda mod, args, _t=transform: (_t(args[0]),))
    return model, facts
