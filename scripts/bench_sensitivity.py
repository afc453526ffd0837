#!/usr/bin/env python3
"""Benchmark: the sensitivity analysis vs one plain forward pass, and vs ModelOpt's AutoQuantize.

Measured side by side in one run, each in a fresh process (so peak RSS is that work's own), on the
model and calibration tokens an earlier `invoke download` prepared:

  1. a plain fp32 forward over the calibration set with transformers (batches of 4, logits included);
  2. the sensitivity analysis (pipeline.quant.sensitivity.analyse) with the config's formats;
  3. ModelOpt's mtq.auto_quantize (gradient scores) on the same tokens, INT8 SmoothQuant vs high precision.

Prints time and peak RSS for each, and the ratios the sensitivity issue sets targets for: analysis time /
forward time (target <= 2) and analysis peak RSS / fp32 weight bytes (target <= 0.5), the latter both for
the whole process and above the process's RSS once torch and transformers are imported.

    .venv/bin/python scripts/bench_sensitivity.py [--config engine_configs/X.yaml] [--work-root build]
        [--skip-autoquant] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _imports():
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    torch.set_num_threads(torch.get_num_threads())
    return torch


def job_forward(model_dir: str, calib: str, conn) -> None:
    torch = _imports()
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    ids = torch.as_tensor(load_file(calib)["input_ids"])
    base = _rss_now()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    t1 = time.perf_counter()
    with torch.no_grad():
        for b in range(0, ids.shape[0], 4):
            model(ids[b:b + 4])
    t2 = time.perf_counter()
    conn.send({"load_s": t1 - t0, "compute_s": t2 - t1, "peak_rss": _peak(), "base_rss": base})


def job_sensitivity(model_dir: str, calib: str, config: str, conn) -> None:
    _imports()
    from safetensors.numpy import load_file

    from pipeline.config import load_config
    from pipeline.quant.sensitivity import (
        _return_freed_memory_to_the_os,
        analyse,
        fusion_groups_for,
    )

    cfg = load_config(config).config
    ids = load_file(calib)["input_ids"]
    _return_freed_memory_to_the_os()  # as the stage does
    base = _rss_now()
    t0 = time.perf_counter()
    table = analyse(Path(model_dir), ids, section=cfg.sensitivity, quant=cfg.quantization,
                    fusion_groups=fusion_groups_for(cfg.build.target))
    conn.send({"compute_s": time.perf_counter() - t0, "peak_rss": _peak(), "base_rss": base,
               "over_threshold": {f: sum(l["errors"][f]["error"] > cfg.sensitivity.threshold for l in table["layers"])
                                  for f in cfg.sensitivity.formats}})


def job_autoquant(model_dir: str, calib: str, effective_bits: float, conn) -> None:
    torch = _imports()
    import modelopt.torch.quantization as mtq
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    ids = torch.as_tensor(load_file(calib)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batches = [{"input_ids": ids[b:b + 4], "labels": ids[b:b + 4]} for b in range(0, ids.shape[0], 4)]
    base = _rss_now()
    t0 = time.perf_counter()
    _, state = mtq.auto_quantize(
        model, constraints={"effective_bits": effective_bits}, quantization_formats=[mtq.INT8_SMOOTHQUANT_CFG],
        data_loader=batches, forward_step=lambda m, b: m(**b), loss_func=lambda out, b: out.loss,
        num_calib_steps=len(batches), num_score_steps=len(batches), verbose=False)
    conn.send({"compute_s": time.perf_counter() - t0, "peak_rss": _peak(), "base_rss": base,
               "effective_bits": effective_bits})


def run(target, *args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, send))
    p.start()
    send.close()
    try:
        out = recv.recv()
    except EOFError:
        out = {"error": f"child exited with {p.exitcode}"}
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "engine_configs" / "smollm2-135m-cpu.yaml"))
    ap.add_argument("--work-root", default=str(ROOT / "build"))
    ap.add_argument("--repeats", type=int, default=2, help="alternating forward/analysis pairs (default 2)")
    ap.add_argument("--skip-autoquant", action="store_true")
    args = ap.parse_args()

    from pipeline.config import load_config

    loaded = load_config(args.config)
    work = Path(args.work_root) / loaded.name
    model_dir = work / "model" / "hf_model"
    calib = work / "text" / "calibration_tokens.safetensors"
    if not calib.is_file():
        sys.exit(f"run `invoke download --config {args.config}` first ({calib} is missing)")
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    fwd, sens = [], []
    for _ in range(args.repeats):  # alternate, so machine noise hits both alike
        fwd.append(run(job_forward, str(model_dir), str(calib)))
        sens.append(run(job_sensitivity, str(model_dir), str(calib), args.config))
    aq = None if args.skip_autoquant else run(job_autoquant, str(model_dir), str(calib), 10.0)

    f_t = statistics.median(r["compute_s"] for r in fwd)
    f_load = statistics.median(r["load_s"] for r in fwd)
    s_t = statistics.median(r["compute_s"] for r in sens)
    s_peak = max(r["peak_rss"] for r in sens)
    s_base = min(r["base_rss"] for r in sens)
    f_peak = max(r["peak_rss"] for r in fwd)
    result = {
        "config": loaded.name,
        "calibration_tokens": str(calib.name),
        "fp32_weight_bytes": weights,
        "forward": {"compute_s": round(f_t, 2), "load_s": round(f_load, 2), "peak_rss_mb": round(f_peak / 1e6)},
        "sensitivity": {"compute_s": round(s_t, 2), "peak_rss_mb": round(s_peak / 1e6),
                        "rss_after_imports_mb": round(s_base / 1e6), "over_threshold": sens[0]["over_threshold"]},
        "ratios": {
            "sensitivity_time / forward_time": round(s_t / f_t, 2),
            "sensitivity_time / (forward_load + forward_time)": round(s_t / (f_t + f_load), 2),
            "sensitivity_peak_rss / fp32_weights (whole process)": round(s_peak / weights, 2),
            "sensitivity_peak_rss_above_imports / fp32_weights": round((s_peak - s_base) / weights, 2),
            "forward_peak_rss / fp32_weights (whole process)": round(f_peak / weights, 2),
        },
        "runs": {"forward_s": [round(r["compute_s"], 2) for r in fwd],
                 "sensitivity_s": [round(r["compute_s"], 2) for r in sens]},
    }
    if aq is not None:
        result["autoquantize"] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in aq.items()}
        if "compute_s" in aq:
            result["ratios"]["autoquantize_time / sensitivity_time"] = round(aq["compute_s"] / s_t, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
