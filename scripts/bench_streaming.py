#!/usr/bin/env python3
"""Layer-streamed quantize, measured: memory and time of the model stages, in memory and streamed.

    .venv/bin/python scripts/bench_streaming.py                      # SmolLM2, side by side (about 10 min)
    .venv/bin/python scripts/bench_streaming.py --large --bound 2.5GiB   # a random 2B Llama in a memory cgroup
    .venv/bin/python scripts/bench_streaming.py --large --all --work DIR  # ... through invoke all (cpu target)

Default: ``invoke quantize`` on the embedded default (SmolLM2-135M; it fits, so quantize runs in memory),
then the same quantize stage again with layer streaming, in a child process measured the same way
(pipeline.child: peak RSS = VmHWM). Prints, per model stage, the time, the peak RSS and its ratio to the
model's fp32 weight bytes, the streamed / in-memory time ratio, and whether the two checkpoints are
bit-equal (every tensor of every rank file, config.json, quant_cfg.json).

``--large``: writes a random-weight bf16 Llama (hidden 2048, MLP 8192, 32 heads / 8 KV heads, SmolLM2's
tokenizer and vocabulary, tied embeddings as Llama-3.2-1B's; 2.05B parameters, 8.2 GB in fp32) and runs ``invoke
quantize`` on it (model, text, sensitivity, plan, quantize) inside a new memory cgroup of ``--bound`` bytes (needs root
and the cgroup v1 memory controller or cgroup v2): the stages find that limit themselves (compute: the cgroup's limit
less the 10 % margin), and quantize streams because three fp32 copies do not fit. A smaller calibration set keeps it
to minutes on two cores (8 x 128 tokens; the memory measured is the weights' and one layer's, not the
set's). Prints each stage's peak RSS, its bound and the fp32 weights / bound ratio; exits 1 if a stage failed
or went over its bound.

``--large --all``: the same model through ``invoke all``: build, publish, verify and bench on the ``cpu``
target too, whose runtime then streams its decoder layers from the checkpoint (a small serving shape and
short checks: SMALL_SERVING). The cgroup's anonymous memory is sampled twice a second, so the servers that
verify and bench start are measured too; the kernel's count of processes it killed for memory there is
printed. With ``--work`` kept from a ``--large`` run, the stages already done are not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
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
# --all: a small serving shape and short checks, sized for a runtime that reads its 2 GB of INT8 weights from the
# checkpoint at every forward (seconds a step on two cores)
SMALL_SERVING = ["build.max_batch_size=4", "build.max_input_len=128", "build.max_seq_len=256",
                 "build.max_num_tokens=512", "verify.max_tokens=2", "verify.concurrent_requests=4",
                 "bench.concurrency=[1, 2]", "bench.requests_per_level=2", "bench.warmup_requests=1",
                 "bench.prompt_tokens=32", "bench.output_tokens=2"]
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
        model_dir, work / "text" / artifacts.CALIBRATION_TOKENS_FILE,
        evaluation_file=work / "text" / artifacts.EVALUATION_TOKENS_FILE, plan_file=work / "plan" / artifacts.PLAN_FILE,
        table_file=work / "sensitivity" / artifacts.SENSITIVITY_TABLE_JSON, quant=cfg.quantization, build=cfg.build,
        out_dir=out, compute=cfg.compute, stream=True, bound=compute.host_memory_bound(cfg.compute),
        log_path=out / "stage.log")
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


class CgroupSampler(threading.Thread):
    """Samples a memory cgroup's anonymous memory (memory.stat: total_rss under v1, anon under v2) twice a
    second while the run goes on: the memory of every process in it, the servers verify and bench start
    included, which the stages' own peak RSS figures do not see."""

    def __init__(self, cg: Path):
        super().__init__(daemon=True)
        self.cg, self.samples, self.stop = cg, [], threading.Event()

    def run(self) -> None:
        key = "total_rss" if (self.cg / "memory.limit_in_bytes").exists() else "anon"
        while not self.stop.wait(0.5):
            try:
                stat = dict(line.split() for line in (self.cg / "memory.stat").read_text().splitlines())
            except OSError:
                continue
            self.samples.append((time.time(), int(stat[key])))

    def peak(self, start: float, end: float) -> int | None:
        inside = [v for t, v in self.samples if start <= t <= end + 1]
        return max(inside) if inside else None


def oom_kills(cg: Path) -> int | None:
    """Processes the kernel killed for memory in the cgroup (v1 memory.oom_control, v2 memory.events)."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            for line in (cg / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
    return None


def large(root: Path, bound: int, everything: bool) -> int:
    from datetime import datetime

    from pipeline import artifacts, compute

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check import llama_config, write_model

    invoke("download", "--config", str(DEFAULT_CONFIG), "--work-root", str(root / "default"))
    model_dir = root / "random-llama-2b"
    t = 0.0
    if not (model_dir / "config.json").is_file():  # kept from an earlier run with the same --work
        tokenizer_dir = root / "default" / NAME / "model" / artifacts.MODEL_DIR
        t = write_model(llama_config(tokenizer_dir, LARGE_LAYERS, LARGE_SHAPE, tie=True), tokenizer_dir, model_dir,
                        "cpu")
    fp32 = compute.model_bytes(model_dir, "float32")
    print(f"wrote a random {LARGE_LAYERS}-layer Llama: {fp32 // 4 / 1e9:.2f}B parameters, {gib(fp32)} in fp32, "
          f"bf16 on disk ({t:.0f} s); memory cgroup limit {gib(bound)} ({fp32 / bound:.1f}x smaller)")
    task = "all" if everything else "quantize"
    args = [task, "--config", str(DEFAULT_CONFIG), "--work-root", str(root / "large"),
            "--set", "model.source={kind: local, path: " + str(model_dir) + "}", "--set", "model.dtype=auto"]
    for s in SMALL_TEXT + WIDE_GATE + (SMALL_SERVING if everything else []):
        args += ["--set", s]
    cg, procs = _cgroup(bound)
    sampler = CgroupSampler(cg)
    sampler.start()
    try:
        wall = invoke(*args, cgroup_procs=procs)
        kills = oom_kills(cg)
    finally:
        sampler.stop.set()
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    work = root / "large" / NAME
    print(f"\ninvoke {task} of the 2B model in {wall:.0f} s, inside a {gib(bound)} memory cgroup "
          f"(processes killed for memory there: {kills})")
    print(f"{'stage':12} {'time':>8} {'peak RSS':>10} {'bound':>10} {'RSS / fp32':>11} {'cgroup anon':>12}  notes")
    ok = kills in (0, None)
    stages = [s for s in ("sensitivity", "quantize", "build", "publish", "verify", "bench")
              if everything or s in ("sensitivity", "quantize")]
    for stage in stages:
        m = json.loads((work / stage / "manifest.json").read_text())
        s = m["summary"]
        window = [datetime.fromisoformat(m[k]).timestamp() for k in ("started_at", "finished_at")]
        anon = sampler.peak(*window)
        rss = s.get("peak_rss_bytes")
        limit = (s.get("compute") or {}).get("host_memory_bound_bytes")
        if rss is not None and limit is not None:
            ok &= rss < limit
        if anon is not None:
            ok &= anon < bound
        notes = {"sensitivity": "streamed", "quantize": f"streamed: {s.get('layer_streaming')}",
                 "build": f"runtime streams its layers: {(s.get('smoke_test') or {}).get('layer_streaming')}",
                 "verify": f"{s.get('checks')} checks passed" if s.get("all_ok") else "FAILED",
                 "publish": "", "bench": ""}[stage]
        print(f"{stage:12} {m['duration_s']:>7.0f}s {gib(rss):>10} {gib(limit):>10} "
              f"{'-' if rss is None else f'{rss / fp32:.2f}':>11} {gib(anon):>12}  {notes}")
    print(f"\n{'PASS' if ok else 'FAIL'}: every stage of a model with {fp32 / bound:.1f}x the bound in fp32 weights "
          f"stayed under its bound (cgroup anon: every process in the cgroup, servers included, sampled at 2 Hz)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--large", action="store_true", help="the random 2B Llama inside a memory cgroup")
    ap.add_argument("--all", action="store_true", help="with --large: invoke all (build, publish, verify, bench, "
                    "report on the cpu target), not only quantize")
    ap.add_argument("--bound", default="2.5GiB", help="the memory cgroup's limit for --large (default 2.5GiB)")
    a = ap.parse_args()
    from pydantic import ByteSize, TypeAdapter

    root = a.work or Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if a.large:
            return large(root, int(TypeAdapter(ByteSize).validate_python(a.bound)), a.all)
        return side_by_side(root)
    finally:
        if a.work is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
