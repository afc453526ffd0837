"""Process groups (pipeline.procs): stopping one ends every member and removes the shared memory they mapped,
as vLLM's engine core leaves it behind when killed, and nothing another process owns."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from pipeline import procs

# A server stand-in: it maps a new shared-memory segment (Python's multiprocessing.shared_memory, as vLLM's
# message queues are), starts a child in its group that maps it too, prints the name and both pids, and then
# ignores SIGTERM (the case the grace period and SIGKILL are for) or not, per argv[1].
SERVER = r"""
import json, signal, subprocess, sys, time
from multiprocessing import shared_memory
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
from multiprocessing import resource_tracker
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # its owner unlinks it at shutdown, as vLLM does: no
# tracker process cleans up after a kill, so only the code under test can remove it
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time; from multiprocessing import shared_memory as s, resource_tracker as r; "
    "m = s.SharedMemory(name=sys.argv[1]); r.unregister(m._name, 'shared_memory'); "
    "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)", shm.name])
time.sleep(0.5)
print(json.dumps({"shm": shm.name, "pid": child.pid}), flush=True)
time.sleep(600)
"""


def _start(mode: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, mode], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    facts = json.loads(proc.stdout.readline())
    deadline = time.monotonic() + 30
    while len(procs.group_members(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, facts


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_stopping_a_group_ends_every_member_and_removes_the_shared_memory_it_left(mode):
    other = shared_memory.SharedMemory(create=True, size=4096)  # another process's segment: must survive
    proc, facts = _start(mode)
    try:
        shm = Path("/dev/shm") / facts["shm"]
        assert shm.exists() and {proc.pid, facts["pid"]} <= set(procs.group_members(proc.pid))
        assert shm in procs.mapped_shm([facts["pid"]])
        t0 = time.monotonic()
        procs.stop_process_group(proc, "stand-in server", grace_s=2.0 if mode == "stubborn" else 15.0)
        assert proc.poll() is not None and not procs.group_members(proc.pid)
        assert not shm.exists()  # killed before it could unlink it: removed for it
        assert Path("/dev/shm", other.name.lstrip("/")).exists()
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            procs.kill_process_group(proc, "stand-in server")
        other.close()
        other.unlink()


def test_killing_a_group_at_once_removes_its_shared_memory_too():
    proc, facts = _start("stubborn")
    shm = Path("/dev/shm") / facts["shm"]
    procs.kill_process_group(proc, "stand-in worker")
    assert proc.poll() is not None and not procs.group_members(proc.pid) and not shm.exists()


# A server stand-in as vLLM's are: its spawned child makes a named semaphore (registered with Python's
# multiprocessing resource tracker, a member of the group that ignores SIGTERM) and ends without unlinking it,
# and another spawned child (vLLM's engine core) takes a second to shut down on SIGTERM. Nobody maps the
# semaphore any more, so only the tracker knows it: once every process using the tracker has ended, the tracker
# unlinks it, unless a SIGKILL ends the tracker first.
SEM_SERVER = r"""
import json, multiprocessing as mp, os, signal, time

def make(names):
    lock = mp.get_context("spawn").Lock()
    names.put(lock._semlock.name)
    time.sleep(0.5)
    os._exit(0)  # without its finalizers: the semaphore stays behind

def core(ready):
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), os._exit(0)))
    ready.put(True)
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    names = ctx.SimpleQueue()
    child = ctx.Process(target=make, args=(names,))
    child.start()
    name = names.get()
    child.join()
    ctx.Process(target=core, args=(names,)).start()
    names.get()
    print(json.dumps({"sem": name}), flush=True)
    time.sleep(600)
"""


def test_stopping_a_group_lets_its_resource_tracker_unlink_what_a_member_left(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SEM_SERVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name = json.loads(proc.stdout.readline())["sem"]
        sem = Path("/dev/shm") / ("sem." + name.lstrip("/"))
        assert sem.exists() and sem not in procs.mapped_shm(procs.group_members(proc.pid))
        procs.stop_process_group(proc, "stand-in server")
        assert proc.poll() is not None and not procs.group_members(proc.pid)
        assert not sem.exists()
    finally:
        if proc.poll() is None:
            procs.kill_process_group(proc, "stand-in server")
