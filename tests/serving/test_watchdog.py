"""The serving model's watchdog (triton_repo/common/llm_watchdog.py) on its own: its limits, its clock, the fault
switch. The real-server test (a failing and a leaking model stopped and restarted by `invoke serve --supervise`)
is in test_verify.py."""

from __future__ import annotations

import sys

from conftest import REPO

from pipeline.serving import serve as server

sys.path.insert(0, str(REPO / "triton_repo" / "common"))
import llm_watchdog as watchdog  # noqa: E402  (the serving models' own module: not a package)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _dog(**kwargs):
    clock, trips = Clock(), []
    return watchdog.Watchdog(on_trip=trips.append, clock=clock, **kwargs), clock, trips


def test_errors_trip_it_once_past_the_limit_within_a_minute_and_not_when_spread_out():
    dog, clock, trips = _dog(errors_per_minute=2)
    for _ in range(2):
        dog.error()
        clock.t += 29
    assert dog.errors_last_minute() == 2 and not trips  # at the limit, not over it
    clock.t += 5  # the first error is now 63 s old
    dog.error()
    assert dog.errors_last_minute() == 2 and not trips
    dog.error()
    assert trips == ["3 requests failed in the last minute (limit 2)"] and dog.tripped == trips[0]
    dog.error()
    assert len(trips) == 1  # once


def test_memory_growth_is_judged_over_a_full_window_only():
    rss = [100_000_000]
    dog, clock, trips = _dog(memory_mb_per_s=1.0, memory_window_s=10, rss=lambda: rss[0])
    for _ in range(10):  # 0 to 9 s of 3 MB/s: the window is not full yet
        assert dog.sample() is None
        clock.t += 1
        rss[0] += 3_000_000
    assert not trips
    assert abs(dog.sample() - 3.0) < 1e-9  # 10 s: judged
    assert trips and trips[0].startswith("resident memory grew 3.0 MB/s over the last 10 s (100 -> 130 MB")


def test_a_step_that_stops_growing_is_not_a_leak():
    """A runtime that grows once (a batch's buffers) and then holds steady passes once the window has moved on."""
    rss = [100_000_000]
    dog, clock, trips = _dog(memory_mb_per_s=1.0, memory_window_s=10, rss=lambda: rss[0])
    dog.sample()
    clock.t += 1
    rss[0] += 5_000_000  # 5 MB once: 0.5 MB/s over the window
    for _ in range(30):
        growth = dog.sample()
        clock.t += 1
        assert growth is None or growth <= 0.5 + 1e-9
    assert not trips and dog.sample() == 0.0


def test_off_when_its_limits_are_zero():
    rss = [0]
    dog, clock, trips = _dog(memory_window_s=5, rss=lambda: rss[0])
    assert not dog.enabled
    for _ in range(100):
        dog.error()
        dog.sample()
        clock.t += 1
        rss[0] += 10**9
    assert not trips and dog.tripped is None


def _anonymous_resident_bytes() -> int:
    """RssAnon from /proc/self/status. The watchdog's own figure (statm's resident set) also counts file-backed
    pages, which the kernel drops under memory pressure: with other workers busy that hid 10 MB of a 40 MB leak.
    The leak itself maps fresh private pages: a bytearray reused 40 MB that a worker's heap had freed, and RssAnon
    did not move at all."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_fault_switch_reads_its_file_and_a_leak_is_resident(tmp_path):
    path = tmp_path / "fault"
    faults = watchdog.Faults(str(path))
    faults.poll()
    assert not faults.raising and faults.leak_mb_per_s == 0  # no file: no fault
    path.write_text("raise")
    faults.poll()
    assert faults.raising
    path.write_text("leak 40")
    faults.poll()
    freed = [bytearray(1000) for _ in range(60_000)]  # 60 MB of small blocks, freed: resident heap malloc reuses
    del freed
    before = _anonymous_resident_bytes()
    faults.leak(1.0)
    assert not faults.raising and _anonymous_resident_bytes() - before >= 35_000_000
    path.unlink()
    faults.poll()
    assert faults.leak_mb_per_s == 0


def test_the_supervisor_reads_the_watchdogs_line(tmp_path):
    assert server.WATCHDOG_MARK == watchdog.MARK
    log = tmp_path / "tritonserver.log"
    log.write_text(f"I1202 model loaded\n{watchdog.MARK} old: cause before the offset\n")
    offset = log.stat().st_size
    assert server.stop_cause(log, offset) is None
    with log.open("a") as f:
        f.write(f"E1202 something\n{watchdog.MARK} llm_tensorrt_llm: 3 requests failed in the last minute "
                f"(limit 2); stopping the server so that it is restarted\n")
    assert server.stop_cause(log, offset) == ("watchdog: llm_tensorrt_llm: 3 requests failed in the last minute "
                                              "(limit 2); stopping the server so that it is restarted")
    assert server.stop_cause(tmp_path / "missing.log") is None


def test_the_latency_window_gives_the_last_minutes_tail_and_jitter():
    clock = Clock()
    window = watchdog.LatencyWindow(window_s=60, clock=clock)
    assert window.figures()["latency_p99_ms"] == 0  # nothing answered yet
    for _ in range(99):
        window.add(0.100, [0.010] * 9)  # steady: no jitter between tokens
    window.add(1.000, [0.010, 0.110])  # one slow request, one long gap
    got = window.figures()
    assert got["latency_p50_ms"] == 100 and got["latency_p99_ms"] == 100  # nearest rank: the 99th of 100
    mean = (99 * 0.1 + 1.0) / 100
    std = ((99 * 0.1 ** 2 + 1.0) / 100 - mean ** 2) ** 0.5
    assert abs(got["latency_jitter"] - std / mean) < 1e-9
    assert got["token_gap_jitter"] > 0
    window.add(1.000, [])
    assert window.figures()["latency_p99_ms"] == 1000 and window.figures()["latency_p99_over_p50"] == 10
    clock.t += 61  # all of them older than the window
    assert window.figures() == dict.fromkeys(got, 0.0)
