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
    """Join a memory cgroup (its limit is enforced by the kernel), then touch more than it allows."""
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    chunks = [bytearray(1 << 20) for _ in range(mib)]  # bytearray zero-fills: the pages are really touched
    return len(chunks)
