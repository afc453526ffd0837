"""Functions the child-process tests run in a spawned interpreter (they must be importable by name)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from pipeline.errors import ConfigError


def add(a: int, b: int) -> int:
    return a + b


def raise_config_error() -> None:
    raise ConfigError("build.max_batch_size: 0 is not allowed; use 1 or more")


def raise_bug() -> None:
    raise KeyError("a bug, not a user error")


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def allocate_in_cgroup(cgroup: str, mib: int) -> int:
    """Join a memory cgroup (its limit is enforced by the kernel), then touch more than it allows, 16 MiB at a
    time as a stage's working set grows (slowly enough for the parent to watch it)."""
    import time

    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    chunks = []
    for _ in range(0, mib, 16):
        chunks.append(bytearray(16 << 20))  # bytearray zero-fills: the pages are really touched
        time.sleep(0.05)
    return len(chunks)


def generate_in_cgroup(cgroup: str, bundle: str, layer_streaming: str, prompts: list[list[int]], tokens: int):
    """Join a memory cgroup, load a cpu bundle's runtime there and decode ``prompts`` together (greedy);
    returns (their tokens, whether the layers were streamed, what the runtime read of them)."""
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams

    with CpuRuntime.load(bundle, layer_streaming=layer_streaming) as rt:
        requests = [rt.submit(p, SamplingParams(max_new_tokens=tokens)) for p in prompts]
        return [r.result(timeout=600) for r in requests], rt.layer_streaming


def report_pid_and_wait(pid_file: str) -> None:
    """Write this process's pid, then wait (for the test to kill the parent)."""
    import time

    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


def warn_print_and_count(n: int) -> int:
    """A stage's work as the console sees it: a library's warning, a print, and a step of ``n`` units."""
    import warnings

    from pipeline import console

    warnings.warn("a library's warning", UserWarning, stacklevel=1)
    print("a library's print")
    return sum(1 for _ in console.track(range(n), "counting"))
