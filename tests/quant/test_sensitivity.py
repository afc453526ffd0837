"""Sensitivity analysis and the plan stage on a tiny real Llama: a planted outlier is found (and only it),
the layer-by-layer pass reproduces the model's own forward, and the stages write what a person reads."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import tiny_config as _tiny_config

from pipeline.config import QuantizationSection, SensitivitySection, load_config
from pipeline.errors import InputError
from pipeline.runner import Runner
from pipeline.stages import STAGES

IDS = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(2))


def _errors(model_dir, fmt):
    from pipeline.quant.sensitivity import analyse

    table = analyse(model_dir, IDS.numpy(), section=SensitivitySection(formats=(fmt,)), quant=QuantizationSection())
    return {l["name"]: l["errors"][fmt]["error"] for l in table["layers"]}, table


def test_planted_outlier_is_flagged_and_nothing_else(tiny_model_dir, outlier_model_dir):
    clean, _ = _errors(tiny_model_dir, "int8_w8a8")
    assert max(clean.values()) < 0.1  # nothing is sensitive in the unmodified model
    planted, table = _errors(outlier_model_dir, "int8_w8a8")
    flagged = {n for n, e in planted.items() if e > 0.1}
    assert flagged == {f"model.layers.1.self_attn.{m}_proj" for m in "qkv"}
    rec = {l["name"]: l for l in table["layers"]}["model.layers.1.self_attn.q_proj"]
    assert rec["activation"]["outlier_ratio"] > 50  # the table says why
    # SmoothQuant moves the outlier into the weights: most of that error goes away
    smoothed, _ = _errors(outlier_model_dir, "int8_sq")
    for name in flagged:
        assert smoothed[name] < planted[name] / 3


def test_layerwise_pass_reproduces_the_full_forward(tiny_model_dir):
    """The analysis walks the model decoder layer by decoder layer from the safetensors files; the hidden
    state it hands to lm_head must be the model's own."""
    from transformers import AutoModelForCausalLM

    import pipeline.quant.sensitivity as S

    seen = {}
    original = S._measure_lm_head

    def spy(analyser, hidden, head):
        seen["hidden"] = hidden.clone()
        original(analyser, hidden, head)

    S._measure_lm_head = spy
    try:
        S.analyse(tiny_model_dir, IDS.numpy(), section=SensitivitySection(formats=("int8_wo",)),
                  quant=QuantizationSection())
    finally:
        S._measure_lm_head = original
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        ref = model(IDS, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(seen["hidden"], ref, rtol=1e-5, atol=1e-5)


def test_awq_group_size_that_does_not_divide_is_a_clear_error(tiny_model_dir):
    from pipeline.quant.sensitivity import analyse

    with pytest.raises(InputError, match="does not divide"):
        analyse(tiny_model_dir, IDS.numpy(), section=SensitivitySection(formats=("int4_awq",)),
                quant=QuantizationSection(awq_group_size=128))  # tiny model width 64


def test_stages_write_table_plan_and_plots_and_take_a_hand_edit(tmp_path, outlier_model_dir):
    cfg = _tiny_config(tmp_path, outlier_model_dir, "quantization: {weight_format: int8_sq}")
    work = tmp_path / "work"
    said = []
    Runner(load_config(cfg, ["plan.mode=threshold", "sensitivity.threshold=0.1"]), STAGES, work) \
        .run(["plan"], echo=said.append)
    sdir, pdir = work / "tiny" / "sensitivity", work / "tiny" / "plan"
    for f in ("sensitivity_table.json", "sensitivity_table.md", "sensitivity_heatmap.png"):
        assert (sdir / f).stat().st_size > 0
    for f in ("plan.yaml", "plan.md", "sensitivity_errors.png"):
        assert (pdir / f).stat().st_size > 0
    assert (sdir / "sensitivity_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads((sdir / "sensitivity_table.json").read_text())
    plan = yaml.safe_load((pdir / "plan.yaml").read_text())
    assert set(plan["layers"]) == {l["name"] for l in table["layers"]}
    assert plan["layers"]["lm_head"]["format"] == "high_precision" and "rule" in plan["layers"]["lm_head"]["reason"]
    sens = json.loads((sdir / "manifest.json").read_text())["summary"]
    assert sens["peak_rss_bytes"] > 0 and sens["layers"] == 15
    summary = json.loads((pdir / "manifest.json").read_text())["summary"]
    assert summary["kept_high_precision"] == sum(e["format"] == "high_precision" for e in plan["layers"].values())
    assert summary["weight_bytes_planned"] < summary["weight_bytes_fp16"]
    md = (sdir / "sensitivity_table.md").read_text()
    first_row = [l for l in md.splitlines() if l.startswith("| model.")][0]
    worst = max(table["layers"], key=lambda l: l["errors"]["int8_sq"]["error"])["name"]
    assert first_row.startswith(f"| {worst} |")  # sorted, most sensitive first
    assert "threshold" not in sens and "**" not in md  # the measurement knows no threshold: the plan judges it
    over = {t: {f: sum(l["errors"][f]["error"] > t for l in table["layers"]) for f in table["layers"][0]["errors"]}
            for t in (0.1, 0.2)}
    assert summary["threshold"] == 0.1 and summary["over_threshold"] == over[0.1]

    # a new threshold reuses the measurement: the plan reruns alone, and records and counts the new threshold
    swept = Runner(load_config(cfg, ["plan.mode=threshold", "sensitivity.threshold=0.2"]), STAGES, work)
    assert swept.status("sensitivity").up_to_date and not swept.status("plan").up_to_date
    said.clear()
    swept.run(["plan"], echo=said.append)
    assert any(s.startswith("sensitivity: up to date") for s in said) and not said[-1].startswith("plan: up to date")
    assert yaml.safe_load((pdir / "plan.yaml").read_text())["threshold"] == 0.2
    summary = json.loads((pdir / "manifest.json").read_text())["summary"]
    assert summary["threshold"] == 0.2 and summary["over_threshold"] == over[0.2]
    assert "- threshold 0.2 (decides on the `int8_sq` column)" in (pdir / "plan.md").read_text()
    back = Runner(load_config(cfg, ["plan.mode=threshold", "sensitivity.threshold=0.1"]), STAGES, work)
    back.run(["plan"], echo=said.append)  # the 0.1 plan again, for the hand edit below

    # a person edits the plan: the edit is checked, kept, recorded, and the plan is not regenerated
    plan["layers"]["model.layers.0.mlp.down_proj"]["format"] = "high_precision"
    (pdir / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    said.clear()
    runner = Runner(load_config(cfg, ["plan.mode=threshold", "sensitivity.threshold=0.1"]), STAGES, work)
    assert any("edited by hand" in r for r in runner.status("plan").reasons)
    runner.run(["plan"], echo=said.append)
    assert any("using the hand-edited plan.yaml" in s for s in said)
    edited = yaml.safe_load((pdir / "plan.yaml").read_text())
    assert edited["layers"]["model.layers.0.mlp.down_proj"]["format"] == "high_precision"
    manifest = json.loads((pdir / "manifest.json").read_text())
    assert manifest["hand_edited"] == ["plan.yaml"]
    assert "model.layers.0.mlp.down_proj" in manifest["summary"]["kept_high_precision_layers"]
    said.clear()
    runner.run(["plan"], echo=said.append)
    assert said[-1].startswith("plan: up to date")

    # an invalid edit is refused with the layer named
    edited["layers"]["model.layers.1.mlp.up_proj"]["format"] = "int3"
    (pdir / "plan.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    with pytest.raises(InputError, match="model.layers.1.mlp.up_proj.*int3"):
        runner.run(["plan"], echo=said.append)

    # an edit plus a changed input: refuse rather than overwrite the edit
    runner2 = Runner(load_config(cfg, ["plan.mode=threshold", "sensitivity.threshold=0.2"]), STAGES, work)
    with pytest.raises(InputError, match="edited by hand.*--force"):
        runner2.run(["plan"], echo=said.append)
    runner2.run(["plan"], force=["plan"], echo=said.append)  # --force regenerates
    assert yaml.safe_load((pdir / "plan.yaml").read_text())["threshold"] == 0.2


@pytest.mark.parametrize("in_features", [576, 1536])  # one block of EXACT_K, and several summed in fp64
def test_the_int8_matmul_is_the_exact_integer_product(in_features):
    """Integer weights whose rows reach 127 and an input scale of 1 leave every scale at 1: the result must be
    the int64 product rounded once to fp32, bit for bit. (Blocks of EXACT_K channels make that hold whatever
    order BLAS sums in; on this machine's BLAS a plain fp32 matmul over 1536 channels happened to match too.)"""
    import torch

    from pipeline.quant import sensitivity as S

    g = torch.Generator().manual_seed(0)
    # large products of one sign: over 1536 channels the sums reach 2.4e7, past fp32's exact integers
    x = torch.randint(90, 128, (300, in_features), generator=g, dtype=torch.int8)
    w_int = torch.randint(90, 128, (200, in_features), generator=g, dtype=torch.int64)
    w_int[:, 0] = 127  # every row's amax 127: its scale 127 / 127 = 1
    got = S._int8_matmul((x, torch.tensor(1.0)), w_int.float(), None, None)(0, 300)
    want = (x.to(torch.int64) @ w_int.t()).double().float()
    assert torch.equal(got, want)


@pytest.mark.parametrize("target, groups", [("cpu", [["q_proj", "k_proj", "v_proj"]]),
                                            ("vllm", [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]])])
def test_the_table_records_what_the_target_runs_as_one_gemm(tiny_model_dir, tmp_path, target, groups):
    """The sensitivity stage's table says which layers the plan must give one format: q/k/v everywhere, gate/up
    too for vLLM (one gate_up_proj GEMM), while the smoothing groups stay the TensorRT-LLM checkpoint's."""
    from safetensors.torch import save_file

    from pipeline import artifacts
    from pipeline.quant.sensitivity import run_analysis

    calibration = tmp_path / artifacts.CALIBRATION_TOKENS_FILE
    save_file({artifacts.TOKENS_KEY: IDS}, str(calibration))
    run_analysis(tiny_model_dir, calibration, section=SensitivitySection(formats=("int8_sq",)),
                 quant=QuantizationSection(), out_dir=tmp_path, decision=None, target=target)
    table = json.loads((tmp_path / artifacts.SENSITIVITY_TABLE_JSON).read_text())
    assert table["fusion_groups"] == [["q_proj", "k_proj", "v_proj"]]
    assert table["format_groups"] == groups
