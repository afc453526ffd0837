"""The server launcher on the real Triton 2.51 binary from nvidia-pytriton, with small Python models written
here: set-up (stub, library path, the serving Python and its numpy), HTTP and gRPC, explicit model control,
failures with the log's tail, and the clean-up of every process and shared-memory region."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import kill_the_starter

from pipeline.errors import EnvironmentProblem, StageFailed
from pipeline.serving.server import (
    SHM_DIR,
    STUB_NAME,
    TritonServer,
    find_pytriton,
    log_tail,
    prepare_backends_dir,
    probe_python_env,
)

pytest.importorskip("pytriton", reason="nvidia-pytriton provides the server")

ECHO = '''
import ssl  # fails inside the stub when it links another Python's libpython
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x * 2).astype(np.int32))]))
        return out
'''


def _model(repo: Path, name: str, code: str = ECHO) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 0
        input [{{name: "x" data_type: TYPE_INT32 dims: [-1]}}]
        output [{{name: "y" data_type: TYPE_INT32 dims: [-1]}}]
        instance_group [{{kind: KIND_CPU count: 1}}]
        """))


def _group_alive(pgid: int) -> bool:
    """Any live (not zombie) process left in the group (the server and its Python-backend stubs)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, _, pgrp = text[text.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


@pytest.fixture
def no_leftovers():
    """Every test here must leave no server process and no shared-memory region of its own behind."""
    before = set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()
    servers: list[TritonServer] = []
    yield servers
    for s in servers:
        s.stop()
    time.sleep(0.2)
    after = set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()
    ours = [n for n in after - before if any(s.shm_prefix and n.startswith(s.shm_prefix) for s in servers)]
    assert not ours, f"shared memory left behind: {ours}"


def test_backends_dir_is_prepared_outside_the_package(tmp_path):
    dist = find_pytriton()
    env = probe_python_env()
    assert env.version == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert int(env.numpy_version.split(".")[0]) < 2
    out = prepare_backends_dir(tmp_path / "backends", dist, env)
    stub = out / "python" / STUB_NAME
    assert stub.is_file() and not stub.is_symlink() and os.access(stub, os.X_OK)
    assert (out / "python" / "libtriton_python.so").resolve() == (dist.python_backend / "libtriton_python.so")
    assert dist.root not in stub.parents


def test_a_serving_python_with_numpy_2_is_refused(tmp_path):
    # a stand-in interpreter that reports numpy 2: the check must refuse it before any server starts
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/sh\necho '{\"version\": \"3.11\", \"libdir\": \"/usr/lib\", \"numpy\": \"2.1.0\"}'\n")
    fake.chmod(0o755)
    with pytest.raises(EnvironmentProblem, match="numpy 2.1.0.*empty"):
        probe_python_env(bin_dir)
    with pytest.raises(EnvironmentProblem, match="numpy 2.1.0"):
        TritonServer(tmp_path, python_bin_dir=bin_dir).start()


def test_serves_http_and_grpc_on_loopback_then_stops_everything(tmp_path, no_leftovers):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    repo = tmp_path / "repo"
    _model(repo, "echo")
    server = TritonServer(repo, log_path=tmp_path / "server.log")
    no_leftovers.append(server)
    with server:
        assert server.startup_s is not None and server.startup_s < 60
        assert server.http_url.startswith("127.0.0.1:") and server.grpc_url.startswith("127.0.0.1:")
        x = np.array([1, 2, 3], dtype=np.int32)
        for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
            client = module.InferenceServerClient(url)
            inp = module.InferInput("x", [3], "INT32")
            inp.set_data_from_numpy(x)
            y = client.infer("echo", [inp]).as_numpy("y")
            assert y.tolist() == [2, 4, 6]  # numpy 2 in the stub would give an empty tensor here
            client.close()
        pid = server.pid
        regions = [n for n in os.listdir(SHM_DIR) if n.startswith(server.shm_prefix)]
        assert regions, "the Python backend's shared memory carries this server's prefix"
        listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
        bound = [line for line in listening.splitlines() if f"pid={pid}," in line]
        local = [line.split()[3].rsplit(":", 1)[0] for line in bound]
        assert len(bound) == 3 and set(local) <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, bound  # http, grpc, metrics
    assert server.process is None and not _group_alive(pid)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(server.shm_prefix)]
    assert "successfully loaded 'echo'" in (tmp_path / "server.log").read_text()


def test_a_model_that_fails_to_load_shows_the_log_and_leaves_nothing(tmp_path, no_leftovers):
    repo = tmp_path / "repo"
    _model(repo, "broken", "def broken(:\n")
    server = TritonServer(repo)
    no_leftovers.append(server)
    with pytest.raises(StageFailed) as info:
        server.start()
    msg = str(info.value)
    assert "exited with code" in msg and "broken" in msg and "SyntaxError" in msg
    assert server.process is None and server._tmp is None


HANGS = '''
import faulthandler, signal, sys, threading

class TritonPythonModel:
    def initialize(self, args):  # as the pipeline's models do first (llm_io.stacks_on_signal), then never returns
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
        threading.Event().wait()
'''


def test_a_model_still_loading_at_the_timeout_shows_where_it_stood(tmp_path, no_leftovers):
    """Not ready in time while alive: before the server is stopped, its models' stubs dump their Python stacks
    into its log, so the failure says where loading stood."""
    repo = tmp_path / "repo"
    _model(repo, "hangs", HANGS)
    server = TritonServer(repo, log_path=tmp_path / "server.log", ready_timeout_s=8.0)
    no_leftovers.append(server)
    with pytest.raises(StageFailed) as info:
        server.start()
    msg = str(info.value)
    assert "was not ready after 8 s" in msg
    assert "the Python threads of model hangs" in msg and "in initialize" in msg
    assert server.process is None and server._tmp is None


def test_explicit_model_control_loads_on_request_and_survives_a_broken_model(tmp_path, no_leftovers):
    repo = tmp_path / "repo"
    _model(repo, "echo")
    _model(repo, "broken", "raise RuntimeError('no')\n")
    server = TritonServer(repo, load_models=[])
    no_leftovers.append(server)
    with server:
        assert not server.model_ready("echo")
        server.load_model("echo")
        assert server.model_ready("echo")
        with pytest.raises(StageFailed, match="broken"):
            server.load_model("broken")
        assert server.is_alive() and server.model_ready("echo")
        server.unload_model("echo")
        deadline = time.monotonic() + 30
        while server.model_ready("echo") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.model_ready("echo")


def test_a_server_killed_hard_has_its_stubs_and_memory_cleaned(tmp_path, no_leftovers):
    repo = tmp_path / "repo"
    _model(repo, "echo")
    server = TritonServer(repo)
    no_leftovers.append(server)
    server.start()
    pid = server.pid
    os.kill(pid, signal.SIGKILL)  # no chance to stop its stub or free its shared memory itself
    server.process.wait(timeout=30)
    server.stop()
    assert not _group_alive(pid)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(server.shm_prefix)]


def test_the_server_dies_with_the_process_that_started_it(tmp_path):
    repo = tmp_path / "repo"
    _model(repo, "echo")
    facts, left = kill_the_starter(f"""
        import json, sys, time
        from pathlib import Path
        from pipeline.serving.server import TritonServer
        s = TritonServer(Path({str(repo)!r})).start()
        print(json.dumps({{"pid": s.pid, "prefix": s.shm_prefix}}), flush=True)
        time.sleep(600)
        """)
    for leftover in SHM_DIR.glob(facts["prefix"] + "*"):  # nobody was left to free them: this test does
        leftover.unlink()
    assert left == [], "the server outlived the process that started it"


def test_log_tail_puts_errors_first_and_drops_tables(tmp_path):
    log = tmp_path / "log"
    log.write_text("I1 ok\n+----+\n| a |\nE1130 12:00:00.000 1 x.cc:1] \"real problem\"\n"
                   "E1130 12:00:00.000 1 server.cc:1] \"CudaDriverHelper has not been initialized.\"\nI2 end\n")
    tail = log_tail(log)
    assert tail.splitlines()[0].endswith('"real problem"')
    assert "|" not in tail and "CudaDriverHelper" not in tail


@pytest.mark.parametrize("lost", ["http taken", "grpc taken", "metrics taken", "grpc and metrics on one port"])
def test_a_server_whose_chosen_port_was_lost_starts_again_on_new_ports(tmp_path, no_leftovers, monkeypatch, lost):
    """The real tritonserver, started on ports of which one was taken between choosing and binding it (or, as
    once happened when ports were chosen one at a time, two that came out equal): it fails, the launcher sees why
    in its log and starts it again on new ports, and it becomes ready there. The metrics port is bound after
    /v2/health/ready answers (tritonserver starts that service last), so a taken one ends a server that was ready:
    start() waits for the metrics port too, and a server it returns answers there."""
    import socket
    import urllib.request

    from pipeline.serving import server as server_module
    from pipeline.serving.ports import fill_ports, free_ports

    repo = tmp_path / "repo"
    _model(repo, "echo")
    http, grpc, metrics = free_ports(3)
    first = {"http taken": [http, grpc, metrics], "grpc taken": [http, grpc, metrics],
             "metrics taken": [http, grpc, metrics],
             "grpc and metrics on one port": [http, grpc, grpc]}[lost]
    chosen: list[list[int]] = []

    # stand-in for the race: another process taking a chosen port before the server binds it cannot be timed
    # from here, so the launcher's first choice is the lost one (below, a port this test holds); later choices are
    # the real ones
    def first_choice_lost(want, host):
        chosen.append(first if not chosen else fill_ports(want, host))
        return chosen[-1]

    monkeypatch.setattr(server_module, "fill_ports", first_choice_lost)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        if lost != "grpc and metrics on one port":
            holder.bind(("127.0.0.1", {"http taken": http, "grpc taken": grpc, "metrics taken": metrics}[lost]))
            holder.listen()
        server = TritonServer(repo, log_path=tmp_path / "server.log")
        no_leftovers.append(server)
        with server:
            assert len(chosen) == 2 and [server.http_port, server.grpc_port, server.metrics_port] == chosen[1]
            assert len(set(chosen[1])) == 3 and server.model_ready("echo")
            with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
                assert r.status == 200 and b"nv_inference_count" in r.read()
    said = (tmp_path / "server.log").read_text()
    assert {"http taken": "failed to start HTTP service: Unavailable - Socket '127.0.0.1:%d' already in use" % http,
            "grpc taken": "failed to start GRPC service: Unavailable - Socket '127.0.0.1:%d' already in use" % grpc,
            "metrics taken": "failed to start Metrics service: Unavailable - Socket '127.0.0.1:%d' already in use"
                             % metrics,
            "grpc and metrics on one port": "The server cannot listen to GRPC requests and metrics requests at the "
                                            "same address and port 127.0.0.1:%d" % grpc}[lost] in said
