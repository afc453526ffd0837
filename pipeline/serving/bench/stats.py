"""The numbers of a sweep: percentiles and summaries, a level's medians and spread over repeated rounds, the knee,
goodput against the SLA, the padding factor, and this/baseline ratios.

The knee: the lowest level past which throughput gains less than ``bench.knee_min_gain`` per doubling of
concurrency, i.e. where added concurrency stops paying and only adds latency.
"""

from __future__ import annotations

import copy
import math
import statistics
from typing import Any, Optional, Sequence

import numpy as np

from pipeline import targets
from pipeline.records import BuildSettings

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default method)."""
    if not len(values):
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Sequence[float]) -> dict:
    """n, mean, std, min, max, P50/P90/P99, P99/P50 and jitter (std / mean; population std)."""
    if not len(values):
        return {"n": 0}
    x = np.asarray(values, dtype=np.float64)
    mean, std = float(x.mean()), float(x.std())
    pct = {q: percentile(values, q) for q in PERCENTILES}
    out: dict = {"n": int(x.size), "mean": mean, "std": std, "min": float(x.min()), "max": float(x.max())}
    out.update({f"p{q}": v for q, v in pct.items()})
    out["p99_over_p50"] = pct[99] / pct[50] if pct[50] > 0 else None
    out["jitter"] = std / mean if mean > 0 else None
    return out


# ---------------------------------------------------------------- a level over repeated rounds

SPREAD_FIGURES = ("output_tokens_per_s", "e2e_p99_ms")  # the figures whose spread over rounds a level reports


def median_rounds(rounds: Sequence[dict], bounds: dict[str, float]) -> dict:
    """One level measured in several rounds, as one level: every figure the median over the rounds
    (``median_figures``), the SLA judged again on the median P99s against ``bounds``, and ``spread``. One round
    is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    level = median_figures(rounds)
    sla = level.get("sla")
    if sla is not None:  # as goodput judges one round: a bounded P99 over its bound is a violation
        sla["violations"] = [m for m, b in bounds.items() if sla["p99_ms"][m] is not None and sla["p99_ms"][m] > b]
        sla["met"] = not sla["violations"] and bool(sla["requests"])
    level["spread"] = spread(rounds)
    return level


def median_figures(rounds: Sequence[Any]) -> Any:
    """The median over rounds of each number in the rounds' figures, walking dicts key by key (the first round's
    keys). A value equal in every round (a level, a count, a basis) is kept as it is; numbers missing (None) in
    some rounds are the median of the rest; any other value (a judgement such as the SLA's ``met``) is the first
    round's, to be judged again on the medians."""
    first = rounds[0]
    if all(r == first for r in rounds):
        return copy.deepcopy(first)
    if isinstance(first, dict):
        return {k: median_figures([r.get(k) if isinstance(r, dict) else None for r in rounds]) for k in first}
    numbers = [r for r in rounds if _is_number(r)]
    if numbers and all(r is None or _is_number(r) for r in rounds):
        return statistics.median(numbers)
    return copy.deepcopy(first)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def round_figures(level: dict) -> dict:
    """One round's headline figures, as a level's ``spread.per_round`` lists them."""
    return {"output_tokens_per_s": level["output_tokens_per_s"], "requests_per_s": level["requests_per_s"],
            "ttft_p50_ms": level["ttft_ms"].get("p50"), "itl_p50_ms": level["itl_ms"].get("p50"),
            "e2e_p50_ms": level["e2e_ms"].get("p50"), "e2e_p99_ms": level["e2e_ms"].get("p99")}


def spread(rounds: Sequence[dict]) -> dict:
    """How far a level's rounds differ: for each of ``SPREAD_FIGURES`` min, max and (max - min) / median
    (``relative``); the number of rounds, and each round's headline figures."""
    per_round = [round_figures(r) for r in rounds]
    out: dict = {"rounds": len(rounds)}
    for name in SPREAD_FIGURES:
        values = [p[name] for p in per_round]
        mid = statistics.median(values)
        out[name] = {"min": min(values), "max": max(values),
                     "relative": (max(values) - min(values)) / mid if mid else None}
    out["per_round"] = per_round
    return out


def spread_sentence(level: dict) -> str:
    """A level's medians and spread over its rounds, for the log."""
    s = level["spread"]
    tps, p99 = s["output_tokens_per_s"], s["e2e_p99_ms"]
    return (f"c={level['concurrency']}, median of {s['rounds']} rounds: {level['output_tokens_per_s']:.1f} tok/s "
            f"({tps['min']:.1f}-{tps['max']:.1f}, spread {tps['relative']:.0%}), e2e p99 "
            f"{level['e2e_ms']['p99']:.0f} ms ({p99['min']:.0f}-{p99['max']:.0f}, spread {p99['relative']:.0%})")


# ---------------------------------------------------------------- the knee


def find_knee(concurrency: Sequence[int], throughput: Sequence[float], min_gain: float) -> dict:
    """Where added concurrency stops paying: the lowest level from which no higher level gains min_gain or more
    per doubling.

    The gain from level c1 to c2 is normalised per doubling, (t2 / t1) ** (1 / log2(c2 / c1)) - 1, so sweeps
    with uneven steps are judged alike. Every higher level is compared with the candidate, not only the next
    one: one noisy low level (1 -> 2 gaining 9.9 %, then 2 -> 4 and 4 -> 8 gaining 50 % each, as a fresh clone
    measured once) cannot stop the search early, since 1 -> 4 still gains 28 % per doubling. No such level: the
    knee is not inside the sweep (``found`` false; ``concurrency`` is then the highest level, where throughput
    was still rising). ``next_gain_per_doubling``: the best gain per doubling from the knee to any higher level.
    """
    if len(concurrency) != len(throughput) or not concurrency:
        raise ValueError("one throughput per concurrency level")

    def per_doubling(i: int, j: int) -> float:
        t1, t2 = throughput[i], throughput[j]
        return (t2 / t1) ** (1.0 / math.log2(concurrency[j] / concurrency[i])) - 1.0 if t1 > 0 else float("inf")

    n = len(concurrency)
    gains = [{"from": concurrency[i], "to": concurrency[i + 1], "gain_per_doubling": per_doubling(i, i + 1)}
             for i in range(n - 1)]
    for i in range(n - 1):
        best = max(per_doubling(i, j) for j in range(i + 1, n))
        if best < min_gain:
            return {"found": True, "concurrency": concurrency[i], "throughput": throughput[i],
                    "next_gain_per_doubling": best, "min_gain": min_gain, "gains": gains}
    return {"found": False, "concurrency": concurrency[-1], "throughput": throughput[-1],
            "next_gain_per_doubling": None, "min_gain": min_gain, "gains": gains}


def knee_sentence(knee: dict, levels: list[dict]) -> str:
    """The knee in one sentence, with the throughput rise and the latency cost of the level past it."""
    by_c = {l["concurrency"]: l for l in levels}
    first, top = levels[0], max(levels, key=lambda l: l["output_tokens_per_s"])
    rise = (f"throughput rises from {first['output_tokens_per_s']:.1f} output tokens/s at concurrency "
            f"{first['concurrency']} to {top['output_tokens_per_s']:.1f} at {top['concurrency']}")
    if not knee["found"]:
        return (f"{rise}, and was still rising at the highest level ({knee['concurrency']}): the knee is beyond "
                f"this sweep; add higher bench.concurrency levels to find it.")
    c = knee["concurrency"]
    nxt = next(g for g in knee["gains"] if g["from"] == c)["to"]
    lat = by_c[nxt]["e2e_ms"]["p50"] / by_c[c]["e2e_ms"]["p50"]
    return (f"{rise}; past concurrency {c} no level gains more than {knee['next_gain_per_doubling'] * 100:.0f}% per "
            f"doubling (below {knee['min_gain'] * 100:.0f}%) while median end-to-end latency grows {lat:.2f}x to the "
            f"next level: the knee is at concurrency {c}.")


# ---------------------------------------------------------------- the SLA


SLA_NAMES = {"e2e_ms": "end-to-end", "ttft_ms": "TTFT", "itl_ms": "inter-token"}  # the bounded latencies, in words


def goodput(requests: Sequence[dict], wall_s: float, bounds: dict[str, float]) -> dict:
    """One level against the SLA. ``requests``: each successful request's ``e2e_ms``, ``ttft_ms`` and ``itl_ms``
    (None for a one-token answer); ``bounds``: {metric: P99 bound in ms}.

    goodput: requests per second that met every bound on their own (a request is good when each of its own
    latencies is within the bound, as vLLM's serving benchmark and genai-perf count goodput); ``met``: the level
    keeps the SLA, its P99 of each bounded metric within the bound (``violations`` names those that are not).
    """
    good = sum(all(r[m] is None or r[m] <= b for m, b in bounds.items()) for r in requests)
    p99: dict[str, Optional[float]] = {}
    violations = []
    for m, bound in bounds.items():
        values = [r[m] for r in requests if r[m] is not None]
        p99[m] = value = percentile(values, 99) if values else None
        if value is not None and value > bound:
            violations.append(m)
    return {"goodput_rps": good / wall_s if wall_s > 0 else 0.0, "good_requests": good, "requests": len(requests),
            "met": not violations and bool(requests), "p99_ms": p99, "violations": violations}


def sla_choice(levels: list[dict], bounds: dict[str, float]) -> dict:
    """The level to run at under the SLA: the highest throughput among the levels that keep it; none keeping
    it, the lowest level with what it missed by. With a sentence for the report."""
    sla = ", ".join(f"P99 {SLA_NAMES[m]} <= {b:g} ms" for m, b in bounds.items())
    kept = [l for l in levels if l["sla"]["met"]]
    if kept:
        best = max(kept, key=lambda l: l["output_tokens_per_s"])
        return {"met": True, "concurrency": best["concurrency"], "goodput_rps": best["sla"]["goodput_rps"],
                "output_tokens_per_s": best["output_tokens_per_s"],
                "sentence": f"SLA ({sla}) kept up to concurrency {best['concurrency']}: "
                            f"{best['output_tokens_per_s']:.1f} output tokens/s, goodput "
                            f"{best['sla']['goodput_rps']:.2f} requests/s"}
    low = levels[0]
    missed = "; ".join(f"P99 {SLA_NAMES[m]} {low['sla']['p99_ms'][m]:.0f} ms > {bounds[m]:g} ms"
                       for m in low["sla"]["violations"])
    return {"met": False, "concurrency": None, "goodput_rps": max(l["sla"]["goodput_rps"] for l in levels),
            "output_tokens_per_s": None,
            "sentence": f"no level keeps the SLA ({sla}): at the lowest, concurrency {low['concurrency']}, "
                        f"{missed or 'no request succeeded'}. A faster build or a looser SLA is needed; more "
                        f"concurrency only adds latency."}


def padding_factor(settings: Optional[BuildSettings], concurrency: int) -> dict:
    """Useful batch slots / processed batch slots in a decode step, where the build says how batches pad."""
    if settings is None:
        return {"value": None, "basis": "unknown: no build settings for this repository"}
    live = min(concurrency, settings.max_batch_size)
    if targets.get(settings.target).reference_runtime:
        return {"value": 1.0, "basis": "cpu runtime: prompts are prefilled one at a time, unpadded, and each decode "
                                       "step runs exactly the live sequences (attention's K/V padding to the "
                                       "longest sequence is inside the runtime and not counted)"}
    graphs = settings.cuda_graphs
    if graphs.enabled and graphs.enable_padding:
        sizes = sorted(graphs.batch_sizes)
        padded = next((s for s in sizes if s >= live), live)
        return {"value": live / padded, "basis": f"CUDA graphs pad a decode batch of {live} to the captured size "
                                                 f"{padded} (batch_sizes {sizes})"}
    return {"value": 1.0, "basis": "no CUDA-graph padding: decode batches are the live sequences"}


def ratios(this: list[dict], base: list[dict]) -> list[dict]:
    """Per level, this build's figures / the baseline's (None where either is missing or the baseline's is 0)."""

    def r(a, b):
        return a / b if a is not None and b else None

    out = []
    for a, b in zip(this, base, strict=True):
        out.append({
            "concurrency": a["concurrency"],
            "output_tokens_per_s": r(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "requests_per_s": r(a["requests_per_s"], b["requests_per_s"]),
            "ttft_p50": r(a["ttft_ms"].get("p50"), b["ttft_ms"].get("p50")),
            "itl_p50": r(a["itl_ms"].get("p50"), b["itl_ms"].get("p50")),
            "e2e_p50": r(a["e2e_ms"].get("p50"), b["e2e_ms"].get("p50")),
            "e2e_p99": r(a["e2e_ms"].get("p99"), b["e2e_ms"].get("p99")),
        })
    return out
