"""Fault injection: what docs/concepts/stage-cache.md promises when a run is killed or the disk fills up, on the tiny
model.

- kill -9 of the whole run (the invoke process and its stage child) at points inside the long stages, then a
  rerun: outputs identical to an uninterrupted run, nothing partial at a final path, no leftover staging or
  lock that blocks the next run, and no process of the run left;
- a full file system during a stage's write: a clear error naming the file system, the previous output
  intact, nothing left in staging, and the next run (with space again) succeeds;
- the Triton server killed under verify's checks and under bench's load: each stage fails saying the server
  died, with the end of its log, and leaves no process behind;
- on the vllm target (the project's default, e2e), kill -9 of the `invoke` process alone (as an OOM killer
  does) with vLLM's OpenAI server up, with Triton over vLLM up, inside bench and inside build's vLLM check:
  no process of the run left (vLLM's engine core and resource tracker included), no new /dev/shm file, and a
  rerun that completes (scripts/kill_vllm_runs.py repeats these and reports the figures).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, RUN_TOKEN_ENV, run_invoke, run_processes, tiny_config

from pipeline import artifacts, procs

pytestmark = pytest.mark.faults

STAGES = ("model", "text", "sensitivity", "plan", "quantize", "build")


def _outputs(work: Path, upto: str) -> dict[str, str]:
    """The output digest of each stage up to ``upto`` (its manifest's record of the files it wrote)."""
    stages = STAGES[: STAGES.index(upto) + 1]
    return {s: json.loads((work / s / artifacts.MANIFEST_FILE).read_text())["outputs"]["digest"] for s in stages}


def _ours(marker: str) -> list[int]:
    """Live processes whose command line names ``marker`` (the run's work root)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(entry.name))
    return out


def _run_and_kill_at(cfg: Path, work_root: Path, stage: str, marker: str, timeout: float = 600) -> bool:
    """`invoke <stage>` killed (SIGKILL to its process group: the run and its stage child) as soon as the
    stage log of ``stage`` says ``marker``. Returns whether the kill landed inside that stage."""
    proc = subprocess.Popen([sys.executable, "-m", "invoke", stage, "--config", str(cfg), "--work-root",
                             str(work_root)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    staging = work_root / "tiny" / artifacts.STAGING_DIR
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(staging.glob(f"{stage}-*/{artifacts.STAGE_LOG_FILE}"))
            if logs and marker in logs[0].read_text(errors="replace"):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return not (work_root / "tiny" / stage / artifacts.MANIFEST_FILE).exists()
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """The tiny config through build, uninterrupted: (config, its outputs, the work root)."""
    root = tmp_path_factory.mktemp("faults")
    cfg = tiny_config(root, tiny_model_dir)
    proc = run_invoke("build", "--config", str(cfg), "--work-root", str(root / "reference"), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cfg, _outputs(root / "reference" / "tiny", "build"), root / "reference"


@pytest.fixture(scope="module")
def published(reference):
    """The reference work root through publish: (config, work root)."""
    cfg, _, work_root = reference
    proc = run_invoke("publish", "--config", str(cfg), "--work-root", str(work_root), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cfg, work_root


@pytest.mark.parametrize("stage, marker", [
    ("sensitivity", "layer 1/2 done"),  # between decoder layers
    ("quantize", "quantize on cpu"),  # before calibration
    ("quantize", "accuracy: "),  # calibrated, gated, not yet exported
    ("build", "cpu runtime: "),  # the bundle written, its smoke test loading it
])
def test_a_run_killed_inside_a_stage_reruns_to_the_same_outputs(reference, tmp_path, stage, marker):
    cfg, outputs, _ = reference
    want = {s: d for s, d in outputs.items() if STAGES.index(s) <= STAGES.index(stage)}
    work_root = tmp_path / "work"
    assert _run_and_kill_at(cfg, work_root, stage, marker), f"the run ended before the kill at {marker!r}"
    deadline = time.monotonic() + 10
    while _ours(str(work_root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours(str(work_root)) == [], "a process of the killed run is still alive"
    work = work_root / "tiny"
    assert not (work / stage).exists()  # nothing partial at the final path
    assert list((work / artifacts.STAGING_DIR).iterdir())  # the kill left its staging folder ...
    proc = run_invoke(stage, "--config", str(cfg), "--work-root", str(work_root), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # ... which does not block the next run
    assert f"{stage}: running" in proc.stdout
    assert _outputs(work, stage) == want
    assert list((work / artifacts.STAGING_DIR).iterdir()) == []


def _kill_server_when_ready(stage: str, cfg: Path, work_root: Path, settle_s: float) -> subprocess.CompletedProcess:
    """`invoke <stage>` with its Triton server killed (SIGKILL to tritonserver only) ``settle_s`` after the stage
    found it ready; returns the finished run."""
    proc = subprocess.Popen([sys.executable, "-m", "invoke", stage, "--config", str(cfg), "--work-root",
                             str(work_root)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    staging = work_root / "tiny" / artifacts.STAGING_DIR
    repo = str(work_root / "tiny" / "publish" / artifacts.MODEL_REPOSITORY_DIR)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(staging.glob(f"{stage}-*/{artifacts.STAGE_LOG_FILE}"))
            if logs and "tritonserver ready in" in logs[0].read_text(errors="replace"):
                time.sleep(settle_s)
                servers = [pid for pid in _ours(repo) if Path(Path(f"/proc/{pid}/cmdline").read_text(
                    errors="replace").split("\0")[0]).name == "tritonserver"]  # not its stubs
                assert servers, "the stage's tritonserver was not found"
                os.kill(servers[0], signal.SIGKILL)
                break
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.mark.parametrize("stage, settle_s, said", [
    ("verify", 0.0, "verify: tritonserver died during the checks (exit code -9)"),
    ("bench", 1.0, "bench: tritonserver died during the sweep (exit code -9)"),
])
def test_a_server_killed_under_load_is_reported_as_a_server_failure(published, stage, settle_s, said):
    cfg, work_root = published
    done = _kill_server_when_ready(stage, cfg, work_root, settle_s)
    assert done.returncode == 1, done.stdout
    assert said in done.stdout and "Last lines of its log" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout
    deadline = time.monotonic() + 10
    while _ours(str(work_root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours(str(work_root)) == []  # the stubs of the killed server too
    assert not (work_root / "tiny" / stage).exists()


def test_a_run_killed_inside_bench_leaves_no_server_behind_and_reruns(published):
    """kill -9 of `invoke bench` (the run's process group) while its Triton server is under load: the server,
    in a session of its own, and its model stubs die with the run; nothing is at bench's final path, and the
    next bench runs to the end and leaves no staging behind. (After the server-kill test above, which needs
    bench not run yet.)"""
    cfg, work_root = published
    assert _run_and_kill_at(cfg, work_root, "bench", "tritonserver ready in"), "bench ended before the kill"
    deadline = time.monotonic() + 60  # the group's reaper: SIGTERM, the stubs' grace, then SIGKILL
    while _ours(str(work_root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours(str(work_root)) == [], "tritonserver or a stub of the killed run is still alive"
    work = work_root / "tiny"
    assert not (work / "bench").exists()
    proc = run_invoke("bench", "--config", str(cfg), "--work-root", str(work_root), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (work / "bench" / artifacts.MANIFEST_FILE).exists()
    assert list((work / artifacts.STAGING_DIR).iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (its size is enforced by the kernel), unmounted after the test."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a size-limited tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write until the file system is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def test_a_full_disk_during_a_stage_is_a_clear_error_and_keeps_the_previous_output(small_disk, tiny_model_dir,
                                                                                   tmp_path):
    cfg = tiny_config(tmp_path, tiny_model_dir)
    args = ("sensitivity", "--config", str(cfg), "--work-root", str(small_disk))
    proc = run_invoke(*args, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = small_disk / "tiny"
    before = {p.relative_to(work / "sensitivity"): p.read_bytes() for p in (work / "sensitivity").rglob("*")
              if p.is_file()}
    ballast = small_disk / "ballast"
    _fill(ballast)
    proc = run_invoke(*args, "--force", timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out  # an environment problem, not a crash
    assert f"the file system holding {work} is full" in out and "Traceback" not in out
    after = {p.relative_to(work / "sensitivity"): p.read_bytes() for p in (work / "sensitivity").rglob("*")
             if p.is_file()}
    assert after == before  # the previous output, byte for byte
    assert list((work / artifacts.STAGING_DIR).iterdir()) == []
    ballast.unlink()
    proc = run_invoke(*args, "--force", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the vllm target: kill -9 of the run alone

VLLM_CONFIG = REPO / "engine_configs" / "smollm2-135m-vllm.yaml"
VLLM_NAME = "smollm2-135m-vllm"
# bench's sweep, briefly (its wiring is what is under test, not its figures)
LIGHT_BENCH = ["--set", "bench.concurrency=[2]", "--set", "bench.requests_per_level=4", "--set",
               "bench.warmup_requests=1"]
# (stage, the stage log's line at which the run is killed, seconds after it): the kill points
VLLM_KILL_POINTS = {
    "verify-openai": ("verify", "vLLM server ready in", 0.0),  # vLLM's OpenAI server up (engine core, tracker)
    "verify-triton": ("verify", "tritonserver ready in", 0.0),  # Triton up, its vLLM model's stub running vLLM
    "bench": ("bench", "vLLM server ready in", 2.0),  # the server under bench's load
    "build-check": ("build", "Loading weights took", 0.0),  # build's vLLM check: its worker's engine loaded
}


def _started_by_a_live_process(name: str) -> bool:
    """Whether a /dev/shm name is a Triton region whose name says its server's starter is alive: another test's
    server (in CI, the other xdist worker's), made before its stubs map it or left until its stop unlinks it."""
    from pipeline.serving.server import SHM_PREFIX

    pid = name[len(SHM_PREFIX):].split("_", 1)[0] if name.startswith(SHM_PREFIX) else ""
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def new_shm(before: set[str]) -> dict[str, int]:
    """/dev/shm files that were not there before, and that no live process maps or names as its own (another
    run's live memory on a shared machine): name -> bytes."""
    live = procs.mapped_shm(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    out = {}
    for p in procs.SHM_DIR.iterdir():
        if p.name not in before and p not in live and not _started_by_a_live_process(p.name):
            try:
                out[p.name] = p.stat().st_size
            except OSError:
                pass
    return out


def kill_invoke_at(work_root: Path, point: str, token: str, timeout_s: float = 900) -> bool:
    """`invoke <stage> --force` on the vllm config, SIGKILLed (the invoke process alone, as an OOM killer or a
    node drain kills it: its children are not signalled) once its stage log says the kill point's line. Whether
    the kill landed there."""
    stage, marker, settle_s = VLLM_KILL_POINTS[point]
    proc = subprocess.Popen([sys.executable, "-m", "invoke", stage, "--force", "--config", str(VLLM_CONFIG),
                             "--work-root", str(work_root), *LIGHT_BENCH], cwd=REPO,
                            env={**os.environ, RUN_TOKEN_ENV: token}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    staging = work_root / VLLM_NAME / artifacts.STAGING_DIR
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(staging.glob(f"{stage}-*/{artifacts.STAGE_LOG_FILE}"))
            if logs and marker in logs[0].read_text(errors="replace"):
                time.sleep(settle_s)
                proc.kill()
                proc.wait(timeout=30)
                return proc.returncode == -signal.SIGKILL
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return False


def leftovers(token: str, shm_before: set[str], wait_s: float = 60) -> tuple[list[str], dict]:
    """What the killed run left after up to ``wait_s`` (its reapers end its groups within seconds): (processes,
    as "pid: command line", new /dev/shm files -> bytes). Processes left are then killed (the test started
    them), by pid."""
    deadline = time.monotonic() + wait_s
    while (run_processes(token) or new_shm(shm_before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    pids, shm = run_processes(token), new_shm(shm_before)
    left = []
    for pid in pids:
        try:
            left.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            left.append(f"{pid}: (gone)")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left, shm


@pytest.fixture(scope="module")
def vllm_published(default_work_root):
    """The embedded default (vllm target) published in the session's default work root (shared with
    tests/engines/vllm/test_vllm.py; the cpu default's model, text and checkpoint are reused where present)."""
    from pipeline.engines.vllm import runtime
    from pipeline.errors import EnvironmentProblem

    try:
        runtime.serving_python()
    except EnvironmentProblem as e:
        pytest.skip(f"vLLM's serving environment is not installed here ({e})")
    if not runtime.cpu_runs_vllm():
        pytest.skip("vLLM's CPU build needs AVX-512 or AMX (this CPU has neither)")
    cpu_work, work = default_work_root / "smollm2-135m-cpu", default_work_root / VLLM_NAME
    if (cpu_work / "quantize" / artifacts.MANIFEST_FILE).is_file() and not work.exists():
        shutil.copytree(cpu_work, work, symlinks=True, ignore=shutil.ignore_patterns(
            "build", "publish", "verify", "bench", "report", "model_repository"))
    proc = run_invoke("publish", "--config", str(VLLM_CONFIG), "--work-root", str(default_work_root), timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return default_work_root


@pytest.mark.e2e
@pytest.mark.timeout(2400)
# every run kills at vLLM's own server and at the build's check; Triton over vLLM and bench's load (the same
# reaper, another server) run with `invoke test --heavy`, to keep CI's run well inside its time
@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.heavy) if p in ("verify-triton", "bench") else p
                                   for p in VLLM_KILL_POINTS])
def test_a_killed_vllm_run_leaves_nothing_behind_and_reruns(vllm_published, point):
    """kill -9 of `invoke` alone at each vllm kill point: within a minute no process of the run is left (vLLM's
    server, engine core and resource tracker; Triton and its stubs; the build's vLLM worker), no /dev/shm file
    is new, and the stage then runs again to the end (leaving no /dev/shm file either)."""
    work_root = vllm_published
    stage = VLLM_KILL_POINTS[point][0]
    token = uuid.uuid4().hex
    shm_before = {p.name for p in procs.SHM_DIR.iterdir()}
    assert kill_invoke_at(work_root, point, token), f"the run ended before the kill at {point}"
    left, shm = leftovers(token, shm_before)
    assert left == [], f"processes of the killed run still alive: {left}"
    assert shm == {}, f"/dev/shm files the killed run left: {shm}"
    proc = run_invoke(stage, "--force", "--config", str(VLLM_CONFIG), "--work-root", str(work_root), *LIGHT_BENCH,
                      timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (work_root / VLLM_NAME / stage / artifacts.MANIFEST_FILE).is_file()
    assert new_shm(shm_before) == {}
