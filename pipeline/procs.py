"""Process groups the pipeline starts (servers, vLLM workers): who is in one, and ending all of it.

Every server and worker runs in a session of its own (``start_new_session``), so its process group id is its
pid and its children (Triton's Python-backend stubs, vLLM's engine core and workers) are in the group.
Stopping one ends the whole group, and then removes the POSIX shared memory (``/dev/shm``) its members had
mapped: vLLM's message queues (Python ``multiprocessing.shared_memory``, ``psm_*``, hundreds of MiB each)
and Triton's Python-backend regions stay behind when a process is killed before it cleans up, and they are
memory. Only what the group's own processes mapped is removed. Before any SIGKILL the group's last members get
LINGER_S to end by themselves: Python's multiprocessing resource tracker (vLLM's processes have one) unlinks the
semaphores and shared memory they left registered once they have all ended.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
STOP_GRACE_S = 15.0
# After the SIGTERM, how long the group's last members get to end by themselves before SIGKILL. Python's
# multiprocessing resource tracker (vLLM's processes have one) ignores SIGTERM, and once every process using it
# has ended it unlinks what they left registered, named semaphores (/dev/shm/sem.mp-*) among them; a SIGKILL
# at once left one behind per vLLM server stop (seen in bench, which stops a loaded server).
LINGER_S = 5.0


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in a process group, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def mapped_shm(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm files these processes have mapped (from /proc/<pid>/maps; a process gone meanwhile is
    skipped)."""
    found = set()
    prefix = f"{SHM_DIR}/"
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:  # address perms offset device inode [path]
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith(prefix) and not path.endswith(" (deleted)"):
                found.add(Path(path))
    return found


def remove_files(paths: Iterable[Path]) -> list[Path]:
    """Unlink those that still exist; returns them."""
    removed = []
    for p in paths:
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s: %s", p, e)
    return removed


def foreign_python_env() -> dict[str, str]:
    """This process's environment for a program of another virtual environment (vLLM's, aiperf's): without this
    venv's Python paths, which would make it import our packages instead of its own."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def stop_process_group(proc: Optional[subprocess.Popen], what: str, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to ``proc`` (started with ``start_new_session``) and its process group, SIGKILL after a grace
    period; then whatever is left in the group (children of a server that died hard); then the shared memory
    the group had mapped and left behind."""
    if proc is None:
        return
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
    removed = remove_files(shm)
    if removed:
        log.info("%s left %d shared-memory file(s) behind; removed: %s", what, len(removed),
                 ", ".join(p.name for p in removed))
