"""vLLM's OpenAI-compatible server on a published vllm repository: started, checked ready, stopped.

The server is ``python -m vllm.entrypoints.openai.api_server`` of the serving environment
(pipeline.engines.vllm.runtime), with the engine arguments the build recorded beside the export
(``vllm_engine.json``), on 127.0.0.1 and a free port unless told otherwise. It answers the OpenAI API under
``/v1`` (completions, chat completions, streaming), ``/health`` and Prometheus metrics on ``/metrics``
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ...). It runs in its own session: stopping
it ends its engine-core and worker processes too (``pipeline.procs.stop_process_group``, which also removes
the shared memory they leave), and a parent that dies takes it all along (``pipeline.procs.start_group``:
PDEATHSIG for the server, a reaper for its engine core and resource tracker and their shared memory).
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

from pipeline import records
from pipeline.errors import InputError, StageFailed
from pipeline.procs import start_group, stop_process_group
from pipeline.serving import launch
from pipeline.serving.ports import LOOPBACK, START_TRIES, free_port, lost_port_race
from pipeline.serving.server import ServerProcess, log_tail

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # measured on 2 busy cores: 40-90 s to import vLLM and load SmolLM2


def published_model(repository: Path) -> tuple[Path, dict, records.Provenance]:
    """(the export folder, its vllm_engine.json, provenance.json) of a published vllm repository."""
    prov = records.read_provenance(repository)
    try:
        folder, engine = launch.vllm_model(repository)
    except SystemExit as e:
        raise InputError(str(e)) from None
    return folder, engine, prov


@dataclass
class VllmServer(ServerProcess):
    """vLLM's OpenAI server on a published repository. The Triton-style port arguments are accepted so that
    callers can start either server alike: vLLM serves everything, metrics too, on ``http_port``."""

    model_repository: Path
    http_port: int = 0
    grpc_port: int = 0  # unused: vLLM's server has no gRPC endpoint
    metrics_port: int = 0  # unused: metrics are on http_port/metrics
    host: str = LOOPBACK
    log_path: Optional[Path] = None
    ready_timeout_s: float = READY_TIMEOUT_S

    process: Optional[subprocess.Popen] = field(default=None, init=False, repr=False)
    startup_s: Optional[float] = field(default=None, init=False)
    model_name: str = field(default="", init=False)
    engine: dict = field(default_factory=dict, init=False)
    _log_file: Optional[IO[bytes]] = field(default=None, init=False, repr=False)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def base_url(self) -> str:  # what an OpenAI client takes
        return f"http://{self.http_url}/v1"

    @property
    def grpc_url(self) -> str:
        return ""

    @property
    def metrics_url(self) -> str:
        return f"http://{self.http_url}/metrics"

    def command(self, python: str) -> list[str]:
        return launch.vllm_argv(python, self.model_repository, self.host, self.http_port)

    def start(self) -> "VllmServer":
        from pipeline.engines.vllm import runtime

        if self.process is not None:
            raise RuntimeError("server already started")
        self.model_repository = Path(self.model_repository).resolve()
        folder, self.engine, prov = published_model(self.model_repository)
        self.model_name = self.engine["engine_args"].get("served_model_name") or prov.model_name
        python = runtime.serving_python()
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="vllm-server-")) / "vllm-server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        want = self.http_port
        t0 = time.monotonic()
        try:
            for attempt in range(START_TRIES):  # a free port can be taken between choosing it and binding it
                self.http_port = want or free_port(self.host)
                self._spawn(python, launch.vllm_env(folder, self.engine, runtime.child_env(self.engine.get("env", {}))))
                if self._wait_ready():
                    break
                if attempt < START_TRIES - 1 and not want and lost_port_race(log_tail(self.log_path)):
                    log.info("the chosen port was taken meanwhile; retrying with a new one")
                    stop_process_group(self.process, "vLLM server")
                    continue
                raise StageFailed(self._failure_message())
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - t0, 2)
        log.info("vLLM server ready in %.1f s (pid %d): %s", self.startup_s, self.pid, self.base_url)
        return self

    def _spawn(self, python: str, env: dict) -> None:
        assert self.log_path is not None  # set by start()
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self.log_path, "ab")
        cmd = self.command(python)
        log.info("starting %s", " ".join(cmd))
        self.process = start_group(cmd, "vLLM server", stdout=self._log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env)

    def _wait_ready(self) -> bool:
        return self.wait_ready(f"http://{self.http_url}/health", self.ready_timeout_s, poll_s=0.25)

    def _failure_message(self) -> str:
        code = self.process.poll() if self.process else None
        state = f"exited with code {code}" if code is not None else f"was not ready after {self.ready_timeout_s:.0f} s"
        tail = log_tail(self.log_path) if self.log_path else "(no log)"
        return f"the vLLM server {state}. Last lines of its log {self.log_path}:\n{tail}"

    def stop(self) -> None:
        stop_process_group(self.process, "vLLM server")
        self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
