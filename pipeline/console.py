"""The console of a task: one line per stage, a progress bar for each long step, everything else in the stage's log.

Quiet (the default, once ``configure`` ran): while a stage runs, this process's standard output and error (file
descriptors 1 and 2, so ``print``, Python warnings, C libraries and child processes alike) write into the stage's
log, and the console writes to copies of them taken before. On a terminal a running stage is one live line (a
spinner, its elapsed time) with a bar per long step under it (layers, calibration batches, bench levels, with an
ETA), replaced by the stage's outcome; elsewhere (CI, a pipe, a test) the lines are printed as they come, and
a long step adds a line for each quarter of its total it passes, a minute apart at the earliest (three at most).
Errors still reach the console in full.

Verbose (``--verbose``, or ``PIPELINE_VERBOSE=1`` in the environment, which child processes inherit): nothing is
redirected and every log record at INFO and above is shown too.

A stage's heavy work may run in a child process (pipeline.child): there ``report_to`` sends the progress events to
the parent, which shows them (``relay``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, TypeVar

from pipeline.constants import VERBOSE_ENV

if TYPE_CHECKING:
    from rich.live import Live
    from rich.progress import Progress, TaskID

T = TypeVar("T")

LINE_EVERY_S = 60.0  # off a terminal, a long step's progress line at most this often (CI logs stay short)
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


@dataclass
class _Step:
    what: str
    total: Optional[int]
    completed: int = 0
    started: float = field(default_factory=time.monotonic)
    said: float = field(default_factory=time.monotonic)  # when its last progress line was printed
    quarter_said: int = 0  # the quarter of the total that line had reached

    def worth_a_line(self) -> bool:
        """Off a terminal: a line when the step has passed another quarter of its total, a minute after the last
        one at the earliest (a step of any length prints three at most)."""
        quarter = 4 * self.completed // self.total if self.total else 0
        if quarter <= self.quarter_said or quarter >= 4 or time.monotonic() - self.said < LINE_EVERY_S:
            return False
        self.said, self.quarter_said = time.monotonic(), quarter
        return True

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        text = f"  {self.what}: {self.completed}/{self.total if self.total is not None else '?'} in {_clock(elapsed)}"
        if self.total and self.completed:
            text += f", about {_clock(elapsed / self.completed * (self.total - self.completed))} left"
        return text


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class _Display:
    """What the console shows: printed lines, and on a terminal (when quiet) a live status line and bars."""

    def __init__(self, out, err, live: bool):
        from rich.console import Console

        self.out = Console(file=out, highlight=False, soft_wrap=True)
        self.err = Console(file=err, highlight=False, soft_wrap=True, stderr=True)
        self.live_ok = live and self.out.is_terminal
        self.steps: dict[str, _Step] = {}
        self._live: Optional[Live] = None
        self._status: Optional[Progress] = None  # the running stage's line
        self._bars: Optional[Progress] = None  # a bar per long step
        self._status_id: Optional[TaskID] = None
        self._bar_ids: dict[str, TaskID] = {}

    # -- printed lines
    def echo(self, text: str) -> None:
        """A stage's outcome (it replaces the running stage's live line), or any line of the task's own."""
        self.clear_status()
        self.out.print(text, markup=False)
        self._stop_if_idle()

    def note(self, text: str) -> None:
        """A log record: on stderr, or above the live lines while they are drawn (which it leaves as they are)."""
        (self.out if self._live is not None else self.err).print(text, markup=False)

    # -- the live part (a terminal) or plain lines
    def status(self, text: str) -> None:
        if not self.live_ok:
            self.out.print(text, markup=False)
            return
        self._start()
        self.clear_status()
        assert self._status is not None
        self._status_id = self._status.add_task(text, total=None)

    def clear_status(self) -> None:
        if self._status is not None and self._status_id is not None:
            self._status.remove_task(self._status_id)
            self._status_id = None

    def start_step(self, key: str, what: str, total: Optional[int]) -> None:
        self.steps[key] = _Step(what, total)
        if self.live_ok:
            self._start()
            assert self._bars is not None
            self._bar_ids[key] = self._bars.add_task(what, total=total)

    def update_step(self, key: str, completed: int, what: Optional[str] = None) -> None:
        step = self.steps.get(key)
        if step is None:
            return
        step.completed = completed
        if what is not None:
            step.what = what
        if key in self._bar_ids:
            assert self._bars is not None
            self._bars.update(self._bar_ids[key], completed=completed, description=step.what)
        elif step.worth_a_line():
            self.out.print(step.line(), markup=False)

    def stop_step(self, key: str) -> None:
        self.steps.pop(key, None)
        if key in self._bar_ids:
            assert self._bars is not None
            self._bars.remove_task(self._bar_ids.pop(key))
        self._stop_if_idle()

    def _start(self) -> None:
        if self._live is not None:
            return
        from rich.console import Group
        from rich.live import Live
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._status = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                console=self.out)
        self._bars = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.out)
        live = Live(Group(self._status, self._bars), console=self.out, transient=True, refresh_per_second=8,
                    redirect_stdout=False, redirect_stderr=False)
        live.start()
        self._live = live

    def _stop_if_idle(self) -> None:
        if self._live is not None and self._status_id is None and not self._bar_ids:
            self._live.stop()
            self._live = self._status = self._bars = None

    def close(self) -> None:
        self.clear_status()
        for key in list(self.steps):
            self.stop_step(key)
        self._stop_if_idle()


_display: Optional[_Display] = None
_quiet = False
_in_stage = False
_send: Optional[Callable[[tuple], None]] = None  # in a stage's child process: the pipe to the parent
_next_key = 0


class _ConsoleHandler(logging.Handler):
    """Log records on the console: quiet, the pipeline's warnings and errors (its INFO lines too outside a
    stage, which has no log to hold them) and other libraries' errors (their warnings too outside a stage);
    verbose, everything at INFO and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _quiet:
            return True
        ours = record.name == "pipeline" or record.name.startswith("pipeline.")
        if _in_stage:
            return record.levelno >= (logging.WARNING if ours else logging.ERROR)
        return record.levelno >= (logging.INFO if ours else logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - logging's own convention: a bad record never raises
            self.handleError(record)
            return
        if _display is not None:
            _display.note(text)


def configure(verbose_flag: bool = False) -> None:
    """Set up this process's console (the invoke tasks call it once): quiet unless ``verbose_flag`` or
    PIPELINE_VERBOSE=1, which is then set for the child processes too."""
    global _display, _quiet
    loud = verbose_flag or verbose()
    if loud:
        os.environ[VERBOSE_ENV] = "1"
    _quiet = not loud
    if _display is None:
        with contextlib.suppress(AttributeError, ValueError):  # print() and the console share the descriptor
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stdout.flush()
        sys.stderr.flush()
        # copies of the console's descriptors: a stage points 1 and 2 at its log, the console keeps these
        out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
        err = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
        _display = _Display(out, err, live=_quiet)
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _ConsoleHandler):
            root.removeHandler(h)
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO if loud else logging.WARNING)
    logging.getLogger("pipeline").setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings are log records: into the stage's log, or the console


def finish() -> None:
    """Take the live lines down (before an error is printed on a terminal)."""
    if _display is not None:
        _display.close()


def echo(text: str) -> None:
    """A line on the console (a stage's outcome, the summary); plain print where ``configure`` never ran."""
    if _display is None:
        print(text, flush=True)
    else:
        _display.echo(text)


def status(text: str) -> None:
    """A running stage's line: on a terminal a live line until the next ``echo``; elsewhere printed."""
    if _display is None:
        print(text, flush=True)
    else:
        _display.status(text)


@contextlib.contextmanager
def stage_output(log_path: Path) -> Iterator[None]:
    """While a stage runs: quiet, this process's stdout and stderr append to its log (child processes inherit
    that); verbose or unconfigured, nothing changes."""
    global _in_stage
    if _display is None or not _quiet:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _in_stage = True
    try:
        yield
    finally:
        _in_stage = False
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a full disk: the stage's own error says so
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        _display.close()


# ---------------------------------------------------------------- progress


class Step:
    """A long step's progress: ``advance()`` after each unit (a layer, a batch, a level)."""

    def __init__(self, what: str, total: Optional[int]):
        global _next_key
        _next_key += 1
        self.key = f"{os.getpid()}:{_next_key}"
        self.completed = 0
        _emit(("start", self.key, what, total))

    def advance(self, n: int = 1, what: Optional[str] = None) -> None:
        self.completed += n
        _emit(("update", self.key, self.completed, what))

    def restart(self, what: str) -> None:
        """Count again from zero under a new name (a second calibration pass)."""
        self.completed = 0
        _emit(("update", self.key, 0, what))

    def stop(self) -> None:
        _emit(("stop", self.key))


@contextlib.contextmanager
def step(what: str, total: Optional[int]) -> Iterator[Step]:
    s = Step(what, total)
    try:
        yield s
    finally:
        s.stop()


def track(items: Iterable[T], what: str, total: Optional[int] = None) -> Iterator[T]:
    """``items``, with a bar advancing after each one."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with step(what, total) as s:
        for item in items:
            yield item
            s.advance()


def _emit(event: tuple) -> None:
    if _send is not None:
        with contextlib.suppress(OSError):  # the parent is gone: its own clean-up ends this process
            _send(event)
    else:
        relay(event)


def report_to(send: Optional[Callable[[tuple], None]]) -> None:
    """In a stage's child process: send progress events to the parent (``send`` puts one on the pipe)."""
    global _send
    _send = send


def relay(event: tuple) -> None:
    """Show a progress event (this process's own, or one a child sent)."""
    if _display is None:
        return
    kind, key = event[0], event[1]
    if kind == "start":
        _display.start_step(key, event[2], event[3])
    elif kind == "update":
        _display.update_step(key, event[2], event[3])
    else:
        _display.stop_step(key)


def end_relayed(pid: Optional[int]) -> None:
    """A child process ended: drop the bars it left open (it crashed mid-step)."""
    if _display is not None and pid is not None:
        for key in [k for k in _display.steps if k.startswith(f"{pid}:")]:
            _display.stop_step(key)
