"""The cpu runtime's adaptive batch limit against static limits, under a step in request rate.

    # once: build/smollm2-135m-cpu/build/cpu_bundle
    .venv/bin/invoke build --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_adaptive.py [--bundle DIR] [--base-rps 0.25] [--spike-rps 1] [--phase-s 20]

One runtime, one bundle, one run: first the solo step time is measured (one sequence decoding alone); the
inter-token SLA is ``--sla-factor`` times it. Then each arm serves the same open-loop load (Poisson
arrivals drawn from one seed: ``--base-rps`` for a phase, ``--spike-rps`` for a phase, ``--base-rps`` again;
every request ``--prompt-tokens`` prompt tokens of real text and exactly ``--output-tokens`` new ones):
static limits of 1, 2, 4 and max_batch_size sequences at once, and the adaptive limit (AdaptiveBatchLimit,
target = the SLA); then the default static limit and the adaptive one again with chunked prefill
(``--prefill-chunk`` prompt tokens per scheduler step: triton.prefill_chunk_tokens). The arms run one after the
other on the same warm runtime; the limit and the chunk are set on that runtime's scheduler directly (what
triton.max_running and triton.prefill_chunk_tokens set).

Per arm it prints, over the requests that arrived during the spike: P99 of the gaps between a request's
tokens (what the SLA bounds), P99 time to first token, the requests that met the SLA on every gap of theirs
and whose TTFT met ``--ttft-factor`` solo steps (goodput, requests/s from the spike's first arrival to its last
answer), and the adaptive limit's changes. The runtime is driven in-process:
this measures its scheduler, not Triton (which adds the same request handling to every arm).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np

TEXT = ("The history of the city goes back to a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries the market grew into a town with walls, a cathedral and a "
        "university, and its bridges carried the roads of half a continent. ") * 8


def arrivals(seed: int, base_rps: float, spike_rps: float, phase_s: float) -> list[tuple[float, str]]:
    """(time from the start, phase) of each request: Poisson arrivals at base, spike, base rate."""
    rng, out, t = random.Random(seed), [], 0.0
    for phase, rate, end in (("before", base_rps, phase_s), ("spike", spike_rps, 2 * phase_s),
                             ("after", base_rps, 3 * phase_s)):
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            out.append((t, phase))
    return out


def serve(rt, schedule, prompt_ids: list[int], output_tokens: int) -> list[dict]:
    """Submit each request at its time (a thread per request reads its stream); per-request token times."""
    from pipeline.engines.cpu_runtime import SamplingParams

    params = SamplingParams(max_new_tokens=output_tokens, end_id=-1)
    records, threads = [], []
    t0 = time.perf_counter()

    def one(phase: str, sent: float) -> None:
        req = rt.submit(prompt_ids, params)
        times = [time.perf_counter() for _ in req.stream()]
        records.append({"phase": phase, "sent": sent, "times": times})

    for at, phase in schedule:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(phase, time.perf_counter()), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return records


def figures(records: list[dict], itl_sla_ms: float, ttft_sla_ms: float) -> dict:
    """Over the requests that arrived during the spike: ITL and TTFT percentiles, and goodput: the requests
    whose every inter-token gap and whose TTFT met the SLA, per second from the spike's first arrival to the
    last of its requests' last token (a limit that queues requests for long pays for it here)."""
    spike = [r for r in records if r["phase"] == "spike"]
    gaps = [(b - a) * 1e3 for r in spike for a, b in zip(r["times"], r["times"][1:])]
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in spike]
    good = sum(all((b - a) * 1e3 <= itl_sla_ms for a, b in zip(r["times"], r["times"][1:]))
               and (r["times"][0] - r["sent"]) * 1e3 <= ttft_sla_ms for r in spike)
    span = max(r["times"][-1] for r in spike) - min(r["sent"] for r in spike)
    return {"requests": len(spike), "itl_p50": float(np.percentile(gaps, 50)),
            "itl_p99": float(np.percentile(gaps, 99)),
            "ttft_p99": float(np.percentile(ttft, 99)), "goodput": good / span, "good": good}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-135m-cpu/build/cpu_bundle"))
    ap.add_argument("--base-rps", type=float, default=0.25)
    ap.add_argument("--spike-rps", type=float, default=1.0)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--sla-factor", type=float, default=2.0, help="the ITL SLA in solo step times")
    ap.add_argument("--ttft-factor", type=float, default=20.0, help="the TTFT SLA in solo step times")
    ap.add_argument("--prefill-chunk", type=int, default=16, help="prompt tokens per step in the chunked arms")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from pipeline.engines.cpu_runtime import AdaptiveBatchLimit, CpuRuntime, SamplingParams

    tok = AutoTokenizer.from_pretrained(a.bundle / "model")
    prompt_ids = tok(TEXT).input_ids[: a.prompt_tokens]
    schedule = arrivals(a.seed, a.base_rps, a.spike_rps, a.phase_s)
    with CpuRuntime.load(a.bundle) as rt:
        rt.generate(prompt_ids, SamplingParams(max_new_tokens=4, end_id=-1))  # warm up
        solo = []
        for _ in range(3):
            req = rt.submit(prompt_ids, SamplingParams(max_new_tokens=a.output_tokens, end_id=-1))
            times = [time.perf_counter() for _ in req.stream()]
            solo.append(statistics.median(b - x for x, b in zip(times, times[1:])) * 1e3)
        step_ms = statistics.median(solo)
        sla_ms, ttft_ms = a.sla_factor * step_ms, a.ttft_factor * step_ms
        top = rt.max_running
        print(f"solo decode step {step_ms:.0f} ms; SLA: inter-token gaps <= {sla_ms:.0f} ms, TTFT <= {ttft_ms:.0f} ms; "
              f"{len(schedule)} requests: {a.base_rps:g} req/s, {a.spike_rps:g} req/s for {a.phase_s:g} s, "
              f"{a.base_rps:g} req/s; {a.prompt_tokens} prompt + {a.output_tokens} output tokens each\n")
        chunk = a.prefill_chunk
        arms = ([(f"static {n}", n, None, None) for n in sorted({1, 2, 4, top})] + [("adaptive", top, sla_ms, None)]
                + [(f"static {top}+c{chunk}", top, None, chunk), (f"adaptive+c{chunk}", top, sla_ms, chunk)])
        print(f"{'arm':16} {'spike reqs':>10} {'ITL P50':>9} {'ITL P99':>9} {'P99 / SLA':>10} {'TTFT P99':>10} "
              f"{'goodput':>12} {'changes':>8}")
        results = {}
        for name, limit, target, prefill_chunk in arms:
            rt.max_running, rt.prefill_chunk = limit, prefill_chunk
            rt.adaptive = (AdaptiveBatchLimit(target, top, chunk=prefill_chunk, max_chunk=a.prompt_tokens)
                           if target else None)
            f = figures(serve(rt, schedule, prompt_ids, a.output_tokens), sla_ms, ttft_ms)
            results[name] = f
            changes = rt.adaptive.changes if rt.adaptive else "-"
            print(f"{name:16} {f['requests']:>10} {f['itl_p50']:>7.0f}ms {f['itl_p99']:>7.0f}ms "
                  f"{f['itl_p99'] / sla_ms:>10.2f} {f['ttft_p99']:>8.0f}ms {f['goodput']:>8.2f} r/s {changes:>8}")
    static = {k: v for k, v in results.items() if k.startswith("static")}
    best = max(static, key=lambda k: static[k]["goodput"])
    ad = results["adaptive"]
    print(f"\nbest static limit by goodput: {best} ({static[best]['goodput']:.2f} req/s, ITL P99 "
          f"{static[best]['itl_p99'] / sla_ms:.2f}x the SLA); adaptive: {ad['goodput']:.2f} req/s, ITL P99 "
          f"{ad['itl_p99'] / sla_ms:.2f}x the SLA; default (static {top}): ITL P99 "
          f"{results[f'static {top}']['itl_p99'] / sla_ms:.2f}x the SLA; with {chunk}-token prefill chunks: static "
          f"{top} {results[f'static {top}+c{chunk}']['itl_p99'] / sla_ms:.2f}x, adaptive "
          f"{results[f'adaptive+c{chunk}']['itl_p99'] / sla_ms:.2f}x the SLA "
          f"({results[f'adaptive+c{chunk}']['goodput']:.2f} req/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
