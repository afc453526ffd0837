"""The quantize stage on a tiny real Llama: ModelOpt calibration from the plan, the accuracy gate, and the
TensorRT-LLM checkpoint it exports (checked against the plan)."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors import safe_open

from pipeline.config import load_config
from pipeline.errors import InputError, StageFailed
from pipeline.runner import Runner
from pipeline.stages import STAGES

from conftest import tiny_config as _tiny_config

pytest.importorskip("modelopt.torch.quantization")


def _run(cfg, work, *overrides):
    said = []
    Runner(load_config(cfg, list(overrides)), STAGES, work).run(["quantize"], echo=said.append)
    return said


def _dtypes(ckpt):
    with safe_open(str(ckpt / "rank0.safetensors"), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_int8_sq_with_kept_layers_and_int8_kv(tmp_path, outlier_model_dir):
    cfg = _tiny_config(tmp_path, outlier_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "quantization.kv_cache=int8", "sensitivity.threshold=0.1",
         "quantization.accuracy.max_perplexity_increase_pct=50", "quantization.accuracy.min_top1_agreement=0.5",
         "quantization.accuracy.max_kl_divergence=1.0")
    out = work / "tiny" / "quantize"
    plan = yaml.safe_load((work / "tiny" / "plan" / "plan.yaml").read_text())
    kept = {n for n, e in plan["layers"].items() if e["format"] == "high_precision"}
    assert "lm_head" in kept
    ckpt = out / "trtllm_checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    q = config["quantization"]
    assert q["quant_algo"] == "W8A8_SQ_PER_CHANNEL" and q["kv_cache_quant_algo"] == "INT8"
    from pipeline.quantize import trtllm_name

    assert set(q["exclude_modules"]) == {trtllm_name(n) for n in kept}
    assert config["rotary_base"] == json.loads((outlier_model_dir / "config.json").read_text())["rope_theta"]
    dtypes = _dtypes(ckpt)
    assert dtypes["transformer.layers.0.mlp.proj.weight"] == "I8"
    assert dtypes["transformer.layers.0.attention.qkv.weight"] == "I8"
    assert dtypes["lm_head.weight"] == "F16"
    assert "transformer.layers.0.attention.kv_cache_scaling_factor" in dtypes
    for name in kept - {"lm_head"}:
        assert dtypes[trtllm_name(name) + ".weight"] == "F16"
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    acc = summary["accuracy"]
    assert acc["tokens"] == 2 * 63 and 0 <= acc["top1_agreement"] <= 1 and acc["kl_divergence"] >= 0
    assert acc["perplexity_original"] > 1 and acc["perplexity_quantized"] > 1
    assert (out / "generations.md").read_text().count("- quantized:") == 3


def test_fp8_with_fp8_kv(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "sensitivity.formats=[fp8]", "quantization.weight_format=fp8", "quantization.kv_cache=fp8",
         "quantization.accuracy.max_perplexity_increase_pct=50", "quantization.accuracy.min_top1_agreement=0.5")
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] == "FP8"
    assert _dtypes(ckpt)["transformer.layers.1.mlp.fc.weight"] == "F8_E4M3"


def test_accuracy_gate_fails_below_the_measured_loss_and_exports_nothing(tmp_path, outlier_model_dir):
    cfg = _tiny_config(tmp_path, outlier_model_dir)
    work = tmp_path / "work"
    with pytest.raises(StageFailed, match="accuracy gate failed.*Nothing was exported") as err:
        _run(cfg, work, "sensitivity.threshold=5", "quantization.accuracy.max_kl_divergence=0")
    assert "most sensitive layers still quantized" in str(err.value)
    assert not (work / "tiny" / "quantize").exists()


def test_awq_group_size_that_does_not_divide_is_refused_before_any_work(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    with pytest.raises(InputError, match="does not divide"):
        _run(cfg, tmp_path / "work", "sensitivity.formats=[int4_awq]", "quantization.weight_format=int4_awq", "quantization.awq_group_size=128",
             "quantization.kv_cache=none")


def test_a_plan_mixing_formats_is_refused_with_the_reason(tmp_path, tiny_model_dir):
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    with pytest.raises(InputError, match="mixes int8_sq with \\['int8_wo'\\].*not built yet"):
        _run(cfg, tmp_path / "work", "sensitivity.formats=[int8_sq, int8_wo]",
             "plan.rules=[{pattern: '*.down_proj', format: int8_wo}]")


def test_modelopt_config_disables_kept_layers_and_adds_kv_quantizers():
    from pipeline.config import QuantizationSection
    from pipeline.quantize import modelopt_config

    plan = {"layers": {"model.layers.0.mlp.down_proj": {"format": "high_precision"},
                       "model.layers.0.mlp.up_proj": {"format": "int8_sq"},
                       "lm_head": {"format": "high_precision"}}}
    cfg = modelopt_config(plan, QuantizationSection(weight_format="int8_sq", kv_cache="fp8", smoothquant_alpha=0.8))
    entries = cfg["quant_cfg"]
    assert {"quantizer_name": "model.layers.0.mlp.down_proj.*", "enable": False} in entries
    assert not any(e.get("quantizer_name", "").startswith("model.layers.0.mlp.up_proj") for e in entries)
    kv = [e for e in entries if e.get("quantizer_name") == "*[kv]_bmm_quantizer"]
    assert kv and kv[-1]["cfg"]["num_bits"] == (4, 3)
    assert cfg["algorithm"] == {"method": "smoothquant", "alpha": 0.8}
    awq = modelopt_config({"layers": {}}, QuantizationSection(weight_format="int4_awq", kv_cache="none",
                                                              awq_group_size=64))
    blocks = [e["cfg"]["block_sizes"] for e in awq["quant_cfg"] if isinstance(e.get("cfg"), dict)
              and "block_sizes" in e["cfg"]]
    assert blocks and all(b[-1] == 64 for b in blocks)


def test_checkpoint_read_back_computes_what_the_simulated_model_computes(tmp_path, outlier_model_dir):
    """Without a quantized KV cache the rebuilt model differs from ModelOpt's simulation only by the FP16
    storage of scales and kept weights: the same perplexity to a fraction of a percent."""
    cfg = _tiny_config(tmp_path, outlier_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "quantization.kv_cache=none", "quantization.accuracy.max_perplexity_increase_pct=50",
         "quantization.accuracy.min_top1_agreement=0.5", "quantization.accuracy.max_kl_divergence=1.0")
    summary = json.loads((work / "tiny" / "quantize" / "manifest.json").read_text())["summary"]
    acc = summary["accuracy"]
    assert acc["from_checkpoint"]["perplexity_quantized"] == pytest.approx(acc["perplexity_quantized"], rel=2e-3)
    facts = summary["checkpoint"]["read_back"]
    assert facts["quantized_linears"] + facts["high_precision_linears"] == 2 * 7


def test_reader_refuses_a_checkpoint_that_contradicts_the_plan(tmp_path, tiny_model_dir):
    from pipeline.checkpoint import rebuild
    from pipeline.errors import IntegrityError

    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "quantization.kv_cache=none", "quantization.accuracy.max_perplexity_increase_pct=50",
         "quantization.accuracy.min_top1_agreement=0.5", "quantization.accuracy.max_kl_divergence=1.0")
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    with pytest.raises(IntegrityError, match="model.layers.0.mlp.down_proj"):
        rebuild(ckpt, tiny_model_dir, kept={"lm_head", "model.layers.0.mlp.down_proj"})


def test_llama3_rope_fields_survive_the_export(tmp_path, tiny_tokenizer_dir):
    """transformers 5 loses rotary_base / rotary_scaling in this export; with the pinned 4.57 they must be
    there, and the stage checks them."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                         rope_theta=500000.0, rope_scaling=rope, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=2))
    model_dir = tmp_path / "llama3_tiny"
    model.save_pretrained(model_dir, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, model_dir / f.name)
    cfg = _tiny_config(tmp_path, model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "quantization.kv_cache=none", "quantization.accuracy.max_perplexity_increase_pct=50",
         "quantization.accuracy.min_top1_agreement=0.5", "quantization.accuracy.max_kl_divergence=1.0")
    config = json.loads((work / "tiny" / "quantize" / "trtllm_checkpoint" / "config.json").read_text())
    assert config["rotary_base"] == 500000.0
    scaling = config["rotary_scaling"]
    assert scaling["factor"] == 8.0 and scaling.get("rope_type", scaling.get("type")) == "llama3"
    assert scaling["original_max_position_embeddings"] == 256
