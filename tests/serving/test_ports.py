"""Port selection for the servers: every port of one server differs, a given port is kept, two endpoints on one
port are refused, and a server that loses a chosen port to another process is started again on new ones (the
real tritonserver, in tests/serving/test_triton_server.py)."""

from __future__ import annotations

import socket

import pytest

from pipeline.errors import InputError
from pipeline.serving.ports import fill_ports, free_port, free_ports, lost_port_race

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


def test_the_ports_of_one_server_always_differ():
    # asking the kernel once per port, closing each socket before the next ask, repeated a port in 14 of 50,000
    # sets of three here (Linux 6.18: bind(host, 0) picks among ~14,000 ports); the sets below must never
    sets = [free_ports(3) for _ in range(50_000)]
    repeated = [s for s in sets if len(set(s)) < 3]
    assert repeated == [], f"{len(repeated)} sets repeat a port, e.g. {repeated[:3]}"
    assert all(len(s) == 3 and all(1024 <= p < 65536 for p in s) for s in sets)


def test_chosen_ports_are_free_and_an_excluded_one_is_never_chosen():
    ports = free_ports(4)
    for port in ports:  # free now: each binds
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    taken = free_port()
    assert all(taken not in free_ports(3, exclude=[taken]) for _ in range(2000))


def test_given_ports_are_kept_and_the_rest_filled_with_other_ones():
    given = free_port()
    http, grpc, metrics = fill_ports({"http_port": 0, "grpc_port": given, "metrics_port": 0})
    assert grpc == given and len({http, grpc, metrics}) == 3
    assert fill_ports({"http_port": 8000, "grpc_port": 8001}) == [8000, 8001]
    with pytest.raises(InputError, match=r"same port \(http_port 8000, grpc_port 8001, metrics_port 8001\)"):
        fill_ports({"http_port": 8000, "grpc_port": 8001, "metrics_port": 8001})


def test_a_lost_port_race_is_told_from_the_servers_own_words():
    # lines as the servers wrote them here: tritonserver 2.51 (nvidia-pytriton) with its HTTP or gRPC port taken,
    # and with its gRPC and metrics ports equal (tests/serving/test_triton_server.py makes it write each); vLLM 0.32's
    # OpenAI server with its port taken (vllm/entrypoints/launchers/launcher.py create_server_socket, line 348,
    # raising in sock.bind)
    assert lost_port_race('E1205 13:03:19.705810 7247 main.cc:257] "failed to start HTTP service: Unavailable - '
                          "Socket '127.0.0.1:52979' already in use \"")
    assert lost_port_race('E1205 13:03:13.384730 6784 main.cc:245] "failed to start GRPC service: Unavailable - '
                          "Socket '127.0.0.1:57785' already in use \"")
    assert lost_port_race("The server cannot listen to GRPC requests and metrics requests at the same address and "
                          "port 127.0.0.1:46361")
    assert lost_port_race("OSError: [Errno 98] Address already in use")
    assert not lost_port_race("E1205 13:03:13.370600 6784 model_lifecycle.cc:1] failed to load 'echo': SyntaxError")
