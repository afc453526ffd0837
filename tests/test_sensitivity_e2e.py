"""The sensitivity and plan stages on the embedded default (SmolLM2-135M), through the CLI."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import run_invoke

pytestmark = pytest.mark.e2e
NAME = "smollm2-135m-cpu"


@pytest.fixture(scope="module")
def analysed(default_work_root):
    proc = run_invoke("sensitivity", "--work-root", str(default_work_root), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sensitivity: done" in proc.stdout and "plan: done" in proc.stdout
    return default_work_root / NAME


def test_table_covers_every_linear_layer_and_finds_the_down_projections(analysed):
    table = json.loads((analysed / "sensitivity" / "sensitivity_table.json").read_text())
    assert len(table["layers"]) == 30 * 7 + 1  # q k v o gate up down per block, and lm_head
    assert table["calibration"]["tokens"] == 32 * 256
    over = [l for l in table["layers"] if l["errors"]["int8_sq"]["error"] > 0.1]
    assert 1 <= len(over) <= 42  # SmoothQuant helps: plain W8A8 has 42 here (design brief)
    assert sum(l["module"] == "down_proj" for l in over) >= len(over) - 1
    for l in table["layers"]:
        e = l["errors"]["int8_sq"]
        assert 0 < e["mean"] <= e["max"] and e["error"] < 1
    assert 0 < table["embedding"]["int8_per_row_error"] < 0.05


def test_plan_keeps_the_sensitive_layers_and_lm_head(analysed):
    plan = yaml.safe_load((analysed / "plan" / "plan.yaml").read_text())
    table = json.loads((analysed / "sensitivity" / "sensitivity_table.json").read_text())
    over = {l["name"] for l in table["layers"] if l["errors"]["int8_sq"]["error"] > 0.1}
    kept = {n for n, e in plan["layers"].items() if e["format"] == "high_precision"}
    assert kept == over | {"lm_head"}
    summary = json.loads((analysed / "plan" / "manifest.json").read_text())["summary"]
    assert summary["kept_high_precision"] == len(kept)
    assert 8 < summary["effective_bits_per_weight"] < 12
    for png in (analysed / "sensitivity" / "sensitivity_heatmap.png", analysed / "plan" / "sensitivity_errors.png"):
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


def test_rerun_is_up_to_date(analysed):
    proc = run_invoke("sensitivity", "--work-root", str(analysed.parent))
    assert proc.returncode == 0
    assert "sensitivity: up to date" in proc.stdout and "plan: up to date" in proc.stdout
