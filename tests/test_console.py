"""The console (pipeline/console.py) on a real `invoke quantize`: ModelOpt's warnings land in the stage's log, not
on the console, which shows the stage lines only; --verbose shows them again."""

from __future__ import annotations

from conftest import run_invoke, tiny_config

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
