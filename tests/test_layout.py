"""The house plan holds: the import graph is the layered DAG pyproject.toml declares (checked by import-linter,
the real tool, on this tree and on a copy with one planted back-edge), and no GPU-only or heavy library is
imported by merely loading the stage graph; no import cycle between modules either; and a function with six or
more parameters takes all but the first one or two by keyword; no test imports a private name; and a parallel
run of the suite gives each test file one worker."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
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


WIDE_SIGNATURE = 6  # parameters (a method's self/cls not counted) from which the rest are taken by keyword
POSITIONAL_IN_WIDE = 2  # the subject or two stay positional: `def build(cfg, target, *, artifact_dir, ...)`


def positional_wide_functions(root: Path, paths: list[Path]) -> list[str]:
    """The functions and methods with WIDE_SIGNATURE or more parameters of which more than POSITIONAL_IN_WIDE can
    be passed by position, as 'path:line qualified.name(positional ...)'."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                positional = [a.arg for a in args.posonlyargs + args.args]
                if in_class and positional[:1] in (["self"], ["cls"]):
                    positional = positional[1:]
                if (len(positional) + len(args.kwonlyargs) >= WIDE_SIGNATURE
                        and len(positional) > POSITIONAL_IN_WIDE):
                    found.append(f"{path.relative_to(root)}:{child.lineno} {prefix}{child.name}"
                                 f"({', '.join(positional)}, ...)")
                visit(child, f"{prefix}{child.name}.", False)
            else:
                visit(child, prefix, in_class)

    for path in paths:
        visit(ast.parse(path.read_text(), filename=str(path)), "", False)
    return found


def test_wide_signatures_take_their_parameters_by_keyword():
    scanned = sorted((REPO / "pipeline").rglob("*.py")) + sorted((REPO / "triton_repo").rglob("*.py"))
    found = positional_wide_functions(REPO, scanned + [REPO / "tasks.py"])
    assert found == [], (f"{len(found)} function(s) with {WIDE_SIGNATURE}+ parameters take more than "
                         f"{POSITIONAL_IN_WIDE} by position; put a `*` after the first one or two:\n"
                         + "\n".join(found))


def test_a_planted_wide_positional_signature_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def wide(a, b, c, d, e, f): ...\n"
        "def keyword_only(a, b, *, c, d, e, f): ...\n"
        "def narrow(a, b, c, d, e): ...\n"
        "def variadic(a, b, *rest, c=1, d=2, e=3, f=4): ...\n"
        "class K:\n"
        "    def method(self, a, b, *, c, d, e, f): ...\n"
        "    def wide_method(self, a, b, c, d, e, f):\n"
        "        def inner(a, b, c, *, d, e, f): ...\n")
    assert positional_wide_functions(tmp_path, [planted]) == [
        "planted.py:1 wide(a, b, c, d, e, f, ...)",
        "planted.py:7 K.wide_method(a, b, c, d, e, f, ...)",
        "planted.py:8 K.wide_method.inner(a, b, c, ...)",
    ]


def private_imports(root: Path, files: list[Path]) -> list[str]:
    """Every ``from X import _name`` (a single-underscore name, not a dunder) in ``files``."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.relative_to(root)}:{node.lineno} from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_test_imports_a_private_name():
    """Tests use what a module offers; a helper several test modules share lives in a plain module of tests/
    (tiny_families, modelopt_exports, grafana) under a public name."""
    found = private_imports(REPO, sorted((REPO / "tests").rglob("*.py")))
    assert found == [], "tests import private names; make them public or test through the public API:\n" + "\n".join(
        found)


def test_a_planted_private_import_is_found(tmp_path):
    (tmp_path / "test_planted.py").write_text("from pipeline.runner import _lock, Runner\nfrom x import __version__\n")
    assert private_imports(tmp_path, [tmp_path / "test_planted.py"]) == [
        "test_planted.py:1 from pipeline.runner import _lock"]


def test_a_parallel_run_gives_each_test_file_one_worker():
    """`invoke test` spreads files over workers (pytest-xdist ``--dist loadgroup``, the groups from
    tests/conftest.py). Grouping leans on xdist's nodeid suffix, which pytest 9.2's structured node ids silently
    drop (pytest-xdist issue 1386: every test on its own, module fixtures built on every worker): this fails
    if a pytest or xdist upgrade brings that back."""
    files = ["tests/test_formats.py", "tests/test_commands.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist",
                        "loadgroup", "--no-loadscope-reorder", *files], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [line.split() for line in r.stdout.splitlines() if line.startswith("[gw") and " PASSED " in line]
    assert len(ran) > 8
    workers: dict[str, set[str]] = {}
    for worker, *_, nodeid in ran:
        test, _, group = nodeid.rpartition("@")
        assert group == test.split("::")[0], nodeid  # its file is its group
        workers.setdefault(group, set()).add(worker)
    assert sorted(workers) == sorted(files) and all(len(w) == 1 for w in workers.values()), workers


def test_a_parallel_run_gives_each_value_of_a_split_fixture_one_worker_and_one_setup(tmp_path):
    """A file that sets GROUP_PER_PARAM (tests/conftest.py) is one unit per value of that module fixture: each
    value's tests run on one worker, and its fixture is set up once (a group name xdist cannot parse back, such as
    one ending in "]", made every test its own unit and set the fixture up again)."""
    setups = tmp_path / "setups"
    (tmp_path / "test_chains.py").write_text(textwrap.dedent(f"""
        import pytest

        GROUP_PER_PARAM = "chain"


        @pytest.fixture(scope="module", params=["a", "b", "c"])
        def chain(request):
            with open({str(setups)!r}, "a") as f:
                f.write(request.param + "\\n")
            return request.param


        @pytest.mark.parametrize("step", [1, 2, 3])
        def test_step(chain, step):
            pass
        """))
    # tests/conftest.py as a plugin, so its grouping applies to this file outside the tree
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "conftest", "-n", "2",
                        "--dist", "loadgroup", "--no-loadscope-reorder", "--rootdir", str(tmp_path), str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [line.split() for line in r.stdout.splitlines() if line.startswith("[gw") and " PASSED " in line]
    assert len(ran) == 9, r.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, *_, nodeid in ran:
        workers.setdefault(nodeid.rpartition("@")[2], set()).add(worker)
    assert sorted(workers) == [f"test_chains.py::{v}" for v in "abc"] and all(len(w) == 1 for w in workers.values())
    assert sorted(setups.read_text().split()) == ["a", "b", "c"]  # each value's fixture once
