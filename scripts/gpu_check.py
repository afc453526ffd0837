#!/usr/bin/env python3
"""GPU check of the model stages at a real size: sensitivity and quantize (FP8, then INT8 SmoothQuant) of a
random-weight model of Llama-3.1-8B's shape, on one GPU, with no network.

    .venv/bin/python scripts/gpu_check.py [--work DIR] [--layers 32]
    .venv/bin/python scripts/gpu_check.py --device cpu --tiny   # the same flow on a CPU, a tiny model (tests)
    python3 scripts/gpu_check.py --formats fp8 --set compute.layer_streaming=always   # the streamed path on a GPU

Needs a CUDA build of torch and one H100/H200-class GPU (FP8 needs SM 89+); meant to finish in under
8 minutes there. What it does:
1. ``invoke download`` on the embedded default (local files only) for a real tokenizer (SmolLM2's);
2. writes a bf16 Llama with Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP
   14336) and random weights; its vocabulary is the tokenizer's (49152, not Llama 3's 128256);
3. runs ``invoke quantize`` (model, text, sensitivity, plan, quantize) with ``compute.device: cuda``, for FP8
   and then INT8 SmoothQuant, with the accuracy gate opened wide (random weights have no accuracy to keep);
4. prints, per stage and format, the time, the device and dtype it ran with, peak GPU memory and peak host
   RSS from the stage manifests, and one PASS/FAIL line (exit code 0/1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "engine_configs" / "smollm2-135m-cpu.yaml"
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
FORMATS = {"fp8": ["quantization.weight_format=fp8", "quantization.kv_cache=fp8",
                   "sensitivity.formats=[fp8]", "plan.decision_format=fp8"],
           "int8_sq": ["quantization.weight_format=int8_sq", "quantization.kv_cache=int8"]}
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
WIDE_GATE = ["quantization.accuracy.max_perplexity_increase_pct=1000000", "quantization.accuracy.min_top1_agreement=0",
             "quantization.accuracy.max_kl_divergence=1000000"]


def invoke(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"FAIL: invoke {' '.join(args)} exited with {proc.returncode}")
    return time.perf_counter() - t0


def llama_config(tokenizer_dir: Path, layers: int, shape: dict, tie: bool = False):
    """A bf16 Llama config of the given shape with the tokenizer's vocabulary; ``tie``: one tensor for the
    embedding and lm_head (as Llama-3.2-1B/3B)."""
    from transformers import LlamaConfig

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    return LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=tie, torch_dtype="bfloat16",
                       **shape)


def disk_needed(config) -> int:
    """Bytes on disk at the run's peak: the bf16 model, the model stage's copy of it, and one checkpoint (8-bit
    linears; the embedding and lm_head in 16 bits). Counted on the meta device: nothing is allocated."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    edges = model.get_input_embeddings().weight.numel() * (1 if config.tie_word_embeddings else 2)
    return 2 * 2 * total + (total - edges) + 2 * edges


def write_model(config, tokenizer_dir: Path, out: Path, device: str) -> float:
    """A random bf16 Llama of ``config``, made on ``device`` and saved as safetensors shards with the tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template")):
            shutil.copy2(f, out / f.name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def manifest(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "manifest.json").read_text())


def row(fmt: str, stage: str, dev: str | None, dt: str | None, rss: int | None, gpu: int | None,
        sec: float | None) -> str:
    def gib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**30:.1f} GiB"
    return f"{fmt:8} {stage:12} {dev or '-':6} {dt or '-':9} {gib(rss):>10} {gib(gpu):>10} {sec or 0:>7.0f}s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: Llama-3.1-8B's 32; --tiny: 2)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a folder with a tokenizer and its config.json (default: the embedded default's, downloaded)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same family (to test this script)")
    ap.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS), help="the formats to run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="a config override for every quantize run, e.g. compute.layer_streaming=always")
    a = ap.parse_args()
    import torch

    shape, layers = (TINY, a.layers or 2) if a.tiny else (LLAMA_31_8B, a.layers or 32)
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("FAIL: torch sees no GPU (a CPU build of torch, or no GPU here)")
            return 1
        print(f"GPU: {torch.cuda.get_device_name(0)} (SM "
              f"{''.join(map(str, torch.cuda.get_device_capability(0)))}), torch {torch.__version__}")
    root = a.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    try:
        if a.tokenizer:
            tokenizer_dir = a.tokenizer
        else:
            invoke("download", "--config", str(DEFAULT_CONFIG), "--work-root", str(root / "default"))
            tokenizer_dir = root / "default" / DEFAULT_CONFIG.stem / "model" / "hf_model"
        config = llama_config(tokenizer_dir, layers, shape)
        need, free = disk_needed(config), shutil.disk_usage(root).free
        if free < need:
            print(f"FAIL: this run writes about {need / 2**30:.2f} GiB at its peak and {root} has "
                  f"{free / 2**30:.2f} GiB free: pass --work on a larger disk, or fewer --layers")
            return 1
        model_dir = root / "random-llama"
        t_write = write_model(config, tokenizer_dir, model_dir, a.device)
        print(f"wrote a random {layers}-layer Llama (hidden {shape['hidden_size']}) in {t_write:.0f} s")
        # One work root for both formats: the model and text stages (a 16 GB copy and its hashes at 8B) are done
        # once and reused by the second run; sensitivity and quantize run again (their settings differ).
        work_root = root / "work"
        rows, summaries = [], {}
        header = f"{'format':8} {'stage':12} {'device':6} {'dtype':9} {'host RSS':>10} {'GPU peak':>10} {'time':>8}"
        for fmt in a.formats:
            sets = FORMATS[fmt] + a.sets
            args = ["quantize", "--config", str(DEFAULT_CONFIG), "--work-root", str(work_root),
                    "--set", "model.source={kind: local, path: " + str(model_dir) + "}", "--set", "model.dtype=auto",
                    "--set", f"compute.device={a.device}", "--set", "build.dtype=bfloat16"]
            for override in sets + WIDE_GATE:
                args += ["--set", override]
            wall = invoke(*args)
            work = work_root / DEFAULT_CONFIG.stem
            print(f"{fmt}: invoke quantize took {wall:.0f} s\n{header}")
            for stage in ("sensitivity", "quantize"):
                s = manifest(work, stage)["summary"]
                summaries[f"{fmt}/{stage}"] = s
                c = s.get("compute") or {}
                rows.append((fmt, stage, c.get("device"), c.get("dtype"), s.get("peak_rss_bytes"),
                             c.get("peak_gpu_bytes"), s.get("analysis_s") or (s.get("timing_s") or {}).get("total")))
                print(row(*rows[-1]), flush=True)
            print(f"{fmt}: quantize streamed layer by layer: {s.get('layer_streaming')}")
            # every stage summary (timings, peaks, accuracy) for whoever reads the run afterwards
            (root / "summary.json").write_text(json.dumps(summaries, indent=1, default=str))
            # the next format's checkpoint is written beside this one before this one is replaced: at 8B that is
            # 16 GB of model, its 16 GB copy and two 8 GB checkpoints; dropping this one keeps the peak lower
            for stage in ("sensitivity", "quantize"):
                shutil.copy2(work / stage / "stage.log", root / f"{fmt}-{stage}.log")
            shutil.rmtree(work / "quantize")
        print(f"\n{header}")
        for r in rows:
            print(row(*r))
        total = time.perf_counter() - t_all
        ok = all(dev == a.device for _, _, dev, *_ in rows)
        what = "a tiny Llama" if a.tiny else "a Llama-3.1-8B-shape model"
        print(f"\n{'PASS' if ok else 'FAIL'}: sensitivity and quantize ({', '.join(a.formats)}) of {what} "
              f"on {a.device} in {total:.0f} s")
        return 0 if ok else 1
    finally:
        if a.work is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
