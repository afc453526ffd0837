"""The edge target's host side for real: `invoke publish` on a tiny Llama runs quantize, TensorRT Edge-LLM 0.11.0's
own export (in .venv-edgellm) and the read-back, then hands over the device bundle. Asserts on what the export
holds: onnx.checker's verdict, its inputs and outputs, and every linear's format, codes and scales against the
quantize stage's checkpoint and the plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import run_invoke, tiny_config
from upstream_facts import upstream

from pipeline import artifacts
from pipeline.engines.edgellm import env, target
from pipeline.errors import EnvironmentProblem
from pipeline.procs import foreign_python_env

FACTS_COMMIT = upstream("edgellm.json")["platforms"]["sources"][0]["generated_from_commit"]  # the 0.11.0 docs' source
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.fixture(scope="module")
def edge_python() -> str:
    try:
        return env.export_python()
    except EnvironmentProblem as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def chat_model_dir(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights, every linear's sides multiples of 64 (Edge-LLM's INT4 plugin needs it:
    tests/data/upstream/edgellm.json int4_alignment), and a chat template (its export writes the model's template
    for the runtime)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("tiny_chat_model")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def edge_overrides(weight_format: str) -> list[str]:
    sets = ["build.target=edge", "build.target_sm=87", "build.dtype=float16", "build.max_batch_size=2",
            "build.max_input_len=64", "build.max_seq_len=128", "build.max_num_tokens=128", "bench.concurrency=[1,2]",
            f"quantization.weight_format={weight_format}", "quantization.accuracy.max_perplexity_increase_pct=100",
            "quantization.accuracy.min_top1_agreement=0", "quantization.accuracy.max_kl_divergence=10"]
    if weight_format == "int4_awq":
        sets += ["quantization.awq_group_size=64", "sensitivity.formats=[int4_awq]", "plan.decision_format=null",
                 "sensitivity.threshold=0.2"]
    return [x for s in sets for x in ("--set", s)]


@pytest.mark.parametrize("weight_format", ["int4_awq", "int8_sq"])
def test_publish_exports_with_edgellm_and_reads_the_plans_formats_back(tmp_path, chat_model_dir, edge_python,
                                                                        weight_format):
    cfg = tiny_config(tmp_path, chat_model_dir)
    work_root = tmp_path / "work"
    proc = run_invoke("publish", "--config", str(cfg), "--work-root", str(work_root), *edge_overrides(weight_format),
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    work = work_root / "tiny"
    check = json.loads((work / "build" / artifacts.EDGE_CHECK_FILE).read_text())
    assert check["checker"] == "ok"
    plan = yaml.safe_load((work / "plan" / artifacts.PLAN_FILE).read_text())["layers"]
    # every linear in the format the plan gave it, its codes and scales the checkpoint's own
    assert check["formats"] == {name: plan.get(name, {"format": "high_precision"})["format"]
                                for name in check["layers"]}
    assert check["formats"]["lm_head"] == "high_precision"  # the config's rule
    assert weight_format in check["formats"].values()
    for name, layer in check["layers"].items():
        assert layer["codes_match"] and layer.get("scales_match", True), (name, layer)
    if weight_format == "int4_awq":  # k/v rows padded to the INT4 kernel's tile with zero codes
        assert "Int4GroupwiseGemmPluginV2" in check["custom_ops"]
        assert check["layers"]["model.layers.0.self_attn.k_proj"]["padding_codes"] > 0
    # Edge-LLM's own reading of the checkpoint agrees: the kept layers are excluded, no FP8 KV on Orin
    assert check["edgellm"]["quant_type"] == {"int4_awq": "int4_awq_modelopt", "int8_sq": "int8_sq"}[weight_format]
    assert "lm_head" in check["edgellm"]["excluded"] and check["edgellm"]["kv_cache_quant"] is None
    # inputs and outputs: logits over the vocabulary, one FP16 paged KV cache per layer
    outputs = {o["name"]: o for o in check["outputs"]}
    assert outputs["logits"]["shape"][-1] == 512 and outputs["logits"]["elem_type"] == "FLOAT"
    kv = [i for i in check["inputs"] if i["name"].startswith("past_key_values_")]
    assert len(kv) == 2 and {i["elem_type"] for i in kv} == {"FLOAT16"}
    assert check["runtime_config"]["kv_cache_dtype"] == "fp16" and check["runtime_config"]["model"] == "llama"

    bundle = work / "publish" / artifacts.EDGE_BUNDLE_DIR
    manifest = json.loads((bundle / artifacts.EDGE_MANIFEST_FILE).read_text())
    assert (manifest["platform"], manifest["jetpack"], manifest["tensorrt_edgellm"]) == ("Jetson Orin", "7.2",
                                                                                         "0.11.0")
    assert manifest["engine"] == {"max_batch_size": 2, "max_input_len": 64, "max_kv_cache_capacity": 128,
                                  "cuda_graphs": False, "kv_cache_dtype": "fp16"}
    assert manifest["layer_formats"] == check["formats"]
    build_sh = (bundle / artifacts.EDGE_BUILD_SCRIPT).read_text()
    assert "--maxBatchSize 2 --maxInputLen 64 --maxKVCacheCapacity 128" in build_sh
    assert "-DEMBEDDED_TARGET=jetson-orin" in build_sh and FACTS_COMMIT in build_sh
    for name in ("model.onnx", "model.onnx.data", "config.json", "embedding.safetensors", "chat_template.jinja",
                 "tokenizer.json"):
        assert (bundle / artifacts.EDGE_ONNX_DIR / "llm" / name).is_file(), name
    # no Triton repository for a device-only target
    assert not (work / artifacts.DEFAULT_REPOSITORY_DIR).exists()
    if weight_format == "int4_awq":
        planted_changes_are_found(edge_python, bundle / artifacts.EDGE_ONNX_DIR / "llm", work, tmp_path)


# In Edge-LLM's environment (onnx is not in the pipeline's): one INT4 code flipped, one group scale doubled and one
# FP16 lm_head weight moved, the model saved elsewhere with its weights as external data
PLANT = """
import shutil, sys
import onnx
from onnx import numpy_helper
src, dst = sys.argv[1], sys.argv[2]
model = onnx.load(src + "/model.onnx", load_external_data=True)
for t in model.graph.initializer:
    a = numpy_helper.to_array(t).copy()
    if t.name == "_model.model.layers.0.mlp.down_proj.weight":
        a.view("uint8").flat[0] ^= 0x01
    elif t.name == "_model.model.layers.0.mlp.gate_proj.weight_scale":
        a *= 2
    elif t.name == "_model.lm_head.weight":
        a.flat[0] += 1
    else:
        continue
    t.CopyFrom(numpy_helper.from_array(a, t.name))
onnx.save_model(model, dst + "/model.onnx", save_as_external_data=True, location="model.onnx.data")
shutil.copy(src + "/config.json", dst + "/config.json")
"""


def planted_changes_are_found(edge_python: str, onnx_dir: Path, work: Path, tmp_path: Path) -> None:
    """The read-back is a check only if it fails: each planted change is reported, and the build would refuse it."""
    import subprocess

    planted = tmp_path / "planted"
    planted.mkdir()
    subprocess.run([edge_python, "-c", PLANT, str(onnx_dir), str(planted)], check=True, capture_output=True,
                   env=foreign_python_env(), timeout=300)
    check = target.read_back(edge_python, planted / "model.onnx", work / "quantize" / artifacts.HF_CHECKPOINT_DIR,
                             tmp_path / "read_back.log")
    layers = check["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["codes_match"] is False
    assert layers["model.layers.0.mlp.gate_proj"]["scales_match"] is False
    assert not layers["lm_head"].get("codes_match")
    plan = yaml.safe_load((work / "plan" / artifacts.PLAN_FILE).read_text())["layers"]
    _, problems = target.compare(check, {name: layer["format"] for name, layer in plan.items()})
    assert len(problems) == 3, problems


def test_a_model_without_a_chat_template_is_refused_before_the_export(tmp_path, tiny_model_dir, edge_python):
    cfg = tiny_config(tmp_path, tiny_model_dir)
    proc = run_invoke("build", "--config", str(cfg), "--work-root", str(tmp_path / "work"),
                      *edge_overrides("int8_sq"), timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "has no chat template" in out, out[-3000:]
    assert not (tmp_path / "work" / "tiny" / "build").exists()  # the failed stage left nothing in place


def test_int4_layers_the_plugin_cannot_take_are_refused_naming_them(tmp_path, tiny_model_dir, edge_python):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)  # 64 wide, its k/v projections 32 rows: not 64-aligned
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    proc = run_invoke("build", "--config", str(tiny_config(tmp_path, model_dir)), "--work-root",
                      str(tmp_path / "work"), *edge_overrides("int4_awq"), timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "not 64-aligned" in out and "model.layers.0.self_attn.k_proj (32 x 64)" in out, \
        out[-3000:]
    assert not (tmp_path / "work" / "tiny" / "build").exists()
