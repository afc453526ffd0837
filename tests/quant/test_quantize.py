"""The quantize stage on a tiny real Llama: ModelOpt calibration from the plan (one format or mixed), the
accuracy gate, the TensorRT-LLM checkpoint it exports (one rank or two) and the HF unified checkpoint, each
checked against the plan; and the rules refused before any work."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import tiny_config as _tiny_config
from safetensors import safe_open
from upstream_facts import UPSTREAM

from pipeline import records
from pipeline.config import load_config
from pipeline.errors import InputError, StageFailed
from pipeline.runner import Runner
from pipeline.stages import STAGES

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
    from pipeline.quant.recipe import trtllm_name

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
         "quantization.accuracy.max_perplexity_increase_pct=50", "quantization.accuracy.min_top1_agreement=0.5",
         "quantization.greedy_generations=false")
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8" and q["kv_cache_quant_algo"] == "FP8"
    assert _dtypes(ckpt)["transformer.layers.1.mlp.fc.weight"] == "F8_E4M3"
    generations = (work / "tiny" / "quantize" / "generations.md").read_text()
    assert "Not run (quantization.greedy_generations: false)" in generations and "- quantized:" not in generations


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
        _run(cfg, tmp_path / "work", "sensitivity.formats=[int4_awq]", "quantization.weight_format=int4_awq",
             "quantization.awq_group_size=128", "quantization.kv_cache=none")


LOOSE = ("quantization.accuracy.max_perplexity_increase_pct=1000", "quantization.accuracy.min_top1_agreement=0",
         "quantization.accuracy.max_kl_divergence=100")


def test_a_mixed_plan_exports_mixed_precision_listing_exactly_the_plans_layers(tmp_path, tiny_model_dir):
    """INT4 AWQ everywhere, INT8 SmoothQuant on layer 1's attention and down_proj (plan rules), lm_head kept:
    MIXED_PRECISION, and quant_cfg.json lists each quantized GEMM with its format (q/k/v as one qkv)."""
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "sensitivity.formats=[int4_awq, int8_sq]", "quantization.weight_format=int4_awq",
         "quantization.awq_group_size=32", "quantization.kv_cache=int8", "sensitivity.threshold=5",
         "plan.rules=[{pattern: lm_head, keep_high_precision: true}, "
         "{pattern: 'model.layers.1.self_attn.[qkv]_proj', format: int8_sq}, "
         "{pattern: 'model.layers.1.mlp.down_proj', format: int8_sq}, "
         "{pattern: 'model.layers.0.mlp.up_proj', keep_high_precision: true}]", *LOOSE)
    from pipeline.quant.recipe import trtllm_name

    plan = yaml.safe_load((work / "tiny" / "plan" / "plan.yaml").read_text())
    assert plan["summary"]["mixed_precision"]
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "INT8"}
    listed = json.loads((ckpt / "quant_cfg.json").read_text())["quantized_layers"]
    want = {trtllm_name(n): e["format"] for n, e in plan["layers"].items() if e["format"] != "high_precision"}
    assert set(listed) == set(want) and len(listed) == 2 * 5 - 1  # qkv, dense, fc, gate, proj; one gate kept
    algo = {"int4_awq": "W4A16_AWQ", "int8_sq": "W8A8_SQ_PER_CHANNEL"}
    assert {m: e["quant_algo"] for m, e in listed.items()} == {m: algo[f] for m, f in want.items()}
    assert listed["transformer.layers.0.mlp.fc"]["group_size"] == 32
    assert "transformer.layers.0.mlp.gate" not in listed and "lm_head" not in listed
    dtypes = _dtypes(ckpt)
    assert dtypes["transformer.layers.0.mlp.gate.weight"] == "F16"
    assert dtypes["transformer.layers.1.attention.qkv.weight"] == "I8"
    assert "transformer.layers.1.attention.qkv.activation_scaling_factor" in dtypes
    assert "transformer.layers.0.attention.qkv.activation_scaling_factor" not in dtypes  # W4A16: fp16 inputs
    summary = json.loads((work / "tiny" / "quantize" / "manifest.json").read_text())["summary"]
    assert summary["checkpoint"]["quant_cfg_layers"] == 9
    assert summary["checkpoint"]["read_back"]["formats"] == {"W4A16_AWQ": 9, "W8A8_SQ_PER_CHANNEL": 4}
    acc = summary["accuracy"]
    # the export gives q/k/v one AWQ pre-quant scale; the rebuilt model holds that, the simulation does not
    assert acc["from_checkpoint"]["perplexity_quantized"] == pytest.approx(acc["perplexity_quantized"], rel=2e-2)


def test_the_hf_unified_checkpoint_is_written_from_a_fresh_copy_and_says_what_the_plan_says(tmp_path,
                                                                                           outlier_model_dir):
    cfg = _tiny_config(tmp_path, outlier_model_dir)
    work = tmp_path / "work"
    _run(cfg, work, "quantization.export_hf_checkpoint=true", "quantization.kv_cache=fp8",
         "sensitivity.threshold=0.1", "plan.decision_format=int8_w8a8", *LOOSE)
    out = work / "tiny" / "quantize"
    plan = yaml.safe_load((work / "tiny" / "plan" / "plan.yaml").read_text())
    kept = {n for n, e in plan["layers"].items() if e["format"] == "high_precision"}
    assert "lm_head" in kept and len(kept) > 1
    hf = out / "hf_checkpoint"
    q = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "W8A8_SQ_PER_CHANNEL" and q["kv_cache_quant_algo"] == "FP8"
    import fnmatch

    excluded = {n for pat in q["exclude_modules"] for n in plan["layers"] if fnmatch.fnmatchcase(n, pat)}
    assert excluded == kept
    from transformers import AutoConfig, AutoTokenizer

    parsed = AutoConfig.from_pretrained(hf)  # transformers 4.57 reads it
    assert parsed.quantization_config["quant_method"] == "modelopt" and parsed.model_type == "llama"
    assert AutoTokenizer.from_pretrained(hf)("quantization").input_ids
    with safe_open(str(next(hf.glob("*.safetensors"))), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == "I8" and dtypes["lm_head.weight"] == "F16"
    assert "model.layers.0.self_attn.k_proj.k_scale" in dtypes
    # the TensorRT-LLM checkpoint beside it is untouched by the HF export (it ran on its own copy)
    trtllm = json.loads((out / "trtllm_checkpoint" / "config.json").read_text())["quantization"]
    assert trtllm["kv_cache_quant_algo"] == "FP8"
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert summary["hf_checkpoint"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    # read back by the HF reader (tests/quant/test_hf_checkpoint.py) and gated: every quantized layer, both KV scales
    # of both layers; the same figures as the TensorRT-LLM checkpoint's read-back, to the resmoothing of gate/up
    read = summary["hf_checkpoint"]["read_back"]
    assert read["formats"] == {"W8A8_SQ_PER_CHANNEL": len(plan["layers"]) - len(kept)}
    assert read["kv_cache_scales"] == 2 * 2
    with safe_open(str(next(hf.glob("*.safetensors"))), framework="pt") as f:
        k = max(float(f.get_tensor(f"model.layers.{i}.self_attn.k_proj.k_scale")) for i in range(2))
        v = max(float(f.get_tensor(f"model.layers.{i}.self_attn.v_proj.v_scale")) for i in range(2))
    assert summary["hf_checkpoint"]["kv_scales_max"] == {"k_scale": k, "v_scale": v, "layers_over_unit_scale": 0}
    acc = summary["accuracy"]
    assert acc["from_hf_checkpoint"]["perplexity_quantized"] == pytest.approx(
        acc["from_checkpoint"]["perplexity_quantized"], rel=2e-2)
    assert acc["from_hf_checkpoint"]["top1_agreement"] >= 0.9


def test_the_pytorch_target_refuses_keys_its_unit_scale_fp8_kv_cache_cannot_hold(tmp_path, tiny_model_dir,
                                                                                  tiny_tokenizer_dir):
    """TensorRT-LLM 1.2's PyTorch backend keeps an FP8 KV cache at scale 1.0 (tests/data/upstream/
    pytorch_kv_cache_scales.json): layer 1's k_proj made 20000 times larger puts its keys far past FP8's 448, which
    calibration sees (k_scale = amax / 448 > 1); quantize for the pytorch target stops, naming the layer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.quant.export_checks import PYTORCH_FP8_KV_SCALE
    from pipeline.quant.quant_math import FP8_MAX

    upstream = json.loads((UPSTREAM / "pytorch_kv_cache_scales.json").read_text())
    assert (PYTORCH_FP8_KV_SCALE, FP8_MAX) == (upstream["fp8_kv_scale_served"], upstream["fp8_e4m3_max"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(20000.0)
    big = tmp_path / "big_keys"
    model.save_pretrained(big, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, big / f.name)
    cfg = _tiny_config(tmp_path, big)
    with pytest.raises(StageFailed, match=r"scale 1.0 .*larger keys or values in 1 layer\(s\) \(layer 1: K amax "
                                          r"[0-9]{4,}.*quantization.kv_cache: none, or with build.target: tensorrt"):
        _run(cfg, tmp_path / "work", "build.target=pytorch", "quantization.export_hf_checkpoint=true",
             "quantization.kv_cache=fp8", *LOOSE)


def test_tensor_parallel_2_writes_two_ranks_that_read_back_to_the_tp1_logits(tmp_path, tiny_model_dir):
    """4 heads / 2 KV heads split over 2 ranks; the reader joins the ranks into the model TP=1 gives, to float16
    rounding (the same calibration, the same FP16 values in different files)."""
    import torch

    from pipeline.quant.checkpoint import rebuild

    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    # INT8 weight-only keeps the two runs quick; INT4 AWQ and mixed plans over two ranks are read back in
    # tests/quant/test_checkpoint.py
    common = ("build.target=tensorrt", "sensitivity.formats=[int8_wo]", "quantization.weight_format=int8_wo",
              "quantization.kv_cache=int8", *LOOSE)
    _run(cfg, work, "build.tensor_parallel_size=2", *common)
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["mapping"]["world_size"] == config["mapping"]["tp_size"] == 2
    assert sorted(p.name for p in ckpt.glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    two, facts = rebuild(ckpt, tiny_model_dir)
    assert facts["tp_size"] == 2
    with torch.no_grad():
        logits_tp2 = two(ids).logits
    _run(cfg, work, "build.tensor_parallel_size=1", *common)  # only the quantize stage reruns
    one, _ = rebuild(ckpt, tiny_model_dir)
    with torch.no_grad():
        logits_tp1 = one(ids).logits
    assert torch.allclose(logits_tp1, logits_tp2, rtol=0, atol=1e-3 * float(logits_tp1.abs().max()))


def _plan(layers: dict) -> records.Plan:
    return records.Plan.model_validate({"format_version": records.PLAN_FORMAT_VERSION, "layers": layers})


def _rules(plan_layers: dict, table: dict, model_config=None, **quant):
    from pipeline.config import BuildSection, QuantizationSection
    from pipeline.quant.export_checks import check_rules

    tp = quant.pop("tp", 1)
    check_rules(_plan(plan_layers), QuantizationSection(**quant),
                BuildSection(target="tensorrt", tensor_parallel_size=tp),
                model_config or {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3}, table)


def test_awq_group_size_rule_names_the_sizes_that_divide_576():
    layers = {"model.layers.0.self_attn.o_proj": {"format": "int4_awq"}}
    table = {"model.layers.0.self_attn.o_proj": {"in_features": 576}}
    with pytest.raises(InputError, match="awq_group_size 128 does not divide its input width 576; use 64 or 32"):
        _rules(layers, table, weight_format="int4_awq", awq_group_size=128, kv_cache="none")
    _rules(layers, table, weight_format="int4_awq", awq_group_size=64, kv_cache="none")
    # a row-parallel layer is split on its input: each rank's 576 / 3 = 192 must hold whole groups
    with pytest.raises(InputError, match=r"576 split over 3 ranks \(192 per rank\); use 64 or 32"):
        _rules(layers, table, weight_format="int4_awq", awq_group_size=128, kv_cache="none", tp=3)


def test_tensor_parallel_size_must_divide_heads_and_kv_heads():
    with pytest.raises(InputError, match=r"tensor_parallel_size 2 must divide the attention heads \(9\) and KV "
                                         r"heads \(3\); valid: \[1, 3\]"):
        _rules({}, {}, tp=2)
    with pytest.raises(InputError, match=r"valid: \[1, 2\]"):
        _rules({}, {}, {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 2}, tp=4)
    _rules({}, {}, tp=3)


def test_layers_fused_in_the_checkpoint_must_share_a_format():
    qkv = {"model.layers.0.self_attn.q_proj": {"format": "int8_sq"},
           "model.layers.0.self_attn.k_proj": {"format": "int8_wo"},
           "model.layers.0.self_attn.v_proj": {"format": "int8_sq"}}
    with pytest.raises(InputError, match="q/k/v of model.layers.0.self_attn have different formats"):
        _rules(qkv, {})
    gate_up = {"model.layers.0.mlp.gate_proj": {"format": "int8_sq"},
               "model.layers.0.mlp.up_proj": {"format": "high_precision"}}
    _rules(gate_up, {}, kv_cache="fp8")  # separate GEMMs in the TensorRT-LLM checkpoint
    with pytest.raises(InputError, match="gate/up of model.layers.0.mlp have different formats"):
        _rules(gate_up, {}, kv_cache="fp8", export_hf_checkpoint=True)  # one in the HF unified checkpoint
    fp8 = {"model.layers.0.mlp.gate_proj": {"format": "fp8"},
           "model.layers.0.mlp.up_proj": {"format": "high_precision"}}
    with pytest.raises(InputError, match="gate/up of model.layers.0.mlp"):
        _rules(fp8, {}, weight_format="fp8")  # TensorRT-LLM fuses gate/up for FP8


def test_int8_kv_with_an_hf_unified_checkpoint_and_gpu_only_formats_are_refused_by_the_config(tmp_path,
                                                                                             tiny_model_dir):
    from pipeline.errors import ConfigError

    cfg = _tiny_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError, match="INT8 KV cache cannot be exported as an HF unified checkpoint"):
        load_config(cfg, ["quantization.kv_cache=int8", "quantization.export_hf_checkpoint=true"])
    for fmt in ("nvfp4", "mxfp8"):
        with pytest.raises(ConfigError, match=f"{fmt} needs a GPU: ModelOpt quantizes NVFP4 and MX formats only "
                                              f"with CUDA"):
            load_config(cfg, [f"quantization.weight_format={fmt}"])


def test_modelopt_config_for_a_mixed_plan_gives_each_layer_its_format_and_each_algorithm_its_layers():
    from pipeline.config import QuantizationSection
    from pipeline.quant.recipe import calibration_phases, modelopt_config

    plan = _plan({"model.layers.0.mlp.down_proj": {"format": "int8_sq"},
                  "model.layers.0.mlp.up_proj": {"format": "int4_awq"},
                  "model.layers.0.mlp.gate_proj": {"format": "int8_wo"},
                  "lm_head": {"format": "high_precision"}})
    quant = QuantizationSection(weight_format="int4_awq", kv_cache="int8", awq_group_size=32, smoothquant_alpha=0.8)
    cfg = modelopt_config(plan, quant)
    entries = cfg["quant_cfg"]
    assert cfg["algorithm"] == "max"
    down = [e for e in entries if e["quantizer_name"].startswith("model.layers.0.mlp.down_proj.")]
    assert {e["quantizer_name"]: e["cfg"]["num_bits"] for e in down} == {
        "model.layers.0.mlp.down_proj.weight_quantizer": 8, "model.layers.0.mlp.down_proj.input_quantizer": 8}
    gate = {e["quantizer_name"]: e for e in entries if e["quantizer_name"].startswith("model.layers.0.mlp.gate_proj.")}
    assert gate["model.layers.0.mlp.gate_proj.input_quantizer"]["enable"] is False
    assert not any(e["quantizer_name"].startswith("model.layers.0.mlp.up_proj") for e in entries)  # the base
    assert entries.index(down[0]) > max(i for i, e in enumerate(entries) if e["quantizer_name"] == "*input_quantizer")
    phases = calibration_phases(plan, quant)
    assert [(a if isinstance(a, str) else a["method"], layers) for a, layers in phases] == [
        ("awq_lite", ["model.layers.0.mlp.up_proj"]), ("smoothquant", ["model.layers.0.mlp.down_proj"])]
    assert phases[1][0]["alpha"] == 0.8
    single = _plan({"model.layers.0.mlp.up_proj": {"format": "int4_awq"}})
    assert calibration_phases(single, quant) == []


def test_modelopt_config_disables_kept_layers_and_adds_kv_quantizers():
    from pipeline.config import QuantizationSection
    from pipeline.quant.recipe import modelopt_config

    plan = _plan({"model.layers.0.mlp.down_proj": {"format": "high_precision"},
                  "model.layers.0.mlp.up_proj": {"format": "int8_sq"},
                  "lm_head": {"format": "high_precision"}})
    cfg = modelopt_config(plan, QuantizationSection(weight_format="int8_sq", kv_cache="fp8", smoothquant_alpha=0.8))
    entries = cfg["quant_cfg"]
    assert {"quantizer_name": "model.layers.0.mlp.down_proj.*", "enable": False} in entries
    assert not any(e.get("quantizer_name", "").startswith("model.layers.0.mlp.up_proj") for e in entries)
    kv = [e for e in entries if e.get("quantizer_name") == "*[kv]_bmm_quantizer"]
    assert kv and kv[-1]["cfg"]["num_bits"] == (4, 3)
    assert cfg["algorithm"] == {"method": "smoothquant", "alpha": 0.8}
    awq = modelopt_config(_plan({}), QuantizationSection(weight_format="int4_awq", kv_cache="none",
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
    assert facts["quantized_linears"] + facts["high_precision_linears"] == 2 * 7 + 1  # and lm_head


def test_reader_refuses_a_checkpoint_that_contradicts_the_plan(tmp_path, tiny_model_dir):
    from pipeline.errors import IntegrityError
    from pipeline.quant.checkpoint import rebuild

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


@pytest.mark.e2e
@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_mixed_int4_int8_config_on_smollm2_exports_mixed_precision(default_work_root):
    """engine_configs/smollm2-135m-cpu-int4-mixed.yaml: INT4 AWQ (group 64) with INT8 weight-only where the
    budget allows, behind the accuracy gate; quant_cfg.json lists exactly the plan's quantized GEMMs."""
    from conftest import REPO, run_invoke

    from pipeline.quant.recipe import trtllm_name

    proc = run_invoke("quantize", "--config", str(REPO / "engine_configs" / "smollm2-135m-cpu-int4-mixed.yaml"),
                      "--work-root", str(default_work_root), timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = default_work_root / "smollm2-135m-cpu-int4-mixed"
    plan = yaml.safe_load((work / "plan" / "plan.yaml").read_text())
    ckpt = work / "quantize" / "trtllm_checkpoint"
    assert json.loads((ckpt / "config.json").read_text())["quantization"]["quant_algo"] == "MIXED_PRECISION"
    listed = json.loads((ckpt / "quant_cfg.json").read_text())["quantized_layers"]
    algo = {"int4_awq": "W4A16_AWQ", "int8_wo": "W8A16"}
    want = {trtllm_name(n): algo[e["format"]] for n, e in plan["layers"].items() if e["format"] != "high_precision"}
    assert {m: e["quant_algo"] for m, e in listed.items()} == want
    acc = json.loads((work / "quantize" / "manifest.json").read_text())["summary"]["accuracy"]
    assert abs(acc["from_checkpoint"]["perplexity_quantized"] / acc["perplexity_quantized"] - 1) < 0.02


def test_weight_format_none_exports_the_unquantized_baseline(tmp_path, tiny_model_dir):
    """The baseline bench compares against: same config, nothing quantized, nothing gated, every layer F16."""
    cfg = _tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work"
    # the KV cache follows the weights when the config leaves it unset (pipeline/autoconfig.py); set otherwise, refused
    assert load_config(cfg, ["quantization.weight_format=none"]).config.quantization.kv_cache == "none"
    with pytest.raises(Exception, match="set kv_cache: none"):
        load_config(cfg, ["quantization.weight_format=none", "quantization.kv_cache=int8"])
    _run(cfg, work, "quantization.weight_format=none", "quantization.kv_cache=none")
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q["quant_algo"] is None and q["kv_cache_quant_algo"] is None and not q.get("exclude_modules")
    assert {d for k, d in _dtypes(ckpt).items() if k.endswith(".weight")} == {"F16"}
    acc = json.loads((work / "tiny" / "quantize" / "manifest.json").read_text())["summary"]["accuracy"]
    assert acc["perplexity_increase_pct"] == 0 and acc["top1_agreement"] == 1
    # read back: only the fp16 storage separates it from the fp32 original
    assert abs(acc["from_checkpoint"]["perplexity_increase_pct"]) < 0.5
