"""`invoke optimize`: the plan and the serving settings chosen together, by measurement, against an accuracy floor
and the SLA.

A candidate is a plan (``optimize.candidates``: config fields of the plan and the quantization); ``seed``, the
config's own plan, is always one. Without candidates in the config: ``seed``, its ``sensitivity.threshold`` halved
and doubled, and ``all-<format>`` (every layer in ``quantization.weight_format`` but those ``plan.rules`` keep).
Each is built in a work dir of its own, ``<work dir>/optimize/candidates/<name>/``, first seeded with hard links
to the config's own stage folders: what a candidate shares with the config (the download, the sensitivity
measurement, which a threshold does not change) is up to date there and not redone, and a candidate built by an
earlier run is up to date too (the stage cache, pipeline/runner.py).

The search, cheapest evidence first:

1. **Accuracy.** Each candidate is built through the quantize stage's gate (``quantization.accuracy``: perplexity,
   top-1, KL and any lm-eval tasks). The gate refuses a candidate: it is out, with the gate's reason. With
   ``optimize.floor: seed`` a candidate must also be no worse than ``seed`` on perplexity, top-1 and KL. A
   candidate whose stages fail otherwise is recorded as failed, with its log, and the search goes on.
2. **Speed, by successive halving.** The survivors are measured at the config's serving settings, each on its own
   server under `invoke tune`'s load; the better half (keeping the SLA first, then the goal) goes on to a round
   with twice the requests, until ``optimize.finalists`` remain. The last round has ``tune.requests``.
3. **Serving settings.** On each finalist, `invoke tune`'s search (pipeline/serving/tune.py).
4. **The choice**, among the measured (plan, settings) points that keep the SLA: with ``goal: goodput`` the most
   good requests/s, and ``seed`` unless another beats it by ``tune.min_gain`` (noise is not a gain); with ``goal:
   memory`` the fewest weight bytes among those with at least ``min_goodput_rps``. Then the choice and
   ``optimize.compare_with`` side by side: ``tune.ab_rounds`` rounds, the order rotated, one server up at a time
   (each started for its turn; ``bench.servers: together`` keeps them all up); where
   ``seed``'s medians keep the SLA with at least the choice's goodput, ``seed`` stays (``confirm``).
5. **Published:** the chosen serving settings are written to the candidate's ``tune/tuned_settings.yaml`` and its
   publish stage runs. No candidate meets the objective: nothing is published, and the error names the closest
   candidates and what each missed by.

Cost, for C candidates of which S pass the gate: C quantize-and-build runs (less those up to date: a rerun costs
only the measurements); ceil(log2(S / finalists)) halving rounds, each about S x tune.requests / 2^(rounds - 1)
requests and one server start per candidate measured; each finalist's serving search, as `invoke tune` (up to
log2(build.max_batch_size) + 4 servers); then (len(compare_with) + 1) x tune.ab_rounds server starts for the
side-by-side rounds (len(compare_with) + 1 with bench.servers "together"). The
quantize stage dominates (the gate evaluates both models; a refusal is remembered with the gate's inputs, so a
rerun does not evaluate that candidate again): cost grows linearly in C; bound it with fewer
candidates, ``text.evaluation.num_samples``, or ``optimize.serving_search: false``.

Written to ``<work dir>/optimize/results/`` (replaced when a run ends; a run that chose nothing writes
``results.failed/``): ``optimize_results.json``, ``optimize.md`` (the table, the front, the choice and why, the
cost), ``pareto.png`` and ``optimize.log`` (the servers' lines and each measurement).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import yaml

from pipeline import artifacts, console, targets
from pipeline.config import OptimizeCandidate, PipelineConfig
from pipeline.errors import GateFailed, InputError, PipelineError, StageFailed
from pipeline.fsutil import atomic_write_json, atomic_write_text, hash_json, remove_tree, replace_dir
from pipeline.runner import Runner
from pipeline.serving import tune as tuning
from pipeline.serving.bench.stats import SLA_NAMES
from pipeline.serving.serve import gpu_server_binary
from pipeline.serving.tuned import FORMAT_VERSION, TUNE_DIR, TUNED_FILE, build_digest, servers_said

log = logging.getLogger(__name__)

OPTIMIZE_DIR = artifacts.OPTIMIZE_DIR  # <work dir>/optimize
CANDIDATES_DIR = "candidates"  # <work dir>/optimize/candidates/<name>: a candidate's work dir
RESULTS_DIR = artifacts.OPTIMIZE_RESULTS_DIR
FAILED_DIR = RESULTS_DIR + ".failed"
RESULTS_FILE = artifacts.OPTIMIZE_RESULTS_FILE
TABLE_FILE = artifacts.OPTIMIZE_TABLE_FILE
PLOT_FILE = artifacts.OPTIMIZE_PLOT_FILE
LOG_FILE = "optimize.log"
SEED = "seed"
# the config's stage folders a candidate's work dir starts from (hard links: nothing is copied)
SEEDED_STAGES = ("model", "text", "sensitivity", "plan", "quantize", "build")
ACCURACY = ("perplexity_increase_pct", "top1_agreement", "kl_divergence")
# in a candidate's work dir: the quantize stage's inputs the gate refused and why (a refusal leaves no stage output
# for the cache to keep, so without it every run would quantize and evaluate that candidate again)
REFUSED_FILE = "gate_refused.json"

OpenCandidate = Callable[[list[str]], Runner]  # --set overrides on top of the config's -> the candidate's runner


@dataclass
class Candidate:
    name: str
    overrides: dict
    runner: Runner
    status: str = "pending"  # built, gate, worse than seed, failed, measured
    why: str = ""
    log: Optional[str] = None
    accuracy: dict = field(default_factory=dict)
    weight_bytes: Optional[int] = None
    kept_high_precision: Optional[int] = None
    built_s: float = 0.0
    stages_run: int = 0
    rounds: list[dict] = field(default_factory=list)  # each halving round: {"round", "requests", figures}
    points: list[dict] = field(default_factory=list)  # measured (settings, label, level) at full load

    @property
    def work_dir(self) -> Path:
        return self.runner.work_dir

    def row(self) -> dict:
        return {"name": self.name, "set": self.overrides, "status": self.status, "why": self.why, "log": self.log,
                "accuracy": self.accuracy, "weight_bytes": self.weight_bytes,
                "kept_high_precision": self.kept_high_precision, "built_s": round(self.built_s, 1),
                "stages_run": self.stages_run, "rounds": self.rounds,
                "points": [{"label": p["label"], "settings": p["settings"],
                            **tuning.point_figures(p["level"])} for p in self.points]}


# ---------------------------------------------------------------- the candidates


def candidate_plans(config: PipelineConfig) -> list[OptimizeCandidate]:
    """``seed`` first, then the config's candidates, or without any the derived ones (this module's docstring)."""
    listed = list(config.optimize.candidates)
    if any(c.name == SEED for c in listed):
        raise InputError(f"optimize.candidates: {SEED!r} is the config's own plan, always a candidate; give yours "
                         f"another name")
    seed = OptimizeCandidate(name=SEED)
    if listed:
        return [seed, *listed]
    out = [seed]
    threshold, plan = config.sensitivity.threshold, config.plan
    as_threshold = {} if plan.mode == "threshold" else {"plan.mode": "threshold", "plan.budget": None}
    for t in (threshold / 2, threshold * 2):
        if t < 10:  # the schema's bound
            out.append(OptimizeCandidate(name=f"threshold-{t:g}", set={**as_threshold, "sensitivity.threshold": t}))
    base = config.quantization.weight_format
    if base != "none":  # rules first, the last matching wins: the config's own rules still keep their layers
        rules = [{"pattern": "*", "format": base}, *(r.model_dump(exclude_none=True, exclude_defaults=True)
                                                     for r in plan.rules)]
        out.append(OptimizeCandidate(name=f"all-{base}", set={"plan.rules": rules}))
    return out


def override_args(candidate: OptimizeCandidate) -> list[str]:
    """The candidate as --set items (its name is its work dir's)."""
    return [f"name={candidate.name}", *(f"{k}={json.dumps(v)}" for k, v in candidate.set.items())]  # JSON is YAML


def check_optimizable(config: PipelineConfig) -> None:
    """What `invoke optimize` needs, refused before any work."""
    target = targets.get(config.build.target)
    if target.device_only or not target.tunable:
        raise InputError(f"invoke optimize builds and measures every candidate on real servers, with invoke tune's "
                         f"search; the {target.name} target's serving settings are not tuned by it "
                         f"({target.untuned_why or 'its engine runs on its device'})")
    if target.gpu_only and gpu_server_binary() is None:
        raise InputError(f"invoke optimize builds and measures every {target.name} candidate on the image's "
                         f"tritonserver, which is not on PATH here: run it on the GPU machine with the Triton "
                         f"TensorRT-LLM image (the same command and config), where each candidate's engine is built "
                         f"and served")
    tuning.check_measurable(config, "invoke optimize")
    names = {c.name for c in candidate_plans(config)}
    missing = [n for n in config.optimize.compare_with if n not in names]
    if missing:
        raise InputError(f"optimize.compare_with names {', '.join(missing)}, not a candidate (the candidates: "
                         f"{', '.join(sorted(names))})")


def open_candidates(config: PipelineConfig, open_candidate: OpenCandidate) -> list[Candidate]:
    """Every candidate's runner, each config checked before any work (a bad candidate is an error naming it)."""
    out = []
    for plan in candidate_plans(config):
        try:
            runner = open_candidate(override_args(plan))
        except PipelineError as e:
            raise InputError(f"optimize candidate {plan.name!r} ({plan.set}) is not a valid config: {e}") from None
        out.append(Candidate(plan.name, plan.set, runner))
    return out


def seed_work_dir(base: Path, runner: Runner) -> None:
    """Seed a candidate's work dir with the config's stage folders where it has none of its own: files as hard
    links (stages write new files and rename them into place, never into one in place), but a stage's manifest
    and the outputs a person may edit in place (the plan) as copies, so nothing done in a candidate's folder
    reaches the config's. The runner then judges each; a folder whose inputs differ for the candidate is rebuilt
    there."""
    for stage in SEEDED_STAGES:
        src, dst = base / stage, runner.work_dir / stage
        if dst.exists() or not (src / artifacts.MANIFEST_FILE).is_file():
            continue
        copied = {artifacts.MANIFEST_FILE, *runner.stages[stage].editable}

        def link_or_copy(a: str, b: str, src: Path = src, copied: set = copied) -> None:
            if Path(a).relative_to(src).as_posix() in copied:
                shutil.copy2(a, b)
            else:
                os.link(a, b)

        tmp = runner.work_dir / artifacts.STAGING_DIR / f"seed-{stage}-{uuid.uuid4().hex[:8]}"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, tmp, copy_function=link_or_copy, symlinks=True)
        os.rename(tmp, dst)


def build_candidate(c: Candidate, base: Path) -> None:
    """Through the gate and the build; the outcome recorded on ``c`` (a failure is recorded, not raised)."""
    seed_work_dir(base, c.runner)
    t0 = time.monotonic()

    def echo(line: str) -> None:
        console.status(f"optimize {c.name}: {line}")

    refusal = c.work_dir / REFUSED_FILE
    stages = c.runner.closure(["build"])
    recorded = {s: (c.runner.read_manifest(s) or {}).get("finished_at") for s in stages}
    try:
        c.runner.run(["plan"], echo=echo)  # then the gate's inputs are known: a refusal is not measured again
        gate_inputs = hash_json(c.runner.compute_inputs(c.runner.stages["quantize"]))
        before = json.loads(refusal.read_text()) if refusal.is_file() else {}
        if before.get("inputs") == gate_inputs:
            c.status, c.why = "gate", f"{before['why']} (the same inputs as the last run's refusal)"
        else:
            c.runner.run(["build"], echo=echo)
            c.status = "built"
            refusal.unlink(missing_ok=True)
    except GateFailed as e:
        c.status, c.why = "gate", str(e).split(" Nothing was exported")[0]
        atomic_write_json(refusal, {"inputs": gate_inputs, "why": c.why})
    except (PipelineError, OSError) as e:  # a crash of this candidate's stages: recorded, the search goes on
        c.status, c.why = "failed", str(e).split("\n")[0]
        logs = sorted((c.work_dir / "logs").glob("*.failed.log"), key=lambda p: p.stat().st_mtime)
        c.log = str(logs[-1]) if logs else None
    c.stages_run = sum((c.runner.read_manifest(s) or {}).get("finished_at") != recorded[s] for s in stages)
    c.built_s = time.monotonic() - t0
    quantize = c.runner.read_manifest("quantize") if c.status == "built" else None
    if quantize:
        s = quantize.get("summary", {})
        acc = s.get("accuracy", {})
        c.accuracy = {k: acc.get(k) for k in ACCURACY} | {"tasks": [
            {"name": t.get("name"), "recovery": t.get("recovery")} for t in acc.get("tasks", [])]}
        c.weight_bytes, c.kept_high_precision = s.get("checkpoint_bytes"), s.get("kept_high_precision")
    console.echo(f"optimize {c.name}: {c.status}" + (f" ({c.why})" if c.why else "") +
                 (f", perplexity +{c.accuracy['perplexity_increase_pct']:.2f} %" if c.accuracy else "") +
                 f" [{c.built_s:.0f} s, {c.stages_run} stage(s) run]")


def apply_floor(cands: list[Candidate], floor: str) -> None:
    """``floor: seed``: a built candidate worse than seed on perplexity, top-1 or KL is out."""
    seed = next(c for c in cands if c.name == SEED)
    if floor != "seed" or seed.status != "built":
        return
    s = seed.accuracy
    for c in cands:
        if c.status != "built" or c is seed:
            continue
        a = c.accuracy
        worse = ([f"perplexity +{a['perplexity_increase_pct']:.2f} % > seed's +{s['perplexity_increase_pct']:.2f} %"]
                 if a["perplexity_increase_pct"] > s["perplexity_increase_pct"] else [])
        worse += ([f"top-1 {a['top1_agreement']:.4f} < seed's {s['top1_agreement']:.4f}"]
                  if a["top1_agreement"] < s["top1_agreement"] else [])
        worse += ([f"KL {a['kl_divergence']:.4f} > seed's {s['kl_divergence']:.4f}"]
                  if a["kl_divergence"] > s["kl_divergence"] else [])
        if worse:
            c.status, c.why = "worse than seed", "; ".join(worse)


# ---------------------------------------------------------------- ranking, the front, the choice (pure)


def rank_key(figures: dict, weight_bytes: int, goal: str, min_goodput: Optional[float]) -> tuple:
    """Larger is better: keeping the SLA first, then the goal."""
    if goal == "goodput":
        return (figures["sla_met"], figures["goodput_rps"])
    ok = figures["sla_met"] and figures["goodput_rps"] >= (min_goodput or 0)
    return (ok, -weight_bytes if ok else figures["goodput_rps"])


def halving_schedule(survivors: int, finalists: int, requests: int, concurrency: int) -> list[int]:
    """Requests per candidate in each round: the last has ``requests``; each earlier one half the next (at least
    one per client)."""
    rounds = max(1, math.ceil(math.log2(max(survivors, 1) / finalists))) if survivors > finalists else 1
    return [max(concurrency, math.ceil(requests / 2 ** (rounds - 1 - r))) for r in range(rounds)]


def pareto_front(points: list[dict]) -> list[dict]:
    """The points no other point beats on every axis (more goodput, less perplexity increase, fewer weight
    bytes) and strictly on one. Each point: {"goodput_rps", "perplexity_increase_pct", "weight_bytes", ...}."""
    def axes(p: dict) -> tuple:
        return (p["goodput_rps"], -p["perplexity_increase_pct"], -p["weight_bytes"])

    def beats(a: dict, b: dict) -> bool:
        return all(x >= y for x, y in zip(axes(a), axes(b), strict=True)) and axes(a) != axes(b)

    return [p for p in points if not any(beats(q, p) for q in points)]


def choose(points: list[dict], *, goal: str, min_goodput: Optional[float], min_gain: float) -> tuple[
        Optional[dict], str]:
    """(the chosen point or None, why). A point: {"candidate", "label", "settings", "sla_met", "goodput_rps",
    "weight_bytes", "perplexity_increase_pct", ...}."""
    ok = [p for p in points if p["sla_met"] and (goal == "goodput" or p["goodput_rps"] >= (min_goodput or 0))]
    if not ok:
        return None, "no candidate meets the objective"
    if goal == "memory":
        best = min(ok, key=lambda p: (p["weight_bytes"], -p["goodput_rps"]))
        return best, (f"{best['candidate']} ({best['label']}) has the fewest weight bytes, "
                      f"{best['weight_bytes'] / 2**20:.1f} MiB, among the deployments keeping the SLA with at least "
                      f"{min_goodput:g} good requests/s ({best['goodput_rps']:.2f})")
    best = max(ok, key=lambda p: (p["goodput_rps"], -p["perplexity_increase_pct"]))
    seed = [p for p in ok if p["candidate"] == SEED]
    top_seed = max(seed, key=lambda p: p["goodput_rps"]) if seed else None
    if top_seed is not None and best is not top_seed and best["goodput_rps"] < top_seed["goodput_rps"] * (1 + min_gain):
        return top_seed, (f"seed ({top_seed['label']}) stays: {top_seed['goodput_rps']:.2f} good requests/s, and "
                          f"the best other, {best['candidate']} ({best['label']}, {best['goodput_rps']:.2f}), does "
                          f"not beat it by tune.min_gain {min_gain:.0%}")
    vs = (f"; {best['goodput_rps'] / top_seed['goodput_rps']:.2f}x seed's best" if top_seed and top_seed is not best
          and top_seed["goodput_rps"] > 0 else "; seed keeps no SLA-meeting point" if not top_seed else "")
    return best, (f"{best['candidate']} ({best['label']}) keeps the SLA with the most goodput, "
                  f"{best['goodput_rps']:.2f} good requests/s{vs}")


def confirm(chosen: dict, side: dict, points: list[dict]) -> tuple[dict, str]:
    """The side-by-side rounds' verdict on the choice: where seed's medians keep the SLA with at least the
    chosen one's goodput, seed (at the config's settings) stays; else the choice holds."""
    med, name = side["medians"], side_key(chosen["candidate"], chosen["settings"])
    seed = med.get(SEED)
    if name == SEED or seed is None or not seed["sla_kept"] or seed["goodput_rps"] < med[name]["goodput_rps"]:
        return chosen, (f"confirmed side by side ({side['rounds']} round(s), medians: {med[name]['goodput_rps']:.2f} "
                        f"good requests/s" + (f" vs seed's {seed['goodput_rps']:.2f})" if seed else ")"))
    stays = next((p for p in points if p["candidate"] == SEED and not p["settings"]),
                 {"candidate": SEED, "label": tuning.DEFAULT, "settings": {}})  # out in a halving round
    return stays, (f"the side-by-side rounds did not confirm it: seed's median goodput {seed['goodput_rps']:.2f} "
                   f"kept the SLA and was not below its {med[name]['goodput_rps']:.2f} (the machine's noise is "
                   f"larger than the difference), so seed stays")


def misses(c: Candidate, sla: dict[str, float], goal: str, min_goodput: Optional[float]) -> str:
    """What a candidate missed the objective by, in words."""
    if c.status != "measured":
        return f"{c.status}: {c.why}"
    best = max((tuning.point_figures(p["level"]) for p in c.points), key=lambda f: (f["sla_met"], f["goodput_rps"]))
    if not best["sla_met"]:
        return "; ".join(f"P99 {SLA_NAMES[m]} {best['p99_ms'][m]:.0f} ms > {sla[m]:g} ms" for m in best["violations"])
    return f"goodput {best['goodput_rps']:.2f} < {min_goodput:g} good requests/s"


# ---------------------------------------------------------------- measuring


class _Measurer:
    """Servers for one candidate's build (tune's), measured under tune's load."""

    def __init__(self, c: Candidate, config_name: str, root: Path, prompts: tuple[list, list] = ([], [])):
        cfg = c.runner.loaded.config
        self.servers = tuning.Servers(cfg, config_name, c.work_dir, root / c.name)
        self.warm, self.measured = prompts
        self.concurrency, self.sla = tuning.load_for(cfg)["concurrency"], cfg.sla.bounds()

    def measure(self, settings: dict, requests: int) -> dict:
        return tuning.measure_fn(self.servers, self.warm, self.measured[:requests], self.concurrency,
                                 self.sla)(settings)


def run_optimize(config: PipelineConfig, config_name: str, work_dir: Path, open_candidate: OpenCandidate) -> dict:
    """The search (this module's docstring): results, with the chosen candidate published; StageFailed where no
    candidate meets the objective (nothing published)."""
    check_optimizable(config)
    t0 = time.monotonic()
    cands = open_candidates(config, open_candidate)
    root = work_dir / OPTIMIZE_DIR
    remove_tree(root / artifacts.STAGING_DIR)  # what a killed run left (the config's work dir lock is held)
    staging = root / artifacts.STAGING_DIR / f"results-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        return _search(config, config_name, cands=cands, root=root, staging=staging, t0=t0)
    except BaseException:
        if staging.is_dir():  # an unexpected stop: its servers' logs, for the next person to read
            replace_dir(staging, root / FAILED_DIR)
        raise


def _search(config: PipelineConfig, config_name: str, *, cands: list[Candidate], root: Path, staging: Path,
            t0: float) -> dict:
    opt, sla = config.optimize, config.sla.bounds()
    work_dir = root.parent
    timing: dict[str, float] = {}

    for c in cands:
        build_candidate(c, work_dir)
    apply_floor(cands, opt.floor)
    timing["build_and_gate_s"] = time.monotonic() - t0
    alive = [c for c in cands if c.status == "built"]
    servers_started = 0
    with console.stage_output(staging / LOG_FILE), _logged_to(staging / LOG_FILE):
        if alive:
            load = tuning.load_for(config)
            first = _Measurer(alive[0], config_name, staging / "servers")
            warm, measured = tuning.prompts_for(config, alive[0].work_dir, first.servers.settings)
            meters = {c.name: _Measurer(c, config_name, staging / "servers", prompts=(warm, measured))
                      for c in alive}  # every candidate measured on the same prompts
            schedule = halving_schedule(len(alive), opt.finalists, load["requests"], load["concurrency"])
            t1 = time.monotonic()
            for r, requests in enumerate(schedule):
                for c in list(alive):
                    servers_started += 1
                    try:
                        level = meters[c.name].measure({}, requests)
                    except PipelineError as e:  # the engine crashed or its server did not come up
                        _measure_failed(c, e, staging)
                        alive.remove(c)
                        continue
                    c.rounds.append({"round": r + 1, "requests": requests, **tuning.point_figures(level)})
                    c.status = "measured"
                    if requests >= load["requests"]:
                        c.points = [{"settings": {}, "label": tuning.DEFAULT, "level": level}]
                    console.echo(f"optimize {c.name}: round {r + 1}, {requests} requests: "
                                 f"{c.rounds[-1]['goodput_rps']:.2f} good requests/s, SLA "
                                 f"{'kept' if c.rounds[-1]['sla_met'] else 'missed'}")
                alive.sort(key=lambda c: rank_key(c.rounds[-1], c.weight_bytes or 0, opt.goal, opt.min_goodput_rps),
                           reverse=True)
                keep = max(opt.finalists, math.ceil(len(alive) / 2)) if r < len(schedule) - 1 else opt.finalists
                alive = alive[:keep]
            timing["halving_s"] = time.monotonic() - t1
            t2 = time.monotonic()
            if opt.serving_search:
                for c in alive:
                    servers_started += _search_settings(c, meters[c.name], load["requests"])
            timing["serving_search_s"] = time.monotonic() - t2
        points = _points(cands)
        chosen, why = choose(points, goal=opt.goal, min_goodput=opt.min_goodput_rps, min_gain=config.tune.min_gain)
        side = None
        if chosen is not None:
            t3 = time.monotonic()
            side = _side_by_side(chosen, cands, config=config, config_name=config_name, root=staging / "side_by_side",
                                 prompts=(warm, measured))
            servers_started += (len(side["sides"]) * (1 if side["servers"] == "together" else side["rounds"])
                                if side else 0)
            if side is not None:
                chosen, verdict = confirm(chosen, side, points)
                why = f"{why}; {verdict}"
            timing["side_by_side_s"] = time.monotonic() - t3
    timing["total_s"] = time.monotonic() - t0
    front = pareto_front([p for p in points if p["sla_met"]]) if points else []
    results = {
        "format_version": 1, "config": config_name, "target": config.build.target, "sla": sla,
        "load": tuning.load_for(config), "goal": opt.goal, "min_goodput_rps": opt.min_goodput_rps,
        "floor": opt.floor, "finalists": opt.finalists, "serving_search": opt.serving_search,
        "candidates": [c.row() for c in cands], "points": points,
        "front": [{"candidate": p["candidate"], "label": p["label"]} for p in front],
        "chosen": None if chosen is None else {k: chosen[k] for k in ("candidate", "label", "settings")},
        "why": why, "side_by_side": side,
        "cost": {"candidates": len(cands), "built": sum(c.stages_run > 0 for c in cands),
                 "measured": sum(bool(c.rounds) for c in cands), "server_runs": servers_started,
                 **{k: round(v, 1) for k, v in timing.items()}},
    }
    _write_evidence(results, staging)
    if chosen is None:
        replace_dir(staging, root / FAILED_DIR)
        closest = sorted(cands, key=lambda c: _closeness(c), reverse=True)[:3]
        raise StageFailed(
            "optimize: no candidate meets the objective (" + _objective_words(config) + "); the closest: " +
            "; ".join(f"{c.name}: {misses(c, sla, opt.goal, opt.min_goodput_rps)}" for c in closest) +
            f". Nothing was published. The evidence is in {root / FAILED_DIR} (the previous {RESULTS_DIR}/ is kept). "
            f"Relax the SLA or the floor, or add candidates that keep more layers in high precision")
    winner = next(c for c in cands if c.name == chosen["candidate"])
    _publish(winner, chosen, sla, why)
    results["published"] = {"work_dir": str(winner.work_dir),
                            "repository": str(artifacts.published_repository(winner.work_dir)),
                            "set": override_args(OptimizeCandidate(name=winner.name, set=winner.overrides))[1:]}
    atomic_write_text(staging / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    replace_dir(staging, root / RESULTS_DIR)
    remove_tree(root / FAILED_DIR)
    return results


@contextlib.contextmanager
def _logged_to(path: Path) -> Iterator[None]:
    """The pipeline's log lines (each server's start, each measurement) also into ``path``."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pipeline")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()


def _measure_failed(c: Candidate, e: PipelineError, staging: Path) -> None:
    """A candidate whose server failed under measurement: recorded with its server's log (relative to the
    results folder), out of the search."""
    c.status, c.why, c.points = "failed", f"under measurement: {str(e).splitlines()[0]}", []
    logs = sorted((staging / "servers" / c.name).glob(f"settings/*/{artifacts.SERVER_LOG_FILE}"))
    c.log = str(logs[0].relative_to(staging)) if logs else None
    console.echo(f"optimize {c.name}: failed under measurement ({c.why}); its server's log: "
                 f"{RESULTS_DIR}/{c.log}")


def _closeness(c: Candidate) -> tuple:
    if c.status != "measured":
        return (0, -(c.accuracy or {}).get("perplexity_increase_pct", 1e9) if c.accuracy else -1e9)
    best = max(tuning.point_figures(p["level"])["goodput_rps"] for p in c.points) if c.points else 0.0
    return (1, best)


def _objective_words(config: PipelineConfig) -> str:
    sla = ", ".join(f"P99 {SLA_NAMES[m]} <= {b:g} ms" for m, b in config.sla.bounds().items())
    goal = (f"at least {config.optimize.min_goodput_rps:g} good requests/s" if config.optimize.goal == "memory"
            else "the most goodput")
    return f"the quantize gate{' and no worse than seed' if config.optimize.floor == 'seed' else ''}, {sla}, {goal}"


def _search_settings(c: Candidate, meter: _Measurer, requests: int) -> int:
    """tune's search on one finalist (its default point is the last halving round's). Servers started."""
    started = 0

    def measure(settings: dict) -> dict:
        nonlocal started
        if not settings and c.points:
            return c.points[0]["level"]
        started += 1
        return meter.measure(settings, requests)

    cfg = c.runner.loaded.config
    points: list[dict]
    try:
        if targets.get(cfg.build.target).gpu_only:  # a GPU server starts in minutes: tune's plan of points
            points = [{"settings": st, "label": tuning.label_of(st), "level": measure(st)}
                      for st in tuning.gpu_plan(cfg)]
        else:
            points = tuning.search(measure, meter.servers.settings.max_batch_size, cfg.sla.p99_itl_ms is not None,
                                   cfg.tune.min_gain, cfg.tune.prefill_chunk_tokens)
    except PipelineError as e:  # a setting crashed the engine: the candidate keeps its measured default
        c.why = f"serving search stopped: {str(e).splitlines()[0]}"
        console.echo(f"optimize {c.name}: {c.why}")
        return started
    c.points = points
    for p in points[1:]:
        f = tuning.point_figures(p["level"])
        console.echo(f"optimize {c.name}: {p['label']}: {f['goodput_rps']:.2f} good requests/s, SLA "
                     f"{'kept' if f['sla_met'] else 'missed'}")
    return started


def _points(cands: list[Candidate]) -> list[dict]:
    """Every candidate's measured points at full load, with its accuracy and weight bytes."""
    out = []
    for c in cands:
        for p in c.points:
            out.append({"candidate": c.name, "label": p["label"], "settings": p["settings"],
                        **tuning.point_figures(p["level"]), "weight_bytes": c.weight_bytes or 0,
                        "perplexity_increase_pct": c.accuracy["perplexity_increase_pct"],
                        "top1_agreement": c.accuracy["top1_agreement"], "kl_divergence": c.accuracy["kl_divergence"]})
    return out


def side_key(candidate: str, settings: dict) -> str:
    """A side of the side-by-side rounds: the candidate, and its settings where not the config's."""
    return candidate if not settings else f"{candidate} [{tuning.label_of(settings)}]"


def _side_by_side(chosen: dict, cands: list[Candidate], *, config: PipelineConfig, config_name: str,
                  root: Path, prompts: tuple[list, list]) -> Optional[dict]:
    """The choice and optimize.compare_with, tune.ab_rounds rounds with the order rotated, the servers up as
    bench.servers says (one at a time by default): medians per side."""
    by_name = {c.name: c for c in cands}
    sides = [(chosen["candidate"], chosen["settings"])]
    for name in config.optimize.compare_with:
        if by_name[name].status == "measured" and (name, {}) not in sides:
            sides.append((name, {}))
    if len(sides) < 2:
        return None
    keys = [side_key(n, st) for n, st in sides]
    warm, measured = prompts  # the halving rounds' (chosen is only ever a measured candidate's point)
    load, bounds = tuning.load_for(config), config.sla.bounds()

    def side(k: int, name: str, settings: dict) -> tuning.Side:
        c = by_name[name]
        servers = tuning.Servers(c.runner.loaded.config, config_name, c.work_dir, root / f"{k}-{name}")
        return (lambda: servers.start(settings, warm, load["concurrency"])), (lambda t: servers.stop(t.label))

    together = config.bench.servers == "together"
    rounds = tuning.rotated_rounds(
        {key: side(k, name, settings) for k, (key, (name, settings)) in enumerate(zip(keys, sides, strict=True))},
        config.tune.ab_rounds, together=together,
        measure=lambda t: tuning.point_figures(tuning.run_level(t, measured[:load["requests"]], load["concurrency"],
                                                                config.bench, bounds)))
    med = {}
    for key in keys:
        p99 = {m: statistics.median(r[key]["p99_ms"][m] for r in rounds) for m in bounds}
        med[key] = {"goodput_rps": statistics.median(r[key]["goodput_rps"] for r in rounds),
                    "output_tokens_per_s": statistics.median(r[key]["output_tokens_per_s"] for r in rounds),
                    "sla_met_rounds": sum(r[key]["sla_met"] for r in rounds), "p99_ms": p99,
                    "sla_kept": all(v <= bounds[m] for m, v in p99.items())}
    top = med[keys[0]]
    ratios = {key: {"goodput": top["goodput_rps"] / med[key]["goodput_rps"] if med[key]["goodput_rps"] > 0 else None,
                    "output_tokens_per_s": top["output_tokens_per_s"] / med[key]["output_tokens_per_s"]}
              for key in keys[1:]}
    return {"rounds": len(rounds), "servers": "together" if together else "alone",
            "sides": [{"key": key, "candidate": n, "settings": st}
                                             for key, (n, st) in zip(keys, sides, strict=True)],
            "medians": med, "chosen_over": ratios, "per_round": rounds}


def _publish(c: Candidate, chosen: dict, sla: dict, why: str) -> None:
    """The chosen settings as the candidate's tuned settings file (what publish applies), then its publish stage."""
    tuned = c.work_dir / TUNE_DIR / TUNED_FILE
    if chosen["settings"]:
        tuned.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(tuned, yaml.safe_dump({
            "format_version": FORMAT_VERSION, "triton": chosen["settings"], "sla": sla,
            "build_digest": build_digest(c.work_dir), "chosen_by": f"invoke optimize: {why}"}, sort_keys=False))
    else:
        remove_tree(tuned.parent)  # an earlier run's settings would be applied to this choice
    c.runner.run(["publish"], echo=lambda line: console.status(f"optimize {c.name}: {line}"))


# ---------------------------------------------------------------- the evidence


def _write_evidence(results: dict, folder: Path) -> None:
    atomic_write_text(folder / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    atomic_write_text(folder / TABLE_FILE, table_markdown(results))
    if results["points"]:
        plot_front(results, folder / PLOT_FILE)


def table_markdown(results: dict) -> str:
    """The candidates, the measured points (the front marked), the choice, the side-by-side rounds and the cost."""
    sla = ", ".join(f"P99 {SLA_NAMES[m]} <= {b:g} ms" for m, b in results["sla"].items())
    load = results["load"]
    lines = [f"Objective: {results['goal']}" + (f" (at least {results['min_goodput_rps']:g} good requests/s)"
                                                 if results["goal"] == "memory" else "") +
             f"; floor: {results['floor']}; SLA: {sla}. Load: {load['requests']} requests of "
             f"{load['prompt_tokens']} + {load['output_tokens']} tokens, {load['concurrency']} in flight.", "",
             "| candidate | set | outcome | perplexity + % | top-1 | KL | weights MiB | kept layers | rounds "
             "(requests: good req/s) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in results["candidates"]:
        a = c["accuracy"] or {}
        rounds = ", ".join(f"{r['requests']}: {r['goodput_rps']:.2f}" for r in c["rounds"]) or "-"
        sets = ", ".join(f"{k}={v}" for k, v in c["set"].items()) or "(the config)"
        outcome = c["status"] + (f": {c['why']}" if c["why"] else "")
        mib = f"{c['weight_bytes'] / 2**20:.1f}" if c["weight_bytes"] else "-"
        lines.append(f"| {c['name']} | {sets} | {outcome} | {_cell(a, 'perplexity_increase_pct', '{:.2f}')} | "
                     f"{_cell(a, 'top1_agreement', '{:.4f}')} | {_cell(a, 'kl_divergence', '{:.4f}')} | {mib} | "
                     f"{c['kept_high_precision'] if c['kept_high_precision'] is not None else '-'} | {rounds} |")
    front = {(p["candidate"], p["label"]) for p in results["front"]}
    if results["points"]:
        lines += ["", "Measured at full load (on the front: no other point has more goodput, less perplexity "
                      "increase and fewer weight bytes):", "",
                  "| candidate | serving settings | goodput req/s | output tok/s | TTFT P99 ms | ITL P99 ms | "
                  "e2e P99 ms | SLA | front |", "|---|---|---|---|---|---|---|---|---|"]
        for p in results["points"]:
            itl = f"{p['itl_p99_ms']:.0f}" if p["itl_p99_ms"] is not None else "-"
            lines.append(f"| {p['candidate']} | {p['label']} | {p['goodput_rps']:.2f} | "
                         f"{p['output_tokens_per_s']:.1f} | {p['ttft_p99_ms']:.0f} | {itl} | {p['e2e_p99_ms']:.0f} | "
                         f"{'kept' if p['sla_met'] else 'missed: ' + ', '.join(p['violations'])} | "
                         f"{'yes' if (p['candidate'], p['label']) in front else ''} |")
    lines += ["", f"Chosen: {results['why']}."]
    side = results.get("side_by_side")
    if side:
        chosen = side["sides"][0]["key"]
        med = side["medians"]
        lines += ["", f"Side by side, {side['rounds']} round(s), {servers_said(side)}, the order rotated "
                      "(medians):", "",
                  "| candidate | goodput req/s | output tok/s | SLA kept (rounds) | chosen's goodput / this | "
                  "chosen's tok/s / this |", "|---|---|---|---|---|---|"]
        for s in side["sides"]:
            n = s["key"]
            r = side["chosen_over"].get(n)
            ratio = (f"{r['goodput']:.2f}x" if r and r["goodput"] is not None else "-" if not r else "none good")
            tokens = f"{r['output_tokens_per_s']:.2f}x" if r else "-"
            lines.append(f"| {n}{' (chosen)' if n == chosen else ''} | {med[n]['goodput_rps']:.2f} | "
                         f"{med[n]['output_tokens_per_s']:.1f} | {med[n]['sla_met_rounds']}/{side['rounds']} | "
                         f"{ratio} | {tokens} |")
    cost = results["cost"]
    lines += ["", f"Cost: {cost['candidates']} candidates, {cost['built']} built (the rest up to date or refused "
                  f"before building), {cost['measured']} measured, {cost['server_runs']} server runs; "
                  f"{cost['total_s']:.0f} s in all (" + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.0f} s"
                                                          for k, v in cost.items() if k.endswith("_s")
                                                          and k != "total_s") + ")."]
    return "\n".join(lines) + "\n"


def _cell(figures: dict, key: str, fmt: str) -> str:
    return fmt.format(figures[key]) if figures.get(key) is not None else "-"


def plot_front(results: dict, path: Path) -> None:
    """Goodput against perplexity increase, a point per measured (plan, settings), the front joined."""
    import matplotlib  # heavy, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    front = {(p["candidate"], p["label"]) for p in results["front"]}
    for p in results["points"]:
        on = (p["candidate"], p["label"]) in front
        ax.plot(p["perplexity_increase_pct"], p["goodput_rps"], "o" if p["sla_met"] else "x",
                color="#2ca02c" if on else "#1f77b4" if p["sla_met"] else "#d62728")
        ax.annotate(f"{p['candidate']}" + ("" if p["label"] == tuning.DEFAULT else f" [{p['label']}]") +
                    f", {p['weight_bytes'] / 2**20:.0f} MiB",
                    (p["perplexity_increase_pct"], p["goodput_rps"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    pts = sorted((p["perplexity_increase_pct"], p["goodput_rps"]) for p in results["points"]
                 if (p["candidate"], p["label"]) in front)
    if len(pts) > 1:
        ax.plot(*zip(*pts, strict=True), "-", color="#2ca02c", alpha=0.6, label="front")
        ax.legend(fontsize=8)
    ax.set_xlabel("perplexity increase over the original (%)")
    ax.set_ylabel("goodput (good requests/s)")
    ax.set_title("goodput within the SLA vs accuracy (x: SLA missed); the front also counts weight bytes",
                 fontsize=9)
    ax.set_ylim(0, max(p["goodput_rps"] for p in results["points"]) * 1.15 or 1)  # room for the labels
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
