"""`invoke optimize` on the default model, its choice against the seed-rule plan and against all-INT8 side by side
in one run (issue #40's benchmark).

    .venv/bin/python scripts/bench_optimize.py [--config FILE] [--work-root DIR] [--sla-e2e-ms 20000]
                                               [--requests 16] [--concurrency 16] [--rounds 1] [--no-serving-search]

It runs `invoke optimize` on the default config (the one `invoke all` runs: the vllm target, or the cpu fallback on
a CPU without AVX-512; ``--config`` another) with the derived
candidates (seed, the threshold halved and doubled, every layer INT8) and ``optimize.compare_with: [seed,
all-<format>]``: after the search, the choice, the seed-rule plan and all-INT8 are served at once and measured
``--rounds`` times, the order rotated each round (pipeline/optimize.py). It prints every candidate's outcome and
accuracy, the measured points, the side-by-side medians with the chosen / other ratios, and the cost. A second
run reuses every candidate's build (the stage cache): only the measurements are repeated.

Where a comparison side is missing (all-INT8 refused by the accuracy gate, or the choice is seed itself), the
side-by-side has the sides that remain, and the table says why.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline import artifacts  # noqa: E402
from pipeline.commands import default_config  # noqa: E402
from pipeline.config import load_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help="default: the one `invoke all` runs here")
    ap.add_argument("--work-root", type=Path, default=REPO / "build" / "bench-optimize")
    ap.add_argument("--sla-e2e-ms", type=float, default=20000.0, help="P99 end-to-end bound (ms)")
    ap.add_argument("--requests", type=int, default=16, help="tune.requests: the last halving round's requests")
    ap.add_argument("--concurrency", type=int, default=16, help="tune.concurrency: clients in flight")
    ap.add_argument("--rounds", type=int, default=1, help="tune.ab_rounds: side-by-side rounds")
    ap.add_argument("--no-serving-search", action="store_true", help="optimize.serving_search: false")
    args = ap.parse_args()

    config = args.config or default_config()
    base = load_config(config).config.quantization.weight_format
    sets = [f"sla.p99_e2e_ms={args.sla_e2e_ms:g}", f"tune.requests={args.requests}",
            f"tune.concurrency={args.concurrency}", f"tune.ab_rounds={args.rounds}",
            f"optimize.compare_with=[seed, all-{base}]",
            f"optimize.serving_search={'false' if args.no_serving_search else 'true'}"]
    cmd = [str(REPO / ".venv" / "bin" / "invoke"), "optimize", "--config", str(config),
           "--work-root", str(args.work_root), *(x for s in sets for x in ("--set", s))]
    print("running:", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO)
    name = load_config(config).name
    folder = args.work_root / name / artifacts.OPTIMIZE_DIR
    path = folder / artifacts.OPTIMIZE_RESULTS_DIR / artifacts.OPTIMIZE_RESULTS_FILE
    if proc.returncode != 0:
        path = folder / (artifacts.OPTIMIZE_RESULTS_DIR + ".failed") / artifacts.OPTIMIZE_RESULTS_FILE
        if not path.is_file():
            return proc.returncode
    r = json.loads(path.read_text())
    print(f"\nSLA {r['sla']} ms; load {r['load']['requests']} requests, {r['load']['concurrency']} in flight")
    print(f"{'candidate':<18} {'outcome':<10} {'ppl +%':>7} {'KL':>8} {'MiB':>7} {'kept':>5}  "
          f"rounds (requests: good req/s)")
    for c in r["candidates"]:
        a = c["accuracy"] or {}
        rounds = ", ".join(f"{x['requests']}: {x['goodput_rps']:.2f}" for x in c["rounds"])
        print(f"{c['name']:<18} {c['status']:<10} {a.get('perplexity_increase_pct', float('nan')):>7.2f} "
              f"{a.get('kl_divergence', float('nan')):>8.4f} {(c['weight_bytes'] or 0) / 2**20:>7.1f} "
              f"{c['kept_high_precision'] if c['kept_high_precision'] is not None else '-':>5}  {rounds}"
              + (f"  ({c['why'][:100]})" if c["why"] else ""))
    print(f"\nchosen: {r['why']}")
    side = r.get("side_by_side")
    if side:
        print(f"\nside by side, {side['rounds']} round(s), medians:")
        for s in side["sides"]:
            m = side["medians"][s["key"]]
            ratio = side["chosen_over"].get(s["key"])
            print(f"  {s['key']:<30} goodput {m['goodput_rps']:.3f} req/s, {m['output_tokens_per_s']:.1f} tok/s"
                  + (f"; chosen / this: goodput {ratio['goodput']:.2f}x, tok/s {ratio['output_tokens_per_s']:.2f}x"
                     if ratio and ratio["goodput"] is not None else ""))
    cost = r["cost"]
    print(f"\ncost: {cost['candidates']} candidates, {cost['built']} built, {cost['measured']} measured, "
          f"{cost['server_runs']} server runs, {cost['total_s']:.0f} s "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in cost.items() if k.endswith('_s') and k != 'total_s')})")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
