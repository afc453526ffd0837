"""What the invoke tasks call: load the config, open the work dir's runner, run or explain stages, call the
release and serving entry points, and turn errors into one paragraph.

Each function here is one task of tasks.py, kept free of invoke so it can be tested (and used) without a
shell. This is the only module that opens a Runner from a config path; everything below it takes one.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from pipeline import artifacts, console, constants, targets
from pipeline.config import LoadedConfig, load_config
from pipeline.doctor import Report, examine, render
from pipeline.errors import EnvironmentProblem, InputError, PipelineError
from pipeline.fsutil import remove_tree
from pipeline.reaper import reap_dead_runs
from pipeline.release.deploy import pod_host_memory, render_manifests
from pipeline.release.image import ImagePlan, build_image, check_release, release_image
from pipeline.runner import Runner, WorkDirLock
from pipeline.serving.serve import serve_published
from pipeline.serving.server import remove_stale_leftovers
from pipeline.stages import SERVING_STAGES, STAGES, TASK_STAGES, host_stages


@contextmanager
def user_errors() -> Iterator[None]:
    """Print a pipeline error as a paragraph (no traceback) and exit with its code."""
    try:
        yield
    except PipelineError as e:
        console.finish()
        print(f"error: {e}\n  (causes and fixes: {e.docs_link()})", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:
        console.finish()
        print("interrupted.", file=sys.stderr)
        raise SystemExit(130) from None


def setup_logging(verbose: bool = False) -> None:
    """The console (pipeline/console.py): quiet, or with ``verbose`` everything the stages and their libraries say."""
    console.configure(verbose)
    # progress bars from the Hub client and transformers' loaders would flood CI logs
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def open_runner(config: Optional[str], overrides: Sequence[str], work_root: Path) -> Runner:
    """The runner for ``config``; without one, for ``default_config()``. A model whose type the source alone does
    not tell (a Hub model not in the local cache) is resolved from the model stage's download where it is there."""
    path = config or default_config()
    loaded: LoadedConfig = load_config(path, list(overrides))
    runner = Runner(loaded, STAGES, work_root)
    if loaded.resolution is not None and loaded.resolution.model_type is None:
        downloaded = runner.stage_dir("model") / artifacts.MODEL_DIR / "config.json"
        if downloaded.is_file():
            model_type = json.loads(downloaded.read_text()).get("model_type")
            runner = Runner(load_config(path, list(overrides), model_type=model_type), STAGES, work_root)
    return runner


def _resolved_runner(runner: Runner, *, config: Optional[str], overrides: Sequence[str], work_root: Path,
                     stages: Sequence[str], force: bool) -> Runner:
    """``runner``, or where the model's family is not known yet and ``stages`` go past the download: the model
    stage run first, then the runner reopened with the family's defaults (pipeline/autoconfig.py)."""
    res = runner.loaded.resolution
    if res is None or res.model_type is not None or list(stages) == ["model"]:
        return runner
    runner.preflight(list(stages))  # what this machine lacks stops the task before the download too
    runner.run(["model"], force=["model"] if force else False)
    return open_runner(config, overrides, work_root)


@functools.lru_cache(maxsize=1)  # asked once per command (`invoke all` opens the runner twice): one note, one look
def default_config() -> Path:
    """The project's default (vLLM's, constants.DEFAULT_CONFIG) or, where vLLM cannot run here, the same model
    and plan on the cpu target (constants.CPU_DEFAULT_CONFIG), saying why on stderr."""
    from pipeline.engines.vllm.runtime import unusable_reason

    why = unusable_reason(load_config(constants.DEFAULT_CONFIG).config)
    if why is None:
        return constants.DEFAULT_CONFIG
    print(f"note: the default config {constants.DEFAULT_CONFIG.stem} cannot run here: {why.split('. ')[0]}. "
          f"Using {constants.CPU_DEFAULT_CONFIG.stem} (the same model and plan on the cpu target).", file=sys.stderr)
    return constants.CPU_DEFAULT_CONFIG


def sweep_dead_runs() -> list[Path]:
    """Remove what runs killed before they could stop their servers and workers left (the /dev/shm files and
    temporary folders a dead run's record lists, pipeline.reaper; Triton's, named after their dead starter),
    and say so. What is not provably ours is left alone and named in the log."""
    removed, _ = reap_dead_runs()
    removed += remove_stale_leftovers(quiet=True)  # said once, below
    if removed:
        print(f"note: removed {len(removed)} leftover(s) of dead runs: {', '.join(p.name for p in removed)}")
    return removed


def run_task(task: str, config: Optional[str], overrides: Sequence[str], work_root: Path,
             force: bool = False) -> list[dict]:
    runner = open_runner(config, overrides, work_root)
    print(f"config: {runner.loaded.name} ({runner.loaded.path}); work dir: {runner.work_dir}")
    sweep_dead_runs()
    stages = list(TASK_STAGES[task])
    serving = [s for s in stages if s in SERVING_STAGES]
    if serving:
        refuse_device_only(runner, " or ".join(serving))  # before the upstream stages' own preflights
    runner = _resolved_runner(runner, config=config, overrides=overrides, work_root=work_root, stages=stages,
                              force=force)
    return runner.run(stages, force=stages if force else False)


def run_all(config: Optional[str], overrides: Sequence[str], work_root: Path, force: bool = False) -> None:
    runner = open_runner(config, overrides, work_root)
    print(f"config: {runner.loaded.name} ({runner.loaded.path}); work dir: {runner.work_dir}")
    sweep_dead_runs()
    target = targets.get(runner.loaded.config.build.target)
    names = host_stages(target)
    runner = _resolved_runner(runner, config=config, overrides=overrides, work_root=work_root, stages=names,
                              force=force)
    runner.run(names, force=force)
    print(f"all: {len(names)} stage(s) ran or were up to date; artifacts in {runner.work_dir}")
    if target.device_only:
        print(f"all: the {target.name} target's engine is built and run on the device: "
              f"{target.device_hand_over(runner.stage_dir('publish'))}")


def print_summary(config: Optional[str], overrides: Sequence[str], work_root: Path) -> None:
    """What `invoke all` prints last: where the report is and its five lines."""
    runner = open_runner(config, overrides, work_root)
    if targets.get(runner.loaded.config.build.target).device_only:
        return  # no report here: run_all said where the device bundle is
    report = runner.stage_dir("report")
    m = runner.read_manifest("report")
    if not m or m.get("status") != "ok":
        print("report: not run (`invoke report` writes it)")
        return
    print(f"report: {report / artifacts.REPORT_HTML} (Markdown: {report / artifacts.REPORT_MD})")
    for line in m["summary"]["five_lines"]:
        print(f"  {line}")


def explain(config: Optional[str], overrides: Sequence[str], work_root: Path) -> bool:
    """Print which stages would run and why; True when everything is up to date."""
    runner = open_runner(config, overrides, work_root)
    print(f"config: {runner.loaded.name} ({', '.join(str(p) for p in runner.loaded.files)})")
    print(f"work dir: {runner.work_dir}")
    res = runner.loaded.resolution
    target = targets.get(runner.loaded.config.build.target)
    print(f"target: {target.name} ({target.summary})")
    if res is not None:
        print(f"model type: {res.model_type or 'not known until the model is downloaded'}")
        for dotted, (value, why) in res.chosen.items():
            print(f"  chosen: {dotted} = {value!r}: {why}")
    if not target.device_only:
        print(f"serving pod: {serving_pod_line(runner.loaded.config)}")
    all_current = True
    here = host_stages(target)
    for st in runner.explain(here):
        if st.up_to_date:
            print(f"  {st.name:<12} up to date")
        else:
            all_current = False
            print(f"  {st.name:<12} will run: " + "; ".join(st.reasons))
    off_host = [s.name for s in STAGES if s.name not in here]
    if off_host:
        print(f"  {', '.join(off_host)}: not on this machine, the engine is built and run on the device: "
              f"{target.device_hand_over(runner.stage_dir('publish'))}")
    return all_current


def serving_pod_line(cfg) -> str:
    """The serving pod's host memory as `invoke deploy-manifests` sizes it, and what it holds."""
    host = pod_host_memory(cfg)
    line = f"memory {host['memory']} GiB, /dev/shm {host['shm']} GiB"
    target = targets.get(cfg.build.target)
    offload = target.kv_offloading_gib(cfg)
    if offload:
        ranks = cfg.build.tensor_parallel_size
        where = "in process memory" if target.on_cpu(cfg) else "in /dev/shm"
        line += (f" (vLLM's KV offloading: {offload:g} GiB in all, {offload / ranks:g} GiB per rank of {ranks}, "
                 f"{where})")
    return line


def doctor(config: Optional[str], overrides: Sequence[str], work_root: Path) -> Report:
    """Print what this machine has of what each target needs (pipeline.doctor); an EnvironmentProblem where the
    config cannot run here. Without ``config``: the project's default (constants.DEFAULT_CONFIG), not the cpu
    fallback that default_config() takes where vLLM cannot run, which is named after it."""
    loaded = load_config(config or constants.DEFAULT_CONFIG, list(overrides))
    report = examine(loaded.config, work_root, loaded.name)
    print(render(report))
    print()
    if report.ready:
        print(f"{loaded.name}: ready on this machine")
        return report
    if config is None:
        from pipeline.engines.vllm.runtime import unusable_reason

        if unusable_reason(loaded.config) is not None:
            # the same model as the default (it extends the cpu config): its type is known, not probed again
            model_type = loaded.resolution.model_type if loaded.resolution else None
            fallback = load_config(constants.CPU_DEFAULT_CONFIG, list(overrides), model_type=model_type)
            lacking = examine(fallback.config, work_root, fallback.name).lacking
            print(f"note: where vLLM cannot run, the tasks without --config use {fallback.name}: "
                  + (f"it lacks {', '.join(lacking)} too" if lacking else "ready on this machine"))
    raise EnvironmentProblem(f"{loaded.name} (build.target {report.target}) cannot run on this machine: it lacks "
                             f"{', '.join(report.lacking)}. Each one's fix is above.")


def clean(config: Optional[str], overrides: Sequence[str], work_root: Path) -> Path:
    runner = open_runner(config, overrides, work_root)
    sweep_dead_runs()
    with WorkDirLock(runner.work_dir):
        for child in runner.work_dir.iterdir():
            if child.name == artifacts.LOCK_FILE:
                continue
            if child.is_dir():
                remove_tree(child)
            else:
                child.unlink()
    (runner.work_dir / artifacts.LOCK_FILE).unlink(missing_ok=True)
    runner.work_dir.rmdir()
    return runner.work_dir


def refuse_device_only(runner: Runner, what: str) -> None:
    """An InputError for ``what`` (verify, bench, a server, an image, manifests) where the target runs on its device
    only (Target.device_only)."""
    target = targets.get(runner.loaded.config.build.target)
    if target.device_only:
        raise InputError(f"the {target.name} target has no {what} on this machine: its engine is built and run on "
                         f"the device, not here. It ships as the device bundle `invoke publish` writes: "
                         f"{target.device_hand_over(runner.stage_dir('publish'))}")


def serve(config: Optional[str], overrides: Sequence[str], work_root: Path, supervise: bool = False,
          max_restarts: int = 5, **ports) -> None:
    runner = open_runner(config, overrides, work_root)
    refuse_device_only(runner, "server")
    cfg = runner.loaded.config
    serve_published(runner.work_dir, frontend=targets.get(cfg.build.target).frontends(cfg)[0], supervise=supervise,
                    max_restarts=max_restarts, **ports)


def tune(config: Optional[str], overrides: Sequence[str], work_root: Path, results: Optional[Path] = None) -> dict:
    """Measure serving settings against the SLA (pipeline/serving/tune.py), then republish with the chosen ones.
    A GPU target where no tritonserver runs: write the plan of points instead. ``results``: choose from points
    measured elsewhere."""
    from pipeline.serving import tune as tuning  # starts servers: imported when asked for
    from pipeline.serving.serve import gpu_server_binary
    from pipeline.serving.tuned import build_digest

    runner = open_runner(config, overrides, work_root)
    cfg, work_dir = runner.loaded.config, runner.work_dir
    print(f"config: {runner.loaded.name} ({runner.loaded.path}); work dir: {work_dir}")
    tuning.check_tunable(cfg)
    if results is not None:
        with WorkDirLock(work_dir):
            out = tuning.apply_results(cfg, work_dir, results)
        print(f"tune: {out['why']}")
        if out["build_digest"] != build_digest(work_dir):
            print(f"tune: {tuning.TUNE_DIR}/{tuning.TUNED_FILE} applies to the build it was measured on, which is "
                  f"not in this work dir: publish applies it where that build is (copy the file into that work "
                  f"dir's {tuning.TUNE_DIR}/)")
            return out
    elif targets.get(cfg.build.target).gpu_only and gpu_server_binary() is None:
        with WorkDirLock(work_dir):
            out = tuning.write_plan(cfg, runner.loaded.name, work_dir)
        print(f"tune: {out['why']}")
        for point in out["points"]:
            print(f"  - {point['label']}")
        print(f"tune: {tuning.PLAN_HOW.format(results=f'{tuning.TUNE_DIR}/{tuning.RESULTS_FILE}')}")
        return out
    else:
        runner.run(["build", "text"])  # what the settings are measured on, up to date
        with WorkDirLock(work_dir):
            out = tuning.run_tune(cfg, runner.loaded.name, work_dir)
        print(f"tune: {out['why']}")
    runner.run(["publish"])  # publish applies the tuned settings file: its content is one of publish's inputs
    return out


def optimize(config: Optional[str], overrides: Sequence[str], work_root: Path) -> dict:
    """Choose the plan and the serving settings together, by measurement (pipeline/optimize.py); publish the
    chosen candidate. Every candidate is the config with its fields set, in a work dir of its own under
    <work dir>/optimize/candidates/."""
    from pipeline import optimize as optimizing  # starts servers: imported when asked for

    runner = open_runner(config, overrides, work_root)
    cfg, work_dir = runner.loaded.config, runner.work_dir
    print(f"config: {runner.loaded.name} ({runner.loaded.path}); work dir: {work_dir}")
    sweep_dead_runs()
    optimizing.check_optimizable(cfg)
    runner = _resolved_runner(runner, config=config, overrides=overrides, work_root=work_root,
                              stages=["sensitivity"], force=False)
    # what this machine lacks, and unreadable lm-eval tasks (every candidate's: quantization.accuracy is fixed)
    runner.preflight(["build"])
    runner.run(["sensitivity"])  # what every candidate shares: measured once, here
    root = work_dir / optimizing.OPTIMIZE_DIR / optimizing.CANDIDATES_DIR

    def open_candidate(extra: list[str]) -> Runner:
        return open_runner(config, [*overrides, *extra], root)

    with WorkDirLock(work_dir):
        out = optimizing.run_optimize(runner.loaded.config, runner.loaded.name, work_dir, open_candidate)
    results = work_dir / optimizing.OPTIMIZE_DIR / optimizing.RESULTS_DIR
    print(f"optimize: {out['why']}")
    print(f"optimize: the table, the front and the cost: {results / optimizing.TABLE_FILE}")
    published = out["published"]
    sets = "".join(f" --set {shlex.quote(s)}" for s in [*overrides, *published["set"]])
    print(f"optimize: published {out['chosen']['candidate']} to {published['repository']}; serve it with "
          f"`invoke serve{' --config ' + shlex.quote(str(config)) if config else ''}{sets} --set "
          f"name={out['chosen']['candidate']} --work-root {root}`, or make it the config's own by setting "
          f"{', '.join(published['set']) or 'nothing (it is the config as it is)'} in it")
    return out


def image(config: Optional[str], overrides: Sequence[str], *, work_root: Path, push: bool = False,
          dry_run: bool = False, builder: bool = False, echo: Callable[[str], None] = print) -> ImagePlan:
    runner = open_runner(config, overrides, work_root)
    refuse_device_only(runner, "serving image")
    return build_image(runner, push=push, dry_run=dry_run, builder=builder, echo=echo)


def release(config: Optional[str], overrides: Sequence[str], *, work_root: Path, dry_run: bool = False,
            force: bool = False, echo: Callable[[str], None] = print) -> ImagePlan:
    """`invoke all`, then the image with the report inside, then push it."""
    runner = open_runner(config, overrides, work_root)
    refuse_device_only(runner, "serving image")
    check_release(runner, dry_run=dry_run, echo=echo)
    if not dry_run:
        run_all(config, overrides, work_root, force=force)
    return release_image(runner, dry_run=dry_run, echo=echo)


def deploy_manifests(config: Optional[str], overrides: Sequence[str], work_root: Path,
                     gpu_types: Sequence[str] = (), echo: Callable[[str], None] = print) -> Path:
    runner = open_runner(config, overrides, work_root)
    refuse_device_only(runner, "Kubernetes manifests")
    return render_manifests(runner, overrides, gpu_types, echo=echo)
