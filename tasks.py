"""invoke tasks: thin wiring to the `pipeline` package (all logic lives there).

Every task takes --config (default: the embedded SmolLM2 CPU config), --set section.key=value
(repeatable) and --work-root (default: ./build next to this file). `invoke --list` shows them all.
"""

import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from invoke import Collection, task

from pipeline import commands

ROOT = Path(__file__).resolve().parent
WORK_ROOT = ROOT / "build"

CONFIG_HELP = {
    "config": "engine config YAML (default: engine_configs/smollm2-135m-vllm.yaml)",
    "set": "override a config field, e.g. --set build.max_batch_size=16 (repeatable)",
    "work_root": "where work dirs live (default: ./build); artifacts go to <work-root>/<config name>/",
}
RUN_HELP = {
    **CONFIG_HELP,
    "force": "rerun the task's stages even if up to date",
    "verbose": "show everything on the console: the libraries' warnings and output, every INFO line (quiet "
               "by default: they go to each stage's log)",
}


def _stage_task(name: str, doc: str):
    @task(name=name, iterable=["set"], help=RUN_HELP)
    def _task(c, *, config=None, set=None, work_root=str(WORK_ROOT), force=False, verbose=False):
        commands.setup_logging(verbose)
        with commands.user_errors():
            commands.run_task(name, config, set or [], Path(work_root), force=force)

    _task.__doc__ = doc
    _task.body.__doc__ = doc
    return _task


download = _stage_task("download",
                       "Download the model (Hub, local folder or GGUF) and prepare calibration/evaluation text "
                       "(stages model, text).")
sensitivity = _stage_task("sensitivity",
                          "Per-layer INT8 sensitivity table and the mixed-precision plan (stages sensitivity, plan).")
quantize = _stage_task("quantize", "Quantize with ModelOpt, export the TensorRT-LLM checkpoint, check accuracy.")
build = _stage_task("build", "Build engines (tensorrt), LLM-API options (pytorch) or the CPU runtime bundle (cpu).")
publish = _stage_task("publish", "Publish the build to a versioned Triton model repository.")
verify = _stage_task("verify", "Start a real Triton server on the repository and check its answers.")


@task(name="bench", iterable=["set"], help={
    **RUN_HELP,
    "compare_with": "also sweep a second published build (its model repository, or the work dir holding it), "
                    "alternating level by level, and report the ratios (sets bench.compare_repository)",
})
def bench(c, *, config=None, set=None, work_root=str(WORK_ROOT), force=False, verbose=False, compare_with=None):
    """Benchmark the served model over a concurrency sweep (throughput, TTFT, inter-token and end-to-end latency)."""
    overrides = list(set or [])
    if compare_with:
        overrides.append(f"bench.compare_repository={Path(compare_with).resolve()}")
    commands.setup_logging(verbose)
    with commands.user_errors():
        commands.run_task("bench", config, overrides, Path(work_root), force=force)


@task(iterable=["set"], help=RUN_HELP)
def report(c, *, config=None, set=None, work_root=str(WORK_ROOT), force=False, verbose=False):
    """Write the build report (running what it needs first), then print where it is and its five lines."""
    commands.setup_logging(verbose)
    with commands.user_errors():
        commands.run_task("report", config, set or [], Path(work_root), force=force)
        commands.print_summary(config, set or [], Path(work_root))


@task(name="all", iterable=["set"], help=RUN_HELP)
def all_(c, *, config=None, set=None, work_root=str(WORK_ROOT), force=False, verbose=False):
    """Run every stage that is built, in order; list the ones not built yet."""
    commands.setup_logging(verbose)
    with commands.user_errors():
        commands.run_all(config, set or [], Path(work_root), force=force)
        commands.print_summary(config, set or [], Path(work_root))  # where the report is, and its five lines


@task(iterable=["set"], help=CONFIG_HELP)
def explain(c, config=None, set=None, work_root=str(WORK_ROOT)):
    """Check a config and print which stages would run, and why (which input changed). Runs nothing."""
    with commands.user_errors():
        commands.explain(config, set or [], Path(work_root))


@task(name="plan", iterable=["set"], help=CONFIG_HELP)
def plan_alias(c, config=None, set=None, work_root=str(WORK_ROOT)):
    """Old name of `invoke explain` (kept for one release; the plan stage runs under `invoke sensitivity`)."""
    print("note: `invoke plan` is now `invoke explain`; the old name goes in the next release.", file=sys.stderr)
    explain(c, config=config, set=set, work_root=work_root)


@task(iterable=["set"], help=CONFIG_HELP)
def doctor(c, config=None, set=None, work_root=str(WORK_ROOT)):
    """Check this machine for what each build target needs (CPU features, the vLLM and aiperf environments, Triton,
    GPUs, TensorRT-LLM, disk, memory, /dev/shm, the tests' tools) and say how to get each missing piece. Exits 3
    when the config (default: engine_configs/smollm2-135m-vllm.yaml) cannot run here."""
    with commands.user_errors():
        commands.doctor(config, set or [], Path(work_root))


@task(iterable=["set"], help=CONFIG_HELP)
def clean(c, config=None, set=None, work_root=str(WORK_ROOT)):
    """Delete the config's work dir (all its stages' artifacts), and what killed runs left in /dev/shm and the
    temporary directory that is provably theirs."""
    with commands.user_errors():
        print(f"removed {commands.clean(config, set or [], Path(work_root))}")


@task(iterable=["set"], help={**CONFIG_HELP, "verbose": RUN_HELP["verbose"],
                               "results": "choose from points measured elsewhere (a tune_results.json of the GPU "
                                          "machine's `invoke tune`) instead of measuring"})
def tune(c, *, config=None, set=None, work_root=str(WORK_ROOT), verbose=False, results=None):
    """Measure serving settings against the SLA on real servers (cpu target here; tensorrt/pytorch where the
    image's tritonserver runs, else write the plan of points to <work dir>/tune_plan.yaml), write the evidence
    and the chosen settings to <work dir>/tune, and republish with them."""
    commands.setup_logging(verbose)
    with commands.user_errors():
        commands.tune(config, set or [], Path(work_root), results=Path(results) if results else None)


@task(iterable=["set"], help={**CONFIG_HELP, "verbose": RUN_HELP["verbose"]})
def optimize(c, *, config=None, set=None, work_root=str(WORK_ROOT), verbose=False):
    """Choose the plan and the serving settings together: build and gate each candidate plan, measure the
    survivors on real servers (successive halving, then invoke tune's search on the finalists), against the
    accuracy floor and the SLA; write the table, the front and the cost to <work dir>/optimize/results and publish
    the chosen candidate."""
    commands.setup_logging(verbose)
    with commands.user_errors():
        commands.optimize(config, set or [], Path(work_root))


@task(iterable=["set"], help={**CONFIG_HELP,
                              "http_port": "HTTP port (default 8000; vLLM's OpenAI server: its API and metrics)",
                               "grpc_port": "gRPC port (default 8001)", "metrics_port": "metrics port (default 8002)",
                               "host": "address to bind (default 127.0.0.1: this machine only)",
                               "supervise": "restart the server when it stops by itself (its watchdog, a crash), "
                                            "with backoff, each restart printed with its cause",
                               "max_restarts": "with --supervise: restarts in a row before giving up (default 5)"})
def serve(c, *, config=None, set=None, work_root=str(WORK_ROOT), http_port=8000, grpc_port=8001, metrics_port=8002,
          host="127.0.0.1", supervise=False, max_restarts=5):
    """Serve the published build in the foreground until Ctrl-C or SIGTERM, with the server its target gives:
    Triton (cpu, tensorrt, pytorch targets) or, for the vllm target, vLLM's OpenAI server (vllm.frontends'
    first; triton: Triton over vLLM). Prints one line naming the server, the model and its URLs."""
    commands.setup_logging(False)
    with commands.user_errors():
        commands.serve(config, set or [], Path(work_root), http_port=http_port, grpc_port=grpc_port,
                       metrics_port=metrics_port, host=host, supervise=supervise, max_restarts=int(max_restarts))


@task(iterable=["set"], help={
    **CONFIG_HELP,
    "push": "push the image to image.repository after building it",
    "dry_run": "print the exact docker commands (and tags) instead of running them; needs no Docker",
    "builder": "build the engine-build image (for deploy/jobs) instead of the serving image",
})
def image(c, *, config=None, set=None, work_root=str(WORK_ROOT), push=False, dry_run=False, builder=False):
    """Build the container image of the published build (tags and labels derived from its provenance)."""
    with commands.user_errors():
        commands.image(config, set or [], work_root=Path(work_root), push=push, dry_run=dry_run, builder=builder)


@task(iterable=["set"], help={**RUN_HELP,
                              "dry_run": "print what would run (all, docker build, docker push); run nothing"})
def release(c, *, config=None, set=None, work_root=str(WORK_ROOT), dry_run=False, force=False, verbose=False):
    """`all`, then the image with the build report inside, then push it to image.repository."""
    commands.setup_logging(verbose)
    with commands.user_errors():
        commands.release(config, set or [], work_root=Path(work_root), dry_run=dry_run, force=force)


@task(name="deploy-manifests", iterable=["set", "gpu_type"], help={
    **CONFIG_HELP,
    "gpu_type": "also render an engine-build Job for this GPU type (node label nvidia.com/gpu.product; repeatable)",
})
def deploy_manifests(c, config=None, set=None, work_root=str(WORK_ROOT), gpu_type=None):
    """Render the Kubernetes manifests (deploy/) for the published build into <work dir>/deploy/."""
    with commands.user_errors():
        commands.deploy_manifests(config, set or [], Path(work_root), gpu_types=gpu_type or [])


@task(help={"quick": "skip the slow end-to-end tests (marked e2e)",
            "heavy": "also run the tests marked heavy (INT4 AWQ calibration of the real model: ~15 min on 2 cores)",
            "unit": "only the unit tier: the tests marked unit (no model run, no server start; minutes on 2 cores)",
            "k": "pytest -k expression",
            "no_lint": "skip the house rules (ruff, import layers, mypy, the docs build) and run only the tests",
            "workers": "test processes side by side (default: the CPUs this process may use, at most 4; 1 runs the "
                       "suite in this process)"})
def test(c, *, quick=False, heavy=False, unit=False, k=None, no_lint=False, workers=None):
    """The house rules (ruff, the import-layer contract, mypy, the docs built strict), then the test suite:
    everything but the heavy tests (--heavy adds them; --quick also skips e2e; --unit runs the unit tier only)."""
    if not no_lint:
        bin_dir = Path(sys.executable).parent
        c.run(shlex.join([str(bin_dir / "ruff"), "check", "pipeline", "triton_repo", "tests", "tasks.py", "scripts"]),
              pty=False)
        c.run(shlex.join([str(bin_dir / "lint-imports"), "--no-cache"]), pty=False)
        c.run(shlex.join([str(bin_dir / "mypy")]), pty=False)
        # Triton's Python models: each is a `model.py` beside the shared helpers (triton_repo/common, put on their
        # sys.path at load), so mypy checks one model's files at a time with those helpers on its path (the vllm
        # model's folder also holds the OpenAI server's tenant middleware)
        models = sorted(str(m.relative_to(ROOT)) for m in (ROOT / "triton_repo").glob("*/*.py")
                        if m.parent.name != "common")
        for model in models:
            c.run(shlex.join([str(bin_dir / "mypy"), model]), env={"MYPYPATH": str(ROOT / "triton_repo" / "common")},
                  pty=False, hide="out")
        print(f"mypy: {len(models)} files of the Triton models checked")
        _build_docs(c)
    args = [sys.executable, "-m", "pytest", "-q", "--durations=25"]  # the slowest tests named, for CI's time
    cpus = len(os.sched_getaffinity(0))
    workers = int(workers) if workers is not None else min(cpus, 4)
    env = {}
    if workers > 1:  # a test file per worker at a time, the default model's chain as one unit (tests/conftest.py)
        args += ["-n", str(workers), "--dist", "loadgroup", "--no-loadscope-reorder"]
        # each worker's torch gets its share of the CPUs: with two threads each on two cores the tests took 1.7x
        # their serial time (44.8 minutes in all, against 49 serially), and on the tests' small models one thread
        # is faster anyway (three quantize tests: 79 s against 91 s with two)
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(max(1, cpus // workers)))
    if unit:
        args += ["-m", "unit and not e2e and not heavy"]
    elif quick:
        args += ["-m", "not e2e and not heavy"]
    elif not heavy:
        args += ["-m", "not heavy"]
    if k:
        args += ["-k", k]
    c.run(shlex.join(args), env=env, pty=False)


def _build_docs(c, site_dir=None):
    from pipeline import docs_reference

    if docs_reference.stale(ROOT):
        sys.exit(f"{docs_reference.PAGE} differs from the config schema: run `{docs_reference.FIX}`")
    with tempfile.TemporaryDirectory(prefix="trtllm-pipeline-site-") as tmp:
        started = time.monotonic()
        with commands.user_errors():
            built = docs_reference.build_site(ROOT, Path(site_dir or tmp))
        if built.returncode != 0:
            sys.exit(f"{built.stderr}\nthe docs do not build strict (above: each broken link or anchor)")
        print(f"docs: built strict in {time.monotonic() - started:.1f} s" + (f" into {site_dir}" if site_dir else ""))


@task(help={"write": "rewrite docs/reference/config.md from the config schema first",
            "site_dir": "where to write the site (default: a temporary folder, removed after the build)"})
def docs(c, write=False, site_dir=None):
    """Build the documentation site strictly (every link and anchor checked), after checking that the
    configuration reference matches the schema (--write regenerates it)."""
    if write:
        from pipeline import docs_reference

        print(f"wrote {docs_reference.write(ROOT).relative_to(ROOT)}")
    _build_docs(c, site_dir)


ns = Collection(download, sensitivity, quantize, build, publish, verify, bench, report, all_, explain, plan_alias,
                doctor, clean, serve, tune, optimize, image, release, deploy_manifests, test, docs)
