"""run_in_child: results, user errors and crashes come back as the pipeline's own errors, with the log's tail."""

from __future__ import annotations

from pathlib import Path

import child_targets as targets
import pytest
from conftest import REPO, memory_cgroup, needs_memory_cgroup

from pipeline.child import run_in_child
from pipeline.compute import Bound
from pipeline.errors import ConfigError, StageFailed

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


def test_result_and_peak_rss_is_the_childs_own(tmp_path):
    ballast = bytearray(1024 * 2**20)  # the parent holds 1 GiB, touched, while it spawns the child
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    result, peak = run_in_child(targets.add, 2, 3, log_path=tmp_path / "stage.log")
    del ballast
    assert result == 5
    assert 10 * 2**20 < peak < 512 * 2**20  # the child's own interpreter, not the parent's 1 GiB


def test_user_error_is_reraised_as_the_same_class(tmp_path):
    with pytest.raises(ConfigError, match="max_batch_size: 0 is not allowed"):
        run_in_child(targets.raise_config_error, log_path=tmp_path / "stage.log")


def test_a_bug_becomes_stage_failed_with_the_traceback_in_the_log(tmp_path):
    log = tmp_path / "stage.log"
    with pytest.raises(StageFailed, match="KeyError: 'a bug, not a user error'"):
        run_in_child(targets.raise_bug, log_path=log)
    assert "Traceback" in log.read_text()


def test_a_killed_child_is_a_stage_failure_not_a_hang(tmp_path):
    with pytest.raises(StageFailed, match=r"died \(exit code -9"):
        run_in_child(targets.killed, log_path=tmp_path / "stage.log")


@needs_memory_cgroup
def test_out_of_memory_kill_names_the_likely_cause(tmp_path):
    bound = Bound(200 * 2**20, "a test cgroup")
    with memory_cgroup(200 * 2**20) as cg:
        with pytest.raises(StageFailed, match=r"^quantize: .*ran out of memory; its peak memory was at least "
                                              r"[0-9.]+ GiB, against a bound of 0.20 GiB \(a test cgroup\)"):
            run_in_child(targets.allocate_in_cgroup, str(cg), 600, log_path=tmp_path / "stage.log",
                         what="quantize", bound=bound)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_child_dies_with_a_parent_killed_hard(tmp_path):
    """kill -9 of the process running a stage (as a caller's timeout does): its child does not go on
    computing as an orphan; it is gone within seconds."""
    import os
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import child_targets; "
            "from pathlib import Path; from pipeline.child import run_in_child; "
            f"run_in_child(child_targets.report_pid_and_wait, {str(pid_file)!r}, "
            f"log_path=Path({str(tmp_path / 'log')!r}))")
    starter = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _running(child)
    if alive:  # the test started it: it ends here, and the test fails
        os.kill(child, 9)
    assert not alive, "the stage's child outlived its parent"
