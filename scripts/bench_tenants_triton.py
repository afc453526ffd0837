"""Tenants through Triton over vLLM: a flooding tenant A beside an interactive tenant B, on a server without tenants
(one pool, vLLM's own first-come-first-served queue) and on one whose vLLM model admits each tenant's requests by
its share (``tenants:``, pipeline.tenancy.TenantGate), measured side by side in one run.

    # once: the default build (vllm target), e.g. `.venv/bin/invoke build`
    .venv/bin/python scripts/bench_tenants_triton.py [--config engine_configs/smollm2-135m-vllm.yaml] [--a-share 0.5]
        [--phase-s 30] [--rounds 2]

The script publishes the build twice, with no tenants and with tenants ``a`` (``--a-share`` of vLLM's KV pool) and
``b`` (``--b-share``, default the rest), copies each repository into a temporary folder, and publishes the config as
it is once more at the end, so the work dir's repository is what it was. Both servers (tritonserver, its models in
vLLM's environment) are up for the whole run; one takes load at a time.

The load, as scripts/bench_tenants.py sends it to the cpu runtime, here over gRPC streams to the ensemble's
streaming model (pipeline.serving.bench.load.one_request). B: requests arriving at ``--b-rps`` (Poisson, one seed per
round, so every arm of a round sees the same arrivals), ``--b-prompt-tokens`` tokens of the evaluation text and
exactly ``--b-output-tokens`` new ones; its time to first token is the first streamed response's. A:
``--a-clients`` closed-loop clients (default 3x vLLM's max_num_seqs, so A alone fills vLLM's slots and its queue),
each sending ``--a-prompt-tokens`` prompt tokens for exactly ``--a-output-tokens`` new ones. Three arms take turns
(A B C C B A ...):

- "B alone": B's requests only, on the server without tenants;
- "shared pool": A and B on the server without tenants;
- "partitioned": A and B on the tenanted server, each request naming its tenant.

Printed per arm: B's P50 / P99 time to first token and P99 end-to-end, A's output tokens/s (its requests answered
within the arm's ``--phase-s`` window), the most KV blocks A's admitted requests held reserved at once (the
``tenant_quota_usage{tenant="a"}`` series, read every 0.2 s; partitioned only) against its share; then the ratios
the tenants' targets are stated in (issue #42).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_tenants import load_arguments  # noqa: E402 - this folder's: the same load, sent to the cpu runtime

ARMS = ("B alone", "shared pool", "partitioned")
SAMPLE_S = 0.2
ROOT = Path(__file__).resolve().parents[1]


def publish(config: Path, work_root: Path, extra: list[str]) -> Path:
    """``invoke publish`` with ``--set`` overrides; the work dir's repository."""
    from pipeline.config import load_config

    sets = [a for x in extra for a in ("--set", x)]
    cmd = [sys.executable, "-m", "invoke", "publish", "--config", str(config), "--work-root", str(work_root), *sets]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"publish failed ({' '.join(extra) or 'as configured'}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return work_root / load_config(config).name / "publish" / "model_repository"


def read_series(metrics_url: str, family: str, label: str) -> float:
    """The sum of ``family``'s series whose labels include ``label`` (e.g. 'tenant="a"') at ``metrics_url``."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family + "{") and label in line)


def series(metrics_url: str, family: str, tenant: str) -> float:
    return read_series(metrics_url, family, f'tenant="{tenant}"')


def active(metrics_url: str) -> float:
    return read_series(metrics_url, "nv_trt_llm_request_metrics", 'request_type="active"')


async def run_arm(server, model: str, args, prompts: dict, *, seed: int, a_clients: int, tenants: bool) -> dict:
    import tritonclient.grpc.aio as grpcaio

    from pipeline.serving.bench.load import one_request

    client = grpcaio.InferenceServerClient(server.grpc_url)
    stop = asyncio.Event()
    a_done: list = []
    peak = {"a": 0.0}
    sampled = threading.Event()

    def sample() -> None:
        while tenants and not sampled.wait(SAMPLE_S):
            peak["a"] = max(peak["a"], series(server.metrics_url, "tenant_quota_usage", "a"))

    def send(cls: str, k: int):
        tokens = args.a_output_tokens if cls == "a" else args.b_output_tokens
        batch = prompts[cls]
        return one_request(client, model, prompt=batch[k % len(batch)], max_tokens=tokens, end_id=-1,
                           timeout_s=args.timeout_s, tenant=cls if tenants else None)

    async def a_client(i: int) -> None:
        k = i
        while not stop.is_set():
            a_done.append(await send("a", k))
            k += a_clients

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    a_tasks = [asyncio.create_task(a_client(i)) for i in range(a_clients)]
    t0 = time.perf_counter()
    end = t0 + args.phase_s
    rng = random.Random(seed)
    b_tasks = []
    while True:
        await asyncio.sleep(rng.expovariate(args.b_rps))
        if time.perf_counter() >= end:
            break
        b_tasks.append(asyncio.create_task(send("b", len(b_tasks))))
    b = await asyncio.gather(*b_tasks)
    a_in_window = [r for r in a_done if r.arrivals and r.arrivals[-1][0] <= end]
    stop.set()
    for t in a_tasks:
        t.cancel()
    await asyncio.gather(*a_tasks, return_exceptions=True)
    await client.close()
    sampled.set()
    sampler.join()
    return {"b": b, "a_tokens": sum(r.output_tokens for r in a_in_window), "window_s": args.phase_s,
            "a_failed": sum(r.error is not None for r in a_done), "a_peak": peak["a"]}


def settle(server, timeout_s: float = 300.0) -> None:
    """Wait for what a cancelled arm left running to end: a streamed ensemble request runs to its max tokens
    whatever its client does (docs/serving/publish-verify.md), so the next arm starts on an idle server."""
    deadline = time.monotonic() + timeout_s
    while active(server.metrics_url) and time.monotonic() < deadline:
        time.sleep(0.5)


def figures(runs: list[dict]) -> dict:
    b = [r for run in runs for r in run["b"]]
    ok = [r for r in b if r.error is None]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"n": len(b), "failed": len(b) - len(ok) + sum(run["a_failed"] for run in runs),
            "ttft_p50": pct([r.ttft_ms for r in ok], 50), "ttft_p99": pct([r.ttft_ms for r in ok], 99),
            "e2e_p99": pct([r.e2e_ms for r in ok], 99),
            "ttft_p99_rounds": [pct([r.ttft_ms for r in run["b"] if r.error is None], 99) for run in runs],
            "a_tps": sum(run["a_tokens"] for run in runs) / sum(run["window_s"] for run in runs),
            "a_peak": max(run["a_peak"] for run in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "engine_configs" / "smollm2-135m-vllm.yaml")
    ap.add_argument("--work-root", type=Path, default=ROOT / "build")
    load_arguments(ap, slots="vLLM's max_num_seqs")
    args = ap.parse_args()
    b_share = args.b_share if args.b_share is not None else round(1 - args.a_share, 6)

    from transformers import AutoTokenizer

    from pipeline import artifacts, records
    from pipeline.config import load_config
    from pipeline.serving.bench.load import make_prompts
    from pipeline.serving.serve import server_for_target

    cfg = load_config(args.config).config
    if cfg.build.target != "vllm":
        sys.exit(f"{args.config}: build.target is {cfg.build.target}; this measures the vllm target (the cpu "
                 f"runtime's partitions: scripts/bench_tenants.py)")
    tenants = f"tenants=[{{name: a, kv_share: {args.a_share}}}, {{name: b, kv_share: {b_share}}}]"
    tmp = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    repos = {}
    try:
        for key, extra in (("shared", ["vllm.frontends=[triton]"]), ("tenants", ["vllm.frontends=[triton]", tenants])):
            repos[key] = tmp / key
            shutil.copytree(publish(args.config, args.work_root, extra), repos[key], symlinks=True)
        publish(args.config, args.work_root, [])  # the work dir's repository as the config has it
        tokenizer_dir = sorted(repos["shared"].glob(f"*_preprocessing/*/{artifacts.TOKENIZER_DIR}"))[-1]
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        samples = args.work_root / load_config(args.config).name / "text" / artifacts.EVALUATION_TEXT_FILE
        prompts = {"a": make_prompts(samples, tokenizer, args.a_prompt_tokens, 64),
                   "b": make_prompts(samples, tokenizer, args.b_prompt_tokens, 64)[32:]}
        model = f"{records.read_provenance(repos['shared']).model_name}_stream"
        max_seqs = cfg.build.max_batch_size
        a_clients = args.a_clients or 3 * max_seqs
        order = [a for r in range(args.rounds) for a in (ARMS if r % 2 == 0 else ARMS[::-1])]
        runs: dict[str, list[dict]] = {a: [] for a in ARMS}
        with server_for_target("vllm", repos["shared"], frontend="triton") as shared, \
                server_for_target("vllm", repos["tenants"], frontend="triton") as parted:
            quota = series(parted.metrics_url, "tenant_quota_limit", "a")
            b_quota = series(parted.metrics_url, "tenant_quota_limit", "b")
            for server, who in ((shared, None), (parted, "a")):  # warm-up, not measured
                asyncio.run(run_arm(server, model, argparse.Namespace(**{**vars(args), "phase_s": 2.0, "b_rps": 2.0}),
                                    prompts, seed=0, a_clients=2, tenants=who is not None))
                settle(server)
            for i, name in enumerate(order):
                server = parted if name == "partitioned" else shared
                t0 = time.perf_counter()
                runs[name].append(asyncio.run(run_arm(server, model, args, prompts, seed=args.seed + i // len(ARMS),
                                                      a_clients=0 if name == "B alone" else a_clients,
                                                      tenants=name == "partitioned")))
                settle(server)
                print(f"arm {i + 1}/{len(order)} ({name}) done in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    tpb = cfg.build.kv_cache.tokens_per_block
    a_blocks = -(-(args.a_prompt_tokens + args.a_output_tokens) // tpb)
    print(f"\n{args.config.name}: Triton over vLLM's CPU build, max_num_seqs {max_seqs}, blocks of {tpb} tokens")
    print(f"A: {a_clients} closed-loop clients, {args.a_prompt_tokens} prompt / {args.a_output_tokens} output tokens "
          f"(~{a_blocks} blocks each); B: {args.b_rps:g}/s Poisson, {args.b_prompt_tokens} / {args.b_output_tokens} "
          f"tokens; tenants a {args.a_share:g} ({quota:.0f} blocks), b {b_share:g} ({b_quota:.0f} blocks); "
          f"{args.rounds} rounds of {args.phase_s:g} s per arm\n")
    print(f"{'arm':<12} {'B n':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p99':>8} {'p99 by round':>14}   "
          f"{'A tok/s':>8} {'A peak blk':>10} {'failed':>6}")
    table = {name: figures(rs) for name, rs in runs.items()}
    for name, f in table.items():
        by_round = "/".join(f"{x / 1e3:.2f}" for x in f["ttft_p99_rounds"])
        a_peak = f"{f['a_peak']:.0f}/{quota:.0f}" if name == "partitioned" else "-"
        a_tps = f"{f['a_tps']:.1f}" if name != "B alone" else "-"
        print(f"{name:<12} {f['n']:>4} {f['ttft_p50'] / 1e3:>8.2f}s {f['ttft_p99'] / 1e3:>8.2f}s "
              f"{f['e2e_p99'] / 1e3:>7.2f}s {by_round:>14}   {a_tps:>8} {a_peak:>10} {f['failed']:>6}")
    alone, shared_f, part = table["B alone"], table["shared pool"], table["partitioned"]
    print(f"\nB P99 TTFT, shared / partitioned: {shared_f['ttft_p99'] / part['ttft_p99']:.1f}x (target >= 5x)")
    print(f"B P99 TTFT, partitioned / alone: {part['ttft_p99'] / alone['ttft_p99']:.2f}x (target <= 1.5x)")
    print(f"A's peak reserved blocks {part['a_peak']:.0f} within its share of {quota:.0f}: "
          f"{'yes' if part['a_peak'] <= quota else 'NO'}")
    print(f"A's output tokens/s, partitioned / shared: {part['a_tps'] / shared_f['a_tps']:.2f}x")


if __name__ == "__main__":
    main()
