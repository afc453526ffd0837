"""The plain reference a served model's greedy tokens are checked against, and the tie check.

The reference is the checkpoint rebuilt by pipeline.quant.checkpoint and decoded one sequence at a time with
transformers' own contiguous cache; with ``kv_cache_quant_algo`` set, the cache fake-quantizes what it stores
(same per-layer scales, same rule as the runtime: a prompt attends to its own unquantized K/V, later steps
to the quantized cache). It shares no code with the runtime's paged pool, batching or scheduling, which is
what a comparison against it tests.

Small models have many near-ties: a top-2 logit gap under 1e-3 is common, and any change in summation order
(a batch of 8 instead of 1) may flip such an argmax. So two greedy runs "agree" when they are equal, or when
at the first token where they differ the reference's logits for the two tokens are within ``tie_bound``:
the divergence is a float-rounding tie, not a wrong cache or position.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline import artifacts

# logits. Measured on SmolLM2 INT8 SmoothQuant + INT8 KV (8 prompts x 24 tokens, batch 8 vs the reference):
# divergences at gaps of 0.003-0.05. Batching changes GEMM summation order by ~1e-6; a per-tensor INT8
# activation that sat on a rounding boundary then moves a whole step, which moves logits by up to ~0.05.
# A wrong cache block or position moves them by whole units.
TIE_BOUND = 0.1
# A model computed in a 16-bit float moves the difference of two logits by a few of that float's eps (bfloat16:
# 2**-7) times their size, whatever the machine: measured on SmolLM2-135M, bfloat16 against float32 on the
# float32 model's greedy tokens (8 prompts x 32 tokens, the top logit against each of the next 7: 882 pairs,
# logits about 26), the difference moved by 0.36 eps x |logit| at the median, 1.86 at the 99th percentile and 3.55
# at most (0.07, 0.47 in logits: TIE_BOUND alone is below bf16's own rounding). So a check of such an engine
# takes a near-tie up to ROUNDING_TIE_EPS eps of the larger logit.
ROUNDING_TIE_EPS = 4.0

LoadedReference = tuple[Any, Optional[str], Optional[list[float]]]  # (model, KV-cache quant algo, per-layer KV scales)


def relative_tie_bound(dtype: str) -> float:
    """The near-tie bound, relative to the larger of the two logits, of an engine computing in ``dtype``."""
    import torch

    return ROUNDING_TIE_EPS * torch.finfo(getattr(torch, dtype)).eps if dtype in ("bfloat16", "float16") else 0.0


@dataclass
class Greedy:
    tokens: list[int]
    logits: list  # one fp32 row per generated token (the reference's scores for that step)


def _fake_quant_cache(config, quant_algo: str, scales: list[float]):
    """A transformers DynamicCache whose stored K/V go through INT8/FP8 quantize-dequantize."""
    from transformers import DynamicCache

    from pipeline.engines.cpu_runtime import KVBlockPool

    # for its encode/decode rule only
    codec = KVBlockPool(len(scales), kv_heads=1, head_dim=1, tokens_per_block=1, num_blocks=1, quant_algo=quant_algo,
                        scales=scales)

    class FakeQuantKVCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            fresh = len(self.layers) <= layer_idx or self.get_seq_length(layer_idx) == 0
            kq = codec.decode(codec.encode(key_states, layer_idx), layer_idx).to(key_states.dtype)
            vq = codec.decode(codec.encode(value_states, layer_idx), layer_idx).to(value_states.dtype)
            keys, values = super().update(kq, vq, layer_idx, cache_kwargs)
            if fresh:  # a prompt attends to its own unquantized K/V (the engine's context phase)
                return key_states, value_states
            return keys, values

    return FakeQuantKVCache(config=config)


def load_reference(bundle_dir: Path) -> LoadedReference:
    """The rebuilt model (its layers streamed when the runtime's would be), its KV-cache quant algo and
    per-layer KV scales, from a cpu bundle."""
    from pipeline.engines.cpu_runtime import bundle_model, kv_cache_algo, kv_cache_scales, read_settings

    bundle = Path(bundle_dir)
    ckpt = bundle / artifacts.CPU_CHECKPOINT_SUBDIR
    model, _, _, _ = bundle_model(bundle, read_settings(bundle))
    algo, scales = kv_cache_algo(ckpt), None
    if algo:
        scales = kv_cache_scales(ckpt, model.config.num_hidden_layers)
    return model.eval(), algo, scales


def greedy(model, prompt_ids: list[int], *, max_new_tokens: int, kv_quant_algo: Optional[str] = None,
           kv_scales: Optional[list[float]] = None, end_id: Optional[int] = None) -> Greedy:
    """Greedy decoding, one token per forward, keeping every step's logits."""
    import torch
    from transformers import DynamicCache

    if not kv_quant_algo:
        cache = DynamicCache(config=model.config)
    elif kv_scales is None:
        raise ValueError(f"kv_quant_algo {kv_quant_algo!r} needs kv_scales, one per layer (load_reference gives both)")
    else:
        cache = _fake_quant_cache(model.config, kv_quant_algo, kv_scales)
    tokens, rows = [], []
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            row = out.logits[0, -1].float()
            token = int(row.argmax())
            tokens.append(token)
            rows.append(row)
            if end_id is not None and token == end_id:
                break
            ids = torch.tensor([[token]])
    return Greedy(tokens, rows)


def compare(got: list[int], ref: Greedy, tie_bound: float = TIE_BOUND, relative: float = 0.0) -> dict:
    """Equal, or diverging first at a near-tie of the reference's logits (then nothing after is compared): a
    margin up to ``tie_bound``, or up to ``relative`` times the larger of the two logits (``relative_tie_bound``)."""
    n = min(len(got), len(ref.tokens))
    first = next((i for i in range(n) if got[i] != ref.tokens[i]), None)
    if first is None:
        same_length = len(got) == len(ref.tokens)
        return {"equal": same_length, "ok": same_length, "diverged_at": None if same_length else n,
                "margin": None}
    row = ref.logits[first]
    margin = float(row[ref.tokens[first]] - row[got[first]])
    bound = max(tie_bound, relative * max(abs(float(row[ref.tokens[first]])), abs(float(row[got[first]]))))
    return {"equal": False, "ok": margin <= bound, "diverged_at": first, "margin": round(margin, 6),
            "tie_bound": round(bound, 6), "reference_token": ref.tokens[first], "got_token": got[first]}
