#!/usr/bin/env python3
"""Benchmark: an FP8 KV cache at its calibrated scales against one at scale 1.0, the scale TensorRT-LLM's pytorch
backend serves with (tests/data/upstream/pytorch_kv_cache_scales.json), on a real model.

On the model and tokens an earlier `invoke download` prepared (the embedded default unless --config names
another), measured in one run, weights left unquantized so that the figures are the KV cache's alone:

  1. the model with an FP8 KV cache at the calibrated per-layer scales (ModelOpt's FP8 KV quantizers, max calibration
     on the calibration tokens: what the quantize stage's gate simulates, and what a TensorRT-LLM engine keeps
     where the scale is over 1);
  2. the same model with every K and V quantizer at scale 1.0 (amax 448);

each against the unquantized model with the gate's figures (perplexity, top-1 agreement, KL divergence), and
each layer's calibrated K and V amax (over 448 means the unit scale cannot hold that layer's cache).

    .venv/bin/invoke download
    .venv/bin/python scripts/bench_kv_scale.py [--config engine_configs/X.yaml] [--work-root build]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ModelOpt's FP8 KV fragment (FP8_KV_CFG: the K/V quantizers in FP8 E4M3, one scale per tensor) on its own, with
# everything else off and max calibration, as the quantize stage adds it to a weight format's preset
KV_ONLY = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                         {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None},
                          "enable": True}],
           "algorithm": "max"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="the pipeline config (default: the embedded default's)")
    ap.add_argument("--work-root", default=str(ROOT / "build"))
    a = ap.parse_args()

    import modelopt.torch.quantization as mtq
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline import artifacts
    from pipeline.config import load_config
    from pipeline.constants import DEFAULT_CONFIG
    from pipeline.quant.gate import EVAL_BATCH, accuracy_figures
    from pipeline.quant.quant_math import FP8_MAX

    loaded = load_config(Path(a.config) if a.config else DEFAULT_CONFIG)
    work = Path(a.work_root) / loaded.name
    model_dir, text = work / "model" / "hf_model", work / "text"
    if not (model_dir / "config.json").is_file() or not (text / artifacts.EVALUATION_TOKENS_FILE).is_file():
        print(f"no model and text under {work}: run `invoke download` (with the same --config) first")
        return 2
    calib = load_file(str(text / artifacts.CALIBRATION_TOKENS_FILE))[artifacts.TOKENS_KEY]
    evals = load_file(str(text / artifacts.EVALUATION_TOKENS_FILE))[artifacts.TOKENS_KEY]
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model = copy.deepcopy(original)

    def forward_loop(m):
        for b in range(0, calib.shape[0], EVAL_BATCH):
            m(calib[b:b + EVAL_BATCH])

    with torch.no_grad():
        mtq.quantize(model, KV_ONLY, forward_loop)
    quantizers = {n: m for n, m in model.named_modules() if n.endswith(("k_bmm_quantizer", "v_bmm_quantizer"))}
    if not quantizers:
        print("ModelOpt inserted no K/V quantizers in this model's attention")
        return 1
    amax = {n: float(q.amax) for n, q in quantizers.items()}
    calibrated = accuracy_figures(original, model, evals)
    for q in quantizers.values():
        q.amax = torch.tensor(FP8_MAX)  # scale = amax / 448 = 1.0
    unit = accuracy_figures(original, model, evals)

    print(f"{loaded.name}: {len(quantizers)} K/V quantizers, {int(calib.numel())} calibration and "
          f"{int(evals.numel())} evaluation tokens; weights unquantized\n")
    print(f"{'layer':>5} {'K amax':>9} {'V amax':>9}")
    for name in sorted((n for n in amax if n.endswith("k_bmm_quantizer")), key=lambda n: int(n.split(".")[2])):
        print(f"{name.split('.')[2]:>5} {amax[name]:>9.2f} {amax[name.replace('k_bmm', 'v_bmm')]:>9.2f}")
    over = [n for n, v in amax.items() if v > FP8_MAX]
    print(f"\nlargest K amax {max(v for n, v in amax.items() if 'k_bmm' in n):.2f}, V amax "
          f"{max(v for n, v in amax.items() if 'v_bmm' in n):.2f}; over {FP8_MAX:.0f}: {len(over)}\n")
    print(f"{'FP8 KV cache':28} {'perplexity':>10} {'increase':>9} {'top-1':>7} {'KL':>8}")
    print(f"{'none (the model as it is)':28} {calibrated['perplexity_original']:>10.4f}")
    for label, acc in (("calibrated scales", calibrated), ("scale 1.0 (pytorch target)", unit)):
        print(f"{label:28} {acc['perplexity_quantized']:>10.4f} {acc['perplexity_increase_pct']:>8.3f}% "
              f"{acc['top1_agreement']:>7.4f} {acc['kl_divergence']:>8.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
