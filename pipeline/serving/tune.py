"""`invoke tune`: the serving settings that give the most goodput within the SLA, measured on real servers.

What is searched on the ``cpu`` target: ``triton.max_running``, how many sequences the runtime runs at once
(its KV pool is sized for them), and, with ``sla.p99_itl_ms`` set, ``triton.adaptive_batch`` (the runtime's
EWMA controller) and ``triton.prefill_chunk_tokens`` (chunked prefill). On the ``vllm`` target: ``max_running``
alone, vLLM's ``max_num_seqs`` as served (its scheduler has no other such setting), measured on the first of
``vllm.frontends`` (the server `invoke serve` and the image run). On the GPU targets (``gpu_plan``): the
executor's ``scheduler_policy``, a larger ``kv_cache_free_gpu_memory_fraction``, and on the pytorch target
``max_running`` halved twice and ``adaptive_batch`` (TensorRT-LLM's dynamic batch tuning); each point is measured where
the image's ``tritonserver`` is (a GPU machine). Elsewhere ``invoke tune`` writes those points to ``tune_plan.yaml``,
and ``invoke tune --results FILE`` chooses from the figures measured on the GPU (``apply_results``). Each setting is
published into a repository of its own and measured on its own server: the ``bench.warmup_requests``, then
``tune.requests`` streamed requests of the bench's prompt and output lengths with ``tune.concurrency`` in flight (closed
loop; default twice the highest bench level, so more clients than the server should run at once, which is where the
limit matters).

The search: the default first (the config as it is), then ``max_running`` halved, step by step, while the
SLA is not kept (a smaller batch is what shortens the gap between tokens), or while halving still raises
goodput by ``tune.min_gain``; the first halving that keeps the SLA and loses goodput ends it (smaller ones
only lose more throughput). Then, with an ITL bound, the adaptive controller once, and chunked prefill
(``tune.prefill_chunk_tokens`` prompt tokens a step) alone and with the controller. A setting is eligible when its P99s
keep the SLA; the chosen one is the eligible setting with the most goodput, the default unless another beats it by
``tune.min_gain`` (noise is not a gain). No eligible setting: nothing is written to apply, and the error names
the best point and what bounds it.

Then an A/B: the default and the chosen setting, ``tune.ab_rounds`` rounds alternating which goes first, one
server up at a time (each started for its turn; ``bench.servers: together`` keeps both up). It must confirm
the choice (``confirm``): the chosen setting's median P99s keep the SLA
(else nothing is applied: the machine's noise is larger than the setting's margin), and where the default's
medians keep it too with as much goodput, the default stays. Written (the folder replaced only when the
tune succeeds; a failed tune's evidence goes to ``tune.failed/``): ``tune_results.json``,
``tuned_settings.yaml`` (``pipeline.serving.tuned``: what publish applies), ``tune.md`` and
``throughput_vs_p99.png``, and each server's log.
"""

from __future__ import annotations

import json
import logging
import statistics
import uuid
from pathlib import Path
from typing import Callable, Optional

import yaml
from pydantic import ValidationError

from pipeline import artifacts, records, targets
from pipeline.config import PipelineConfig
from pipeline.errors import InputError, StageFailed
from pipeline.fsutil import atomic_write_text, remove_tree, replace_dir
from pipeline.serving.bench.load import Prompt, make_prompts
from pipeline.serving.bench.stats import SLA_NAMES
from pipeline.serving.bench.target import (
    Target,
    build_settings,
    check_lengths,
    read_repository,
    run_level,
    warm_up,
)
from pipeline.serving.publish import write_repository
from pipeline.serving.serve import measured_server_for_target
from pipeline.serving.tuned import (
    FAILED_DIR,
    FORMAT_VERSION,
    PLAN_FILE,
    PLOT_FILE,
    RESULTS_FILE,
    TABLE_FILE,
    TUNABLE,
    TUNE_DIR,
    TUNED_FILE,
    build_digest,
    servers_said,
    with_triton,
)

log = logging.getLogger(__name__)

DEFAULT = "default"

Measure = Callable[[dict], dict]  # settings (triton keys) -> one measured level (bench.target.run_level's figures)


# ---------------------------------------------------------------- the search and the choice (pure)


def label_of(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or DEFAULT


def _goodput(point: dict) -> float:
    return point["level"]["sla"]["goodput_rps"]


def _met(point: dict) -> bool:
    return point["level"]["sla"]["met"]


def search(measure: Measure, max_batch_size: int, adaptive: bool, min_gain: float,
           chunk: Optional[int] = None) -> list[dict]:
    """The measured points, in order: {"settings", "label", "level"} (the rule: this module's docstring).
    ``adaptive`` (an ITL bound is set): the adaptive limit once, and with ``chunk``, chunked prefill of that
    many tokens a step, alone and with the adaptive limit."""
    points = [{"settings": {}, "label": DEFAULT, "level": measure({})}]

    def better(a: dict, b: dict) -> bool:  # keeping the SLA first, then goodput by min_gain
        if _met(a) != _met(b):
            return _met(a)
        return _goodput(a) > 0 and _goodput(a) >= _goodput(b) * (1 + min_gain)

    best, limit = points[0], max_batch_size
    while limit > 1:
        limit //= 2
        settings = {"max_running": limit}
        point = {"settings": settings, "label": label_of(settings), "level": measure(settings)}
        points.append(point)
        if better(point, best):
            best = point
        elif _met(best):
            break  # the SLA is kept at a larger limit and halving did not pay: smaller ones only lose throughput
    extra: list[dict] = [{"adaptive_batch": True}] if adaptive else []
    if adaptive and chunk:  # a prompt prefilled whole stalls every running sequence's next token
        extra += [{"prefill_chunk_tokens": chunk}, {"adaptive_batch": True, "prefill_chunk_tokens": chunk}]
    for settings in extra:
        points.append({"settings": settings, "label": label_of(settings), "level": measure(settings)})
    return points


KV_FRACTION_CEILING = 0.95  # the largest KV-cache share planned: the rest of free memory for what the runtime
# allocates beside the cache (sampling, CUDA graphs); TensorRT-LLM's own default is 0.9 (KvCacheConfig)


def gpu_plan(config: PipelineConfig) -> list[dict]:
    """The GPU targets' points (settings, the default first): each a key of the triton section the config does
    not set itself (a value the config sets wins at publish, so tuning it would measure what is never applied)."""
    t, b = config.triton, config.build
    free = [k for k in ("scheduler_policy", "kv_cache_free_gpu_memory_fraction", "max_running", "adaptive_batch")
            if k not in t.model_fields_set]
    points: list[dict] = [{}]
    if "scheduler_policy" in free:
        points.append({"scheduler_policy": "max_utilization"})  # more sequences at once; may pause some
    if "kv_cache_free_gpu_memory_fraction" in free and b.kv_cache.free_gpu_memory_fraction < KV_FRACTION_CEILING:
        points.append({"kv_cache_free_gpu_memory_fraction": KV_FRACTION_CEILING})  # more blocks: more admitted
    reads = targets.get(b.target).serving_settings  # the engine's batch limit is a build setting: not tuned
    if "max_running" in reads and "max_running" in free:
        points += [{"max_running": b.max_batch_size // k} for k in (2, 4) if b.max_batch_size // k >= 1]
    if "adaptive_batch" in reads and "adaptive_batch" in free:
        points.append({"adaptive_batch": True})
    return points


def choose(points: list[dict], min_gain: float) -> tuple[Optional[dict], str]:
    """(the chosen point or None, why, in a sentence)."""
    eligible = [p for p in points if _met(p)]
    if not eligible:
        best = max(points, key=_goodput)
        p99 = best["level"]["sla"]["p99_ms"]
        over = "; ".join(f"P99 {SLA_NAMES[m]} {p99[m]:.0f} ms" for m in best["level"]["sla"]["violations"])
        return None, (f"no measured setting keeps the SLA: the best, {best['label']} ({_goodput(best):.2f} good "
                      f"requests/s), is bound by {over}. Relax the SLA, lower tune.concurrency (less load), or "
                      f"build for less (a smaller model or weight format)")
    top = max(eligible, key=_goodput)
    default = points[0]
    if _met(default) and _goodput(top) < _goodput(default) * (1 + min_gain):
        others = [p for p in eligible if p is not default]
        other = max(others, key=_goodput) if others else None
        return default, (f"the default is already the optimum: it keeps the SLA with {_goodput(default):.2f} good "
                         f"requests/s and no other setting beat it by {min_gain:.0%} (" +
                         (f"the best other: {other['label']}, {_goodput(other):.2f}" if other
                          else "no other kept the SLA") + ")")
    why = ("the default does not keep the SLA" if not _met(default)
           else f"{_goodput(top) / _goodput(default):.2f}x the default's goodput")
    return top, f"{top['label']} keeps the SLA with {_goodput(top):.2f} good requests/s: {why}"


def ab_summary(rounds: list[dict], bounds: dict[str, float]) -> dict:
    """Medians over the A/B rounds ({"default": level, "tuned": level} each) and tuned / default. A side keeps
    the SLA (``sla_kept``) when its median P99 of each bounded latency is within the bound."""
    out: dict = {"rounds": len(rounds)}
    for side in ("default", "tuned"):
        p99 = {m: statistics.median(r[side]["sla"]["p99_ms"][m] for r in rounds) for m in bounds
               if all(r[side]["sla"]["p99_ms"].get(m) is not None for r in rounds)}
        out[side] = {"goodput_rps": statistics.median(r[side]["sla"]["goodput_rps"] for r in rounds),
                     "output_tokens_per_s": statistics.median(r[side]["output_tokens_per_s"] for r in rounds),
                     "p99_ms": p99, "sla_kept": all(p99[m] <= b for m, b in bounds.items() if m in p99),
                     "sla_met_rounds": sum(r[side]["sla"]["met"] for r in rounds)}
    d, t = out["default"]["goodput_rps"], out["tuned"]["goodput_rps"]
    out["goodput_ratio"] = t / d if d > 0 else None
    out["output_tokens_per_s_ratio"] = out["tuned"]["output_tokens_per_s"] / out["default"]["output_tokens_per_s"]
    return out


def confirm(chosen: dict, ab: dict, bounds: dict[str, float]) -> tuple[Optional[dict], Optional[str]]:
    """The A/B's verdict on a chosen setting other than the default: (the setting to apply or None, why, where
    the A/B changes the choice). Its medians must keep the SLA; where the default's keep it too with more
    goodput, the default stays."""
    tuned, default = ab["tuned"], ab["default"]
    if not tuned["sla_kept"]:
        over = "; ".join(f"P99 {SLA_NAMES[m]} {v:.0f} ms > {bounds[m]:g} ms" for m, v in tuned["p99_ms"].items()
                         if v > bounds[m])
        return None, (f"the A/B did not confirm {chosen['label']}: over {ab['rounds']} alternating round(s) its "
                      f"median {over}. The machine's noise is larger than the setting's margin: rerun with more "
                      f"tune.ab_rounds, or relax the SLA")
    if default["sla_kept"] and default["goodput_rps"] >= tuned["goodput_rps"]:
        return {"settings": {}, "label": DEFAULT}, (
            f"the default stays: in the A/B its median goodput ({default['goodput_rps']:.2f} req/s) kept the SLA "
            f"and was not below {chosen['label']}'s ({tuned['goodput_rps']:.2f})")
    return chosen, None


# ---------------------------------------------------------------- measuring on real servers


class Servers:
    """A repository and a server per setting, under ``root``; servers stopped by ``stop``/``stop_all``."""

    def __init__(self, config: PipelineConfig, config_name: str, work_dir: Path, root: Path):
        self.config, self.config_name, self.work_dir, self.root = config, config_name, work_dir, root
        self.build_dir = artifacts.stage_dir(work_dir, "build")
        settings = build_settings(self.build_dir)
        if settings is None:
            raise InputError(f"{self.build_dir} has no build settings: run `invoke build` first")
        self.settings: records.BuildSettings = settings
        self.running: dict[str, tuple] = {}

    def start(self, settings: dict, warm: list[Prompt], concurrency: int) -> Target:
        label = label_of(settings)
        folder = self.root / "settings" / label.replace(", ", "_").replace("=", "-")
        repo = folder / artifacts.MODEL_REPOSITORY_DIR
        try:
            candidate = with_triton(self.config, settings)
        except ValidationError as e:  # e.g. tenants' kv_blocks past the pool of a smaller max_running
            raise InputError(f"tune's candidate {label} does not validate with this config ({e.errors()[0]['msg']});"
                             f" give the tenants kv_share fractions (they follow max_running), or narrow the "
                             f"candidates in the tune section") from None
        write_repository(candidate, self.config_name, work_dir=self.work_dir,
                         build_dir=self.build_dir,
                         model_dir=artifacts.stage_dir(self.work_dir, "model") / artifacts.MODEL_DIR, repo=repo)
        repo, prov = read_repository(repo)
        frontend = targets.get(self.settings.target).frontends(self.config)[0]  # what `invoke serve` and the image run
        server = measured_server_for_target(self.settings.target, repo, frontend=frontend,
                                            log_path=folder / artifacts.SERVER_LOG_FILE)
        server.start()
        target = Target(label, repo, prov, self.settings, frontend=frontend, grpc_url=server.grpc_url,
                        http_url=server.http_url, metrics_url=server.metrics_url, server=server)
        self.running[label] = (server, folder)
        try:
            warm_up(target, warm, min(len(warm), concurrency), self.config.bench)
        except BaseException:  # an engine failing its first requests: its server stopped here, not left running
            self.stop(label)
            raise
        return target

    def stop(self, label: str) -> None:
        server, folder = self.running.pop(label)
        server.stop()
        remove_tree(folder / artifacts.MODEL_REPOSITORY_DIR)  # links to the build: the log is what stays

    def stop_all(self) -> None:
        for label in list(self.running):
            self.stop(label)


def measure_fn(servers: Servers, warm: list[Prompt], measured: list[Prompt], concurrency: int,
                sla: dict[str, float]) -> Measure:
    def measure(settings: dict) -> dict:
        target = servers.start(settings, warm, concurrency)
        try:
            level = run_level(target, measured, concurrency, servers.config.bench, sla)
        finally:
            servers.stop(target.label)
        log.info("tune %s: goodput %.2f req/s, %.1f tok/s, SLA %s", target.label, level["sla"]["goodput_rps"],
                 level["output_tokens_per_s"], "kept" if level["sla"]["met"] else
                 "missed (" + ", ".join(level["sla"]["violations"]) + ")")
        return level
    return measure


Side = tuple[Callable[[], Target], Callable[[Target], None]]  # (start its server, warmed up; stop it)


def rotated_rounds(sides: dict[str, Side], rounds: int, measure: Callable[[Target], dict], *,
                   together: bool) -> list[dict]:
    """``rounds`` rounds of ``measure`` on every side ({side: figures} each), the order rotated from round to
    round. ``together`` (bench.servers "together"): every side's server up for the whole run. Otherwise
    ("alone"): one server up at a time, each side's started for its turn in a round and stopped after it, so no
    idle engine takes from the measured one. Every server started here is stopped on leaving."""
    keys, up = list(sides), {}
    try:
        if together:
            for key in keys:
                up[key] = sides[key][0]()
        out = []
        for k in range(rounds):
            row = {}
            for key in keys[k % len(keys):] + keys[:k % len(keys)]:
                if not together:
                    up[key] = sides[key][0]()
                row[key] = measure(up[key])
                if not together:
                    sides[key][1](up.pop(key))
            out.append(row)
        return out
    finally:
        for key, target in up.items():
            sides[key][1](target)


def _ab(servers: Servers, chosen: dict, *, warm: list[Prompt], measured: list[Prompt], concurrency: int,
        sla: dict[str, float], rounds: int) -> list[dict]:
    """Default and chosen, ``rounds`` rounds alternating which goes first, the servers up as bench.servers says."""
    def side(settings: dict) -> Side:
        return (lambda: servers.start(settings, warm, concurrency)), (lambda t: servers.stop(t.label))

    out = rotated_rounds({"default": side({}), "tuned": side(chosen["settings"])}, rounds,
                         lambda t: run_level(t, measured, concurrency, servers.config.bench, sla),
                         together=servers.config.bench.servers == "together")
    for k, row in enumerate(out):
        log.info("tune A/B round %d: goodput default %.2f, tuned %.2f req/s", k + 1,
                 row["default"]["sla"]["goodput_rps"], row["tuned"]["sla"]["goodput_rps"])
    return out


# ---------------------------------------------------------------- the command


def check_tunable(config: PipelineConfig) -> None:
    """What `invoke tune` needs, refused before any work."""
    target = targets.get(config.build.target)
    if not target.tunable:
        tunable = [t.name for t in targets.REGISTRY.values() if t.tunable]
        raise InputError(f"invoke tune measures the {', '.join(tunable[:-1])} and {tunable[-1]} targets' serving "
                         f"settings; the {target.name} target's ({target.untuned_why}) are not tuned by it")
    check_measurable(config, "invoke tune")


def check_measurable(config: PipelineConfig, command: str) -> None:
    """What a command that measures the streaming model against the SLA needs (`invoke tune`, `invoke optimize`)."""
    if not config.sla.bounds():
        raise InputError(f"{command} chooses against the SLA: set at least one of sla.p99_e2e_ms, sla.p99_ttft_ms, "
                         f"sla.p99_itl_ms (e.g. --set sla.p99_e2e_ms=20000)")
    if not config.triton.decoupled:
        raise InputError(f"{command} measures through the streaming model, which needs triton.decoupled: true")


def run_tune(config: PipelineConfig, config_name: str, work_dir: Path) -> dict:
    """Search, choose, A/B; write the evidence and the tuned settings into <work dir>/tune. Returns the results."""
    check_tunable(config)
    cfg, sla = config.tune, config.sla.bounds()
    concurrency = load_for(config)["concurrency"]
    staging = work_dir / artifacts.STAGING_DIR / f"tune-{uuid.uuid4().hex[:8]}"
    servers = Servers(config, config_name, work_dir, staging)
    warm, measured = prompts_for(config, work_dir, servers.settings)
    staging.mkdir(parents=True)
    try:
        measure = measure_fn(servers, warm, measured, concurrency, sla)
        if not targets.get(config.build.target).gpu_only:  # a server starts in seconds: search step by step
            reads = targets.get(config.build.target).serving_settings  # vllm: max_running alone
            points = search(measure, servers.settings.max_batch_size,
                            config.sla.p99_itl_ms is not None and "adaptive_batch" in reads, cfg.min_gain,
                            cfg.prefill_chunk_tokens if "prefill_chunk_tokens" in reads else None)
        else:  # the plan's points, each measured: a GPU server's start is minutes, so no step-by-step search
            points = [{"settings": st, "label": label_of(st), "level": measure(st)} for st in gpu_plan(config)]
        chosen, why = choose(points, cfg.min_gain)
        rounds = (_ab(servers, chosen, warm=warm, measured=measured, concurrency=concurrency, sla=sla,
                      rounds=cfg.ab_rounds)
                  if chosen is not None and chosen["settings"] else [])
    except Exception:
        servers.stop_all()
        replace_dir(staging, work_dir / FAILED_DIR)
        log.error("tune: the servers' logs of this run are in %s (the previous %s/ is kept)", work_dir / FAILED_DIR,
                  TUNE_DIR)
        raise
    finally:
        servers.stop_all()
    ab = {**ab_summary(rounds, sla), "servers": config.bench.servers} if rounds else None
    if ab is not None and chosen is not None:
        chosen, verdict = confirm(chosen, ab, sla)
        why = f"{why}; {verdict}" if verdict else f"{why}; confirmed by the A/B"
    results = {
        "format_version": 1, "target": config.build.target, "sla": sla, "load": load_for(config),
        "build_digest": build_digest(work_dir),
        "build_max_batch_size": servers.settings.max_batch_size, "min_gain": cfg.min_gain,
        "points": [{"label": p["label"], "settings": p["settings"], **point_figures(p["level"])} for p in points],
        "chosen": None if chosen is None else {"label": chosen["label"], "settings": chosen["settings"]},
        "why": why,
        "ab": {**ab, "per_round": [{s: point_figures(r[s]) for s in r} for r in rounds]} if ab else None,
    }
    return _conclude(results, chosen, staging, work_dir)


def load_for(config: PipelineConfig) -> dict:
    """The load each point is measured under (closed loop): at least one measured request per client, so the
    concurrency is reached (a GPU build's bench levels go to hundreds)."""
    concurrency = config.tune.concurrency or 2 * max(config.bench.concurrency)
    return {"concurrency": concurrency,
            "requests": max(config.tune.requests, concurrency), "warmup_requests": config.bench.warmup_requests,
            "prompt_tokens": config.bench.prompt_tokens, "output_tokens": config.bench.output_tokens,
            "loop": "closed"}


def _conclude(results: dict, chosen: Optional[dict], staging: Path, work_dir: Path) -> dict:
    """Write the evidence; with a choice, the tuned settings file too, and make ``staging`` the tune folder.
    Without one, the evidence goes to tune.failed/ and StageFailed says why."""
    why = results["why"]
    _write_evidence(results, staging)
    if chosen is None:
        failed = work_dir / FAILED_DIR
        replace_dir(staging, failed)
        raise StageFailed(f"tune: {why}. The measurements are in {failed}; nothing was applied (the previous "
                          f"{TUNE_DIR}/ is kept).")
    atomic_write_text(staging / TUNED_FILE, yaml.safe_dump({
        "format_version": FORMAT_VERSION, "triton": chosen["settings"], "sla": results["sla"],
        "build_digest": results["build_digest"], "chosen_by": why}, sort_keys=False))
    replace_dir(staging, work_dir / TUNE_DIR)
    remove_tree(work_dir / FAILED_DIR)
    log.info("tune: %s", why)
    return results


# ---------------------------------------------------------------- GPU targets measured elsewhere


PLAN_HOW = (
    "Measure each point on a GPU machine with the Triton TensorRT-LLM image (tritonserver on PATH): `invoke tune` "
    "there measures them all on real servers under this load, chooses, and republishes. To choose here from "
    "figures measured there, pass that run's {results} (or a file of the same shape: format_version, sla, load, "
    "build_digest, and per point its settings, goodput_rps, output_tokens_per_s, requests_per_s, p99_ms of each "
    "SLA bound, ttft_p99_ms, itl_p99_ms, e2e_p99_ms) to `invoke tune --results FILE`.")


def write_plan(config: PipelineConfig, config_name: str, work_dir: Path) -> dict:
    """<work dir>/tune_plan.yaml: the GPU target's points and the load to measure them under."""
    plan: dict = {"format_version": FORMAT_VERSION, "config": config_name, "target": config.build.target,
            "sla": config.sla.bounds(), "load": load_for(config), "build_digest": build_digest(work_dir),
            "points": [{"label": label_of(st), "settings": st} for st in gpu_plan(config)],
            "how": PLAN_HOW.format(results=f"{TUNE_DIR}/{RESULTS_FILE}")}
    path = work_dir / PLAN_FILE
    work_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(plan, sort_keys=False, width=110))
    return {"plan": str(path), "points": plan["points"],
            "why": f"no tritonserver here to serve the {config.build.target} target: wrote the {len(plan['points'])} "
                   f"points to measure to {path}"}


FIGURES = ("goodput_rps", "output_tokens_per_s", "requests_per_s", "ttft_p99_ms", "e2e_p99_ms")


def apply_results(config: PipelineConfig, work_dir: Path, path: Path) -> dict:
    """Choose from points measured elsewhere (``path``: a tune_results.json, or a file of its shape), with the
    same rule as a measuring run; where the file's own A/B tested that same choice, it must confirm it
    (``confirm``). Write the tune folder (the tuned settings file carries the build digest the file names). The
    file's SLA must be the config's; each point's settings must validate with the config. Whether a point keeps
    the SLA is judged again here from its P99s."""
    doc = _read_results(path)
    bounds = config.sla.bounds()
    if doc["sla"] != bounds:
        raise InputError(f"{path} was measured against the SLA {doc['sla']}, and the config's is {bounds}: measure "
                         f"again with this SLA, or set the config's")
    points: list[dict] = []
    for k, raw in enumerate(doc["points"]):
        where = f"{path}: points[{k}]"
        settings = raw.get("settings")
        if not isinstance(settings, dict) or set(settings) - set(TUNABLE):
            raise InputError(f"{where}: settings must be a mapping of {', '.join(TUNABLE)}")
        try:
            with_triton(config, settings)
        except ValidationError as e:
            raise InputError(f"{where}: settings {settings} do not validate with this config "
                             f"({e.errors()[0]['msg']})") from None
        p99 = raw.get("p99_ms")
        bad = [f for f in FIGURES if not _number(raw.get(f))]
        if not isinstance(p99, dict) or any(not _number(p99.get(m)) for m in bounds) or bad:
            raise InputError(f"{where}: needs {', '.join(FIGURES)} and p99_ms of {', '.join(bounds)} (numbers, "
                             f"measured){'; missing or not a number: ' + ', '.join(bad) if bad else ''}")
        violations = [m for m, b in bounds.items() if p99[m] > b]
        figures = {f: raw[f] for f in FIGURES} | {"itl_p99_ms": raw.get("itl_p99_ms"), "p99_ms": p99,
                                                   "sla_met": not violations, "violations": violations}
        points.append({"settings": settings, "label": label_of(settings), "figures": figures,
                       "level": {"sla": {"goodput_rps": raw["goodput_rps"], "met": not violations,
                                         "violations": violations, "p99_ms": p99}}})
    if not points or points[0]["settings"]:
        raise InputError(f"{path}: the first point must be the default (settings: {{}}): a setting is chosen "
                         f"against it")
    chosen, why = choose(points, config.tune.min_gain)
    ab = doc.get("ab")
    file_chosen = (doc.get("chosen") or {}).get("settings")
    if ab and chosen is not None and chosen["settings"] and chosen["settings"] == file_chosen:
        chosen, verdict = confirm(chosen, ab, bounds)  # the measuring run's A/B of this same choice
        why = f"{why}; {verdict}" if verdict else f"{why}; confirmed by the measuring run's A/B"
    results = {"format_version": 1, "target": config.build.target, "sla": bounds, "load": doc["load"],
               "build_digest": doc["build_digest"], "min_gain": config.tune.min_gain,
               "measured_elsewhere": path.name,
               "points": [{"label": p["label"], "settings": p["settings"], **p["figures"]} for p in points],
               "chosen": None if chosen is None else {"label": chosen["label"], "settings": chosen["settings"]},
               "why": why, "ab": ab}
    staging = work_dir / artifacts.STAGING_DIR / f"tune-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    return _conclude(results, chosen, staging, work_dir)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _read_results(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"--results {path} is not readable ({e})") from None
    missing = ([k for k in ("sla", "load", "build_digest", "points") if k not in doc]
               if isinstance(doc, dict) else ["all"])
    if missing or doc.get("format_version") != FORMAT_VERSION or not isinstance(doc["points"], list):
        raise InputError(f"--results {path} is not a tune results file of format {FORMAT_VERSION} (missing: "
                         f"{', '.join(missing) or 'none'}). {PLAN_HOW.format(results=RESULTS_FILE)}")
    load = doc["load"]
    if not isinstance(load, dict) or not all(k in load for k in ("concurrency", "requests", "prompt_tokens",
                                                                  "output_tokens")):
        raise InputError(f"--results {path}: load must say concurrency, requests, prompt_tokens, output_tokens")
    return doc


def prompts_for(config: PipelineConfig, work_dir: Path,
             settings: records.BuildSettings) -> tuple[list[Prompt], list[Prompt]]:
    """(warm-up prompts, measured prompts): the bench's lengths, from the evaluation text."""
    from transformers import AutoTokenizer  # heavy: imported only when tune runs

    bench = config.bench
    check_lengths(bench, settings, "the build")
    tokenizer = AutoTokenizer.from_pretrained(str(artifacts.stage_dir(work_dir, "model") / artifacts.MODEL_DIR))
    text = artifacts.stage_dir(work_dir, "text") / artifacts.EVALUATION_TEXT_FILE
    prompts = make_prompts(text, tokenizer, bench.prompt_tokens, bench.warmup_requests + load_for(config)["requests"])
    return prompts[:bench.warmup_requests], prompts[bench.warmup_requests:]


def point_figures(level: dict) -> dict:
    s = level["sla"]
    return {"goodput_rps": s["goodput_rps"], "sla_met": s["met"], "violations": s["violations"],
            "p99_ms": s["p99_ms"], "output_tokens_per_s": level["output_tokens_per_s"],
            "requests_per_s": level["requests_per_s"], "e2e_p99_ms": level["e2e_ms"]["p99"],
            "ttft_p99_ms": level["ttft_ms"]["p99"], "itl_p99_ms": level["itl_ms"].get("p99")}


def _write_evidence(results: dict, folder: Path) -> None:
    atomic_write_text(folder / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    atomic_write_text(folder / TABLE_FILE, table_markdown(results))
    plot_points(results, folder / PLOT_FILE)


def table_markdown(results: dict) -> str:
    """The measured settings as a Markdown table, the choice and the A/B under it."""
    sla = ", ".join(f"P99 {SLA_NAMES[m]} <= {b:g} ms" for m, b in results["sla"].items())
    load = results["load"]
    lines = [f"SLA: {sla}. Load: {load['requests']} requests of {load['prompt_tokens']} + {load['output_tokens']} "
             f"tokens, {load['concurrency']} in flight (closed loop).", "",
             "| setting | goodput req/s | output tok/s | TTFT P99 ms | ITL P99 ms | e2e P99 ms | SLA |",
             "|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        itl = f"{p['itl_p99_ms']:.0f}" if p["itl_p99_ms"] is not None else "-"
        lines.append(f"| {p['label']} | {p['goodput_rps']:.2f} | {p['output_tokens_per_s']:.1f} | "
                     f"{p['ttft_p99_ms']:.0f} | {itl} | {p['e2e_p99_ms']:.0f} | "
                     f"{'kept' if p['sla_met'] else 'missed: ' + ', '.join(p['violations'])} |")
    lines += ["", f"Chosen: {results['why']}."]
    if results.get("measured_elsewhere"):
        lines.append(f"The figures were measured elsewhere ({results['measured_elsewhere']}); the choice was made "
                     f"here, with the same rule.")
    ab = results.get("ab")
    if ab:
        ratio = f"{ab['goodput_ratio']:.2f}x" if ab["goodput_ratio"] is not None else "the default had none good"
        lines.append(f"A/B over {ab['rounds']} alternating round(s), {servers_said(ab)}, medians: goodput default "
                     f"{ab['default']['goodput_rps']:.2f}, tuned {ab['tuned']['goodput_rps']:.2f} req/s ({ratio}); "
                     f"output tok/s {ab['output_tokens_per_s_ratio']:.2f}x.")
    return "\n".join(lines) + "\n"


def plot_points(results: dict, path: Path) -> None:
    """Output tokens/s against each bounded P99 (one panel per SLA bound), a point per setting."""
    import matplotlib  # heavy, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds = results["sla"]
    fig, axes = plt.subplots(1, len(bounds), figsize=(5.2 * len(bounds), 4.2), squeeze=False)
    for ax, (metric, bound) in zip(axes[0], bounds.items(), strict=True):
        for p in results["points"]:
            x = p["p99_ms"].get(metric)
            if x is None:
                continue
            ax.plot(x, p["output_tokens_per_s"], "o", color="#2ca02c" if p["sla_met"] else "#d62728")
            ax.annotate(p["label"], (x, p["output_tokens_per_s"]), textcoords="offset points", xytext=(5, 4),
                        fontsize=8)
        ax.axvline(bound, color="#7f7f7f", linestyle="--", label=f"SLA {bound:g} ms")
        ax.set_xlabel(f"P99 {SLA_NAMES[metric]} latency (ms)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"throughput vs P99 {SLA_NAMES[metric]} per setting", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
