"""Process groups the pipeline starts (servers, vLLM workers): who is in one, and ending all of it.

Every server and worker runs in a session of its own (``start_new_session``), so its process group id is its
pid and its children (Triton's Python-backend stubs, vLLM's engine core and workers) are in the group.
Stopping one ends the whole group, and then removes the POSIX shared memory (``/dev/shm``) its members had
mapped: vLLM's message queues (Python ``multiprocessing.shared_memory``, ``psm_*``, hundreds of MiB each)
and Triton's Python-backend regions stay behind when a process is killed before it cleans up, and they are
memory. Only what the group's own processes mapped is removed. Before any SIGKILL the group's last members get
LINGER_S to end by themselves: Python's multiprocessing resource tracker (vLLM's processes have one) unlinks the
semaphores and shared memory they left registered once they have all ended.

A run killed before it can stop what it started (kill -9, an OOM killer) is handled by ``start_group``: the
group's leader gets SIGKILL when its starter dies (PR_SET_PDEATHSIG), and a reaper (pipeline.reaper) ends
the rest of the group, vLLM's engine core and resource tracker among them, and removes their shared memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from pipeline.reaper import SHM_DIR, STOP_GRACE_S, STOPPED, group_members, mapped_shm, recorded_shm, remove_files

log = logging.getLogger(__name__)

__all__ = ["SHM_DIR", "group_members", "mapped_shm", "remove_files", "start_group", "stop_process_group",
           "kill_process_group", "foreign_python_env", "run_group"]
REAPER_EXIT_S = 10.0  # how long a stop waits for the group's reaper to see its pipe close and exit
# After the SIGTERM, how long the group's last members get to end by themselves before SIGKILL. Python's
# multiprocessing resource tracker (vLLM's processes have one) ignores SIGTERM, and once every process using it
# has ended it unlinks what they left registered, named semaphores (/dev/shm/sem.mp-*) among them; a SIGKILL
# at once left one behind per vLLM server stop (seen in bench, which stops a loaded server).
LINGER_S = 5.0


def foreign_python_env() -> dict[str, str]:
    """This process's environment for a program of another virtual environment (vLLM's, aiperf's): without this
    venv's Python paths, which would make it import our packages instead of its own."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


_PR_SET_PDEATHSIG = 1  # prctl(2)
_PRCTL: Optional[Callable[..., int]]
try:  # resolved here, not between fork and exec, where loading a library could deadlock
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def set_pdeathsig() -> None:
    """SIGKILL to this process when the thread that started it dies (runs in the child between fork and exec)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Reaper:
    """The reaper of one group, seen from its starter: its process and the write end of the pipe it watches."""

    def __init__(self, pgid: int, what: str, tmp: Sequence[Path], shm_prefix: Sequence[str] = ()) -> None:
        read_end, self.write_end = os.pipe()  # both not inheritable: only the reaper gets the read end
        package_root = str(Path(__file__).resolve().parents[1])  # this very package, whatever sys.path says
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        argv = [sys.executable, "-m", "pipeline.reaper", "--pgid", str(pgid), "--fd", str(read_end),
                "--starter", str(os.getpid()), "--what", what] + [a for t in tmp for a in ("--tmp", str(t))] \
            + [a for p in shm_prefix for a in ("--shm-prefix", p)]
        try:
            self.process = subprocess.Popen(argv, pass_fds=(read_end,), start_new_session=True, env=env,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)  # holds no pipe of the starter's open
        except BaseException:
            os.close(self.write_end)
            raise
        finally:
            os.close(read_end)

    def release(self) -> None:
        """Tell the reaper the group was stopped and close the pipe: it removes its record and exits."""
        try:
            os.write(self.write_end, STOPPED)
        except OSError:  # the reaper has died: nothing to tell
            pass
        os.close(self.write_end)
        try:
            self.process.wait(timeout=REAPER_EXIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the reaper (pid %d) of a stopped group has not exited yet", self.process.pid)


_REAPERS: dict[int, _Reaper] = {}  # process group id -> its reaper


def start_group(argv: Sequence[str], what: str, tmp: Sequence[Path] = (), shm_prefix: Sequence[str] = (),
                **popen) -> subprocess.Popen:
    """Start ``argv`` in a session of its own (its process group id is its pid), tied to this process's life:
    its leader gets SIGKILL when this process dies, and a reaper (pipeline.reaper) then ends the rest of the
    group and removes the shared memory the group mapped, the /dev/shm files named ``shm_prefix``* and the
    temporary folders ``tmp``. Stop it with
    ``stop_process_group`` or ``kill_process_group``."""
    proc = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=set_pdeathsig, **popen)
    try:
        _REAPERS[proc.pid] = _Reaper(proc.pid, what, tmp, shm_prefix)
    except BaseException:
        kill_process_group(proc, what)
        raise
    return proc


def run_group(argv: Sequence[str], what: str, *, log_path: Path, env: dict[str, str], timeout_s: float,
              tmp: Sequence[Path] = ()) -> int:
    """Run ``argv`` to its end as a process group (``start_group``), its output appended to ``log_path``, and return
    its exit code. Whatever it started ends with it (a worker's engine processes, and the memory they mapped), also
    when the wait times out (subprocess.TimeoutExpired) or is interrupted."""
    with open(log_path, "ab") as log_f:
        proc = start_group(argv, what, tmp=tmp, stdout=log_f, stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait(timeout=timeout_s)
        finally:
            kill_process_group(proc, what)


def _release(pgid: int) -> None:
    reaper = _REAPERS.pop(pgid, None)
    if reaper is not None:
        reaper.release()


def stop_process_group(proc: Optional[subprocess.Popen], what: str, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to ``proc`` (started with ``start_new_session``) and its process group, SIGKILL after a grace
    period; then whatever is left in the group (children of a server that died hard); then the shared memory
    the group had mapped and left behind."""
    if proc is None:
        return
    try:
        _stop(proc, what, grace_s)
    finally:
        _release(proc.pid)


def _stop(proc: subprocess.Popen, what: str, grace_s: float) -> None:
    pid = proc.pid  # with start_new_session the process group id is the server's pid
    shm = mapped_shm(group_members(pid))
    if proc.poll() is None:
        for send in (lambda: os.kill(pid, signal.SIGTERM), lambda: os.killpg(pid, signal.SIGTERM)):
            try:
                send()
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it", what, pid, grace_s)
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + LINGER_S
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _end_group(pid, grace_s, shm, what)


def kill_process_group(proc: subprocess.Popen, what: str) -> None:
    """SIGKILL to ``proc``'s process group at once (a worker whose result is in, or one being abandoned), then
    the shared memory it left behind."""
    try:
        _kill(proc, what)
    finally:
        _release(proc.pid)


def _kill(proc: subprocess.Popen, what: str) -> None:
    shm = mapped_shm(group_members(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not end after SIGKILL", what, proc.pid)
    _end_group(proc.pid, STOP_GRACE_S, shm, what)


def _end_group(pgid: int, grace_s: float, shm: set[Path], what: str) -> None:
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.1)
    removed = remove_files(shm | recorded_shm(pgid))  # the reaper's record: released after this
    if removed:
        log.info("%s left %d shared-memory file(s) behind; removed: %s", what, len(removed),
                 ", ".join(p.name for p in removed))
