"""The accuracy gate: perplexity, teacher-forced top-1 agreement and KL(original || quantized) on the evaluation
tokens, the recovery of each lm-eval task configured (pipeline.quant.tasks), the gate's bounds
(quantization.accuracy), and the greedy generations side by side for a person to
read (not gated). The whole-model and the layer-streamed quantize both measure with it."""

from __future__ import annotations

import math

from pipeline import console
from pipeline.config import QuantizationSection
from pipeline.errors import GateFailed
from pipeline.formats import HIGH_PRECISION
from pipeline.quant.tasks import task_failures
from pipeline.records import Plan

EVAL_BATCH = 4


GREEDY_PROMPTS = ("The capital of France is", "A function in Python is defined with", "Once upon a time,")


GREEDY_NEW_TOKENS = 16


class Score:
    """The accuracy gate's figures, accumulated batch by batch from the two models' logits: perplexity of
    both, teacher-forced top-1 agreement and mean KL(original || quantized) per token."""

    def __init__(self) -> None:
        self.nll_o = self.nll_q = self.kl = 0.0
        self.agree = self.count = 0

    def add(self, ids, lo, lq) -> None:
        """ids [B, T]; lo / lq: the logits of the original and the quantized model for them, [B, T, vocab].
        One sequence at a time: the log-softmax temporaries of a whole batch over a large vocabulary would
        outweigh a decoder layer."""
        import torch.nn.functional as F

        for r in range(ids.shape[0]):
            o, q = lo[r, :-1].float(), lq[r, :-1].float().to(lo.device)
            target = ids[r, 1:].to(lo.device)
            logp_o = F.log_softmax(o, dim=-1)
            logp_q = F.log_softmax(q, dim=-1)
            self.nll_o += float(-logp_o.gather(-1, target[..., None]).sum())
            self.nll_q += float(-logp_q.gather(-1, target[..., None]).sum())
            self.kl += float((logp_o.exp() * (logp_o - logp_q)).sum())
            self.agree += int((o.argmax(-1) == q.argmax(-1)).sum())
            self.count += target.numel()

    def result(self) -> dict:
        ppl_o, ppl_q = math.exp(self.nll_o / self.count), math.exp(self.nll_q / self.count)

        def sig(x: float) -> float:  # 6 significant digits: readable, and never rounded to 0 before the gate
            return float(f"{x:.6g}")

        return {"tokens": self.count, "perplexity_original": sig(ppl_o), "perplexity_quantized": sig(ppl_q),
                "perplexity_increase_pct": sig((ppl_q / ppl_o - 1) * 100),
                "top1_agreement": sig(self.agree / self.count), "kl_divergence": sig(self.kl / self.count)}


def accuracy_figures(original, quantized, eval_ids) -> dict:
    """The gate's figures for two whole models, over the evaluation tokens in batches of EVAL_BATCH."""
    import torch

    score = Score()
    with torch.no_grad():
        for b in console.track(range(0, eval_ids.shape[0], EVAL_BATCH), "accuracy gate: evaluation batches"):
            ids = eval_ids[b:b + EVAL_BATCH]
            score.add(ids, original(ids.to(input_device(original))).logits,
                      quantized(ids.to(input_device(quantized))).logits)
    return score.result()


def input_device(model):
    """Where a model's input ids go: its embedding's device (the first GPU of a device map)."""
    return model.get_input_embeddings().weight.device


def greedy_generations(original, quantized, tokenizer) -> list[dict]:
    import torch

    rows = []
    with torch.no_grad():
        for prompt in GREEDY_PROMPTS:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            pad = tokenizer.pad_token_id or tokenizer.eos_token_id
            outs = []
            for m in (original, quantized):
                x = ids.to(input_device(m))
                outs.append(m.generate(x, max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False,
                                       attention_mask=torch.ones_like(x), pad_token_id=pad)[0, ids.shape[1]:])
            o, q = outs
            rows.append({"prompt": prompt, "original": tokenizer.decode(o), "quantized": tokenizer.decode(q)})
    return rows


def gate_failures(acc: dict, quant: QuantizationSection) -> list[str]:
    tol = quant.accuracy
    failed = []
    if acc["perplexity_increase_pct"] > tol.max_perplexity_increase_pct:
        failed.append(f"perplexity +{acc['perplexity_increase_pct']}% > {tol.max_perplexity_increase_pct}%")
    if acc["top1_agreement"] < tol.min_top1_agreement:
        failed.append(f"top-1 agreement {acc['top1_agreement']} < {tol.min_top1_agreement}")
    if acc["kl_divergence"] > tol.max_kl_divergence:
        failed.append(f"KL {acc['kl_divergence']} > {tol.max_kl_divergence}")
    return failed + task_failures(acc.get("tasks", []), tol.min_task_recovery)


def check_gate(acc: dict, quant: QuantizationSection, plan: Plan, table_layers: dict) -> None:
    failed = gate_failures(acc, quant)
    if not failed:
        return
    col = plan.decision_column
    quantized = [(l["errors"].get(col, {}).get("error", 0.0), n) for n, l in table_layers.items()
                 if plan.layers[n].format != HIGH_PRECISION]
    worst = [n for _, n in sorted(quantized, reverse=True)[:5]]
    raise GateFailed(
        f"accuracy gate failed: {'; '.join(failed)} (perplexity {acc['perplexity_original']} -> "
        f"{acc['perplexity_quantized']}, top-1 {acc['top1_agreement']}, KL {acc['kl_divergence']} over "
        f"{acc['tokens']} evaluation tokens). Nothing was exported. Try keeping more layers in high precision "
        f"(lower sensitivity.threshold, or plan rules); the most sensitive layers still quantized: {', '.join(worst)}."
    )


def generations_markdown(rows: list[dict], acc: dict, streamed: bool = False) -> str:
    lines = ["# Greedy generations, original vs quantized (for reading; not gated)", "",
             f"Perplexity {acc['perplexity_original']} -> {acc['perplexity_quantized']} "
             f"(+{acc['perplexity_increase_pct']}%), top-1 agreement {acc['top1_agreement']}, "
             f"KL {acc['kl_divergence']}.", ""]
    if not rows:
        lines += ["Not run (quantization.greedy_generations: false).", ""]
    elif streamed:
        lines += ["Quantized with layer streaming: the quantized side is the written checkpoint read back (as the "
                  "engine gets it), both models streamed a decoder layer at a time.", ""]
    for r in rows:
        lines += [f"**{r['prompt']}**", "", f"- original: {r['original']!r}", f"- quantized: {r['quantized']!r}", ""]
    return "\n".join(lines)
