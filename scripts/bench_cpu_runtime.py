"""Benchmark the cpu reference runtime: throughput at concurrency 1 and 8, and KV-cache memory with INT8 vs
unquantized (fp32) blocks, measured side by side in one run on the same bundle.

    # once: build/smollm2-135m-cpu/build/cpu_bundle
    .venv/bin/invoke build --config engine_configs/smollm2-135m-cpu.yaml
    .venv/bin/python scripts/bench_cpu_runtime.py [--bundle DIR] [--tokens 32] [--rounds 2]

Throughput is generated tokens / wall seconds for N prompts submitted at once (N = concurrency), the runtime
warmed up first; rounds alternate INT8 and fp32 caches so machine noise hits both alike. KV memory is the
block pool's bytes (allocated for max_batch_size sequences of max_seq_len) and the bytes the 8 concurrent
sequences' blocks actually hold.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "A function in Python is defined with", "Once upon a time,",
           "The three primary colors are", "To sort a list in Python you can", "Water boils at",
           "The largest planet in the solar system is", "def fibonacci(n):"]


def run_level(rt, prompt_ids, concurrency: int, tokens: int) -> float:
    from pipeline.engines.cpu_runtime import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, end_id=-1)  # no early stop: every request makes `tokens`
    t0 = time.perf_counter()
    reqs = [rt.submit(prompt_ids[i % len(prompt_ids)], params) for i in range(concurrency)]
    made = sum(len(r.result()) for r in reqs)
    return made / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path("build/smollm2-135m-cpu/build/cpu_bundle"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from pipeline.engines.cpu_runtime import CpuRuntime

    tok = AutoTokenizer.from_pretrained(args.bundle / "model")
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    print(f"bundle {args.bundle}, {torch.get_num_threads()} threads, {args.tokens} new tokens per request")
    results: dict[str, dict[int, list[float]]] = {"INT8": {1: [], 8: []}, "fp32": {1: [], 8: []}}
    memory = {}
    runtimes = {"INT8": CpuRuntime.load(args.bundle), "fp32": CpuRuntime.load(args.bundle, quantize_kv_cache=False)}
    try:
        for rt in runtimes.values():
            run_level(rt, prompt_ids, 2, 4)  # warm-up
        for _ in range(args.rounds):
            for kind, rt in runtimes.items():
                for conc in (1, 8):
                    results[kind][conc].append(run_level(rt, prompt_ids, conc, args.tokens))
        for kind, rt in runtimes.items():
            pool = rt.pool
            per_block = pool.bytes // pool.num_blocks
            positions = sum(len(p) for p in prompt_ids) + 8 * args.tokens
            blocks = sum(-(-(len(p) + args.tokens) // pool.tokens_per_block) for p in prompt_ids)
            memory[kind] = {"pool_bytes": pool.bytes, "bytes_per_block": per_block, "blocks_for_8": blocks,
                            "bytes_for_8": blocks * per_block, "positions_for_8": positions}
    finally:
        for rt in runtimes.values():
            rt.close()

    print("\nthroughput, generated tokens/s (median of rounds)")
    print(f"{'KV cache':10} {'conc 1':>8} {'conc 8':>8} {'8 / 1':>7}")
    for kind, levels in results.items():
        one, eight = statistics.median(levels[1]), statistics.median(levels[8])
        print(f"{kind:10} {one:8.1f} {eight:8.1f} {eight / one:7.2f}x")
    i8, f32 = memory["INT8"], memory["fp32"]
    print("\nKV cache memory")
    print(f"{'KV cache':10} {'pool MB':>9} {'per block kB':>13} {'8 seqs MB':>10}")
    for kind, m in memory.items():
        print(f"{kind:10} {m['pool_bytes'] / 1e6:9.1f} {m['bytes_per_block'] / 1e3:13.1f} "
              f"{m['bytes_for_8'] / 1e6:10.2f}")
    print(f"INT8 / fp32 bytes: {i8['pool_bytes'] / f32['pool_bytes']:.3f} "
          f"(fp16 blocks, as on a GPU, would be 2x the INT8 ones)")


if __name__ == "__main__":
    main()
