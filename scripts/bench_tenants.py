"""Tenants on the cpu reference runtime: a flooding tenant A beside an interactive tenant B, with one shared KV pool
and with the pool partitioned (``tenants:``, pipeline.tenancy), measured side by side in one run.

    # once: build/smollm2-135m-cpu/build/cpu_bundle
    .venv/bin/invoke build --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_tenants.py [--bundle DIR] [--phase-s 30] [--rounds 2] [--a-share 0.5]

The runtime runs in this process (``CpuRuntime``, no Triton): this measures the scheduler's admission, not the
serving path, whose tenant input, limits and refusals the tests check on a real server. Two runtimes are loaded
up front from the same bundle: one without tenants, one with tenants ``a`` (``--a-share`` of the KV pool) and ``b``
(``--b-share``, default the rest).

The load. B: interactive requests arriving at ``--b-rps`` (Poisson, one seed per round, so every arm of a round
sees the same arrivals), ``--b-prompt-tokens`` tokens of real text (the standard library's pydoc topics, through the
bundle's tokenizer) and exactly ``--b-output-tokens`` new ones. A: ``--a-clients`` closed-loop clients (default 3x
max_running: more than A's share holds), each sending ``--a-prompt-tokens`` prompt tokens and exactly
``--a-output-tokens`` new ones, then the next as soon as one ends (256 and 32 by default: on 2 cores a 512-token
prompt takes ~3 s to prefill and a decode step of 8 such sequences ~0.8 s, which would make a run take an hour).
Three arms take turns (A B C C B A ... over ``--rounds``), so drifting machine load hits them alike:

- "B alone": B's requests only, on the runtime without tenants;
- "shared pool": A and B on the runtime without tenants (one pool, first come first served);
- "partitioned": A and B on the tenanted runtime, each request naming its tenant (with ``--b-first``, also in
  their tenants' request classes: B 1, A 2, as ``priority_level`` sets them through Triton).

Tenants share the running slots (max_running) as they share the blocks: each is owed its share of them (at least
one), and with every slot taken a request of a tenant below its slot share pauses the latest sequence of one above
its own (``TenantBook.slot_share``). Before that, a share of A's that held more of its requests than there are
slots let A's queue fill every slot and B waited behind it as in one shared pool (first measured with this script:
at --a-share 0.25, B's P99 TTFT 43.6 s partitioned against 74.8 s shared).

An arm sends B's arrivals for ``--phase-s`` seconds while A's clients keep the runtime full; A keeps sending until
B's last request is answered, then its requests in flight are cancelled. Per arm it prints B's P50 / P99 time to
first token (first token - submit) and P99 end-to-end over every B request of its rounds; A's output tokens/s over
the arms' ``--phase-s`` windows; the most KV blocks A's requests held reserved at once (the tenant book's
``reserved_blocks``, sampled every 20 ms; partitioned only) against its share, and the pool's peak used blocks.
Then the ratios the tenants' targets are stated in: shared / partitioned B P99 TTFT (>= 5x), partitioned / alone
B P99 TTFT (<= 1.5x), A's peak blocks within its share, and A's throughput partitioned vs shared.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("B alone", "shared pool", "partitioned")
SAMPLE_S = 0.02  # how often the pool and the tenant book are read


def text_ids(tokenizer) -> list[int]:
    """Real English prose: the pydoc topics that ship with Python, as the bundle's tokenizer reads them."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:20000]  # ~5k tokens: past max_input_len, under the
    return tokenizer(text, add_special_tokens=False).input_ids  # tokenizer's own limit (a warning past it)


def load_arguments(ap: argparse.ArgumentParser, slots: str) -> None:
    """The tenants' shares and the load's options, shared with scripts/bench_tenants_triton.py (``slots``: what
    the default number of A's clients is three times)."""
    ap.add_argument("--a-share", type=float, default=0.5, help="tenant a's kv_share")
    ap.add_argument("--b-share", type=float, default=None, help="tenant b's kv_share (default: the rest)")
    ap.add_argument("--a-clients", type=int, default=0, help=f"0: 3x {slots}")
    ap.add_argument("--a-prompt-tokens", type=int, default=256)
    ap.add_argument("--a-output-tokens", type=int, default=32)
    ap.add_argument("--b-rps", type=float, default=0.5)
    ap.add_argument("--b-prompt-tokens", type=int, default=16)
    ap.add_argument("--b-output-tokens", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)


class Arm:
    """One arm's run on ``rt``: B's arrivals for ``phase_s``, A's closed-loop clients (``a_clients``, 0: none) until
    B's last answer. ``tenants``: whether requests name tenants a and b."""

    def __init__(self, rt, args, prompts: dict, seed: int, a_clients: int, tenants: bool):
        self.rt, self.args, self.prompts, self.seed = rt, args, prompts, seed
        self.a_clients, self.tenants = a_clients, tenants
        self.b: list[tuple[float, object]] = []  # (submitted at, request)
        self.a: list[object] = []
        self.a_peak_reserved = 0
        self.pool_peak_used = 0
        self._stop = threading.Event()  # A stops sending (B is answered)
        self._submit_lock = threading.Lock()  # A's submits against stop-and-cancel

    def submit(self, cls: str):
        from pipeline.engines.cpu_runtime import SamplingParams

        tokens = self.args.a_output_tokens if cls == "a" else self.args.b_output_tokens
        # --b-first: the tenants' request classes (priority_level: b 1, a 2), on the partitioned arm
        level = {"a": 2, "b": 1}[cls] if self.tenants and self.args.b_first else 0
        return self.rt.submit(self.prompts[cls], SamplingParams(max_new_tokens=tokens, end_id=-1), priority=level,
                              tenant=cls if self.tenants else None)

    def a_client(self) -> None:
        while True:
            with self._submit_lock:
                if self._stop.is_set():
                    return
                req = self.submit("a")
                self.a.append(req)
            req.result()

    def b_arrivals(self, end: float) -> None:
        rng = random.Random(self.seed)
        while True:
            time.sleep(rng.expovariate(self.args.b_rps))
            if time.perf_counter() >= end:
                return
            t = time.perf_counter()
            self.b.append((t, self.submit("b")))

    def sampler(self, done: threading.Event) -> None:
        while not done.wait(SAMPLE_S):
            s = self.rt.stats()
            self.pool_peak_used = max(self.pool_peak_used, s["kv_used_blocks"])
            if self.tenants:
                self.a_peak_reserved = max(self.a_peak_reserved, s["tenants"]["a"]["reserved_blocks"])

    def run(self) -> dict:
        t0 = time.perf_counter()
        end = t0 + self.args.phase_s
        sampled = threading.Event()
        threads = [threading.Thread(target=self.a_client, daemon=True) for _ in range(self.a_clients)]
        sampler = threading.Thread(target=self.sampler, args=(sampled,), daemon=True)
        arrivals = threading.Thread(target=self.b_arrivals, args=(end,), daemon=True)
        for t in (sampler, *threads, arrivals):
            t.start()
        time.sleep(max(0.0, end - time.perf_counter()))
        a_tokens = sum(len(r.output_ids) for r in list(self.a))  # A's output within the window
        arrivals.join()
        for _, req in self.b:
            req.result(timeout=self.args.timeout_s)
        with self._submit_lock:
            self._stop.set()
            for req in self.a:
                req.cancel()
        for t in threads:
            t.join(timeout=self.args.timeout_s)
        sampled.set()
        sampler.join()
        return {"b": [(t, r) for t, r in self.b], "a_tokens": a_tokens, "window_s": self.args.phase_s,
                "a_peak_reserved": self.a_peak_reserved, "pool_peak_used": self.pool_peak_used,
                "a_failed": sum(r.finish_reason == "error" for r in self.a)}


def b_figures(runs: list[dict]) -> dict:
    reqs = [(t, r) for run in runs for t, r in run["b"]]
    failed = sum(r.finish_reason not in ("length", "stop") for _, r in reqs) + sum(run["a_failed"] for run in runs)
    ttft = [(r.first_token_at - t) * 1e3 for t, r in reqs if r.first_token_at is not None]
    e2e = [(r.finished_at - t) * 1e3 for t, r in reqs if r.finish_reason in ("length", "stop")]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    per_round = [pct([(r.first_token_at - t) * 1e3 for t, r in run["b"] if r.first_token_at], 99) for run in runs]
    return {"n": len(reqs), "failed": failed, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "e2e_p99": pct(e2e, 99), "ttft_p99_rounds": per_round,
            "a_tps": sum(run["a_tokens"] for run in runs) / sum(run["window_s"] for run in runs),
            "a_peak_reserved": max(run["a_peak_reserved"] for run in runs),
            "pool_peak_used": max(run["pool_peak_used"] for run in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-135m-cpu/build/cpu_bundle"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the scheduler's forwards)")
    ap.add_argument("--max-running", type=int, default=None, help="sequences at once (default: max_batch_size)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="chunked prefill tokens (default: whole)")
    ap.add_argument("--b-first", action="store_true",
                    help="partitioned arm: tenant b's requests in request class 1, a's in 2 (priority_level)")
    load_arguments(ap, slots="max_running")
    args = ap.parse_args()
    b_share = args.b_share if args.b_share is not None else round(1 - args.a_share, 6)

    from transformers import AutoTokenizer

    from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams, read_settings
    from pipeline.errors import InputError
    from pipeline.tenancy import TenantSpec

    try:
        settings = read_settings(args.bundle)
        tenants = [TenantSpec("a", kv_share=args.a_share), TenantSpec("b", kv_share=b_share)]
        load = dict(threads=args.threads, max_running=args.max_running, prefill_chunk=args.prefill_chunk)
        runtimes = {"shared": CpuRuntime.load(args.bundle, **load),
                    "tenants": CpuRuntime.load(args.bundle, tenants=tenants, **load)}
    except InputError as e:
        sys.exit(str(e))
    rt_of = {"B alone": runtimes["shared"], "shared pool": runtimes["shared"], "partitioned": runtimes["tenants"]}
    max_running = runtimes["shared"].max_running
    a_clients = args.a_clients or 3 * max_running
    ids = text_ids(AutoTokenizer.from_pretrained(args.bundle / "model"))
    a_len = args.a_prompt_tokens
    prompts = {"a": ids[:a_len], "b": ids[a_len:a_len + args.b_prompt_tokens]}
    order = [a for r in range(args.rounds) for a in (ARMS if r % 2 == 0 else ARMS[::-1])]
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    try:
        for tenant, rt in ((None, runtimes["shared"]), ("a", runtimes["tenants"])):  # warm-up, not measured
            rt.submit(prompts["a"], SamplingParams(max_new_tokens=2, end_id=-1), tenant=tenant).result()
        for i, name in enumerate(order):
            arm = Arm(rt_of[name], args, prompts, seed=args.seed + i // len(ARMS),
                      a_clients=0 if name == "B alone" else a_clients, tenants=name == "partitioned")
            t0 = time.perf_counter()
            runs[name].append(arm.run())
            print(f"arm {i + 1}/{len(order)} ({name}) done in {time.perf_counter() - t0:.0f} s", flush=True)
        book = runtimes["tenants"].stats()["tenants"]
    finally:
        for rt in runtimes.values():
            rt.close()

    tpb = settings["tokens_per_block"]
    a_blocks = -(-(a_len + args.a_output_tokens) // tpb)
    quota = book["a"]["quota_blocks"]
    print(f"\nbundle {args.bundle}, {args.threads} torch threads, max_running {max_running}, pool "
          f"{runtimes['shared'].pool.num_blocks} blocks of {tpb} tokens, prefill "
          f"{'chunks of %d' % args.prefill_chunk if args.prefill_chunk else 'whole'}")
    print(f"A: {a_clients} closed-loop clients, {a_len} prompt / {args.a_output_tokens} output tokens ({a_blocks} "
          f"blocks each); B: {args.b_rps:g}/s Poisson, {len(prompts['b'])} / {args.b_output_tokens} tokens; tenants a "
          f"{args.a_share:g} ({quota} blocks, {quota // a_blocks} of A's requests), b {b_share:g} "
          f"({book['b']['quota_blocks']} blocks); {args.rounds} rounds of {args.phase_s:g} s per arm\n")
    print(f"{'arm':<12} {'B n':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p99':>8} {'p99 by round':>14}   "
          f"{'A tok/s':>8} {'A peak blk':>10} {'pool peak':>9} {'failed':>6}")
    table = {name: b_figures(rs) for name, rs in runs.items()}
    for name, f in table.items():
        by_round = "/".join(f"{x / 1e3:.2f}" for x in f["ttft_p99_rounds"])
        a_peak = f"{f['a_peak_reserved']}/{quota}" if name == "partitioned" else "-"
        a_tps = f"{f['a_tps']:.1f}" if name != "B alone" else "-"
        print(f"{name:<12} {f['n']:>4} {f['ttft_p50'] / 1e3:>8.2f}s {f['ttft_p99'] / 1e3:>8.2f}s "
              f"{f['e2e_p99'] / 1e3:>7.2f}s {by_round:>14}   {a_tps:>8} {a_peak:>10} {f['pool_peak_used']:>9} "
              f"{f['failed']:>6}")
    alone, shared, part = table["B alone"], table["shared pool"], table["partitioned"]
    print(f"\nB P99 TTFT, shared / partitioned: {shared['ttft_p99'] / part['ttft_p99']:.1f}x (target >= 5x)")
    print(f"B P99 TTFT, partitioned / alone: {part['ttft_p99'] / alone['ttft_p99']:.2f}x (target <= 1.5x)")
    print(f"A's peak reserved blocks {part['a_peak_reserved']} within its share of {quota}: "
          f"{'yes' if part['a_peak_reserved'] <= quota else 'NO'}")
    print(f"A's output tokens/s, partitioned / shared: {part['a_tps'] / shared['a_tps']:.2f}x")


if __name__ == "__main__":
    main()
