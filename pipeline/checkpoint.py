"""Read a TensorRT-LLM checkpoint back into a float HF model that computes what the engine will compute.

Own code, read from the files ModelOpt writes (checked on exports of SmolLM2 and a tiny Llama):
- INT8 weights (I8) with per-output-channel ``weights_scaling_factor`` (= amax / 127): W = I8 * scale;
- FP8 weights (F8_E4M3) with a per-tensor ``weights_scaling_factor``: W = fp8 * scale;
- activations: per-tensor ``activation_scaling_factor`` (= amax / 127 for INT8, amax / 448 for FP8), after
  the SmoothQuant ``prequant_scaling_factor`` (the input is multiplied by it; the weight already holds 1/s);
- names: attention.qkv (fused, split back into q/k/v), attention.dense -> o_proj, mlp.fc -> gate_proj,
  mlp.gate -> up_proj, mlp.proj -> down_proj, vocab_embedding, ln_f, input/post_layernorm, lm_head.
It checks what it reads: layers the plan keeps in high precision must be unquantized, quantized ones must
carry the scales their format needs, and shapes must match the model; a violation names the layer.
The KV-cache scales are read and reported; the rebuilt model does not quantize its KV cache (the CPU runtime
of the build stage does), so its perplexity leaves that part out.
Not covered yet: INT4 (AWQ) packed weights and MIXED_PRECISION quant_cfg.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import IntegrityError

HF_OF = {"attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj",
         "mlp.proj": "mlp.down_proj"}
NORMS = {"input_layernorm": "input_layernorm", "post_layernorm": "post_attention_layernorm"}


def _fake_act(quant_algo: str, act_scale, prequant):
    """The input transform of a quantized linear: smoothing, then per-tensor INT8 or FP8 fake quantization."""
    import torch

    from . import quant_math as qm

    def f(x):
        if prequant is not None:
            x = x * prequant
        if act_scale is None:
            return x
        if quant_algo.startswith("W8A8"):
            return qm.int_fake_quant(x, act_scale * 127.0)
        if quant_algo == "FP8":
            return qm.fp8_fake_quant(x, act_scale * 448.0)
        return x

    return f


def rebuild(ckpt_dir: Path, model_dir: Path, kept: set[str] | None = None):
    """An HF model (fp32) whose linears compute what the checkpoint's quantized GEMMs compute, plus facts."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    qcfg = cfg.get("quantization", {})
    algo = qcfg.get("quant_algo")
    if algo not in (None, "W8A8_SQ_PER_CHANNEL", "W8A16", "FP8"):
        raise IntegrityError(f"{ckpt_dir}: quant_algo {algo} cannot be read back yet (INT8/FP8 only)")
    if cfg["mapping"]["world_size"] != 1:
        raise IntegrityError(f"{ckpt_dir}: reading tensor-parallel checkpoints back is not built yet")
    hf_config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa").eval()
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads

    with safe_open(str(ckpt_dir / "rank0.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    modules = dict(model.named_modules())
    state = {}
    state["model.embed_tokens.weight"] = t.pop("transformer.vocab_embedding.weight").float()
    state["model.norm.weight"] = t.pop("transformer.ln_f.weight").float()
    if "lm_head.weight" in t:
        state["lm_head.weight"] = t.pop("lm_head.weight").float()
    quantized: dict[str, tuple] = {}  # hf linear name -> (input transform)
    facts = {"quant_algo": algo, "kv_cache_quant_algo": qcfg.get("kv_cache_quant_algo"), "kv_scales": 0,
             "quantized_linears": 0, "high_precision_linears": 0}
    for i in range(hf_config.num_hidden_layers):
        p = f"transformer.layers.{i}"
        for trt, hf in NORMS.items():
            state[f"model.layers.{i}.{hf}.weight"] = t.pop(f"{p}.{trt}.weight").float()
        for trt_mod in ("attention.qkv", *HF_OF):
            name = f"{p}.{trt_mod}"
            w = t.pop(f"{name}.weight")
            wsf = t.pop(f"{name}.weights_scaling_factor", None)
            asf = t.pop(f"{name}.activation_scaling_factor", None)
            pqs = t.pop(f"{name}.prequant_scaling_factor", None)
            hf_names = ([f"model.layers.{i}.self_attn.{m}_proj" for m in "qkv"] if trt_mod == "attention.qkv"
                        else [f"model.layers.{i}.{HF_OF[trt_mod]}"])
            is_quant = w.dtype in (torch.int8, torch.float8_e4m3fn)
            if kept is not None and (hf_names[0] in kept) == is_quant:
                raise IntegrityError(f"{name}: the plan {'keeps' if hf_names[0] in kept else 'quantizes'} "
                                     f"{hf_names[0]} but the checkpoint stores it as {w.dtype}")
            if is_quant:
                if wsf is None:
                    raise IntegrityError(f"{name}: quantized weight without weights_scaling_factor")
                if algo in ("W8A8_SQ_PER_CHANNEL", "FP8") and asf is None:
                    raise IntegrityError(f"{name}: {algo} weight without activation_scaling_factor")
                wf = w.float() * (wsf.float()[:, None] if wsf.numel() > 1 else wsf.float())
                facts["quantized_linears"] += len(hf_names)
            else:
                wf = w.float()
                facts["high_precision_linears"] += len(hf_names)
            parts = wf.split([heads * head_dim, kv * head_dim, kv * head_dim]) if trt_mod == "attention.qkv" else [wf]
            for hf, part in zip(hf_names, parts):
                if tuple(part.shape) != tuple(modules[hf].weight.shape):
                    raise IntegrityError(f"{name}: shape {tuple(part.shape)} does not fit {hf} "
                                         f"{tuple(modules[hf].weight.shape)}")
                state[f"{hf}.weight"] = part
                if is_quant:
                    quantized[hf] = _fake_act(algo, None if asf is None else asf.float(),
                                              None if pqs is None else pqs.float())
        for k in ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor"):
            if t.pop(f"{p}.attention.{k}", None) is not None:
                facts["kv_scales"] += 1
    leftover = sorted(t)
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
