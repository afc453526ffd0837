"""The quantize stage on the embedded default (SmolLM2-135M): INT8 SmoothQuant with the plan's sensitive
layers kept in FP16 and an INT8 KV cache, behind the accuracy gate, exported as a TensorRT-LLM checkpoint."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_invoke
from safetensors import safe_open

# the default's stages run inside the first test's time (see test_build_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]
NAME = "smollm2-135m-cpu"


@pytest.fixture(scope="module")
def quantized(default_work_root):
    proc = run_invoke("quantize", "--work-root", str(default_work_root), timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return default_work_root / NAME


def test_checkpoint_says_what_the_plan_says(quantized):
    from pipeline.quant.recipe import trtllm_name

    ckpt = quantized / "quantize" / "trtllm_checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    q = config["quantization"]
    assert q["quant_algo"] == "W8A8_SQ_PER_CHANNEL" and q["kv_cache_quant_algo"] == "INT8"
    assert config["rotary_base"] == 100000.0 and config["mapping"]["world_size"] == 1
    plan = yaml.safe_load((quantized / "plan" / "plan.yaml").read_text())
    kept = {trtllm_name(n) for n, e in plan["layers"].items() if e["format"] == "high_precision"}
    with safe_open(str(ckpt / "rank0.safetensors"), framework="pt") as f:
        dtypes = {k[: -len(".weight")]: f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(".weight")}
    # SmolLM2 ties lm_head to the embedding: the checkpoint stores it once, as the embedding, in FP16
    assert config["share_embedding_table"] is True and "lm_head" not in dtypes
    assert dtypes["transformer.vocab_embedding"] == "F16"
    for module in kept - {"lm_head"}:
        assert dtypes[module] == "F16", module
    linears = [m for m in dtypes if ".attention." in m or ".mlp." in m]
    assert {dtypes[m] for m in linears if m not in kept} == {"I8"}
    assert "lm_head" in kept


def test_accuracy_is_within_the_configured_tolerance(quantized):
    summary = json.loads((quantized / "quantize" / "manifest.json").read_text())["summary"]
    acc = summary["accuracy"]
    assert acc["tokens"] == 16 * 255
    assert 0 < acc["perplexity_increase_pct"] <= 10 and acc["top1_agreement"] >= 0.8 and acc["kl_divergence"] <= 0.1
    assert 1 < acc["perplexity_original"] < 100  # a real trained model on real prose
    assert "quantized:" in (quantized / "quantize" / "generations.md").read_text()


def test_checkpoint_read_back_agrees_with_the_simulation(quantized):
    acc = json.loads((quantized / "quantize" / "manifest.json").read_text())["summary"]["accuracy"]
    ck = acc["from_checkpoint"]
    # the rebuilt model has no INT8 KV cache (the CPU runtime adds it): a little better, never far off
    assert abs(ck["perplexity_quantized"] / acc["perplexity_quantized"] - 1) < 0.02
    assert ck["top1_agreement"] >= 0.8 and ck["kl_divergence"] <= 0.1
