"""What streaming through Triton costs per token on the cpu target: the streaming model as this checkout has it
against the same model at a baseline revision, side by side in one run (issue #41's "measure first").

    # once: a published cpu build (the default config falls back to it on a CPU without AVX-512)
    .venv/bin/invoke publish --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_stream_path.py [--repo DIR] [--baseline REV] [--concurrency 16] [--tokens 64]

Two copies of the served repository: "now" as published, and "baseline" with ``<model>_stream``'s model.py as
``git show REV:triton_repo/stream/model.py`` gives it (the default REV is the last commit whose streaming model
turned each token into text through a BLS call to the postprocessing model). Everything else is the same files:
the engine model, the tokenizer, the configs.

Each arm starts its own tritonserver on the copy, then ``--concurrency`` gRPC clients, each on its own stream to
the streaming model, send requests back to back for ``--seconds``: a short prose prompt, exactly ``--tokens`` new
tokens (end_id -1). The arms take turns (now, baseline, baseline, now, ... over ``--rounds``) so drifting machine
load hits both alike. Per arm it prints the streamed tokens/s, the CPU milliseconds per token (psutil's user +
system time, read before and after the load) of the engine model's stub and of the frontend (tritonserver and every
other stub: the streaming model's, pre- and postprocessing's), and the time to first token. The last line gives the
now / baseline ratios.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_REPOSITORY = REPO / "build" / "smollm2-135m-cpu" / "model_repository"
DEFAULT_BASELINE = "308cfaa"  # the streaming model before it detokenized in its own process
PROMPTS = ("The history of the printing press begins", "A short guide to keeping bees:",
           "In the morning the harbour was quiet, and", "Three reasons to learn a second language are")


def server_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of tritonserver and of each model's Python stub, by model folder name."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd, t = proc.cmdline(), proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if proc.pid == pid:
            role = "tritonserver"
        elif cmd and cmd[0].endswith("triton_python_backend_stub"):
            role = Path(cmd[1]).parent.parent.name  # <repository>/<model>/<version>/model.py
        else:
            continue  # the stubs' parent-watch shells
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def split_cpu(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(the engine model's CPU seconds, everything else's: the frontend) between two readings."""
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    engine = sum(v for k, v in used.items() if k.endswith("_tensorrt_llm"))
    return engine, sum(used.values()) - engine


def stream_model(repository: Path) -> str:
    """The streaming model's name (publish names it ``<model>_stream``)."""
    found = sorted(p.parent.name for p in repository.glob("*_stream/config.pbtxt"))
    if len(found) != 1:
        raise SystemExit(f"{repository} holds no streaming model (*_stream): publish a cpu build with "
                         "triton.decoupled: true first (see the docstring)")
    return found[0]


def use_baseline(repository: Path, model: str, code: str) -> None:
    """The streaming model's code from the baseline, and the parameter it read: the postprocessing model's name."""
    from pipeline.serving import publish

    for version_dir in (repository / model).iterdir():
        if version_dir.is_dir():
            (version_dir / "model.py").write_text(code)
    config = repository / model / "config.pbtxt"
    msg = publish.read_config(config)
    msg.parameters["postprocessing_model"].string_value = model.removesuffix("_stream") + "_postprocessing"
    config.write_text(publish.config_text(msg))


def run_load(grpc_url: str, model: str, concurrency: int, tokens: int, seconds: float) -> dict:
    """``concurrency`` closed-loop streaming clients for ``seconds``: (tokens, requests, first-token times)."""
    import tritonclient.grpc as grpcclient

    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    got = {"tokens": 0, "requests": 0, "ttft": [], "errors": []}

    def client(index: int) -> None:
        done = threading.Event()
        state = {"first": None, "count": 0}

        def on_result(result, error) -> None:
            if error is not None:
                got["errors"].append(str(error))
                done.set()
                return
            response = result.get_response()
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                if state["first"] is None:
                    state["first"] = time.monotonic()
                state["count"] += ids.size
            if response.parameters.get("triton_final_response") and response.parameters[
                    "triton_final_response"].bool_param:
                done.set()

        c = grpcclient.InferenceServerClient(grpc_url)
        c.start_stream(callback=on_result)
        try:
            n = 0
            while time.monotonic() < stop_at and not got["errors"]:
                inputs = []
                text = f"{PROMPTS[(index + n) % len(PROMPTS)]} ({index}.{n})"
                for name, kind, value in (("text_input", "BYTES", text.encode()), ("max_tokens", "INT32", tokens),
                                          ("end_id", "INT32", -1)):
                    inputs.append(grpcclient.InferInput(name, [1, 1], kind))
                    inputs[-1].set_data_from_numpy(np.array([[value]], dtype=object if kind == "BYTES" else np.int32))
                done.clear()
                state.update(first=None, count=0)
                sent = time.monotonic()
                c.async_stream_infer(model, inputs, enable_empty_final_response=True)
                if not done.wait(600):
                    got["errors"].append("no final response in 600 s")
                    break
                with lock:
                    got["tokens"] += state["count"]
                    got["requests"] += 1
                    if state["first"] is not None:
                        got["ttft"].append(state["first"] - sent)
                n += 1
        finally:
            c.stop_stream()
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if got["errors"]:
        raise SystemExit(f"requests failed: {got['errors'][:3]}")
    return got


def arm(repository: Path, args) -> dict:
    from pipeline.serving.server import TritonServer

    with TritonServer(repository) as server:
        model = stream_model(repository)
        run_load(server.grpc_url, model, min(args.concurrency, 4), args.tokens, 5.0)  # warm-up: stubs, caches
        cpu0, t0 = server_cpu_s(server.process.pid), time.monotonic()
        got = run_load(server.grpc_url, model, args.concurrency, args.tokens, args.seconds)
        wall = time.monotonic() - t0
        engine, frontend = split_cpu(cpu0, server_cpu_s(server.process.pid))
    return {"tokens_per_s": got["tokens"] / wall, "engine_ms": engine / got["tokens"] * 1e3,
            "frontend_ms": frontend / got["tokens"] * 1e3, "requests": got["requests"], "ttft": got["ttft"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=DEFAULT_REPOSITORY, help="a published cpu model repository")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the baseline streaming model")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (forced)")
    ap.add_argument("--seconds", type=float, default=30.0, help="load per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = stream_model(args.repo)
    baseline_code = subprocess.run(["git", "-C", str(REPO), "show", f"{args.baseline}:triton_repo/stream/model.py"],
                                   check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        repos = {}
        for name in ("now", "baseline"):
            repos[name] = Path(tmp) / name
            shutil.copytree(args.repo, repos[name], symlinks=True)
        use_baseline(repos["baseline"], model, baseline_code)
        results: dict[str, list[dict]] = {"now": [], "baseline": []}
        order = [name for r in range(args.rounds) for name in (("now", "baseline") if r % 2 == 0
                                                                else ("baseline", "now"))]
        for name in order:
            results[name].append(arm(repos[name], args))
            last = results[name][-1]
            print(f"  {name:9s} {last['tokens_per_s']:7.1f} tokens/s, CPU ms per token: frontend "
                  f"{last['frontend_ms']:6.2f}, engine {last['engine_ms']:6.2f} ({last['requests']} requests)",
                  flush=True)
    print(f"\n{args.concurrency} streams, {args.tokens} tokens each, {args.rounds} rounds of {args.seconds:.0f} s:")
    summary = {}
    for name, runs in results.items():
        ttft = sorted(t for r in runs for t in r["ttft"])
        summary[name] = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
                         "frontend_ms": statistics.mean(r["frontend_ms"] for r in runs),
                         "engine_ms": statistics.mean(r["engine_ms"] for r in runs),
                         "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3,
                         "ttft_p99_ms": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] * 1e3}
        s = summary[name]
        print(f"{name:9s} {s['tokens_per_s']:7.1f} tokens/s, CPU ms per token: frontend {s['frontend_ms']:6.2f}, "
              f"engine {s['engine_ms']:6.2f}; TTFT P50 {s['ttft_p50_ms']:6.0f} ms, P99 {s['ttft_p99_ms']:6.0f} ms")
    now, base = summary["now"], summary["baseline"]
    print(f"now / baseline: tokens/s {now['tokens_per_s'] / base['tokens_per_s']:.2f}x, frontend CPU per token "
          f"{now['frontend_ms'] / base['frontend_ms']:.2f}x, engine CPU per token "
          f"{now['engine_ms'] / base['engine_ms']:.2f}x")


if __name__ == "__main__":
    main()
