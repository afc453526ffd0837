"""Every dotted module name the project writes (``pipeline.quant.streaming``, ``pipeline.formats.VLLM_SERVABLE``) in
its code, docstrings, docs and Dockerfile (and so the artifacts it writes) names a module that exists, and a name that
module defines: a module moved or renamed leaves no stale reference behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

DOTTED = re.compile(r"(?<![\w./{}-])pipeline(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# not module names: a logger the tests create under the package's own
NOT_MODULES = {"pipeline.test"}


def _defines(source: str, name: str) -> bool:
    # a definition, an assignment, or an import (a package's __init__ re-exports names in parenthesized imports)
    return bool(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|"
                          rf"^\s*from \S+ import .*\b{name}\b|"
                          rf"^\s*from \S+ import \([^)]*\b{name}\b|^\s*import .*\b{name}\b", source, re.M))


def resolves(dotted: str, root: Path = REPO) -> bool:
    """Whether ``dotted`` is a module under ``root`` or a module and a name it defines (read as text: nothing is
    imported, so the GPU-only modules' names are checked too)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            return i == len(parts) or _defines(module.read_text(), parts[i])
    return False


def _stale(texts: dict[str, str]) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for where, text in texts.items():
        for m in DOTTED.finditer(text):
            name = m.group(0)
            if name not in NOT_MODULES and not resolves(name):
                bad.setdefault(name, []).append(where)
    return bad


def test_every_dotted_name_in_code_and_docs_resolves():
    files = [*REPO.glob("pipeline/**/*.py"), *REPO.glob("triton_repo/**/*.py"), *REPO.glob("tests/**/*.py"),
             *REPO.glob("scripts/*.py"), REPO / "README.md", REPO / "Dockerfile", REPO / "tasks.py",
             *REPO.glob("docs/**/*.md")]
    # the artifacts name modules only through literals in this code (build_settings.json's runtime, the bench
    # results' tool), so scanning the code covers what they write
    bad = _stale({str(f.relative_to(REPO)): f.read_text() for f in files if f.name != Path(__file__).name})
    assert bad == {}, bad


def test_a_stale_name_is_found():
    assert _stale({"x": "the reader (pipeline.checkpoint) and pipeline.formats.NO_SUCH_TABLE"}) == {
        "pipeline.checkpoint": ["x"], "pipeline.formats.NO_SUCH_TABLE": ["x"]}
    assert _stale({"x": "pipeline.quant.checkpoint, pipeline.formats.VLLM_SERVABLE, pipeline.engines.trtllm"}) == {}
    # names a package re-exports, one per line of a parenthesized import (pipeline/config/__init__.py)
    assert _stale({"x": "pipeline.config.BenchSection, pipeline.config.NoSuchSection"}) == {
        "pipeline.config.NoSuchSection": ["x"]}
