"""Tiny random-weight models of the supported families, each built from the family's real config shape (no
network), and the helpers that save one as a local model folder and add plan rules to a tiny config. Shared by
the family tests of several stages."""

from __future__ import annotations

import shutil
from pathlib import Path


def qwen2(kv_heads: int = 2):
    """Qwen2.5-0.5B's shape, scaled down: q/k/v biases, tied word embeddings, GQA (``kv_heads`` < 4)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=kv_heads,
                                         max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True))
    for layer in model.model.layers:  # random init leaves biases at 0: give them weight, as trained ones have
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data.normal_(0.0, 0.5)
    return model


def qwen3():
    """Qwen3-0.6B's shape, scaled down: per-head q/k RMSNorms, a head size that is not hidden / heads, tied
    word embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                         tie_word_embeddings=True))
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.data.normal_(1.0, 0.2)
        layer.self_attn.k_norm.weight.data.normal_(1.0, 0.2)
    return model


def mistral():
    """Mistral-7B-v0.1's shape, scaled down: Llama's layers with GQA and a sliding window on every layer (4096
    tokens there, 8 here, so that calibration samples and served sequences outrun it)."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                            sliding_window=8, bos_token_id=1, eos_token_id=2))


def mixtral(experts: int = 4, intermediate: int = 96, hidden: int = 64):
    """Mixtral-8x7B's shape, scaled down: a router and ``experts`` gated-MLP experts per layer, top-2 routing
    (4 query heads of ``hidden`` / 4)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
                                            num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                            num_local_experts=experts, num_experts_per_tok=2, bos_token_id=1,
                                            eos_token_id=2))


def qwen3_moe():
    """Qwen3-30B-A3B's shape, scaled down: Qwen3's attention (q/k norms, head size 32) with a router and 8
    experts per layer, top-2 routing with the top-k weights renormalised; the second layer dense
    (mlp_only_layers), as the config allows."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False))
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.data.normal_(1.0, 0.2)
        layer.self_attn.k_norm.weight.data.normal_(1.0, 0.2)
    return model


def phi3(hidden: int = 64):
    """Phi-3-mini's shape, scaled down: q/k/v as one linear (qkv_proj), gate/up as one (gate_up_proj), GQA."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(vocab_size=512, hidden_size=hidden, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False))


def gemma3():
    """Gemma-3-1B's shape, scaled down: (1 + w) norms around attention and the MLP, embeddings scaled by
    sqrt(hidden), q/k norms, a head size that is not hidden / heads, tied embeddings, one sliding-window layer
    (its own rotary base) and one global one. The window (512 tokens in Gemma-3-1B) is 8 here, so that
    calibration samples and served sequences outrun it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True))
    weigh_unit_offset_norms(model)
    return model


def weigh_unit_offset_norms(model) -> None:
    """(1 + w) norms start at w = 0: give them weight, as trained ones have."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.normal_(0.0, 0.3)


def gemma2():
    """Gemma-2-2B's shape, scaled down: (1 + w) norms around attention and the MLP, scaled embeddings, alternating
    sliding-window (8 tokens here) and global layers, tied embeddings, and both soft-caps, tighter than Gemma 2's
    own (50 and 30) so that on these random weights they bind: the attention scores at 2, the logits at 3."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True))
    weigh_unit_offset_norms(model)
    for layer in model.model.layers:  # attention scores wide enough for the cap to bind (initialised, they are not)
        layer.self_attn.q_proj.weight.data *= 8.0
        layer.self_attn.k_proj.weight.data *= 8.0
    return model


def deepseek_v2(experts: int = 8, full: bool = False, cpu_mla: bool = False):
    """DeepSeek-V2-Lite's shape (deepseek-ai/DeepSeek-V2-Lite config.json), scaled down: multi-head latent
    attention with no q compression (q_lora_rank null; a KV latent of 32, each head's key 16 + 8 rotary wide and
    its value 16), the first layer dense (first_k_dense_replace 1), then 8 routed experts, greedy top-2 of the
    softmax scores unrenormalised (norm_topk_prob false) and 2 shared experts; untied lm_head. Router weights are
    drawn wider than the initializer's so the routing is not a near-tie everywhere. ``full``: DeepSeek-V2's own
    differences, q compressed too (q_a_proj, q_a_layernorm, q_b_proj) and group-limited routing (the top-2
    chosen within the best 2 of 4 expert groups). ``cpu_mla``: the latent KV of DeepSeek-V2 itself (kv_lora_rank 512,
    each head's key 64 + 64 rotary wide, its value 64; hidden 128), which vLLM's CPU multi-head latent attention
    needs (576 wide only)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(DeepseekV2Config(
        vocab_size=512, hidden_size=128 if cpu_mla else 64, intermediate_size=160, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48 if full else None,
        kv_lora_rank=512 if cpu_mla else 32, qk_nope_head_dim=64 if cpu_mla else 16,
        qk_rope_head_dim=64 if cpu_mla else 8, v_head_dim=64 if cpu_mla else 16, n_routed_experts=experts,
        n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
        topk_method="group_limited_greedy" if full else "greedy", n_group=4 if full else 1,
        topk_group=2 if full else 1, norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax",
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
    model.model.layers[1].mlp.gate.weight.data.normal_(0.0, 0.5)
    return model


MAKERS = {"qwen2": qwen2, "qwen3": qwen3, "mistral": mistral, "mixtral": mixtral, "qwen3_moe": qwen3_moe,
          "phi3": phi3, "gemma3_text": gemma3, "gemma2": gemma2, "deepseek_v2": deepseek_v2}
# the HF unified checkpoint and a KV cache it takes, set explicitly (what pipeline/autoconfig.py chooses for the
# families exported that way when a config leaves them unset)
HF_ONLY_QUANTIZATION = "quantization: {export_hf_checkpoint: true, kv_cache: fp8}"


def saved(model, path: Path, tokenizer_dir: Path) -> Path:
    """The model saved with the tiny tokenizer beside it: a local model folder."""
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, path / f.name)
    return path


def with_rules(cfg: Path, *rules: str) -> Path:
    """The tiny config with plan rules added after its lm_head one."""
    text = cfg.read_text().replace("rules: [{pattern: lm_head, keep_high_precision: true}]",
                                   "rules: [{pattern: lm_head, keep_high_precision: true}, " + ", ".join(rules) + "]")
    cfg.write_text(text)
    return cfg
