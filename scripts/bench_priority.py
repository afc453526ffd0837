"""Two classes of requests on a real Triton server: short interactive requests behind long batch ones, with
and without request priorities (triton.priority_levels).

    .venv/bin/invoke publish --set triton.priority_levels=2     # or --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_priority.py [--repository DIR] [--phase-s 60] [--rounds 2]

One Triton server, one run, on a published cpu or vllm repository (the vllm target's Triton frontend: vLLM's
engine under the vLLM Python-backend model, with its priority scheduling policy). The load: ``--batch-clients`` (1.5x
max_batch_size) closed-loop clients send batch requests (``--batch-prompt-tokens`` prompt tokens of real text, exactly
``--batch-output-tokens`` new ones), more clients than the runtime runs sequences at once, so a queue forms; interactive
requests arrive at ``--interactive-rps`` (Poisson arrivals, one seed), ``--interactive-prompt-tokens`` prompt tokens and
exactly ``--interactive-output-tokens`` new ones. Every request streams through the streaming model over
gRPC, as `invoke bench` drives it. Two arms take turns on the same server (A B B A ...), so drifting machine
load hits both alike: "one class" (no request sends a priority) and "priorities" (interactive requests send
priority 1, batch ones 2).

Per arm it prints the interactive class's P50 / P99 time to first token and end-to-end latency over the
requests that arrived during the arm, and what the batch class pays: its output tokens/s and P50 end-to-end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import records  # noqa: E402
from pipeline.errors import InputError  # noqa: E402
from pipeline.serving import publish as pub  # noqa: E402
from pipeline.serving.bench.load import Prompt, RequestRecord, one_request  # noqa: E402
from pipeline.serving.serve import server_for_target  # noqa: E402

TEXT = ("The history of the city goes back to a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries the market grew into a town with walls, a cathedral and a "
        "university, and its bridges carried the roads of half a continent. ") * 16
ARMS = {"one class": None, "priorities": {"interactive": 1, "batch": 2}}


def prompt_of(tokenizer, tokens: int, offset: int) -> Prompt:
    """``tokens`` tokens of TEXT from token ``offset`` on (as the server's tokenizer counts them)."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids[offset:offset + tokens]
    return Prompt(tokenizer.decode(ids), len(ids))


async def arm(client, model: str, args, prompts: dict, priorities, seed: int) -> dict:
    """One arm's load for ``args.phase_s`` seconds; the records of the requests sent in it, by class."""
    out: dict[str, list[RequestRecord]] = {"batch": [], "interactive": []}
    end = time.perf_counter() + args.phase_s

    async def send(cls: str, prompt: Prompt, tokens: int) -> None:
        level = priorities[cls] if priorities else None
        out[cls].append(await one_request(client, model, prompt=prompt, max_tokens=tokens, end_id=-1,
                                          timeout_s=args.timeout_s, priority=level))

    async def batch_client() -> None:
        while time.perf_counter() < end:
            await send("batch", prompts["batch"], args.batch_output_tokens)

    async def interactive() -> None:
        rng, tasks = random.Random(seed), []
        while True:
            await asyncio.sleep(rng.expovariate(args.interactive_rps))
            if time.perf_counter() >= end:
                break
            tasks.append(asyncio.create_task(send("interactive", prompts["interactive"],
                                                  args.interactive_output_tokens)))
        await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    await asyncio.gather(interactive(), *(batch_client() for _ in range(args.batch_clients)))
    out["wall_s"] = time.perf_counter() - t0  # type: ignore[assignment]
    return out


def figures(records: list[RequestRecord]) -> dict:
    failed = [r for r in records if r.error]
    ok = [r for r in records if not r.error]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    ttft, e2e = [r.ttft_ms for r in ok], [r.e2e_ms for r in ok]
    return {"n": len(ok), "failed": len(failed), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "tokens": sum(r.output_tokens for r in ok)}


async def main_async(args) -> None:
    import tritonclient.grpc.aio as grpcaio
    from transformers import AutoTokenizer

    try:
        target = records.read_provenance(args.repository).build.target  # says what to run when there is none
    except InputError as e:
        sys.exit(str(e))
    names = pub.model_names(args.model_name)
    llm = pub.read_config(args.repository / names.tensorrt_llm / "config.pbtxt")
    if not llm.dynamic_batching.priority_levels:
        sys.exit(f"{args.repository} was published without request classes: publish with "
                 f"--set triton.priority_levels=2 first")
    args.batch_clients = args.batch_clients or llm.max_batch_size * 3 // 2
    tokenizer = AutoTokenizer.from_pretrained(str(args.repository / names.preprocessing / "1" / "tokenizer"))
    prompts = {"batch": prompt_of(tokenizer, args.batch_prompt_tokens, 0),
               "interactive": prompt_of(tokenizer, args.interactive_prompt_tokens, 7)}
    order = [a for r in range(args.rounds) for a in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1])]
    with server_for_target(target, args.repository, frontend="triton") as server:
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            for _ in range(2):  # warm-up, not measured
                await one_request(client, names.stream, prompt=prompts["interactive"], max_tokens=4, end_id=-1,
                                  timeout_s=args.timeout_s)
            runs: dict[str, list[dict]] = {a: [] for a in ARMS}
            for i, name in enumerate(order):
                runs[name].append(await arm(client, names.stream, args, prompts, ARMS[name], seed=args.seed + i // 2))
                print(f"arm {i + 1}/{len(order)} ({name}) done", flush=True)
        finally:
            await client.close()
    print(f"\n{args.batch_clients} batch clients ({prompts['batch'].tokens} prompt / {args.batch_output_tokens} "
          f"output tokens), interactive at {args.interactive_rps:g}/s ({prompts['interactive'].tokens} / "
          f"{args.interactive_output_tokens} tokens), {args.rounds} rounds of {args.phase_s:g} s per arm\n")
    print(f"{'arm':<11} {'inter. n':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} {'e2e p99':>8}   "
          f"{'batch tok/s':>11} {'batch e2e p50':>13} {'failed':>6}")
    table = {}
    for name, rs in runs.items():
        inter = figures([r for run in rs for r in run["interactive"]])
        batch = figures([r for run in rs for r in run["batch"]])
        batch_tps = batch["tokens"] / sum(run["wall_s"] for run in rs)
        table[name] = inter
        print(f"{name:<11} {inter['n']:>8} {inter['ttft_p50'] / 1e3:>8.2f}s {inter['ttft_p99'] / 1e3:>8.2f}s "
              f"{inter['e2e_p50'] / 1e3:>7.2f}s {inter['e2e_p99'] / 1e3:>7.2f}s   {batch_tps:>11.1f} "
              f"{batch['e2e_p50'] / 1e3:>12.2f}s {inter['failed'] + batch['failed']:>6}")
    one, pri = table["one class"], table["priorities"]
    print(f"\ninteractive P99 TTFT: one class / priorities = {one['ttft_p99'] / pri['ttft_p99']:.2f}x; "
          f"P99 end-to-end: {one['e2e_p99'] / pri['e2e_p99']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repository", type=Path, default=Path("build/smollm2-135m-vllm/publish/model_repository"))
    ap.add_argument("--model-name", default="llm")
    ap.add_argument("--batch-clients", type=int, default=0, help="0: 1.5x the build's max_batch_size")
    ap.add_argument("--batch-prompt-tokens", type=int, default=128)
    ap.add_argument("--batch-output-tokens", type=int, default=96)
    ap.add_argument("--interactive-rps", type=float, default=0.5)
    ap.add_argument("--interactive-prompt-tokens", type=int, default=16)
    ap.add_argument("--interactive-output-tokens", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
