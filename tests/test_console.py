"""The console (pipeline/console.py) on a real `invoke quantize`: ModelOpt's warnings land in the stage's log, not
on the console, which shows the stage lines only; --verbose shows them again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

from conftest import REPO, run_invoke, tiny_config

STAGES = ("model", "text", "sensitivity", "plan", "quantize")


def test_quantize_keeps_third_party_warnings_in_the_stage_log_and_verbose_shows_them(tmp_path, tiny_model_dir):
    cfg = tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    proc = run_invoke("quantize", "--config", str(cfg), "--work-root", str(work), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    console = proc.stdout + proc.stderr
    for noise in ("UserWarning", "skip smoothing", "tensorrt_llm", "Inserted", "INFO "):
        assert noise not in console, console
    # the config line, then each stage's running and done lines (off a terminal both are printed); a progress
    # line only for a step of a minute or more
    lines = [l for l in proc.stdout.splitlines() if not l.startswith("  ")]
    assert len(lines) == 1 + 2 * len(STAGES), proc.stdout
    for name in STAGES:
        assert f"{name}: running" in proc.stdout and f"{name}: done in" in proc.stdout
    log = (work / "tiny" / "quantize" / "stage.log").read_text()
    # ModelOpt's warning (lm_head is kept in high precision) and its print()s, with the pipeline's own INFO lines
    assert "UserWarning: lm_head is not calibrated, skip smoothing" in log
    assert "Inserted" in log and "INFO pipeline.quant.quantize: calibrated in" in log

    verbose = run_invoke("quantize", "--config", str(cfg), "--work-root", str(work), "--force", "--verbose",
                         timeout=900)
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    shown = verbose.stdout + verbose.stderr
    assert "skip smoothing" in shown and "INFO pipeline.quant.quantize: calibrated in" in shown
    assert "quantize: done in" in verbose.stdout
    # the log holds the warnings whatever the console shows
    assert "skip smoothing" in (work / "tiny" / "quantize" / "stage.log").read_text()


def test_a_child_process_reports_progress_to_the_parents_console_and_writes_into_the_stage_log(tmp_path):
    """Quiet, off a terminal: the child's progress lines are printed by the parent (one a quarter, here with no
    minute between them), and its warning and print land in the stage's log, not on the console."""
    log = tmp_path / "stage.log"
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO / 'tests')!r})
        import child_targets
        from pipeline import console
        from pipeline.child import run_in_child

        console.configure(False)
        console.LINE_EVERY_S = 0
        with console.stage_output(Path({str(log)!r})):
            result, _ = run_in_child(child_targets.warn_print_and_count, 8, log_path=Path({str(log)!r}))
        console.echo(f"counted {{result}}")
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [re.sub(r"\d+:\d\d", "m:ss", l) for l in lines] == [
        "  counting: 2/8 in m:ss, about m:ss left", "  counting: 4/8 in m:ss, about m:ss left",
        "  counting: 6/8 in m:ss, about m:ss left", "counted 8"], proc.stdout
    assert proc.stderr == ""
    text = log.read_text()
    assert "UserWarning: a library's warning" in text and "a library's print" in text
