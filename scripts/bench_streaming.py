#!/usr/bin/env python3
"""Layer-streamed quantize, measured: memory and time of the model stages, in memory and streamed.

    .venv/bin/python scripts/bench_streaming.py                      # SmolLM2, side by side (about 10 min)
    .venv/bin/python scripts/bench_streaming.py --large --bound 2.5GiB   # a random 2B Llama in a memory cgroup

Default: ``invoke quantize`` on the embedded default (SmolLM2-135M; it fits, so quantize runs in memory),
then the same quantize stage again with layer streaming, in a child process measured the same way
(pipeline.child: peak RSS = VmHWM). Prints, per model stage, the time, the peak RSS and its ratio to the
model's fp32 weight bytes, the streamed / in-memory time ratio, and whether the two checkpoints are
bit-equal (every tensor of every rank file, config.json, quant_cfg.json).

``--large``: writes a random-weight bf16 Llama (hidden 2048, MLP 8192, 32 heads / 8 KV heads, SmolLM2's
tokenizer and vocabulary, tied embeddings as Llama-3.2-1B's; 2.05B parameters, 8.2 GB in fp32) and runs ``invoke quantize`` on it (model, text,
sensitivity, plan, quantize) inside a new memory cgroup of ``--bound`` bytes (needs root and the cgroup v1
memory controller or cgroup v2): the stages find that limit themselves (compute: the cgroup's limit less the
10 % margin), and quantize streams because three fp32 copies do not fit. A smaller calibration set keeps it
to minutes on two cores (8 x 128 tokens; the memory measured is the weights' and one layer's, not the
set's). Prints each stage's peak RSS, its bound and the fp32 weights / bound ratio; exits 1 if a stage failed
or went over its bound.
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
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEFAULT_CONFIG = REPO / "engine_configs" / "smollm2-135m-cpu.yaml"
NAME = "smollm2-135m-cpu"
LARGE_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096)
LARGE_LAYERS = 32
SMALL_TEXT = ["text.calibration.num_samples=8", "text.calibration.seq_len=128", "text.evaluation.num_samples=4",
              "text.evaluation.seq_len=128"]
WIDE_GATE = ["quantization.accuracy.max_perplexity_increase_pct=1000000", "quantization.accuracy.min_top1_agreement=0",
             "quantization.accuracy.max_kl_divergence=1000000"]  # random weights have no accuracy to keep


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def invoke(*args: str, cgroup_procs: Path | None = None) -> float:
    def join():  # the child (invoke, and every stage child under it) runs inside the cgroup
        if cgroup_procs is not None:
            cgroup_procs.write_text(str(os.getpid()))

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, preexec_fn=join)
    if proc.returncode != 0:
        raise SystemExit(f"FAIL: invoke {' '.join(args)} exited with {proc.returncode}")
    return time.perf_counter() - t0


def summary(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "manifest.json").read_text())["summary"]


def same_checkpoint(a: Path, b: Path) -> list[str]:
    """What differs between two TensorRT-LLM checkpoints (empty: bit-equal)."""
    import torch
    from safetensors import safe_open

    diffs = []

    def config(p: Path) -> dict:
        c = json.loads((p / "config.json").read_text())
        q = c.get("quantization") or {}
        if "exclude_modules" in q:
            q["exclude_modules"] = sorted(q["exclude_modules"])  # ModelOpt writes a set's order
        return c

    if config(a) != config(b):
        diffs.append("config.json")
    qa, qb = a / "quant_cfg.json", b / "quant_cfg.json"
    if qa.is_file() != qb.is_file() or (qa.is_file() and json.loads(qa.read_text()) != json.loads(qb.read_text())):
        diffs.append("quant_cfg.json")
    for f in sorted(a.glob("rank*.safetensors")):
        with safe_open(str(f), "pt") as x, safe_open(str(b / f.name), "pt") as y:
            if set(x.keys()) != set(y.keys()):
                diffs.append(f"{f.name}: tensor names")
                continue
            for k in x.keys():
                s, t = x.get_tensor(k), y.get_tensor(k)
                if s.dtype != t.dtype or s.shape != t.shape or \
                        not s.reshape(-1).view(torch.uint8).equal(t.reshape(-1).view(torch.uint8)):
                    diffs.append(f"{f.name}: {k}")
    return diffs


def side_by_side(root: Path) -> int:
    from pipeline import artifacts, compute
    from pipeline.config import load_config
    from pipeline.quant.quantize import run_stage

    invoke("quantize", "--work-root", str(root))
    work = root / NAME
    cfg = load_config(DEFAULT_CONFIG).config
    model_dir = work / "model" / artifacts.MODEL_DIR
    fp32 = compute.model_bytes(model_dir, "float32")
    rows = []
    for stage in ("sensitivity", "quantize"):
        s = summary(work, stage)
        rows.append((stage, "in memory" if stage == "quantize" else "streamed",
                     s.get("analysis_s") or s["timing_s"]["total"], s["peak_rss_bytes"]))
    out = root / "streamed-quantize"
    out.mkdir()
    t0 = time.perf_counter()
    streamed, peak = run_stage(
        model_dir, work / "text" / artifacts.CALIBRATION_TOKENS_FILE, work / "text" / artifacts.EVALUATION_TOKENS_FILE,
        work / "plan" / artifacts.PLAN_FILE, work / "sensitivity" / artifacts.SENSITIVITY_TABLE_JSON, cfg.quantization,
        cfg.build, out, cfg.compute, True, compute.host_memory_bound(cfg.compute), out / "stage.log")
    wall = time.perf_counter() - t0
    rows.append(("quantize", "streamed", streamed["timing_s"]["total"], peak))
    print(f"\nSmolLM2-135M, fp32 weights {gib(fp32)}; {os.cpu_count()} CPU cores")
    print(f"{'stage':12} {'mode':10} {'time':>8} {'peak RSS':>10} {'RSS / fp32 weights':>19}")
    for stage, mode, sec, rss in rows:
        print(f"{stage:12} {mode:10} {sec:>7.1f}s {gib(rss):>10} {rss / fp32:>19.2f}")
    ratio = rows[2][2] / rows[1][2]
    diffs = same_checkpoint(work / "quantize" / artifacts.TRTLLM_CHECKPOINT_DIR, out / artifacts.TRTLLM_CHECKPOINT_DIR)
    a, b = summary(work, "quantize")["accuracy"], streamed["accuracy"]
    print(f"streamed / in-memory quantize time: {ratio:.2f}x (child wall {wall:.0f} s)")
    print(f"accuracy: in memory {a['perplexity_original']} -> {a['perplexity_quantized']}, "
          f"streamed {b['perplexity_original']} -> {b['perplexity_quantized']}")
    print("checkpoints: bit-equal" if not diffs else f"checkpoints DIFFER: {diffs[:5]}")
    return 0 if not diffs else 1


def _cgroup(bound: int) -> tuple[Path, Path]:
    """A new memory cgroup limited to ``bound`` bytes (v1 memory controller, else v2); (its dir, procs file)."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((line.split(":", 2)[2] for line in own if "memory" in line.split(":")[1].split(",")), None)
    if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir():
        cg = Path("/sys/fs/cgroup/memory") / v1.lstrip("/") / f"bench-streaming-{uuid.uuid4().hex[:8]}"
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(bound))
    else:
        v2 = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
        cg = Path("/sys/fs/cgroup") / v2.lstrip("/") / f"bench-streaming-{uuid.uuid4().hex[:8]}"
        cg.mkdir()
        (cg / "memory.max").write_text(str(bound))
    return cg, cg / "cgroup.procs"


def large(root: Path, bound: int) -> int:
    from pipeline import artifacts, compute

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check import write_model

    invoke("download", "--work-root", str(root / "default"))
    model_dir = root / "random-llama-2b"
    t = 0.0
    if not (model_dir / "config.json").is_file():  # kept from an earlier run with the same --work
        t = write_model(root / "default" / NAME / "model" / artifacts.MODEL_DIR, model_dir, LARGE_LAYERS,
                        LARGE_SHAPE, "cpu", tie=True)
    fp32 = compute.model_bytes(model_dir, "float32")
    print(f"wrote a random {LARGE_LAYERS}-layer Llama: {fp32 // 4 / 1e9:.2f}B parameters, {gib(fp32)} in fp32, "
          f"bf16 on disk ({t:.0f} s); memory cgroup limit {gib(bound)} ({fp32 / bound:.1f}x smaller)")
    cg, procs = _cgroup(bound)
    try:
        args = ["quantize", "--config", str(DEFAULT_CONFIG), "--work-root", str(root / "large"),
                "--set", "model.source={kind: local, path: " + str(model_dir) + "}", "--set", "model.dtype=auto"]
        for s in SMALL_TEXT + WIDE_GATE:
            args += ["--set", s]
        wall = invoke(*args, cgroup_procs=procs)
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    work = root / "large" / NAME
    print(f"\ninvoke quantize of the 2B model in {wall:.0f} s, inside a {gib(bound)} memory cgroup")
    print(f"{'stage':12} {'time':>8} {'peak RSS':>10} {'bound':>10} {'RSS / fp32 weights':>19} streamed")
    ok = True
    for stage in ("sensitivity", "quantize"):
        s = summary(work, stage)
        c = s.get("compute") or {}
        rss, limit = s["peak_rss_bytes"], c.get("host_memory_bound_bytes")
        ok &= limit is not None and rss < limit
        print(f"{stage:12} {s.get('analysis_s') or s['timing_s']['total']:>7.1f}s {gib(rss):>10} {gib(limit):>10} "
              f"{rss / fp32:>19.2f} {s.get('layer_streaming', True)}")
    print(f"\n{'PASS' if ok else 'FAIL'}: every model stage of a model with {fp32 / bound:.1f}x the bound in fp32 "
          f"weights stayed under its bound")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--large", action="store_true", help="the random 2B Llama inside a memory cgroup")
    ap.add_argument("--bound", default="2.5GiB", help="the memory cgroup's limit for --large (default 2.5GiB)")
    a = ap.parse_args()
    from pydantic import ByteSize, TypeAdapter

    root = a.work or Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return large(root, int(TypeAdapter(ByteSize).validate_python(a.bound))) if a.large else side_by_side(root)
    finally:
        if a.work is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
