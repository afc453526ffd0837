"""Run heavy work (analysis, quantization, builds) in a child process, with its log kept beside the artifact.

The child writes where the parent's stdout and stderr point (the stage's log while a quiet console runs,
pipeline.console) and sends its progress events over the pipe that carries its result, for the parent to show.
A crash in the child (segfault, out-of-memory kill) becomes a StageFailed carrying the log's tail instead
of taking the pipeline down or hanging; a PipelineError raised in the child is re-raised in the parent as
the same class with the same message. The child is a fresh interpreter (spawn), and its peak RSS is read
from VmHWM in /proc/self/status: the high-water mark of the child's own address space. getrusage's
ru_maxrss would not do: Linux carries it across execve, so a child spawned by a 3 GB parent (a test
session with torch loaded) reports at least 3 GB however little it does (see getrusage(2), ru_maxrss).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import resource
import signal
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline import console, errors
from pipeline.errors import PipelineError, StageFailed

LOG_TAIL_LINES = 30
WATCH_S = 0.2  # how often the parent reads the child's peak memory while it works


class StageLogHandler(logging.FileHandler):
    """A stage's log file. A line that cannot be written (the disk is full) is dropped without logging's
    "--- Logging error ---" traceback on the console: the stage's own error says what went wrong."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


def _peak_of(pid: Optional[int] | str) -> Optional[int]:
    """VmHWM of a process ("self", or the child watched from the parent) in bytes; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def own_peak_rss() -> int:
    """Peak resident set of this process's current address space, in bytes (VmHWM; ru_maxrss without /proc)."""
    peak = _peak_of("self")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with(parent: int) -> None:
    """SIGKILL this child when its parent dies (Linux's PR_SET_PDEATHSIG), and end it now if the parent is
    already gone. A stage's parent killed hard (kill -9, a caller's timeout) used to leave the child computing as
    an orphan: a killed `invoke build` left its sensitivity worker on both cores for half an hour."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: no such call; the parent's own clean-up is all there is
        return
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


def _child_main(fn: Callable, args: tuple, *, kwargs: dict, log_path: str, conn, parent: int) -> None:
    _die_with(parent)
    handler = StageLogHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("pipeline").setLevel(logging.INFO)
    logging.captureWarnings(True)  # a library's warnings are log records: into the stage log with the rest
    if console.verbose():  # --verbose: on the console too, with the libraries' INFO lines
        shown = logging.StreamHandler()
        shown.setFormatter(logging.Formatter(console.LOG_FORMAT))
        root.addHandler(shown)
        root.setLevel(logging.INFO)
    console.report_to(lambda event: conn.send(("progress", event, 0)))  # its bars are shown by the parent
    try:
        result = fn(*args, **kwargs)
        peak = own_peak_rss()
        conn.send(("ok", result, peak))
    except PipelineError as e:
        logging.getLogger("pipeline").error("%s", e)
        conn.send(("pipeline_error", (type(e).__name__, str(e)), 0))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback in the log
        logging.getLogger("pipeline").error("child failed:\n%s", traceback.format_exc())
        conn.send(("error", f"{type(e).__name__}: {e}", 0))
    finally:
        try:
            handler.close()
        except OSError:  # a full disk: the error sent above says so
            pass
        conn.close()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_in_child(fn: Callable, *args: Any, log_path: Path, what: str = "the stage", bound: Any = None,
                 **kwargs: Any) -> tuple[Any, int]:
    """fn(*args, **kwargs) in a spawned process; returns (its result, the child's peak RSS in bytes).

    ``what`` names the work in errors; ``bound`` (a compute.Bound) is the memory it was meant to stay under,
    named with the peak watched so far when the child is killed."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(fn, args), daemon=True,
                       kwargs={"kwargs": kwargs, "log_path": str(log_path), "conn": sender, "parent": os.getpid()})
    proc.start()
    sender.close()
    watched = 0
    try:
        while True:
            while not receiver.poll(WATCH_S):  # the child's peak so far, known even if it is killed
                watched = max(watched, _peak_of(proc.pid) or 0)
            message = receiver.recv()
            if message[0] != "progress":
                break
            console.relay(message[1])
    except EOFError:
        message = None
    finally:
        proc.join()
        receiver.close()
        console.end_relayed(proc.pid)
    if message is None:
        memory = f"; its peak memory was at least {watched / 2**30:.2f} GiB" if watched else ""
        if bound is not None:
            memory += f", against a bound of {bound.text()}"
        raise StageFailed(
            f"{what}: the child process died (exit code {proc.exitcode}; -9 usually means it ran out of "
            f"memory{memory}). Last lines of {log_path}:\n"
            f"{log_tail(log_path)}"
        )
    status, payload, peak = message
    if status == "pipeline_error":
        name, text = payload
        raise getattr(errors, name, StageFailed)(text)
    if status == "error":
        raise StageFailed(f"{payload}. Last lines of {log_path}:\n{log_tail(log_path)}")
    return payload, peak
