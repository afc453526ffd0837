"""lm-evaluation-harness tasks in the accuracy gate, on the tiny real Llama: a local multiple-choice task
(tests/data/lm_eval_tiny) scored on the original and the quantized model, its recovery gated, and a task that
cannot be found refused before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import tiny_config as _tiny_config

from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError, StageFailed
from pipeline.runner import Runner
from pipeline.stages import STAGES

pytest.importorskip("modelopt.torch.quantization")
pytest.importorskip("lm_eval")

TASK_DIR = Path(__file__).resolve().parent.parent / "data" / "lm_eval_tiny"
LOOSE = ("quantization.accuracy.max_perplexity_increase_pct=1000", "quantization.accuracy.min_top1_agreement=0",
         "quantization.accuracy.max_kl_divergence=100", "quantization.greedy_generations=false")


def _tasks(name="tiny_facts", path=TASK_DIR, **extra):
    entry = {"name": name, **({"path": str(path)} if path is not None else {}), **extra}
    return f"quantization.accuracy.tasks=[{json.dumps(entry)}]"


def _run(cfg, work, *overrides):
    Runner(load_config(cfg, list(overrides)), STAGES, work).run(["quantize"], echo=lambda _: None)


def _lm_eval_score(model_dir: Path) -> float:
    """What lm-eval itself computes for the task on the model as the quantize stage loads it (float32, CPU)."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), batch_size=4)
    tm = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    cwd = os.getcwd()
    os.chdir(TASK_DIR)  # the task's YAML names its data file relative to its folder
    try:
        res = simple_evaluate(model=lm, tasks=["tiny_facts"], task_manager=tm, bootstrap_iters=0, log_samples=False)
    finally:
        os.chdir(cwd)
    assert res is not None
    return res["results"]["tiny_facts"]["acc,none"]


def test_task_scores_are_recorded_and_an_unmeetable_recovery_fails_the_gate(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, *LOOSE, _tasks(), "quantization.accuracy.min_task_recovery=0.01")
    out = work / "tiny" / "quantize"
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    (row,) = summary["accuracy"]["tasks"]
    assert row["task"] == "tiny_facts" and row["metric"] == "acc,none" and row["samples"] == 20
    assert row["original"] == _lm_eval_score(tiny_model_dir)
    assert 0 <= row["quantized"] <= 1
    assert row["recovery"] == float(f"{row['quantized'] / row['original']:.6g}")
    assert json.loads((out / "accuracy.json").read_text())["accuracy"]["tasks"] == [row]
    assert summary["timing_s"]["lm_eval_tasks"] > 0

    unmeetable = min(2.0, round(row["recovery"] + 0.01, 2))  # 1.01 where the scores are equal
    with pytest.raises(StageFailed, match=rf"accuracy gate failed: .*tiny_facts acc,none recovery "
                                          rf"{row['recovery']} < {unmeetable}"):
        _run(cfg, work, *LOOSE, _tasks(), f"quantization.accuracy.min_task_recovery={unmeetable}")


def test_a_missing_task_folder_is_a_config_error(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError, match=r"task 'tiny_facts': no such folder .*nowhere"):
        load_config(cfg, [_tasks(path=tmp_path / "nowhere")])


def test_a_task_not_in_its_folder_is_refused_before_any_work(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    with pytest.raises(InputError, match=r"no lm-eval task named 'tiny_fact' in the folder .*lm_eval_tiny "
                                         r"\(tasks there: tiny_facts\); close names: tiny_facts"):
        _run(cfg, work, _tasks(name="tiny_fact"))
    assert not (work / "tiny").exists()  # the preflight stopped it: no stage ran


def test_an_unknown_registered_task_is_refused_before_any_work(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    with pytest.raises(InputError, match=r"no lm-eval task named 'arc_easiest' in lm-eval's registered tasks"):
        _run(cfg, work, _tasks(name="arc_easiest", path=None, dataset_revision="0" * 40))
    assert not (work / "tiny").exists()


def test_task_source_and_layer_streaming_are_checked_at_load(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError, match="set exactly one of path .* or dataset_revision"):
        load_config(cfg, [_tasks(path=None)])
    with pytest.raises(ConfigError, match="layer_streaming: always holds one decoder layer at a time"):
        load_config(cfg, [_tasks(), "compute.layer_streaming=always"])
