"""What streaming through Triton costs per token: the Triton models as this checkout has them against the same
models at a baseline revision, and (a vllm build) vLLM's own OpenAI server on the same export, side by side in one
run (issue #41's "measure first").

    # once: a published build with triton.decoupled (the default config: the vllm target on AVX-512 or AMX,
    # the cpu target elsewhere)
    .venv/bin/invoke publish                       # or: --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_stream_path.py [--repo DIR] [--baseline REV | --baseline-repo DIR]
                                                  [--concurrency 16] [--tokens 64]

Copies of the served repository: "now" as published, and "baseline" with every model's Python files (its model.py
and triton_repo/common's) as ``git show REV:triton_repo/...`` gives them; the tokenizer, the engine files and the
configs are the same. Where the models' configs changed too, publish the same build with the older checkout and
pass that repository as ``--baseline-repo``: it is served as it is. A vllm build adds the arm "vllm", vLLM's
OpenAI server on the export in that repository.

Each arm starts its own server, one at a time (the others stopped), warms it up, then ``--concurrency`` clients
send ``--requests`` requests back to back (``invoke bench``'s closed-loop client, pipeline.serving.bench.load):
gRPC streams on the streaming model through Triton, streamed completions on vLLM's server; a short prose prompt,
exactly ``--tokens`` new tokens. The arms take turns, in reversed order every other round, so drifting machine load
hits all alike. Per arm: streamed tokens/s, TTFT P50 / P99, and CPU milliseconds per token of the whole server
tree (pipeline/serving/bench/cpu.py, as `invoke bench` reads it) and, through Triton, of the engine model's stub
apart from the frontend (tritonserver and every other stub). The last lines give the ratios to the baseline and to
vLLM's server (the means over rounds).

``--unary``: requests answered whole instead (gRPC infer on the ensemble, whose steps tokenize, generate and
detokenize; vLLM's completions without ``stream``), the same prompts and token counts; TTFT is then the whole answer's
time.
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

from pipeline import artifacts, records  # noqa: E402

DEFAULT_REPOSITORY = REPO / "build" / "smollm2-135m-vllm" / "model_repository"
# the models before their stubs froze the heap they had made at start (llm_io.freeze_heap)
DEFAULT_BASELINE = "20dd55a"
PROMPTS = ("The history of the printing press begins", "A short guide to keeping bees:",
           "In the morning the harbour was quiet, and", "Three reasons to learn a second language are")


def stream_model(repository: Path) -> str:
    """The streaming model's name (publish names it ``<model>_stream``)."""
    found = sorted(p.parent.name for p in repository.glob("*_stream/config.pbtxt"))
    if len(found) != 1:
        raise SystemExit(f"{repository} holds no streaming model (*_stream): publish a build with "
                         "triton.decoupled: true first (see the docstring)")
    return found[0]


def _git_show(rev: str, path: str) -> str | None:
    out = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def use_baseline(repository: Path, rev: str) -> None:
    """Every published model's Python files as they were at ``rev``: each model's source folder is the
    triton_repo folder whose model.py this checkout's published copy equals (the published version's)."""
    sources = {f.read_text(): f.parent.name for f in (REPO / "triton_repo").glob("*/model.py")}
    version = records.read_provenance(repository).version
    for model_py in repository.glob(f"*/{version}/model.py"):
        folder = sources.get(model_py.read_text())
        if folder is None:
            raise SystemExit(f"{model_py} matches no triton_repo/*/model.py of this checkout: publish again")
        for f in model_py.parent.glob("*.py"):
            where = folder if f.name == "model.py" or (REPO / "triton_repo" / folder / f.name).is_file() else "common"
            code = _git_show(rev, f"triton_repo/{where}/{f.name}")
            if code is None:
                raise SystemExit(f"triton_repo/{where}/{f.name} is not in revision {rev}")
            f.unlink()  # a published file may be a hard link to another version's: never written through
            f.write_text(code)


def prompts(repository: Path, count: int) -> list:
    """``count`` short prose prompts, their tokens counted by the repository's own tokenizer."""
    from transformers import AutoTokenizer

    from pipeline.serving.bench.load import Prompt

    tokenizer_dir = sorted(repository.glob(f"*_preprocessing/*/{artifacts.TOKENIZER_DIR}"))[-1]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(count)]
    return [Prompt(t, len(tokenizer(t).input_ids)) for t in texts]


def arm(repository: Path, name: str, args) -> dict:
    """One server on ``repository`` under the closed-loop load of ``invoke bench`` (pipeline.serving.bench.load):
    Triton's streaming model, or (``name`` "vllm") vLLM's OpenAI server."""
    from pipeline.serving.bench.cpu import cpu_by_role, per_token
    from pipeline.serving.bench.load import drive, drive_openai, level_figures
    from pipeline.serving.serve import server_for_target

    target = records.read_provenance(repository).build.target
    model = stream_model(repository)
    engine_model = model.removesuffix("_stream") + "_tensorrt_llm"
    if args.unary:  # answered whole: the ensemble (tokenize, engine, detokenize)
        model = model.removesuffix("_stream")
    load = prompts(repository, args.requests + 4)
    with server_for_target(target, repository, frontend="openai" if name == "vllm" else "triton") as server:
        def send(batch, concurrency):
            if name == "vllm":
                return drive_openai(server.base_url, server.model_name, prompts=batch, concurrency=concurrency,
                                    max_tokens=args.tokens, stream=not args.unary)
            return drive(server.grpc_url, model, prompts=batch, concurrency=concurrency, max_tokens=args.tokens,
                         stream=not args.unary)

        send(load[:4], 4)  # warm-up
        cpu0 = cpu_by_role(server.process.pid)
        records_, wall = send(load[4:], args.concurrency)
        cpu1 = cpu_by_role(server.process.pid)
    level = level_figures(records_, wall, args.concurrency)
    if level["errors"]:
        raise SystemExit(f"{name}: {level['errors']} requests failed: {[r.error for r in records_ if r.error][:3]}")
    cpu = per_token(cpu0, cpu1, level["output_tokens"], None if name == "vllm" else engine_model)
    return {"tokens_per_s": level["output_tokens_per_s"], "total_ms": cpu["total_ms"], "engine_ms": cpu["engine_ms"],
            "frontend_ms": cpu["frontend_ms"], "requests": level["requests"], "ttft_ms": level["ttft_ms"]}


def _ms(value) -> str:
    return "   —  " if value is None else f"{value:6.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=DEFAULT_REPOSITORY, help="a published model repository")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the baseline Triton models")
    ap.add_argument("--no-baseline", action="store_true", help="no baseline arm: this checkout's models (and vLLM's "
                    "server on a vllm build) only")
    ap.add_argument("--baseline-repo", type=Path, help="a repository published by an older checkout: the baseline "
                    "arm as it is (in place of --baseline)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (forced)")
    ap.add_argument("--requests", type=int, default=64, help="requests per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--unary", action="store_true", help="requests answered whole, not streamed: Triton's ensemble "
                    "over gRPC infer, and vLLM's completions without stream (TTFT is then the whole answer's time)")
    args = ap.parse_args()
    target = records.read_provenance(args.repo).build.target
    names = ["now"] + ([] if args.no_baseline else ["baseline"]) + (["vllm"] if target == "vllm" else [])
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        repos = {}
        for name in names:
            repos[name] = Path(tmp) / name
            source = args.baseline_repo if name == "baseline" and args.baseline_repo else args.repo
            shutil.copytree(source, repos[name], symlinks=True)
        if "baseline" in repos and not args.baseline_repo:
            use_baseline(repos["baseline"], args.baseline)
        results: dict[str, list[dict]] = {name: [] for name in names}
        order = [name for r in range(args.rounds) for name in (names if r % 2 == 0 else names[::-1])]
        for name in order:
            results[name].append(arm(repos[name], name, args))
            last = results[name][-1]
            print(f"  {name:9s} {last['tokens_per_s']:7.1f} tokens/s, CPU ms per token: all {_ms(last['total_ms'])}, "
                  f"frontend {_ms(last['frontend_ms'])}, engine {_ms(last['engine_ms'])} ({last['requests']} "
                  f"requests)", flush=True)
    kind = "unary requests" if args.unary else "streams"
    print(f"\n{target} target, {args.concurrency} {kind}, {args.tokens} tokens each, {args.rounds} rounds of "
          f"{args.requests} requests:")
    summary = {}
    for name, runs in results.items():
        def mean(key, runs=runs):
            return None if runs[0][key] is None else statistics.mean(r[key] for r in runs)

        summary[name] = {"tokens_per_s": mean("tokens_per_s"), "total_ms": mean("total_ms"),
                         "frontend_ms": mean("frontend_ms"), "engine_ms": mean("engine_ms"),
                         "ttft_p50_ms": statistics.mean(r["ttft_ms"]["p50"] for r in runs),
                         "ttft_p99_ms": statistics.mean(r["ttft_ms"]["p99"] for r in runs)}
        s = summary[name]
        print(f"{name:9s} {s['tokens_per_s']:7.1f} tokens/s, CPU ms per token: all {_ms(s['total_ms'])}, frontend "
              f"{_ms(s['frontend_ms'])}, engine {_ms(s['engine_ms'])}; TTFT P50 {s['ttft_p50_ms']:6.0f} ms, "
              f"P99 {s['ttft_p99_ms']:6.0f} ms")
    now = summary["now"]
    for other in names[1:]:
        o = summary[other]
        print(f"now / {other}: tokens/s {now['tokens_per_s'] / o['tokens_per_s']:.2f}x, CPU per token "
              f"{now['total_ms'] / o['total_ms']:.2f}x, TTFT P99 {now['ttft_p99_ms'] / o['ttft_p99_ms']:.2f}x")


if __name__ == "__main__":
    main()
