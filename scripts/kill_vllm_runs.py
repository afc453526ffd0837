"""Repeat the vllm target's kill points (tests/test_faults.py) and report what each kill left behind.

    .venv/bin/python scripts/kill_vllm_runs.py --work-root WORK_ROOT [--reps 3] [--points verify-openai,...]
        [--no-rerun]

WORK_ROOT holds the embedded default (engine_configs/smollm2-135m-vllm.yaml) published (`invoke publish
--config engine_configs/smollm2-135m-vllm.yaml --work-root WORK_ROOT`). For each repetition and kill point it
runs `invoke <stage> --force`, SIGKILLs the invoke process alone at the point, waits up to a minute, and
counts the run's processes still alive and the bytes of new /dev/shm files; then reruns the stage (unless
--no-rerun) and says whether it completed. One JSON line per kill, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import run_invoke  # noqa: E402
from test_faults import LIGHT_BENCH, VLLM_CONFIG, VLLM_KILL_POINTS, kill_invoke_at, leftovers, new_shm  # noqa: E402

from pipeline import procs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-root", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--points", default=",".join(VLLM_KILL_POINTS))
    parser.add_argument("--no-rerun", action="store_true")
    args = parser.parse_args()
    rows = []
    for rep in range(1, args.reps + 1):
        for point in args.points.split(","):
            stage = VLLM_KILL_POINTS[point][0]
            token, before = uuid.uuid4().hex, {p.name for p in procs.SHM_DIR.iterdir()}
            t0 = time.monotonic()
            landed = kill_invoke_at(args.work_root, point, token)
            left, shm = leftovers(token, before)
            row = {"rep": rep, "point": point, "killed_at_point": landed, "processes_left": len(left),
                   "shm_files_left": len(shm), "shm_bytes_left": sum(shm.values()),
                   "to_kill_and_clean_s": round(time.monotonic() - t0, 1), "left": left, "shm_left": shm}
            if not args.no_rerun:
                t1 = time.monotonic()
                proc = run_invoke(stage, "--force", "--config", str(VLLM_CONFIG), "--work-root", str(args.work_root),
                                  *LIGHT_BENCH, timeout=1800)
                row.update(rerun_ok=proc.returncode == 0, rerun_s=round(time.monotonic() - t1, 1),
                           shm_bytes_after_rerun=sum(new_shm(before).values()))
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| rep | kill point | killed there | processes left | /dev/shm bytes left | rerun |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rerun = "-" if "rerun_ok" not in r else ("ok" if r["rerun_ok"] else "FAILED")
        print(f"| {r['rep']} | {r['point']} | {r['killed_at_point']} | {r['processes_left']} | "
              f"{r['shm_bytes_left']} | {rerun} |")
    bad = [r for r in rows if not r["killed_at_point"] or r["processes_left"] or r["shm_bytes_left"]
           or r.get("rerun_ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
