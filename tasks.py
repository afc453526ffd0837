"""invoke tasks: thin wiring to the `pipeline` package (all logic lives there).

Every task takes --config (default: the embedded SmolLM2 CPU config), --set section.key=value
(repeatable) and --work-root (default: ./build next to this file). `invoke --list` shows them all.
"""

import shlex
import sys
from pathlib import Path

from invoke import Collection, task

from pipeline import cli

ROOT = Path(__file__).resolve().parent
WORK_ROOT = ROOT / "build"

CONFIG_HELP = {
    "config": "engine config YAML (default: engine_configs/smollm2-135m-cpu.yaml)",
    "set": "override a config field, e.g. --set build.max_batch_size=16 (repeatable)",
    "work_root": "where work dirs live (default: ./build); artifacts go to <work-root>/<config name>/",
}
RUN_HELP = {
    **CONFIG_HELP,
    "force": "rerun the task's stages even if up to date",
    "verbose": "show INFO logs of the libraries too",
}


def _stage_task(name: str, doc: str):
    @task(name=name, iterable=["set"], help=RUN_HELP)
    def _task(c, config=None, set=None, work_root=str(WORK_ROOT), force=False, verbose=False):
        cli.setup_logging(verbose)
        with cli.user_errors():
            cli.run_task(name, config, set or [], Path(work_root), force=force)

    _task.__doc__ = doc
    _task.body.__doc__ = doc
    return _task


download = _stage_task("download", "Download the model (Hub, local folder or GGUF) and prepare calibration/evaluation text.")
sensitivity = _stage_task("sensitivity", "Per-layer INT8 sensitivity table and the mixed-precision plan.")
quantize = _stage_task("quantize", "Quantize with ModelOpt, export the TensorRT-LLM checkpoint, check accuracy.")
build = _stage_task("build", "Build engines (tensorrt), LLM-API options (pytorch) or the CPU runtime bundle (cpu).")
publish = _stage_task("publish", "Publish the build to a versioned Triton model repository.")
verify = _stage_task("verify", "Start a real Triton server on the repository and check its answers.")
bench = _stage_task("bench", "Benchmark the served model over a concurrency sweep.")
report = _stage_task("report", "Write the build report.")


@task(name="all", iterable=["set"], help=RUN_HELP)
def all_(c, config=None, set=None, work_root=str(WORK_ROOT), force=False, verbose=False):
    """Run every stage that is built, in order; list the ones not built yet."""
    cli.setup_logging(verbose)
    with cli.user_errors():
        cli.run_all(config, set or [], Path(work_root), force=force)


@task(iterable=["set"], help=CONFIG_HELP)
def plan(c, config=None, set=None, work_root=str(WORK_ROOT)):
    """Check a config and print which stages would run, and why (which input changed). Runs nothing."""
    with cli.user_errors():
        cli.explain(config, set or [], Path(work_root))


@task(iterable=["set"], help=CONFIG_HELP)
def clean(c, config=None, set=None, work_root=str(WORK_ROOT)):
    """Delete the config's work dir (all its stages' artifacts)."""
    with cli.user_errors():
        print(f"removed {cli.clean(config, set or [], Path(work_root))}")


def _not_built(name: str, issue: int, doc: str):
    @task(name=name)
    def _task(c, config=None):
        print(f"error: `invoke {name}` is not built yet (issue #{issue}).", file=sys.stderr)
        raise SystemExit(2)

    _task.__doc__ = doc
    _task.body.__doc__ = doc
    return _task


serve = _not_built("serve", 6, "Run a Triton server on the published repository until Ctrl-C.")
image = _not_built("image", 8, "Build the container image for a published build.")


@task(help={"quick": "skip the slow end-to-end tests (marked e2e)", "k": "pytest -k expression"})
def test(c, quick=False, k=None):
    """Run the test suite (the whole suite unless --quick)."""
    args = [sys.executable, "-m", "pytest", "-q"]
    if quick:
        args += ["-m", "not e2e"]
    if k:
        args += ["-k", k]
    c.run(shlex.join(args), pty=False)


ns = Collection(download, sensitivity, quantize, build, publish, verify, bench, report, all_, plan, clean,
                serve, image, test)
