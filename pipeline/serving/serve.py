"""Which server serves a published build, and `invoke serve`: the server started for a build's target (through
``Target.server``: nvidia-pytriton's Triton, vLLM's OpenAI server, Triton over vLLM, the GPU image's
tritonserver), run in the foreground until Ctrl-C or SIGTERM (SIGINT handled even where it arrived ignored),
supervised and restarted where asked, with a line naming the server, the model and its URLs, and a banner. The servers
themselves are pipeline.serving.server and pipeline.serving.vllm_server."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

from pipeline import artifacts, records, targets
from pipeline.errors import EnvironmentProblem, StageFailed
from pipeline.serving.ports import LOOPBACK
from pipeline.serving.server import VLLM_READY_TIMEOUT_S, TritonServer, log_tail


def gpu_server_binary() -> Optional[str]:
    """The Triton TensorRT-LLM image's ``tritonserver`` (the GPU targets' server) where it is on PATH."""
    return shutil.which("tritonserver")


def server_for_target(target: str, repository: Path, frontend: Optional[str] = None, **kwargs):
    """The nvidia-pytriton server for the cpu target; the image's ``tritonserver`` for the GPU targets. The
    vllm target has two: vLLM's OpenAI server (``frontend="openai"``, the default; pipeline.serving.vllm_server)
    and the nvidia-pytriton server with its Python models running in vLLM's serving environment
    (``frontend="triton"``: the vLLM Python-backend model, triton_repo/tensorrt_llm_vllm)."""
    kind = targets.get(target).server(frontend)
    if kind == targets.SERVER_TRITON:
        return TritonServer(repository, **kwargs)
    if kind == targets.SERVER_VLLM_OPENAI:
        from pipeline.serving.vllm_server import VllmServer

        return VllmServer(repository, **kwargs)
    if kind == targets.SERVER_TRITON_VLLM:
        from pipeline.engines.vllm import runtime

        python = Path(runtime.serving_python())
        return TritonServer(repository, python_bin_dir=python.parent, environment=runtime.child_env({}),
                            **{"ready_timeout_s": VLLM_READY_TIMEOUT_S, **kwargs})
    binary = gpu_server_binary()
    if binary is None:
        raise EnvironmentProblem(
            f"serving the {target} target needs the Triton TensorRT-LLM image's tritonserver and a GPU: run this "
            f"inside that image on a GPU machine (there is no tritonserver on PATH here)"
        )
    build = records.read_provenance(repository).build
    return TritonServer(repository, binary=Path(binary), world_size=build.server_ranks,
                        tensorrt_llm_model=build.tensorrt_llm_model, **{"ready_timeout_s": 1800.0, **kwargs})


def measured_server_for_target(target: str, repository: Path, *, frontend: Optional[str], log_path: Path):
    """``server_for_target`` for bench and tune, which read the server's metrics: a Triton server gets its
    latency histograms (METRICS_ARGS); vLLM's OpenAI server has its metrics always on."""
    from pipeline.serving.bench.metrics import METRICS_ARGS

    openai = targets.get(target).server(frontend) == targets.SERVER_VLLM_OPENAI
    extra = {} if openai else {"extra_args": METRICS_ARGS}
    return server_for_target(target, repository, frontend=frontend, log_path=log_path, **extra)


# ---------------------------------------------------------------- invoke serve


SUPERVISE_RESTARTS = 5  # `invoke serve --supervise`: restarts in a row before it gives up
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0  # the wait before restart k is BACKOFF_S * 2**(k - 1), at most BACKOFF_MAX_S
STABLE_S = 300.0  # a server that ran this long before it stopped starts the count of restarts afresh
WATCHDOG_MARK = "trtllm-pipeline watchdog:"  # triton_repo/common/llm_watchdog.py MARK: the line that says why


def serve_published(work_dir: Path, *, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                    host: str = LOOPBACK, echo=print, frontend: Optional[str] = None, supervise: bool = False,
                    max_restarts: int = SUPERVISE_RESTARTS) -> None:
    """Run a server on the work dir's published repository in the foreground until Ctrl-C (or SIGTERM).
    ``frontend``: which server a vllm build gets (``vllm.frontends``' first: "openai" or "triton").

    ``supervise``: a server that stops by itself (its model's watchdog stopped it, or it crashed), or fails to
    start again, is started again on the same ports after a backoff (1, 2, 4 ... s), each restart echoed with
    its cause; after ``max_restarts`` in a row (a server that ran STABLE_S resets the count) it gives up."""
    from pipeline.serving.publish import model_names

    repo = artifacts.published_repository(work_dir)
    prov = records.read_provenance(repo)
    names = model_names(prov.model_name)
    target = prov.build.target
    openai = targets.get(target).server(frontend) == targets.SERVER_VLLM_OPENAI
    log_path = work_dir / "logs" / ("vllm-serve.log" if openai else "tritonserver-serve.log")
    # Ctrl-C stops it even where it was started with SIGINT ignored (a script's background job gets SIG_IGN,
    # and Python then installs no KeyboardInterrupt handler of its own); SIGTERM does the same
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    restarts = 0
    try:
        while True:
            started = time.monotonic()
            offset = log_path.stat().st_size if log_path.is_file() else 0
            try:
                with server_for_target(target, repo, frontend=frontend, http_port=http_port, grpc_port=grpc_port,
                                       metrics_port=metrics_port, host=host, log_path=log_path) as server:
                    if restarts == 0:
                        kind = targets.get(target).server(frontend)
                        echo(serving_line(server, kind, names.ensemble, prov))
                        echo(serve_banner(server, names.ensemble,
                                          stream=names.stream if (repo / names.stream).is_dir() else None, prov=prov,
                                          repo=repo, log_path=log_path))
                    else:
                        echo(f"serve: restarted (pid {server.pid}); ready again")
                    while server.is_alive():
                        time.sleep(0.5)
                    code = server.process.poll() if server.process else None
                cause = stop_cause(log_path, offset) or f"the server exited with code {code}"
            except StageFailed as e:
                if not supervise or restarts == 0:
                    raise
                cause = f"it did not start again: {str(e).splitlines()[0]}"
            if not supervise:
                raise StageFailed(f"the server stopped by itself ({cause}). Last lines of its log {log_path}:\n"
                                  f"{log_tail(log_path)}")
            if time.monotonic() - started >= STABLE_S:
                restarts = 0
            if restarts >= max_restarts:
                raise StageFailed(f"the server stopped {restarts + 1} times in a row, the last time because "
                                  f"{cause}; giving up. Its log: {log_path}")
            restarts += 1
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (restarts - 1))
            echo(f"serve: the server stopped ({cause}); restart {restarts} of {max_restarts} in {delay:.0f} s")
            time.sleep(delay)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_cause(log_path: Path, offset: int = 0) -> Optional[str]:
    """Why the server stopped, where its model's watchdog said so in the log (after byte ``offset``)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if WATCHDOG_MARK in line]
    return "watchdog: " + lines[-1].split(WATCHDOG_MARK, 1)[1].strip() if lines else None


def _raise_interrupt(signum, frame):  # SIGINT, SIGTERM: leave the with block (stopping the server)
    raise KeyboardInterrupt


SERVER_KINDS = {  # targets.SERVER_* -> what a user reads
    targets.SERVER_TRITON: "Triton (nvidia-pytriton; the Python-backend models)",
    targets.SERVER_TRITON_VLLM: "Triton over vLLM (nvidia-pytriton; the vLLM Python-backend model)",
    targets.SERVER_VLLM_OPENAI: "vLLM's OpenAI server",
    targets.SERVER_IMAGE_TRITON: "Triton (the TensorRT-LLM image's tritonserver)",
}


def serving_line(server, kind: str, ensemble: str, prov: records.Provenance) -> str:
    """One line: which server, which model, where."""
    if kind == targets.SERVER_VLLM_OPENAI:
        model, urls = server.model_name, f"OpenAI {server.base_url}, metrics {server.metrics_url}"
    else:
        model = ensemble
        urls = f"HTTP http://{server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}"
    return (f"serve: {SERVER_KINDS[kind]} serving model {model} v{prov.version} ({prov.build.target} "
            f"target) at {urls} (server pid {server.pid})")


def serve_banner(server, ensemble: str, *, stream: Optional[str], prov: records.Provenance, repo: Path,
                 log_path: Path) -> str:
    http = f"http://{server.http_url}"
    if hasattr(server, "base_url"):  # vLLM's OpenAI server
        body = json.dumps({"model": server.model_name, "prompt": "The capital of France is", "max_tokens": 32})
        chat = json.dumps({"model": server.model_name, "max_tokens": 32,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        return "\n".join([
            f"serving {server.model_name} version {prov.version} (vllm target, vLLM's OpenAI server) from {repo}",
            f"  OpenAI   {server.base_url}   (/completions, /chat/completions, stream: true)",
            f"  metrics  {server.metrics_url}",
            f"  log      {log_path}",
            "",
            "try:",
            f"  curl -s {server.base_url}/completions -H 'Content-Type: application/json' -d '{body}'",
            f"  curl -s {server.base_url}/chat/completions -H 'Content-Type: application/json' -d '{chat}'",
            "", "Ctrl-C stops the server."])
    body = json.dumps({"text_input": "The capital of France is", "max_tokens": 32})
    lines = [
        f"serving {ensemble} version {prov.version} ({prov.build.target} target) from {repo}",
        f"  HTTP     {http}   (KServe v2: /v2/models/{ensemble}/infer, /generate)",
        f"  gRPC     {server.grpc_url}",
        f"  metrics  {server.metrics_url}",
        f"  log      {log_path}",
        "",
        "try:",
        f"  curl -s -X POST {http}/v2/models/{ensemble}/generate -d '{body}'",
    ]
    if stream:
        lines.append(f"  curl -sN -X POST {http}/v2/models/{stream}/generate_stream -d '{body}'")
    lines += ["", "Ctrl-C stops the server."]
    return "\n".join(lines)
