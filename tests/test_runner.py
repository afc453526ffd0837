"""The staged runner, with small real stages (functions writing files): skip/rerun decisions, atomic
outputs, manifests, the lock, interrupted and failed stages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import DEFAULT_CONFIG, REPO

from pipeline import artifacts
from pipeline.config import load_config
from pipeline.errors import InputError, StageFailed, WorkDirBusy
from pipeline.runner import Runner, StageDef, WorkDirLock

calls: list[str] = []


def _writer(name: str, text_from):
    def run(ctx):
        calls.append(name)
        (ctx.out_dir / "out.txt").write_text(text_from(ctx))
        return {"wrote": name}
    return run


def make_stages(extra_input=None, first_run=None, second_run=None) -> list[StageDef]:
    return [
        StageDef("first", "first", sections=("text.calibration",),
                 external_inputs=extra_input,
                 run=first_run or _writer("first", lambda ctx: f"n={ctx.config.text.calibration.num_samples}")),
        StageDef("second", "second", needs=("first",), sections=("build.max_batch_size",),
                 run=second_run or _writer("second", lambda ctx: (ctx.upstream("first") / "out.txt").read_text()
                                           + f" b={ctx.config.build.max_batch_size}")),
    ]


def runner(tmp_path, overrides=(), **kw) -> Runner:
    return Runner(load_config(DEFAULT_CONFIG, list(overrides)), make_stages(**kw), tmp_path)


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def test_runs_then_skips_and_says_why(tmp_path):
    said: list[str] = []
    runner(tmp_path).run(["second"], echo=said.append)
    assert calls == ["first", "second"]
    assert any("first: running (never run" in s for s in said)
    work = tmp_path / "smollm2-135m-cpu"
    assert (work / "second" / "out.txt").read_text() == "n=32 b=8"
    m = json.loads((work / "second" / artifacts.MANIFEST_FILE).read_text())
    assert m["status"] == "ok" and m["format_version"] == artifacts.MANIFEST_FORMAT_VERSION
    assert m["outputs"]["files"]["out.txt"]["size_bytes"] == len("n=32 b=8")
    first = json.loads((work / "first" / "manifest.json").read_text())
    assert m["inputs"]["upstream"]["first"] == first["outputs"]["digest"]
    assert "python" in m["tool_versions"] and m["summary"] == {"wrote": "second"}

    calls.clear()
    said.clear()
    runner(tmp_path).run(["second"], echo=said.append)
    assert calls == []
    assert said[0].startswith("first: up to date") and said[1].startswith("second: up to date")


def test_changing_a_downstream_section_reruns_only_downstream(tmp_path):
    runner(tmp_path).run(["second"], echo=lambda s: None)
    calls.clear()
    r = runner(tmp_path, ["build.max_batch_size=4"])
    status = {s.name: s for s in r.explain(["second"])}
    assert status["first"].up_to_date
    assert status["second"].reasons == ["config build.max_batch_size changed: 8 -> 4"]
    r.run(["second"], echo=lambda s: None)
    assert calls == ["second"]


def test_changing_upstream_reruns_both_and_identical_upstream_output_cuts_off(tmp_path):
    runner(tmp_path).run(["second"], echo=lambda s: None)
    calls.clear()
    runner(tmp_path, ["text.calibration.num_samples=8"]).run(["second"], echo=lambda s: None)
    assert calls == ["first", "second"]
    # seq_len is in the hashed section but does not change first's output: second is not rerun
    calls.clear()
    runner(tmp_path, ["text.calibration.num_samples=8", "text.calibration.seq_len=64"]).run(
        ["second"], echo=lambda s: None)
    assert calls == ["first"]


def test_force_reruns(tmp_path):
    runner(tmp_path).run(["second"], echo=lambda s: None)
    calls.clear()
    runner(tmp_path).run(["second"], force=["second"], echo=lambda s: None)
    assert calls == ["second"]


def test_modified_or_missing_output_is_detected(tmp_path):
    runner(tmp_path).run(["second"], echo=lambda s: None)
    out = tmp_path / "smollm2-135m-cpu" / "first" / "out.txt"
    out.write_text("n=99")  # same size, new content
    st = runner(tmp_path).status("first")
    assert not st.up_to_date and "output first/out.txt was modified" in st.reasons
    out.unlink()
    assert "output first/out.txt is missing" in runner(tmp_path).status("first").reasons


def test_failure_keeps_previous_outputs_and_the_log(tmp_path):
    runner(tmp_path).run(["second"], echo=lambda s: None)
    work = tmp_path / "smollm2-135m-cpu"
    before = (work / "second" / "out.txt").read_text()

    def boom(ctx):
        import logging
        logging.getLogger("pipeline.test").info("about to fail")
        (ctx.out_dir / "partial.txt").write_text("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(StageFailed, match="disk on fire") as err:
        runner(tmp_path, ["build.max_batch_size=4"], second_run=boom).run(["second"], echo=lambda s: None)
    assert "second.failed.log" in str(err.value)
    assert (work / "second" / "out.txt").read_text() == before
    assert not (work / "second" / "partial.txt").exists()
    assert "about to fail" in (work / "logs" / "second.failed.log").read_text()
    assert list((work / artifacts.STAGING_DIR).iterdir()) == []


def test_input_changed_mid_run_is_refused(tmp_path):
    state = {"v": 1}

    def external(loaded, cache, work_dir):
        return {"v": state["v"]}

    def sneaky(ctx):
        state["v"] = 2
        (ctx.out_dir / "out.txt").write_text("x")

    with pytest.raises(InputError, match="changed while the stage ran"):
        runner(tmp_path, extra_input=external, first_run=sneaky).run(["first"], echo=lambda s: None)
    assert not (tmp_path / "smollm2-135m-cpu" / "first").exists()


def test_lock_refuses_a_second_run(tmp_path):
    work = tmp_path / "smollm2-135m-cpu"
    with WorkDirLock(work):
        with pytest.raises(WorkDirBusy, match=f"pid {os.getpid()}"):
            runner(tmp_path).run(["first"], echo=lambda s: None)
    runner(tmp_path).run(["first"], echo=lambda s: None)  # released


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path[:0] = [{repo!r}, {tests!r}]
    from pipeline.config import load_config
    from pipeline.runner import Runner, StageDef

    def slow(ctx):
        (ctx.out_dir / "out.txt").write_text("partial")
        print("STARTED", flush=True)
        time.sleep(60)

    Runner(load_config({cfg!r}), [StageDef("first", "first", sections=("text.calibration",), run=slow)],
           Path({root!r})).run(["first"], echo=lambda s: None)
""")


def test_kill_9_mid_stage_leaves_no_output_and_next_run_redoes_it(tmp_path):
    script = CHILD.format(repo=str(REPO), tests=str(REPO / "tests"), cfg=str(DEFAULT_CONFIG), root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "STARTED"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    work = tmp_path / "smollm2-135m-cpu"
    assert not (work / "first").exists()
    assert len(list((work / artifacts.STAGING_DIR).iterdir())) == 1  # the abandoned staging dir
    said: list[str] = []
    runner(tmp_path).run(["first"], echo=said.append)  # the lock died with the process
    assert (work / "first" / "out.txt").read_text() == "n=32"
    assert list((work / artifacts.STAGING_DIR).iterdir()) == []
    assert any("never run" in s for s in said)


def test_keyboard_interrupt_writes_nothing(tmp_path):
    def interrupted(ctx):
        (ctx.out_dir / "out.txt").write_text("partial")
        raise KeyboardInterrupt

    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        runner(tmp_path, first_run=interrupted).run(["first"], echo=said.append)
    assert not (tmp_path / "smollm2-135m-cpu" / "first").exists()
    assert "interrupted" in said[-1]
