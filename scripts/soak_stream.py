"""Does Triton's streaming path keep answering under long concurrent load? (issue #41's wedge)

    .venv/bin/invoke publish                       # a published build with triton.decoupled (the default config)
    .venv/bin/python scripts/soak_stream.py [--repo DIR] [--minutes 15] [--tokens 16] [--timeout 30]

One Triton server on the published repository (its target's, as `invoke verify` starts it). Back-to-back levels
of 32 gRPC streams on the streaming model, at concurrency 16, 4, 1 and 8 in turn (``invoke bench``'s closed-loop
client), until ``--minutes`` have passed or a level has a failed request. Each level prints a line. On a failure
the models dump every Python thread's stack into the server's log (SIGUSR1), and the script prints where that log
is and exits 1. On a 2-core AVX-512 machine the vllm build wedged within 1-7 minutes, or its engine stub died of
heap corruption within 3.4, until every model made only the outputs its request asked for (llm_io.wanted_outputs);
then it answered all 96 levels of a 6-minute run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline import records  # noqa: E402

DEFAULT_REPOSITORY = REPO / "build" / "smollm2-135m-vllm" / "model_repository"
LEVELS = (16, 4, 1, 8)
REQUESTS = 32
BASE = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"


def main() -> int:
    from bench_stream_path import stream_model  # this folder's: the repository's one streaming model
    from transformers import AutoTokenizer

    from pipeline.serving.bench.load import Prompt, drive
    from pipeline.serving.serve import server_for_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a request may take")
    args = parser.parse_args()
    stream = stream_model(args.repo)
    tokenizers = sorted(args.repo.glob("*_preprocessing/*/tokenizer"))  # every build has this model's copy
    tok = AutoTokenizer.from_pretrained(str(tokenizers[-1]))
    prompts = [Prompt(t, len(tok(t).input_ids)) for t in (f"{BASE} ({i}) and so on" for i in range(REQUESTS))]
    target = records.read_provenance(args.repo).build.target
    logs = Path(tempfile.mkdtemp(prefix="soak-stream-"))
    log = logs / "tritonserver.log"
    started = time.monotonic()
    with server_for_target(target, args.repo, frontend="triton", log_path=log) as server:
        level = 0
        while time.monotonic() - started < args.minutes * 60:
            concurrency = LEVELS[level % len(LEVELS)]
            level += 1
            done, wall = drive(server.grpc_url, stream, prompts=prompts, concurrency=concurrency,
                               max_tokens=args.tokens, timeout_s=args.timeout)
            failed = [r for r in done if r.error]
            print(f"{(time.monotonic() - started) / 60:5.1f} min  level {level:4d}  concurrency {concurrency:2d}  "
                  f"{len(done) - len(failed)}/{len(done)} answered in {wall:.1f} s", flush=True)
            if failed:
                server.dump_python_stacks()
                time.sleep(3)
                print(f"FAILED: {str(failed[0].error)[:300]}\nthe server's log, ending with every model's threads: "
                      f"{log}", flush=True)
                return 1
    shutil.rmtree(logs, ignore_errors=True)
    print(f"no failure in {level} levels ({(time.monotonic() - started) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
