"""The house plan holds: the import graph is the layered DAG pyproject.toml declares (checked by import-linter,
the real tool, on this tree and on a copy with one planted back-edge), and no GPU-only or heavy library is
imported by merely loading the stage graph; no import cycle between modules either."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    # lint-imports reads [tool.importlinter] from the pyproject.toml in its working directory and imports
    # the package from sys.path: run it in `root` with only `root` on the path
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(root)}, timeout=300)


def test_import_layers_hold_on_this_tree():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout


def test_a_planted_back_edge_breaks_the_contract(tmp_path):
    copy = tmp_path / "tree"
    shutil.copytree(REPO / "pipeline", copy / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", copy / "pyproject.toml")
    # a core module reaching up to the task layer: the kind of loop the layout removed
    fsutil = copy / "pipeline" / "fsutil.py"
    fsutil.write_text(fsutil.read_text() + "\nfrom pipeline import commands  # planted back-edge\n")
    r = _lint(copy)
    assert r.returncode != 0
    assert "pipeline.fsutil is not allowed to import pipeline.commands" in r.stdout


def test_loading_the_stage_graph_imports_no_heavy_library():
    code = ("import sys, pipeline.commands, pipeline.stages; "
            "heavy = [m for m in ('torch', 'transformers', 'modelopt', 'tensorrt_llm', 'matplotlib', 'tritonclient') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def module_cycles(package: str = "pipeline") -> list[list[str]]:
    """The import cycles between the package's modules (imports inside functions counted, imports only for type
    checking not): each a strongly connected set of two or more modules."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_between_modules():
    assert module_cycles() == []


def test_a_planted_module_cycle_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from cyclic import b  # inside a function: still an edge\n")
    (pkg / "b.py").write_text("from cyclic import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_cycles("cyclic") == [["cyclic.a", "cyclic.b"]]
