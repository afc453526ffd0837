"""bench stage: drive the published model on a real Triton server over a concurrency sweep.

At each level of ``bench.concurrency`` the closed-loop client (``load``) sends ``bench.requests_per_level``
streaming requests of ``bench.prompt_tokens`` prompt tokens each, after ``bench.warmup_requests`` unmeasured
ones per server; with ``bench.ignore_eos`` every request generates exactly ``bench.output_tokens`` tokens
(``end_id`` -1), so levels are comparable.

Per level (``target``): the client's figures (throughput, TTFT / ITL / end-to-end percentiles, jitter), the
padding factor where the build says how batches are padded, and Triton's own counters from its metrics
endpoint, read before and after the level. The knee (``stats.find_knee``): the lowest level from which
no higher level gains ``bench.knee_min_gain`` or more per doubling of concurrency (one noisy level cannot move it).
With an SLA (the ``sla`` section's P99 bounds), each level's goodput against it and the level to run at
(``stats.goodput``, ``stats.sla_choice``).

Repeats (``bench.repeats`` > 1): the sweep runs that many rounds, each on prompts of its own; a level's figures are
the medians over its rounds with their spread (``stats.median_rounds``), and the knee and the SLA choice are found
on the medians. Cross-check (``bench.cross_check_concurrency``): after the sweep, aiperf drives the same closed
loop at that level on every target, its figures beside our client's median ones (``openloop.cross_check``).

Comparison mode (``bench.compare_repository``): a second published repository gets its own server and the
same sweep; the results carry this build / baseline ratios. A vllm build is swept once per ``vllm.frontends``
entry (vLLM's OpenAI server, Triton through the vLLM Python-backend model) the same way, with triton / openai
ratios. With ``bench.servers: alone`` (the default) one server is up at a time: each round starts each
target's server in turn, the order reversed from round to round, so an idle engine beside the measured one
takes nothing from it. With ``together`` all are up for the whole run and swept level by level, alternating
which goes first (from level to level, and at each level from round to round), so drifting machine load hits
both alike.

Outputs: ``bench_results.json``, ``throughput_vs_concurrency.png``, ``latency_vs_concurrency.png`` and the
servers' logs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Iterator, Optional

from pipeline import artifacts, console, records
from pipeline import targets as registry
from pipeline.config import BenchSection, PipelineConfig
from pipeline.errors import InputError, StageFailed
from pipeline.serving.bench.load import Prompt, make_prompts
from pipeline.serving.bench.openloop import (
    CROSS_CHECK_TOLERANCE,
    aiperf_executable,
    cross_check,
    run_concurrency,
    run_rate,
    sustainable_rate,
)
from pipeline.serving.bench.plots import LATENCY_PNG, THROUGHPUT_PNG, plot_latency, plot_throughput
from pipeline.serving.bench.stats import find_knee, knee_sentence, median_rounds, ratios, sla_choice, spread_sentence
from pipeline.serving.bench.target import (
    Target,
    build_dir_of,
    build_settings,
    check_lengths,
    check_served,
    read_repository,
    run_level,
    warm_up,
)
from pipeline.serving.serve import measured_server_for_target
from pipeline.serving.server import TritonServer, log_tail
from pipeline.summaries import BenchSummary

log = logging.getLogger(__name__)

BASELINE_SERVER_LOG = "tritonserver_baseline.log"
AIPERF_DIR = "aiperf"  # aiperf's runs: one artifact folder per target and rate (and the cross-check's per target)
THIS, BASELINE = "this build", "baseline"  # target labels
SERVERS_SAID = {  # bench.servers, as the results define it (where there is more than one target)
    "alone": "one server up at a time: each round started each target's server in turn (the order reversed from "
             "round to round), warmed it up, measured every level and stopped it",
    "together": "every target's server up for the whole run, the levels interleaved (the target going first "
                "alternating from level to level and from round to round); the servers shared the host",
}


def run_bench(config: PipelineConfig, publish_dir: Path, samples_file: Path, build_dir: Optional[Path],
              out_dir: Path) -> BenchSummary:
    """The bench stage: sweep this build (and the comparison baseline, if configured); write results and plots."""
    cfg, sla = config.bench, config.sla.bounds()
    targets = _resolve_targets(config, publish_dir, build_dir)
    warm, measured = _prompts(cfg, targets[0], samples_file)
    exe = aiperf_executable() if cfg.uses_aiperf else ""  # missing: stop before any server starts

    t_start = time.perf_counter()
    checked = _sweep(targets, warm=warm, measured=measured, cfg=cfg, sla=sla, exe=exe, out_dir=out_dir)
    bench_s = time.perf_counter() - t_start

    knees = _find_knees(targets, cfg)
    for t in targets:
        log.info("%s: %s", t.label, knee_sentence(knees[t.label], t.levels))
    _write_plots(targets, knees, out_dir)
    choices = {t.label: sla_choice(t.levels, sla) for t in targets} if sla else {}
    for label, choice in choices.items():
        log.info("%s: %s", label, choice["sentence"])
    sustained = {t.label: sustainable_rate(t.rates, sla) for t in targets if t.rates}
    for label, rate in sustained.items():
        log.info("%s: %s", label, rate["sentence"])
    results = _results(cfg, sla, targets=targets, knees=knees, choices=choices, sustained=sustained, bench_s=bench_s)
    if checked:
        results["cross_check"] = checked
    records.write_bench_results(out_dir, records.BenchResults.model_validate(results))
    return _summary(targets, knees, choices, sustained, bench_s)


def compare_fingerprint(cfg: BenchSection) -> dict:
    """The bench stage's outside input: the comparison baseline's published content (its repository digest)."""
    if cfg.compare_repository is None:
        return {}
    repo, prov = read_repository(cfg.compare_repository)
    return {"compare_repository": str(repo), "compare_repository_digest": prov.repository_digest}


# ---------------------------------------------------------------- before the sweep


def _resolve_targets(config: PipelineConfig, publish_dir: Path, build_dir: Optional[Path]) -> list[Target]:
    """This build (and the comparison baseline, if configured), checked before any server starts."""
    cfg = config.bench
    repo, prov = read_repository(publish_dir / artifacts.MODEL_REPOSITORY_DIR)
    settings = build_settings(build_dir)
    frontends = list(registry.get(prov.build.target).frontends(config))
    targets = [Target(THIS if len(frontends) == 1 else f"{THIS} ({f})", repo, prov, settings, frontend=f)
               for f in frontends]
    if cfg.compare_repository is not None:
        targets.append(_baseline(cfg.compare_repository, prov))
    for t in targets:
        check_lengths(cfg, t.settings, t.label)
        if not config.triton.decoupled and t.label != BASELINE and not t.openai:
            raise InputError("bench drives the streaming model, which needs triton.decoupled: true")
    return targets


def _baseline(path: Path, this: records.Provenance) -> Target:
    """bench.compare_repository as a target; it must be another build than this one."""
    repo, prov = read_repository(path)
    if prov.repository_digest == this.repository_digest:
        raise InputError(f"bench.compare_repository {repo} is this very build (same repository digest); "
                         f"point it at another build's published repository")
    return Target(BASELINE, repo, prov, build_settings(build_dir_of(repo)),
                  frontend=registry.get(prov.build.target).default_frontends[0])


def _prompts(cfg: BenchSection, target: Target, samples_file: Path) -> tuple[list[Prompt], list[Prompt]]:
    """(warm-up prompts, measured prompts), tokenized as the target's preprocessing model tokenizes them."""
    from transformers import AutoTokenizer  # heavy: imported only when the stage runs

    tokenizer = AutoTokenizer.from_pretrained(str(target.tokenizer_dir))
    warm_n = cfg.warmup_requests
    prompts = make_prompts(samples_file, tokenizer, cfg.prompt_tokens,
                           warm_n + cfg.requests_per_level * len(cfg.concurrency) * cfg.repeats)
    return prompts[:warm_n], prompts[warm_n:]


# ---------------------------------------------------------------- the sweep

DEATH_CHECK_S = 2.0  # after a failed level, how long a server may take to be seen dead


@contextlib.contextmanager
def _servers(group: list[Target], main: Target, cfg: BenchSection, out_dir: Path) -> Iterator[None]:
    """A server for each target of ``group`` while the block runs: for ``main`` (this build), bench.grpc_url's
    where set (checked first), otherwise one started here on the target's repository, its log in ``out_dir``
    (appended to where the target's server starts again), stopped on leaving."""
    started = []
    try:
        for t in group:
            if t is main and cfg.grpc_url is not None:
                t.grpc_url, t.metrics_url = cfg.grpc_url, cfg.metrics_url
                check_served(t)
                continue
            log_name = (artifacts.SERVER_LOG_FILE if t is main else BASELINE_SERVER_LOG if t.label == BASELINE
                        else f"server_{t.frontend}.log")
            server = measured_server_for_target(t.provenance.build.target, t.repository, frontend=t.frontend,
                                                log_path=out_dir / log_name)
            server.start()
            started.append(server)
            t.server, t.grpc_url, t.metrics_url = server, server.grpc_url, server.metrics_url
            t.http_url = server.http_url
        try:
            yield
        except Exception as e:
            for s in started:  # the requests failed because the server went away: say so, with its log
                code = s.exit_code_within(DEATH_CHECK_S)
                if code is not None:
                    tail = log_tail(s.log_path) if s.log_path else "(no log)"
                    raise StageFailed(f"bench: tritonserver died during the sweep (exit code {code}): a server "
                                      f"failure. Last lines of its log ({s.log_path}):\n{tail}") from e
            if isinstance(e, StageFailed) and started:  # requests failed on live servers: keep their side of it
                stacks = [s for s in started if isinstance(s, TritonServer) and s.dump_python_stacks()]
                kept = ", ".join(f"logs/bench.failed.{s.log_path.name}" for s in started if s.log_path)
                raise StageFailed(f"{e} The log of the server bench started is kept as {kept}"
                                  + (", ending with where every Python thread of its models stood then (they "
                                     "dump their stacks on SIGUSR1)." if stacks else ".")) from e
            raise
    finally:
        for server in started:
            server.stop()


def _sweep(targets: list[Target], *, warm: list[Prompt], measured: list[Prompt], cfg: BenchSection,
           sla: dict[str, float], exe: str, out_dir: Path) -> dict[str, dict]:
    """``bench.repeats`` rounds of every level on every target (each level of each round on prompts of its own),
    each server warmed up when it starts; each level's figures are then the medians over its rounds. Then, on
    the servers of the last round, the cross-check and the open-loop rates; their cross-check, by label.

    ``bench.servers`` "together": every server up for the whole run, the target going first alternating from
    level to level and from round to round. "alone" (or one target): one server up at a time, each round
    starting each target's server in turn, the order reversed from round to round."""
    levels, n = list(cfg.concurrency), cfg.requests_per_level
    rounds: dict[str, list[list[dict]]] = {t.label: [[] for _ in levels] for t in targets}
    checked: dict[str, dict] = {}

    def level(t: Target, r: int, k: int, progress: console.Step) -> None:
        i = r * len(levels) + k
        rounds[t.label][k].append(run_level(t, measured[i * n:(i + 1) * n], levels[k], cfg, sla))
        progress.advance()

    def after(group: list[Target]) -> None:  # on the last round's servers, every round of theirs measured
        for t in group:
            t.levels = [median_rounds(per_level, sla) for per_level in rounds[t.label]]
            for lv in t.levels if cfg.repeats > 1 else ():
                log.info("%s %s", t.label, spread_sentence(lv))
        if cfg.cross_check_concurrency is not None:
            checked.update(_cross_check(exe, group, cfg.cross_check_concurrency, cfg, out_dir / AIPERF_DIR))
        if cfg.request_rates:
            _open_loop(exe, group, cfg, sla, out_dir / AIPERF_DIR)

    def either_way(group: list[Target], first: int) -> list[Target]:
        return group if first % 2 == 0 else list(reversed(group))

    main = targets[0]
    with console.step("bench: concurrency levels", total=cfg.repeats * len(levels) * len(targets)) as progress:
        if cfg.servers == "together" or len(targets) == 1:
            with _servers(targets, main, cfg, out_dir):
                for t in targets:
                    warm_up(t, warm, min(len(warm), levels[-1]), cfg)
                for r in range(cfg.repeats):
                    for k in range(len(levels)):
                        for t in either_way(targets, k + r):
                            level(t, r, k, progress)
                after(targets)
        else:
            for r in range(cfg.repeats):
                for t in either_way(targets, r):
                    with _servers([t], main, cfg, out_dir):
                        warm_up(t, warm, min(len(warm), levels[-1]), cfg)
                        for k in range(len(levels)):
                            level(t, r, k, progress)
                        if r == cfg.repeats - 1:
                            after([t])
    return checked


def _cross_check(exe: str, targets: list[Target], c: int, cfg: BenchSection, out_dir: Path) -> dict[str, dict]:
    """aiperf's closed loop at concurrency ``c`` (bench.cross_check_concurrency) on every target, beside our
    client's (median) level there; by label. A disagreement is logged and recorded, not a failure: it is evidence
    about the clients."""
    out = {}
    for t in targets:
        theirs = run_concurrency(exe, openai=t.openai, http_url=t.http_url, model=_aiperf_model(t),
                                 tokenizer_dir=t.tokenizer_dir, concurrency=c, cfg=cfg,
                                 out_dir=out_dir / f"{_folder(t.label)}_c{c}", label=t.label)
        out[t.label] = cross_check(next(l for l in t.levels if l["concurrency"] == c), theirs, c)
        log.info("%s, cross-check against aiperf: %s", t.label, out[t.label]["sentence"])
    return out


def _open_loop(exe: str, targets: list[Target], cfg: BenchSection, sla: dict[str, float], out_dir: Path) -> None:
    """aiperf at every rate of bench.request_rates on every target, alternating which target goes first."""
    for k, rate in enumerate(cfg.request_rates):
        for t in targets if k % 2 == 0 else list(reversed(targets)):
            t.rates.append(run_rate(exe, openai=t.openai, http_url=t.http_url, model=_aiperf_model(t),
                                    tokenizer_dir=t.tokenizer_dir, rate=rate, cfg=cfg, sla=sla,
                                    out_dir=out_dir / f"{_folder(t.label)}_{rate:g}", label=t.label))


def _aiperf_model(t: Target) -> str:
    """The model aiperf asks for: vLLM's served model name, or Triton's streaming model."""
    return getattr(t.server, "model_name", "") if t.openai else t.names.stream


def _folder(label: str) -> str:
    """A target's label as a folder name: "this build (openai)" -> "this_build_openai"."""
    return label.replace(" ", "_").replace("(", "").replace(")", "")


# ---------------------------------------------------------------- after the sweep


def _find_knees(targets: list[Target], cfg: BenchSection) -> dict[str, dict]:
    """Each target's knee, by label."""
    levels = list(cfg.concurrency)
    return {t.label: find_knee(levels, [l["output_tokens_per_s"] for l in t.levels], cfg.knee_min_gain)
            for t in targets}


def _write_plots(targets: list[Target], knees: dict[str, dict], out_dir: Path) -> None:
    levels_by_label = {t.label: t.levels for t in targets}
    plot_throughput(levels_by_label, knees, out_dir / THROUGHPUT_PNG)
    plot_latency(levels_by_label, out_dir / LATENCY_PNG)


def _results(cfg: BenchSection, sla: dict[str, float], *, targets: list[Target], knees: dict[str, dict],
             choices: dict[str, dict], sustained: dict[str, dict], bench_s: float) -> dict:
    """bench_results.json: the settings, what each figure means, and every target's levels and knee."""
    results = {
        "format_version": 1,
        "tool": "pipeline.serving.bench: closed loop; tritonclient asyncio gRPC streams (Triton), openai's AsyncOpenAI "
                "streamed completions (vLLM)" if any(t.openai for t in targets)
                else "pipeline.serving.bench: tritonclient asyncio gRPC streams, closed loop",
        **({"open_loop_tool": "aiperf (NVIDIA), Poisson arrivals, streamed"} if cfg.request_rates else {}),
        "settings": {**cfg.model_dump(mode="json"), "model": targets[0].names.stream,
                     "end_id": -1 if cfg.ignore_eos else "the model's EOS"},
        "definitions": {
            "output_tokens_per_s": "tokens received by all requests of the level / the level's wall time",
            "ttft_ms": "request sent -> first response carrying a token",
            "itl_ms": "per request: (end-to-end - TTFT) / (output tokens - 1)",
            "e2e_ms": "request sent -> last token received",
            "jitter": "standard deviation / mean",
            "token_gap_ms": "time between consecutive responses, per token they carried, over all requests",
            "triton": "Triton's per-model counters, after the level minus before, per successful request; the "
                      "decoupled models return from execute at once, so their compute time is not generation time",
            "knee": f"the lowest level from which no higher level gains {cfg.knee_min_gain:.0%} or more per doubling",
            "sla": "P99 bounds in ms (config sla:) for this request mix; a level keeps the SLA when its P99 of each "
                   "bounded latency is within the bound",
            "goodput_rps": "requests per second whose own latencies were all within the SLA's bounds",
            "rates": "open loop (bench.request_rates): aiperf sends requests_per_level requests with Poisson "
                     "arrivals at the rate; arrived_rps is the rate they actually arrived at, requests_per_s "
                     "aiperf's completed requests / run time; goodput is aiperf's, against the same SLA bounds",
            "sustainable_rate": "the highest rate with no failed request whose P99s kept the SLA (rates judged in "
                                "ascending order; the first that fails ends the search; none without an SLA)",
            **({"servers": SERVERS_SAID[cfg.servers]} if len(targets) > 1 else {}),
            **({"repeats": f"the sweep ran {cfg.repeats} rounds, each on prompts of its own: every figure of a "
                           "level is the median over its rounds of that figure as each round measured it (a P99 is "
                           "the median of the rounds' P99s, not the P99 of all their requests); the SLA is judged, "
                           "and the knee and the SLA choice found, on the medians",
                "spread": "per level, over its rounds: min, max and (max - min) / median (relative) of output "
                          "tokens/s and of P99 end-to-end latency; per_round: each round's headline figures"}
               if cfg.repeats > 1 else {}),
            **({"cross_check": f"aiperf (NVIDIA) drives the same closed loop at concurrency "
                               f"{cfg.cross_check_concurrency} after the sweep, on the same server: requests_per_level "
                               "streamed requests of the same prompt and output token counts on the same endpoint; "
                               "its synthetic prompts differ from ours in content but have the same token counts. "
                               "It counts output tokens by tokenizing the streamed text (output_tokens_mean), which "
                               "need not match the tokens the server generated: its output tokens/s and ITL follow "
                               "that count. ours: our client's figures of that level (the medians over rounds); "
                               f"aiperf_over_ours: aiperf / ours; agree: aiperf's requests/s within "
                               f"{CROSS_CHECK_TOLERANCE:.0%} of ours (every request is output_tokens long on the "
                               "server; a disagreement is reported, not a failure)"}
               if cfg.cross_check_concurrency is not None else {}),
        },
        "sla": sla or None,
        "bench_s": bench_s,
        "targets": [{**t.describe(), "levels": t.levels, "knee": knees[t.label],
                     "knee_sentence": knee_sentence(knees[t.label], t.levels),
                     "sla_choice": choices.get(t.label),
                     **({"rates": t.rates, "sustainable_rate": sustained[t.label]} if t.rates else {})}
                    for t in targets],
    }
    baseline, by_frontend = _pairs(targets)
    if baseline is not None:
        results["comparison"] = {"ratio": "this build / baseline", "levels": ratios(targets[0].levels,
                                                                                     baseline.levels)}
    if by_frontend:
        results["frontends"] = {"ratio": "Triton (vLLM Python-backend model) / vLLM's OpenAI server",
                                "levels": ratios(by_frontend["triton"].levels, by_frontend["openai"].levels)}
    return results


def _pairs(targets: list[Target]) -> tuple[Optional[Target], dict[str, Target]]:
    """(the baseline target or None, {frontend: target} where this build is served both ways, else {})."""
    baseline = next((t for t in targets if t.label == BASELINE), None)
    mine = {t.frontend: t for t in targets if t.label != BASELINE}
    return baseline, mine if set(mine) == {"openai", "triton"} else {}


def _summary(targets: list[Target], knees: dict[str, dict], choices: dict[str, dict], sustained: dict[str, dict],
             bench_s: float) -> BenchSummary:
    """The stage's manifest summary: this build's levels in brief, its peak and knee, and the ratios if compared."""
    main = targets[0]
    top = max(main.levels, key=lambda l: l["output_tokens_per_s"])
    summary: BenchSummary = {
        "levels": [_level_summary(l) for l in main.levels],
        "peak_output_tokens_per_s": round(top["output_tokens_per_s"], 2),
        "peak_at_concurrency": top["concurrency"],
        "knee_concurrency": knees[main.label]["concurrency"] if knees[main.label]["found"] else None,
        "knee": knee_sentence(knees[main.label], main.levels),
        "sla": choices.get(main.label),
        "repository_digest": main.provenance.repository_digest,
        "bench_s": round(bench_s, 1),
    }
    if main.label in sustained:
        summary["sustainable_rate"] = sustained[main.label]
    baseline, by_frontend = _pairs(targets)
    if by_frontend:
        per = ratios(by_frontend["triton"].levels, by_frontend["openai"].levels)
        summary["frontends"] = {"triton_over_openai_output_tokens_per_s": [round(x["output_tokens_per_s"], 3)
                                                                          for x in per],
                                "triton": [_level_summary(l) for l in by_frontend["triton"].levels]}
    if baseline is not None:
        comp = ratios(main.levels, baseline.levels)
        summary["comparison"] = {
            "baseline": baseline.describe(),
            "output_tokens_per_s_ratio": [round(x["output_tokens_per_s"], 3) for x in comp],
            "e2e_p50_ratio": [round(x["e2e_p50"], 3) for x in comp],
        }
    return summary


def _level_summary(level: dict) -> dict:
    return {"concurrency": level["concurrency"], "output_tokens_per_s": round(level["output_tokens_per_s"], 2),
            "requests_per_s": round(level["requests_per_s"], 3), "ttft_p50_ms": round(level["ttft_ms"]["p50"], 1),
            "itl_p50_ms": round(level["itl_ms"]["p50"], 2) if level["itl_ms"].get("p50") is not None else None,
            "e2e_p50_ms": round(level["e2e_ms"]["p50"], 1), "e2e_p99_ms": round(level["e2e_ms"]["p99"], 1),
            **({"goodput_rps": round(level["sla"]["goodput_rps"], 3), "sla_met": level["sla"]["met"]}
               if level.get("sla") else {})}
