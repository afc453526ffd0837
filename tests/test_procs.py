"""Process groups (pipeline.procs): stopping one ends every member and removes the shared memory they mapped,
as vLLM's engine core leaves it behind when killed, and nothing another process owns; a killed starter's group is
ended by its reaper, and what a dead run's record lists is removed by the next run (pipeline.reaper)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from pipeline import procs, reaper

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

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


# A server stand-in as vLLM 0.32's OpenAI server is on the CPU: an "engine core" started with multiprocessing's
# spawn context (which starts Python's resource tracker, a child of the server that ignores SIGTERM), mapping a
# shared-memory segment it made and unregistered from the tracker (only a record of it can remove it after a
# kill) and holding a named semaphore the tracker knows. It prints the names and the engine core's pid.
VLLM_LIKE = r"""
import json, multiprocessing as mp, sys, time
from multiprocessing import resource_tracker, shared_memory

def core(out):
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(shm._name, "shared_memory")
    lock = mp.get_context("spawn").Lock()
    import os
    out.put({"shm": shm.name, "sem": lock._semlock.name.lstrip("/"), "core": os.getpid()})
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    ctx.Process(target=core, args=(out,)).start()
    print(json.dumps(out.get()), flush=True)
    time.sleep(600)
"""

# The run that starts it (pipeline.procs.start_group) and is then killed with SIGKILL: no clean-up code runs in it.
STARTER = r"""
import json, subprocess, sys, time
from pipeline import procs, reaper
proc = procs.start_group([sys.executable, sys.argv[1]], "stand-in vLLM server", stdout=subprocess.PIPE, text=True)
facts = json.loads(proc.stdout.readline())
record = reaper.record_path(proc.pid)
deadline = time.monotonic() + 30
while time.monotonic() < deadline and facts["shm"] not in (json.loads(record.read_text())["shm"]
                                                         if record.is_file() else []):
    time.sleep(0.1)  # the reaper has recorded the segment
print(json.dumps({**facts, "pid": proc.pid, "record": str(record),
                  "tracker": [p for p in procs.group_members(proc.pid) if p not in (proc.pid, facts["core"])]}),
      flush=True)
time.sleep(600)
"""


def test_a_killed_starter_leaves_no_process_and_no_shared_memory(tmp_path):
    """kill -9 of the process that started a group: the leader dies of PDEATHSIG, and the group's reaper ends the
    engine core and the resource tracker (PDEATHSIG would not reach them: they are the leader's children) and
    removes the shared memory the group mapped, then its record."""
    from conftest import kill_the_starter

    script = tmp_path / "server.py"
    script.write_text(VLLM_LIKE)
    code = STARTER.replace("sys.argv[1]", repr(str(script)))
    facts, left = kill_the_starter(code, wait_s=30)
    shm, sem = Path("/dev/shm") / facts["shm"], Path("/dev/shm") / ("sem." + facts["sem"])
    try:
        assert facts["tracker"], "the stand-in started no resource tracker"
        assert left == []  # the tracker too
        deadline = time.monotonic() + 15  # the reaper removes the files after the group has ended
        while (shm.exists() or sem.exists() or Path(facts["record"]).exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not shm.exists() and not sem.exists()
        assert not Path(facts["record"]).exists()
    finally:
        procs.remove_files([shm, sem])


# A run that starts a group named to make its shared memory under a prefix (as Triton's Python backend does with
# shm-region-prefix-name), and is killed the moment that file exists: the group never maps it, and no scan of the
# reaper's can have seen it.
PREFIXED = r"""
import json, subprocess, sys, time
from pathlib import Path
from pipeline import procs
prefix = PREFIX
proc = procs.start_group([sys.executable, "-c", "import sys, time; open(sys.argv[1], 'wb').write(bytes(4096)); "
                          "time.sleep(600)", f"/dev/shm/{prefix}region"], "stand-in tritonserver",
                         shm_prefix=[prefix])
while not Path(f"/dev/shm/{prefix}region").exists():
    time.sleep(0.01)
print(json.dumps({"pid": proc.pid}), flush=True)
time.sleep(600)
"""


def test_a_killed_starter_leaves_no_file_under_its_groups_shm_prefix():
    """The group's files named by its prefix are removed after a kill of the starter, mapped or not: CI saw a
    killed build's check leave three 1 MB Triton regions its server made within the reaper's last second."""
    from conftest import kill_the_starter

    prefix = f"tps-test-{uuid.uuid4().hex[:8]}_"
    region = Path("/dev/shm") / f"{prefix}region"
    try:
        _, left = kill_the_starter(PREFIXED.replace("PREFIX", repr(prefix), 1), wait_s=30)
        assert left == []
        deadline = time.monotonic() + 15
        while region.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not region.exists()
    finally:
        procs.remove_files([region])


def test_a_stop_removes_what_a_member_mapped_earlier_and_left_unmapped(tmp_path):
    """A member that mapped a /dev/shm file (the reaper's scan saw it) and then unmapped it without unlinking it,
    as a vLLM engine core already ending when the stop looks: the stop removes it from the reaper's record."""
    name = f"psm_test{uuid.uuid4().hex[:8]}"
    code = ("import mmap, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); os.ftruncate(fd, 4096); "
            "m = mmap.mmap(fd, 4096); time.sleep(3 * float(sys.argv[2])); m.close(); os.close(fd); "
            "print('unmapped', flush=True); time.sleep(600)")
    proc = procs.start_group([sys.executable, "-c", code, f"/dev/shm/{name}", str(reaper.SCAN_S)], "stand-in",
                             stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "unmapped"
        assert procs.mapped_shm(procs.group_members(proc.pid)) == set()  # nothing mapped when the stop looks
        procs.stop_process_group(proc, "stand-in")
        assert not (Path("/dev/shm") / name).exists()
    finally:
        if proc.poll() is None:
            procs.kill_process_group(proc, "stand-in")
        procs.remove_files([Path("/dev/shm") / name])


def _dead_process() -> tuple[int, int]:
    """(pid, start time) of a process that has ended."""
    proc = subprocess.Popen(["sleep", "30"])
    started = reaper.start_time(proc.pid)
    proc.kill()
    proc.wait()
    assert started is not None
    return proc.pid, started


def test_the_next_run_removes_only_what_a_dead_runs_record_lists(tmp_path, monkeypatch, caplog):
    """A run whose reaper was killed too leaves its record: the sweep removes the /dev/shm files and temporary
    folders it lists once its starter, reaper and members are dead, and nothing else; a live run's record and an
    unlisted psm_ file are left alone, the latter named in the log."""
    monkeypatch.setattr(reaper, "RUNS_DIR", tmp_path / "runs")
    uid = uuid.uuid4().hex[:10]
    dead_pid, dead_started = _dead_process()
    ours = [Path("/dev/shm") / f"psm_{uid}a", Path("/dev/shm") / f"sem.mp-{uid}"]
    live_ones, unlisted = Path("/dev/shm") / f"psm_{uid}b", Path("/dev/shm") / f"psm_{uid}c"
    folder = Path(tempfile.mkdtemp(prefix="vllm-worker-"))
    for p in (*ours, live_ones, unlisted):
        p.write_bytes(b"\0" * 4096)
    dead = {"pid": dead_pid, "started": dead_started}
    me = {"pid": os.getpid(), "started": reaper.start_time(os.getpid())}
    base = {"format": reaper.RECORD_FORMAT, "what": "vLLM server", "pgid": dead_pid, "tmp": []}
    reaper.write_record(reaper.record_path(1), {**base, "starter": dead, "reaper": dead,
                                                "members": {str(dead_pid): dead_started},
                                                "shm": [p.name for p in ours], "tmp": [str(folder), "/etc"]})
    reaper.write_record(reaper.record_path(2), {**base, "starter": me, "reaper": dead, "members": {},
                                                "shm": [live_ones.name]})
    try:
        with caplog.at_level(logging.DEBUG, logger="pipeline.reaper"):
            removed, unproven = reaper.reap_dead_runs()
        assert sorted(removed) == sorted([*ours, folder])
        assert not any(p.exists() for p in ours) and not folder.exists() and Path("/etc").is_dir()
        assert not reaper.record_path(1).exists()
        assert live_ones.exists() and reaper.record_path(2).exists()  # its starter (this process) is alive
        assert unlisted.exists() and unlisted in unproven and live_ones not in unproven
        assert unlisted.name in caplog.text and "not provably ours" in caplog.text
    finally:
        procs.remove_files([*ours, live_ones, unlisted])
        shutil.rmtree(folder, ignore_errors=True)


def test_a_clean_stop_leaves_the_starters_temporary_folder_to_the_starter(tmp_path):
    """A stop by the starter tells the reaper so: it removes its record and not the folder the starter still
    reads (the build's vLLM check reads its worker's result from there after the stop)."""
    folder = Path(tempfile.mkdtemp(prefix="vllm-worker-"))
    try:
        proc = procs.start_group([sys.executable, "-c", "import time; time.sleep(600)"], "stand-in worker",
                                 tmp=[folder])
        record = reaper.record_path(proc.pid)
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.exists()
        procs.kill_process_group(proc, "stand-in worker")  # waits for the reaper to exit
        assert folder.is_dir() and not record.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_sweep_a_run_starts_with_says_what_it_removed(tmp_path, monkeypatch, capsys):
    """What `invoke <stage>` and `invoke clean` run first (pipeline.commands.sweep_dead_runs): a dead run's
    recorded /dev/shm file removed and named on the console."""
    from pipeline import commands

    monkeypatch.setattr(reaper, "RUNS_DIR", tmp_path / "runs")
    dead_pid, dead_started = _dead_process()
    dead = {"pid": dead_pid, "started": dead_started}
    shm = Path("/dev/shm") / f"psm_{uuid.uuid4().hex[:10]}"
    shm.write_bytes(b"\0" * 4096)
    reaper.write_record(reaper.record_path(1), {"format": reaper.RECORD_FORMAT, "what": "vLLM server", "pgid": 1,
                                                "starter": dead, "reaper": dead, "members": {}, "shm": [shm.name],
                                                "tmp": []})
    try:
        assert shm in commands.sweep_dead_runs()
        assert not shm.exists()
        out = capsys.readouterr().out  # (Triton's leftovers of other dead runs may be named beside it)
        assert "leftover(s) of dead runs: " in out and shm.name in out
    finally:
        procs.remove_files([shm])


def test_the_sweep_names_a_dead_servers_leftover_once_on_a_quiet_console():
    """A Triton server's temporary folder whose starter is dead (pipeline.serving.server's leftovers): the sweep
    removes it and the quiet console names it in one line, not again as a log line of the server module."""
    from pipeline.serving.server import TMP_PREFIX

    dead_pid, _ = _dead_process()
    left = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dead_pid}-"))
    try:
        r = subprocess.run([sys.executable, "-c", "from pipeline import commands, console\n"
                            "console.configure()\ncommands.sweep_dead_runs()\nconsole.finish()"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert not left.exists()
        said = [line for line in (r.stdout + r.stderr).splitlines() if left.name in line]
        assert len(said) == 1 and said[0].startswith("note: removed"), said
    finally:
        shutil.rmtree(left, ignore_errors=True)


def test_a_group_run_to_its_end_leaves_no_member_behind_and_its_output_in_the_log(tmp_path):
    """run_group (the vLLM worker's and Edge-LLM's runs): the exit code, the output appended to the log, and a
    child the command left running ended with it, also when the wait times out."""
    log = tmp_path / "run.log"
    log.write_text("before\n")
    pid_file = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pid_file}; echo hello; exit 3"
    code = procs.run_group(["bash", "-c", script], "a test group", log_path=log, env=dict(os.environ), timeout_s=60)
    assert code == 3 and log.read_text() == "before\nhello\n"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run_group(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], "a test group", log_path=log,
                        env=dict(os.environ), timeout_s=1)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its parent, counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
