"""What streaming through Triton costs per token on the cpu target: the streaming model as this checkout has it
against the same model at a baseline revision, side by side in one run (issue #41's "measure first").

    # once: a published cpu build (the default config falls back to it on a CPU without AVX-512)
    .venv/bin/invoke publish --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_stream_path.py [--repo DIR] [--baseline REV] [--concurrency 16] [--tokens 64]

Two copies of the served repository: "now" as published, and "baseline" with ``<model>_stream``'s model.py as
``git show REV:triton_repo/stream/model.py`` gives it (the default REV is the last commit whose streaming model
tokenized each prompt through a BLS call to the preprocessing model). Everything else is the same files:
the engine model, the tokenizer, the configs.

Each arm starts its own tritonserver on the copy, then ``--concurrency`` gRPC clients, each request on its own
stream to the streaming model, send ``--requests`` requests back to back (``invoke bench``'s closed-loop client,
pipeline.serving.bench.load): a short prose prompt, exactly ``--tokens`` new tokens (end_id -1). The arms take turns
(now, baseline, baseline, now, ... over ``--rounds``) so drifting machine load hits both alike. Per arm it prints
the streamed tokens/s, the CPU milliseconds per token (pipeline/serving/bench/cpu.py, as `invoke bench` reads it)
of the engine model's stub and of the frontend (tritonserver and every other stub: the streaming model's, pre- and
postprocessing's), and the time to first token (P50 and P99, the mean over rounds). The last line gives the now /
baseline ratios.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline import artifacts  # noqa: E402

DEFAULT_REPOSITORY = REPO / "build" / "smollm2-135m-cpu" / "model_repository"
# the streaming model before it tokenized the prompt in its own process (308cfaa: before it detokenized there too)
DEFAULT_BASELINE = "5ddef8e"
PROMPTS = ("The history of the printing press begins", "A short guide to keeping bees:",
           "In the morning the harbour was quiet, and", "Three reasons to learn a second language are")


def stream_model(repository: Path) -> str:
    """The streaming model's name (publish names it ``<model>_stream``)."""
    found = sorted(p.parent.name for p in repository.glob("*_stream/config.pbtxt"))
    if len(found) != 1:
        raise SystemExit(f"{repository} holds no streaming model (*_stream): publish a cpu build with "
                         "triton.decoupled: true first (see the docstring)")
    return found[0]


def use_baseline(repository: Path, model: str, code: str) -> None:
    """The streaming model's code from the baseline, and the parameters earlier versions read: the pre- and
    postprocessing models' names (a parameter a model does not read is left alone)."""
    from pipeline.serving import publish

    for version_dir in (repository / model).iterdir():
        if version_dir.is_dir():
            (version_dir / "model.py").write_text(code)
    config = repository / model / "config.pbtxt"
    msg = publish.read_config(config)
    for step in ("preprocessing", "postprocessing"):
        msg.parameters[f"{step}_model"].string_value = model.removesuffix("_stream") + f"_{step}"
    config.write_text(publish.config_text(msg))


def prompts(repository: Path, count: int) -> list:
    """``count`` short prose prompts, their tokens counted by the repository's own tokenizer."""
    from transformers import AutoTokenizer

    from pipeline.serving.bench.load import Prompt

    tokenizer_dir = sorted(repository.glob(f"*_preprocessing/*/{artifacts.TOKENIZER_DIR}"))[-1]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(count)]
    return [Prompt(t, len(tokenizer(t).input_ids)) for t in texts]


def arm(repository: Path, args) -> dict:
    """One server on ``repository`` under the closed-loop load of ``invoke bench`` (pipeline.serving.bench.load)."""
    from pipeline.serving.bench.cpu import cpu_by_role, per_token
    from pipeline.serving.bench.load import drive, level_figures
    from pipeline.serving.server import TritonServer

    model = stream_model(repository)
    load = prompts(repository, args.requests + 4)
    with TritonServer(repository) as server:
        drive(server.grpc_url, model, prompts=load[:4], concurrency=4, max_tokens=args.tokens)  # warm-up
        cpu0 = cpu_by_role(server.process.pid)
        records, wall = drive(server.grpc_url, model, prompts=load[4:], concurrency=args.concurrency,
                              max_tokens=args.tokens)
        cpu1 = cpu_by_role(server.process.pid)
    level = level_figures(records, wall, args.concurrency)
    if level["errors"]:
        raise SystemExit(f"{level['errors']} requests failed: {[r.error for r in records if r.error][:3]}")
    cpu = per_token(cpu0, cpu1, level["output_tokens"], model.removesuffix("_stream") + "_tensorrt_llm")
    return {"tokens_per_s": level["output_tokens_per_s"], "engine_ms": cpu["engine_ms"],
            "frontend_ms": cpu["frontend_ms"], "requests": level["requests"], "ttft_ms": level["ttft_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=DEFAULT_REPOSITORY, help="a published cpu model repository")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the baseline streaming model")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (forced)")
    ap.add_argument("--requests", type=int, default=48, help="requests per arm and round")
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
    print(f"\n{args.concurrency} streams, {args.tokens} tokens each, {args.rounds} rounds of {args.requests} requests:")
    summary = {}
    for name, runs in results.items():
        summary[name] = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
                         "frontend_ms": statistics.mean(r["frontend_ms"] for r in runs),
                         "engine_ms": statistics.mean(r["engine_ms"] for r in runs),
                         "ttft_p50_ms": statistics.mean(r["ttft_ms"]["p50"] for r in runs),
                         "ttft_p99_ms": statistics.mean(r["ttft_ms"]["p99"] for r in runs)}
        s = summary[name]
        print(f"{name:9s} {s['tokens_per_s']:7.1f} tokens/s, CPU ms per token: frontend {s['frontend_ms']:6.2f}, "
              f"engine {s['engine_ms']:6.2f}; TTFT P50 {s['ttft_p50_ms']:6.0f} ms, P99 {s['ttft_p99_ms']:6.0f} ms")
    now, base = summary["now"], summary["baseline"]
    print(f"now / baseline: tokens/s {now['tokens_per_s'] / base['tokens_per_s']:.2f}x, frontend CPU per token "
          f"{now['frontend_ms'] / base['frontend_ms']:.2f}x, engine CPU per token "
          f"{now['engine_ms'] / base['engine_ms']:.2f}x")


if __name__ == "__main__":
    main()
