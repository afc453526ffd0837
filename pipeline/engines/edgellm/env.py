"""TensorRT Edge-LLM's export environment: where its Python is, and what is installed there."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from pipeline.errors import EnvironmentProblem

ENV_VAR = "EDGELLM_PYTHON"
VENV_DIR = ".venv-edgellm"
DIST_NAME = "tensorrt-edgellm"
VERSION = "0.11.0"  # what the device commands and the export checks are written for (pipeline.formats.EDGE_PLATFORMS)
EXPORT_COMMAND = "tensorrt-edgellm-export"  # the wheel's console script (entry point tensorrt_edgellm.scripts.export)
REPO_ROOT = Path(__file__).resolve().parents[3]
HOW = (f"`bash scripts/setup-env` creates {VENV_DIR} (Python 3.11 with {DIST_NAME}[export]=={VERSION}; "
       f"EDGELLM_SETUP=0 skips it), or point {ENV_VAR} at a Python 3.11 that has it")


def python_path() -> str:
    """Where the export environment's Python is looked for: ``EDGELLM_PYTHON``, else ``.venv-edgellm``'s."""
    return os.environ.get(ENV_VAR) or str(REPO_ROOT / VENV_DIR / "bin" / "python")


def export_python() -> str:
    """The export environment's Python, checked to have Edge-LLM at VERSION; EnvironmentProblem says how to get it."""
    python = python_path()
    if not Path(python).is_file():
        raise EnvironmentProblem(f"TensorRT Edge-LLM's export environment is missing ({python} does not exist). "
                                 f"{HOW}.")
    found = edgellm_version(python)
    if found != VERSION:
        raise EnvironmentProblem(f"{python} has {DIST_NAME} {found or 'not installed'}; the edge target is written "
                                 f"for {VERSION}. {HOW}.")
    return python


@functools.lru_cache(maxsize=None)  # one look per Python: the preflight's, then the build's
def edgellm_version(python: str) -> str:
    """Edge-LLM's version in that environment ("" where it is not installed), from its metadata (no import)."""
    code = ("import importlib.metadata as m\ntry:\n    print(m.version(%r))\n"
            "except m.PackageNotFoundError:\n    pass\n" % DIST_NAME)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else ""


def export_command(python: str) -> str:
    """The export's console script beside that Python."""
    return str(Path(python).parent / EXPORT_COMMAND)
