"""Start tritonserver on a published repository: one process, or one per GPU rank under mpirun.

A TensorRT engine built with tensor or pipeline parallelism runs one rank per GPU. The tensorrtllm backend
has two ways to get there; this pipeline uses **leader mode**, the default of upstream's launcher
(``triton_backend/scripts/launch_triton_server.py``, NVIDIA/TensorRT-LLM @ 0b06796b): ``mpirun`` starts one
tritonserver per rank, and the executor checks that the MPI world size is TP x PP
(``cpp/tensorrt_llm/runtime/worldConfig.cpp``: "MPI size %d != TP size %d * PP size %d ..."). Rank 0 serves
every model and the endpoints; every other rank loads only the engine model (explicit model control) and
works for rank 0. Each rank gets its own Python-backend shared-memory prefix. Orchestrator mode
(``TRTLLM_ORCHESTRATOR=1``, workers spawned by the backend) is not used, so publish writes none of its keys.

``launch vllm`` starts vLLM's OpenAI server on a published vllm repository, with the flags the build recorded
beside the export (``vllm_engine.json``, in the engine model's version folder, which Triton serves too): the
vLLM image's entrypoint, and ``VllmServer`` for verify and bench. Where that record has tenants, the server's
flags load their admission (``--middleware``) from the version folder, which ``vllm_env`` puts on its PYTHONPATH.

Used by the GPU image's entrypoint (``python3 -m pipeline.serving.launch tritonserver <flags>``: the world
size and the engine model's name come from the repository's provenance.json) and by ``server.TritonServer``
for ``invoke serve`` / verify on a GPU machine. Standard library only: it runs in the Triton base image.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Mapping, Sequence

MPIRUN = "mpirun"
SHM_PREFIX_FLAG = "--backend-config=python,shm-region-prefix-name="
REPOSITORY_FLAG = "--model-repository="
PROVENANCE_FILE = "provenance.json"  # pipeline.artifacts.PROVENANCE_FILE (this module imports no pipeline code)
_RANK_ZERO_ONLY = ("--model-control-mode", "--load-model")


def rank_args(server_args: Sequence[str], rank: int, tensorrt_llm_model: str) -> list[str]:
    """One rank's tritonserver flags from rank 0's: its own shared-memory prefix, and on ranks > 0 only the
    engine model, loaded explicitly (upstream: ``--model-control-mode=explicit --load-model=<name>``)."""
    base = "prefix"  # upstream's; a prefix given for the server is kept, with the rank appended
    out = []
    for a in server_args:
        if a.startswith(SHM_PREFIX_FLAG):
            base = a[len(SHM_PREFIX_FLAG):] or base
        elif not (rank > 0 and a.startswith(_RANK_ZERO_ONLY)):
            out.append(a)
    out.append(f"{SHM_PREFIX_FLAG}{base}{rank}_")
    if rank > 0:
        out += ["--model-control-mode=explicit", f"--load-model={tensorrt_llm_model}"]
    return out


def server_argv(tritonserver: str, server_args: Sequence[str], world_size: int, tensorrt_llm_model: str,
                mpirun: str = MPIRUN) -> list[str]:
    """The command that serves a repository needing ``world_size`` GPUs: tritonserver itself for one, else
    ``mpirun --allow-run-as-root -n 1 <rank 0> : -n 1 <rank 1> : ...`` (upstream's shape)."""
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be at least 1")
    if world_size == 1:
        return [tritonserver, *server_args]
    if not tensorrt_llm_model:
        raise ValueError("a multi-GPU repository needs the name of its tensorrtllm model")
    argv = [mpirun, "--allow-run-as-root"]
    for rank in range(world_size):
        if rank:
            argv.append(":")
        argv += ["-n", "1", tritonserver, *rank_args(server_args, rank, tensorrt_llm_model)]
    return argv


def read_serving_needs(repository: Path) -> tuple[int, str]:
    """(tritonserver ranks, engine model name) from the repository's provenance.json (publish writes both)."""
    path = repository / PROVENANCE_FILE
    try:
        build = json.loads(path.read_text())["build"]
        # publish writes server_ranks: one per GPU rank for a TensorRT engine (leader mode); one for the pytorch
        # target, whose LLM API starts its own worker per rank (an MPI pool session) from the one model
        return (int(build.get("server_ranks", 1)),
                str(build.get("tensorrt_llm_model", "")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"launch: {path} is missing or unreadable ({e}); it is written by `invoke publish`. "
                         f"Build the image from a published repository.") from None


VLLM_MODEL_DIR = "vllm_model"  # pipeline.artifacts.VLLM_MODEL_DIR
VLLM_ENGINE_FILE = "vllm_engine.json"  # pipeline.artifacts.VLLM_ENGINE_FILE


def vllm_model(repository: Path) -> tuple[Path, dict]:
    """(the export folder, its vllm_engine.json) of a published vllm repository; SystemExit saying what to run."""
    try:
        prov = json.loads((repository / PROVENANCE_FILE).read_text())
        engine_model = str(prov["build"]["tensorrt_llm_model"])  # the Triton model over the same export
        folder = repository / engine_model / str(int(prov["version"])) / VLLM_MODEL_DIR
        engine = json.loads((folder / VLLM_ENGINE_FILE).read_text())
        if not isinstance(engine["server_module"], str) or not isinstance(engine["server_flags"], list):
            raise TypeError("server_module / server_flags of the wrong type")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"launch: {repository} is not a published vllm repository with its engine record ({e}); "
                         f"build and publish it with build.target: vllm (`invoke publish --force` after an "
                         f"upgrade)") from None
    return folder, engine


def vllm_argv(python: str, repository: Path, host: str, port: int) -> list[str]:
    """vLLM's OpenAI server on the repository's export: ``python -m <server module> --model <export> ...``."""
    folder, engine = vllm_model(repository)
    return [python, "-m", engine["server_module"], "--model", str(folder), "--host", host, "--port", str(port),
            *engine["server_flags"], "--disable-uvicorn-access-log"]


def vllm_env(folder: Path, engine: dict, env: Mapping[str, str]) -> dict[str, str]:
    """The OpenAI server's environment for the export ``folder`` and its engine record (``vllm_model``): ``env``,
    and where the record has tenants, the vLLM model's code folder (the version folder holding
    ``tenant_admission.py`` and ``tenancy.py``) first on PYTHONPATH, for the ``--middleware`` its flags name."""
    out = dict(env)
    if engine.get("tenants"):
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder.parent), env.get("PYTHONPATH", "")) if p)
    return out


def main(argv: Sequence[str]) -> int:
    """``launch tritonserver --model-repository=/models <flags>``: exec the right command for the repository."""
    if not argv:
        raise SystemExit("usage: python3 -m pipeline.serving.launch tritonserver --model-repository=DIR [flags]\n"
                         "       python3 -m pipeline.serving.launch vllm --model-repository=DIR [--host=H] [--port=P]")
    if argv[0] == "vllm":
        opts = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
        if "model-repository" not in opts:
            raise SystemExit(f"launch: give {REPOSITORY_FLAG}DIR")
        repository = Path(opts["model-repository"])
        cmd = vllm_argv(sys.executable, repository, opts.get("host", "0.0.0.0"), int(opts.get("port", "8000")))
        print(f"launch: {' '.join(cmd)}", file=sys.stderr, flush=True)
        os.execve(cmd[0], cmd, vllm_env(*vllm_model(repository), os.environ))
    tritonserver, flags = argv[0], list(argv[1:])
    repos = [a[len(REPOSITORY_FLAG):] for a in flags if a.startswith(REPOSITORY_FLAG)]
    if len(repos) != 1:
        raise SystemExit(f"launch: give exactly one {REPOSITORY_FLAG}DIR")
    world, model = read_serving_needs(Path(repos[0]))
    if world > 1 and shutil.which(MPIRUN) is None:
        raise SystemExit(f"launch: the repository needs {world} GPU ranks, started by {MPIRUN}, which is not on PATH "
                         f"(the Triton TensorRT-LLM image has it)")
    cmd = server_argv(tritonserver, flags, world, model)
    print(f"launch: {world} rank(s): {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
