"""Nothing the pipeline starts outlives a killed run: a reaper beside each process group, and a run registry.

Every server and worker runs in a session of its own (its process group id is its pid), and PR_SET_PDEATHSIG
kills that leader when the process that started it dies. That covers the leader only. vLLM 0.32 starts its
engine core with multiprocessing's spawn context (``v1/engine/utils.py``, ``CoreEngineProcManager``; the CPU
platform forces spawn, ``platforms/cpu.py``), and spawn starts Python's resource tracker, a child of the
server that ignores SIGTERM and SIGINT. A kill -9 of the run left that tracker alive for good and vLLM's
shared memory (``psm_*``, ``sem.mp-*``: 400 MB) in /dev/shm. The alternatives fall short: a hook that sets
PDEATHSIG in every Python of the group (sitecustomize) ends each member when its own parent dies but
removes no memory (a SIGKILLed tracker is exactly what leaves it behind), and a child subreaper
(PR_SET_CHILD_SUBREAPER) has to be an ancestor that survives, which the killed run is not.

So ``pipeline.procs.start_group`` starts, beside each group, this module as a small process (``python -m
pipeline.reaper``) in a session of its own, so that a kill of the run's process group does not reach it. It
holds the read end of a pipe whose only write end is in the starting process. While the pipe is open it
records, every SCAN_S, the group's members (with their start times) and the /dev/shm files they have
mapped (and the prefixes of the names its starter chose for its shared memory: a region made after the
last scan, by a group killed a moment later, is found by its name), in a record file of the run registry
(RUNS_DIR, written atomically). When the pipe closes, which the kernel does however the starter ended, it
ends the group as a stop does (SIGTERM; the members' time to end, during which the tracker unlinks what it
tracks; SIGKILL), removes the recorded files and folders that are still there, then its record, and exits.
A clean stop ends the group first, writes STOPPED to the pipe and closes it: the reaper removes its record
and nothing else (the starter still uses the temporary folders).

If the reaper dies too (an OOM killer that takes everything, a node drain), its record stays. The next run,
or ``invoke clean``, removes what a record lists once its starter, its reaper and its group's members are
all gone (``reap_dead_runs``; a pid counts as the same process only with the same start time). Nothing is
removed that no record lists: a ``psm_*`` or ``sem.mp-*`` file of /dev/shm that is not provably ours is
named in the log and left alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
RUNS_DIR = Path(tempfile.gettempdir()) / f"trtllm-pipeline-runs-{os.getuid()}"  # the run registry
RECORD_FORMAT = 1
STOPPED = b"stopped"  # what a starter writes to the pipe before closing it after a stop of its own
LOG_FILE = "reaper.log"  # in RUNS_DIR: what reapers had to end and remove
# how often a reaper records its group's members and mapped files; a scan took 5 ms (4 vLLM processes' maps,
# 100 processes on the machine): half a percent of a core
SCAN_S = 1.0
STOP_GRACE_S = 15.0  # after the SIGTERM, how long the members get before SIGKILL
# shared memory the kinds of process we start make, whose names say nothing about who made them (vLLM's
# multiprocessing.shared_memory segments and Python's named semaphores): removed only when a record lists them
UNNAMED_SHM = ("psm_", "sem.mp-")


# ---------------------------------------------------------------- processes, from /proc


def proc_table() -> dict[int, tuple[int, int, int, int]]:
    """Every live (not zombie) process: pid -> (ppid, pgrp, session, start time in clock ticks after boot)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ... starttime is field 22
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    return out


def start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks after boot), None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def alive(pid: int, started: Optional[int]) -> bool:
    """Whether the process ``pid`` that started at ``started`` is still running (not a later one with its pid)."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in a process group, from /proc."""
    return [pid for pid, (_, pgrp, _, _) in proc_table().items() if pgrp == pgid]


def family(pgid: int, known: Optional[dict[int, int]] = None) -> dict[int, int]:
    """The group's members, those of the session it leads, ``known`` processes (pid -> start time: a member
    that moved to a group of its own) and all their descendants: pid -> start time."""
    table = proc_table()
    found = {pid for pid, (_, pgrp, sid, _) in table.items() if pgid in (pgrp, sid)}
    found |= {pid for pid, started in (known or {}).items() if pid in table and table[pid][3] == started}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _, _) in table.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return {pid: table[pid][3] for pid in found}


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


def kill_family(pgid: int, members: dict[int, int], sig: int) -> None:
    """``sig`` to the process group and to each recorded member still alive outside it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid, started in members.items():
        if alive(pid, started):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def end_family(pgid: int, members: dict[int, int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the group and its recorded members, time to end (Python's resource tracker ends, unlinking
    what it tracks, once the processes using it have), then SIGKILL to whatever is left."""
    live = lambda: [p for p in family(pgid, members) if p != os.getpid()]  # noqa: E731
    if not live():
        return
    members = {**members, **family(pgid, members)}
    kill_family(pgid, members, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live() and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + grace_s
    while live() and time.monotonic() < deadline:
        kill_family(pgid, members, signal.SIGKILL)
        time.sleep(0.1)


# ---------------------------------------------------------------- the run registry


def record_path(pgid: int) -> Path:
    return RUNS_DIR / f"group-{pgid}.json"


def write_record(path: Path, record: dict) -> None:
    """Atomically: a temp file in the registry, fsync, rename."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _owned_shm(names: Iterable[str]) -> list[Path]:
    """Recorded /dev/shm names as paths, refusing anything that is not a plain name in /dev/shm."""
    return [SHM_DIR / n for n in names if n and "/" not in n and n not in (".", "..")]


def _owned_dirs(paths: Iterable[str]) -> list[Path]:
    """Recorded temporary folders, refusing anything outside the temporary directory."""
    tmp = Path(tempfile.gettempdir()).resolve()
    return [Path(p) for p in paths if Path(p).is_absolute() and Path(p).resolve().parent == tmp]


def _prefixed_shm(prefixes: Iterable[str]) -> list[Path]:
    """The /dev/shm files whose names start with one of the group's own prefixes (a plain name each, never
    empty): what it made under a name chosen for it, mapped or not when the reaper last looked."""
    own = tuple(p for p in prefixes if p and "/" not in p and not p.startswith("."))
    return sorted(f for f in SHM_DIR.iterdir() if f.name.startswith(own)) if own and SHM_DIR.is_dir() else []


def recorded_shm(pgid: int) -> set[Path]:
    """The /dev/shm files the group's reaper has seen it map, and those under its prefixes, while its record is
    there (empty without one): what a stop removes once the group has ended, besides what it maps at the stop. A
    member already ending when the stop looks (a vLLM engine core after its worker's leader exited) has unmapped
    memory it has not unlinked yet, and a SIGKILL then leaves it."""
    try:
        record = json.loads(record_path(pgid).read_text())
    except (OSError, ValueError):
        return set()
    return set(_owned_shm(record.get("shm", []))) | set(_prefixed_shm(record.get("shm_prefix", [])))


def remove_recorded(record: dict) -> list[Path]:
    """Remove the /dev/shm files and temporary folders a record lists that are still there; returns them."""
    removed = remove_files(_owned_shm(record.get("shm", [])) + _prefixed_shm(record.get("shm_prefix", [])))
    for d in _owned_dirs(record.get("tmp", [])):
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def record_is_dead(record: dict) -> bool:
    """Whether everything a record names has ended: its starter, its reaper and the members it saw."""
    pids = [(record["starter"]["pid"], record["starter"]["started"]), (record["reaper"]["pid"],
                                                                        record["reaper"]["started"])]
    pids += [(int(pid), started) for pid, started in record.get("members", {}).items()]
    return not any(alive(pid, started) for pid, started in pids)


def reap_dead_runs() -> tuple[list[Path], list[Path]]:
    """Remove what the records of dead runs list (and those records). Returns (what was removed, the ``psm_*`` /
    ``sem.mp-*`` files of /dev/shm that no record lists: not provably ours, left alone and named in the log)."""
    removed: list[Path] = []
    listed: set[str] = set()
    for path in sorted(RUNS_DIR.glob("group-*.json")) if RUNS_DIR.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            dead = record["format"] == RECORD_FORMAT and record_is_dead(record)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("run registry: %s cannot be read (%s); left alone", path, e)
            continue
        listed.update(record.get("shm", []))
        if dead:
            gone = remove_recorded(record)
            if gone:
                log.info("removed what a dead run's %s left behind: %s", record.get("what", "process group"),
                         ", ".join(p.name for p in gone))
            removed += gone
            path.unlink(missing_ok=True)
    unproven = sorted(p for p in SHM_DIR.iterdir() if p.name.startswith(UNNAMED_SHM) and p.name not in listed) \
        if SHM_DIR.is_dir() else []
    if unproven:
        log.debug("left alone in %s (not provably ours: no run record lists them): %s", SHM_DIR,
                 ", ".join(p.name for p in unproven))
    return removed, unproven


# ---------------------------------------------------------------- the reaper process


def _scan(pgid: int, record: dict) -> bool:
    """Add the group's members and the /dev/shm files they map to the record; whether it grew."""
    members = family(pgid, {int(p): s for p, s in record["members"].items()})
    shm = {p.name for p in mapped_shm(members)}
    new_members = {str(p): s for p, s in members.items() if str(p) not in record["members"]}
    new_shm = shm - set(record["shm"])
    record["members"].update(new_members)
    record["shm"] = sorted(set(record["shm"]) | new_shm)
    return bool(new_members or new_shm)


def reap(pgid: int, fd: int, *, starter: int, what: str, tmp: list[str], shm_prefix: Sequence[str] = ()) -> None:
    """Watch the group until ``fd`` (the pipe from the starter) closes; then end it and remove what it left."""
    path = record_path(pgid)
    me = os.getpid()
    record: dict = {"format": RECORD_FORMAT, "what": what, "pgid": pgid,
              "starter": {"pid": starter, "started": start_time(starter)},
              "reaper": {"pid": me, "started": start_time(me)}, "members": {}, "shm": [], "tmp": tmp,
              "shm_prefix": list(shm_prefix)}
    _scan(pgid, record)
    write_record(path, record)
    stopped = False
    while True:
        readable, _, _ = select.select([fd], [], [], SCAN_S)
        if readable:
            data = os.read(fd, 64)
            if not data:
                break  # EOF: the starter closed the pipe, or died
            stopped = stopped or STOPPED in data
        if _scan(pgid, record):
            write_record(path, record)
    if stopped:  # the starter stopped the group itself, and its temporary folders are its own to remove
        path.unlink(missing_ok=True)
        return
    _scan(pgid, record)
    members = {int(p): s for p, s in record["members"].items()}
    if any(alive(p, s) for p, s in members.items()):
        log.warning("%s (process group %d) outlived the process that started it (pid %d); ending it", what,
                    pgid, starter)
    end_family(pgid, members)
    removed = remove_recorded(record)
    if removed:
        log.warning("removed what %s left behind: %s", what, ", ".join(p.name for p in removed))
    path.unlink(missing_ok=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="End a process group when the process that started it ends.")
    parser.add_argument("--pgid", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True, help="the read end of the starter's pipe")
    parser.add_argument("--starter", type=int, required=True)
    parser.add_argument("--what", default="a process group")
    parser.add_argument("--tmp", action="append", default=[], help="a temporary folder of the group's")
    parser.add_argument("--shm-prefix", action="append", default=[],
                        help="a prefix of the names of the group's /dev/shm files (Triton's region prefix)")
    args = parser.parse_args(argv)
    RUNS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)  # its own log: the starter's output may be gone
    logging.basicConfig(filename=RUNS_DIR / LOG_FILE, level=logging.INFO,
                        format=f"%(asctime)s reaper {os.getpid()} of group {args.pgid}: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a Ctrl-C of the terminal is the starter's to
        signal.signal(sig, signal.SIG_IGN)  # handle: the reaper ends when its pipe closes
    reap(args.pgid, args.fd, starter=args.starter, what=args.what, tmp=args.tmp, shm_prefix=args.shm_prefix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
