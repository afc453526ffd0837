"""Free TCP ports for the servers the pipeline starts, and telling a lost bind race from other failures.

A port is free when the kernel hands it out for ``bind(host, 0)``. Asking once per port and closing each socket
before the next ask lets the kernel hand out the same port twice (a Triton server was once given one port for
gRPC and metrics, and refused to start). ``free_ports`` holds every socket bound until all of a server's ports
are chosen, so they always differ. A port is still only free when chosen: another process can take it before
the server binds it, so a server that then fails on a taken port (``lost_port_race``) is started again on new
ones.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Collection

from pipeline.errors import InputError

LOOPBACK = "127.0.0.1"
START_TRIES = 3  # a server whose chosen port was taken meanwhile is started on new ports up to this often
# what a server's log says when a port it was given is taken, as tritonserver 2.51 writes it ("failed to start
# HTTP service: Unavailable - Socket '127.0.0.1:52979' already in use", "failed to start GRPC service: ... already
# in use", after gRPC's "Address already in use"), and as vLLM's OpenAI server does (Python's "[Errno 98] Address
# already in use"); and tritonserver's refusal of two endpoints on one port ("The server cannot listen to GRPC
# requests and metrics requests at the same address and port 127.0.0.1:46361")
PORT_TAKEN_MARKS = ("already in use", "at the same address and port")


def free_ports(count: int, host: str = LOOPBACK, exclude: Collection[int] = ()) -> list[int]:
    """``count`` different ports free on ``host`` now, none of them in ``exclude``."""
    with contextlib.ExitStack() as held:  # every socket stays bound until all are chosen: no port twice
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude:  # an excluded one stays bound too, so the next bind gets another
                ports.append(port)
        return ports


def free_port(host: str = LOOPBACK) -> int:
    """One port free on ``host`` now (a server with more than one port: ``free_ports``)."""
    return free_ports(1, host)[0]


def fill_ports(want: dict[str, int], host: str = LOOPBACK) -> list[int]:
    """The ports of ``want`` (endpoint name -> port) in order, each 0 replaced by a free port, all different.
    Two endpoints given one port are refused: a server cannot listen twice on one port."""
    given = [p for p in want.values() if p]
    if len(set(given)) < len(given):
        named = ", ".join(f"{name} {port}" for name, port in want.items() if port)
        raise InputError(f"two endpoints were given the same port ({named}): give each its own port, or 0 for a "
                         f"free one")
    fresh = iter(free_ports(len(want) - len(given), host, exclude=given))
    return [p or next(fresh) for p in want.values()]


def lost_port_race(log_text: str) -> bool:
    """Whether a server's log says it failed on a port that was taken (``PORT_TAKEN_MARKS``)."""
    text = log_text.lower()
    return any(mark in text for mark in PORT_TAKEN_MARKS)
