"""The serving model's watchdog: it stops a server that is failing, so that whatever runs it starts a new one.

Two signals, thresholds from the model's parameters (``triton.watchdog`` in the engine config, written by
publish; 0 turns a signal off):

- failed requests: more than ``watchdog_errors_per_minute`` requests failed inside the model (the engine
  raised; a client's bad input is not counted) in the last 60 s;
- memory: the model process's resident memory grew faster than ``watchdog_memory_mb_per_s`` MB/s over the
  last ``watchdog_memory_window_s`` seconds (a leak), measured once the window is full.

When one trips: the model answers every new request UNAVAILABLE, the cause goes to the server's log on a
line that starts with ``MARK`` (where ``invoke serve --supervise`` reads why it restarts), and the Triton
server gets SIGTERM. Triton then reports itself unready at once (the readiness probe fails, the Service stops
routing to the pod), lets the requests in flight finish for up to its exit timeout and exits; the
orchestrator (the kubelet, or the supervisor) starts it again.

A test-only switch injects faults: when the server's environment names a file in ``FAULT_ENV``, every
request fails while the file holds ``raise``, and the model allocates (and keeps) N MB a second while it holds
``leak N``. Nothing reads the file when the variable is unset.

Pure Python, no Triton import: the tests drive it directly too.
"""

from __future__ import annotations

import collections
import mmap
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

MARK = "trtllm-pipeline watchdog:"
FAULT_ENV = "TRTLLM_PIPELINE_FAULT_FILE"
ERROR_WINDOW_S = 60.0
SAMPLE_S = 1.0  # resident memory is sampled this often
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Watchdog:
    """Counts failed requests and samples memory; calls ``on_trip(cause)`` once, the first time a limit is
    passed. ``clock`` and ``rss`` are injectable for tests."""

    def __init__(self, *, errors_per_minute: int = 0, memory_mb_per_s: float = 0.0, memory_window_s: float = 300.0,
                 on_trip: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.monotonic,
                 rss: Callable[[], int] = resident_bytes):
        self.errors_per_minute, self.memory_mb_per_s = int(errors_per_minute), float(memory_mb_per_s)
        self.memory_window_s = float(memory_window_s)
        self.on_trip, self.clock, self.rss = on_trip, clock, rss
        self.tripped: Optional[str] = None
        self.last_rss = 0  # bytes, at the last sample()
        self._errors: collections.deque = collections.deque()
        self._samples: collections.deque = collections.deque()  # (time, resident bytes)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.errors_per_minute > 0 or self.memory_mb_per_s > 0

    def error(self) -> None:
        """One request failed inside the model."""
        with self._lock:
            now = self.clock()
            self._errors.append(now)
            count = self._recent_errors(now)
        if self.errors_per_minute and count > self.errors_per_minute:
            self._trip(f"{count} requests failed in the last minute (limit {self.errors_per_minute})")

    def errors_last_minute(self) -> int:
        with self._lock:
            return self._recent_errors(self.clock())

    def _recent_errors(self, now: float) -> int:
        while self._errors and self._errors[0] < now - ERROR_WINDOW_S:
            self._errors.popleft()
        return len(self._errors)

    def sample(self) -> Optional[float]:
        """Record resident memory now; the growth over the window in MB/s once the window is full (else None).
        Trips when it is over the limit."""
        now, rss = self.clock(), self.rss()
        self.last_rss = rss
        self._samples.append((now, rss))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.memory_window_s:
            self._samples.popleft()
        t0, rss0 = self._samples[0]
        if now - t0 < self.memory_window_s:
            return None
        growth = (rss - rss0) / (now - t0) / 1e6
        if self.memory_mb_per_s and growth > self.memory_mb_per_s:
            self._trip(f"resident memory grew {growth:.1f} MB/s over the last {now - t0:.0f} s "
                       f"({rss0 / 1e6:.0f} -> {rss / 1e6:.0f} MB; limit {self.memory_mb_per_s:g} MB/s)")
        return growth

    def _trip(self, cause: str) -> None:
        with self._lock:
            if self.tripped is not None:
                return
            self.tripped = cause
        if self.on_trip is not None:
            self.on_trip(cause)


def server_pid() -> int:
    """The tritonserver process this model's stub runs under (its parent, or the nearest ancestor so named)."""
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "tritonserver":
                    return pid
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return os.getppid()


def stop_server(model: str, cause: str) -> None:
    """Log why, then SIGTERM the server (it turns unready, drains and exits)."""
    print(f"{MARK} {model}: {cause}; stopping the server so that it is restarted", file=sys.stderr, flush=True)
    os.kill(server_pid(), signal.SIGTERM)


QOS_WINDOW_S = 60.0  # the latency figures cover the requests that ended in the last minute


class LatencyWindow:
    """The quality-of-service figures of the requests that ended in the last ``window_s``: end-to-end latency
    (the model's: from its receiving the request to the last token) P50 / P99 (nearest rank), P99 / P50 and
    jitter (population std / mean), and the token-gap jitter pooled over those requests' gaps between tokens."""

    def __init__(self, window_s: float = QOS_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._ended: collections.deque = collections.deque()  # (end time, e2e s, gaps n, sum, sum of squares)
        self._lock = threading.Lock()

    def add(self, e2e_s: float, gaps: list) -> None:
        with self._lock:
            self._ended.append((self.clock(), e2e_s, len(gaps), sum(gaps), sum(g * g for g in gaps)))

    def figures(self) -> dict:
        """{latency_p50_ms, latency_p99_ms, latency_p99_over_p50, latency_jitter, token_gap_jitter}; 0 where
        the window holds too little to say (no request; one gap)."""
        with self._lock:
            now = self.clock()
            while self._ended and self._ended[0][0] < now - self.window_s:
                self._ended.popleft()
            ended = list(self._ended)
        out = dict.fromkeys(("latency_p50_ms", "latency_p99_ms", "latency_p99_over_p50", "latency_jitter",
                             "token_gap_jitter"), 0.0)
        if not ended:
            return out
        e2e = sorted(x[1] for x in ended)
        p50, p99 = _nearest_rank(e2e, 0.50), _nearest_rank(e2e, 0.99)
        mean = sum(e2e) / len(e2e)
        out.update(latency_p50_ms=p50 * 1e3, latency_p99_ms=p99 * 1e3,
                   latency_p99_over_p50=p99 / p50 if p50 > 0 else 0.0,
                   latency_jitter=_std(len(e2e), sum(e2e), sum(x * x for x in e2e)) / mean if mean > 0 else 0.0)
        n, total, squares = (sum(x[i] for x in ended) for i in (2, 3, 4))
        if n > 1 and total > 0:
            out["token_gap_jitter"] = _std(n, total, squares) / (total / n)
        return out


def _nearest_rank(ordered: list, q: float) -> float:
    return ordered[max(0, min(len(ordered) - 1, -(-int(q * 1000) * len(ordered) // 1000) - 1))]


def _std(n: int, total: float, squares: float) -> float:
    return max(0.0, squares / n - (total / n) ** 2) ** 0.5


class Faults:
    """The test-only fault switch (see the module's docstring); ``poll()`` re-reads the file."""

    def __init__(self, path: Optional[str] = None):
        self.path = path if path is not None else os.environ.get(FAULT_ENV)
        self.raising = False
        self.leak_mb_per_s = 0.0
        self._held: list[mmap.mmap] = []

    def poll(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path) as f:
                words = f.read().split()
        except OSError:
            words = []
        self.raising = words[:1] == ["raise"]
        self.leak_mb_per_s = float(words[1]) if words[:1] == ["leak"] and len(words) > 1 else 0.0

    def leak(self, seconds: float) -> None:
        """Allocate (and keep) what the leak rate asks for over ``seconds``, every page written, so resident.

        A fresh anonymous mapping, not a Python object: malloc may hand back a block that an earlier free left
        resident (a test worker's heap had 40 MB of such), and then nothing grows."""
        n = int(self.leak_mb_per_s * 1e6 * seconds)
        if n > 0:
            block = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would count as shmem
            for start in range(0, n, mmap.PAGESIZE):
                block[start] = 1
            self._held.append(block)
