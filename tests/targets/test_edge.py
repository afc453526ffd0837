"""The edge target (TensorRT Edge-LLM for a Jetson): its config rules, refused before any work, and the device
commands it writes, checked against Edge-LLM 0.11.0's own docs and sources (tests/data/upstream/edgellm.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_invoke, tiny_config
from upstream_facts import upstream

from pipeline import targets
from pipeline.config import load_config
from pipeline.engines.edgellm import device, env, target
from pipeline.errors import ConfigError, EnvironmentProblem
from pipeline.formats import EDGE_PLATFORMS

pytestmark = pytest.mark.unit

ORIN = REPO / "engine_configs" / "llama-3.2-1b-jetson-orin-edge.yaml"
SMOLLM2_EDGE = REPO / "engine_configs" / "smollm2-135m-edge.yaml"
FACTS = upstream("edgellm.json")


@pytest.mark.parametrize("path", [ORIN, SMOLLM2_EDGE], ids=lambda p: p.stem)
def test_the_orin_profiles_load_with_the_seeds_edge_settings(path):
    loaded = load_config(path)
    b, q = loaded.config.build, loaded.config.quantization
    assert b.target == "edge" and b.target_sm == 87
    assert (b.max_batch_size, b.max_seq_len, b.cuda_graphs.enabled) == (2, 512, False)  # the seeds' edge settings
    assert q.weight_format == "int4_awq" and q.kv_cache == "none" and q.export_hf_checkpoint
    assert "the edge target serves the HF unified checkpoint" in loaded.resolution.chosen[
        "quantization.export_hf_checkpoint"][1]


def test_the_platform_table_is_edgellms_support_matrix():
    orin = FACTS["platforms"]["value"]["jetson_orin"]
    platform = EDGE_PLATFORMS[orin["sm"]]
    assert platform.jetpack == orin["os_sdk"].split()[-1] and platform.edgellm_version == env.VERSION
    assert orin["precision_constraint"] == "FP16, INT8, and INT4 only"
    assert set(platform.weight_formats) == {"none", "int8_sq", "int4_awq"}  # FP16, INT8 SmoothQuant, INT4 AWQ
    assert "FP8" in orin["not_supported"] and platform.kv_formats == ("none",)  # FP8 KV needs SM 89
    assert "SM89" in json.dumps(FACTS["kv_cache"]["sources"])


@pytest.mark.parametrize("overrides,says", [
    (["quantization.weight_format=fp8", "quantization.kv_cache=none"],
     "quantization.weight_format fp8: Jetson Orin does not run it under TensorRT Edge-LLM 0.11.0; the formats that "
     "run there: none, int8_sq, int4_awq"),
    (["quantization.weight_format=w4a8_awq"], "Jetson Orin does not run it"),
    (["quantization.kv_cache=fp8"], "quantization.kv_cache fp8: Jetson Orin's KV cache under Edge-LLM is none"),
    (["quantization.kv_cache=int8"], "quantization.kv_cache"),
    (["build.target_sm=90"], "build.target_sm 90: the edge target builds for 87 (Jetson Orin)"),
    (["plan.rules=[{pattern: 'model.layers.0.*', format: int8_wo}]"], "plan.rules 'model.layers.0.*': int8_wo"),
    (["build.tensor_parallel_size=2"], "the edge target runs on one process"),
])
def test_what_orin_cannot_run_is_refused_at_load_naming_what_runs(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(SMOLLM2_EDGE, overrides)
    assert says in str(err.value)


def test_a_family_edgellm_lacks_is_refused_naming_the_targets_that_take_it(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "phi3"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3"}))
    with pytest.raises(ConfigError) as err:
        load_config(tiny_config(tmp_path, model_dir), ["build.target=edge", "build.target_sm=87",
                                                       "build.dtype=float16"])
    message = str(err.value)
    assert "the edge target cannot serve phi3" in message and "Llama 3.x, Qwen2/2.5 and Qwen3" in message
    assert "use build.target pytorch or cpu or vllm" in message


def test_a_missing_edgellm_environment_stops_before_any_work_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv(env.ENV_VAR, str(tmp_path / "no-such-python"))
    with pytest.raises(EnvironmentProblem, match="bash scripts/setup-env. creates .venv-edgellm"):
        target.preflight(load_config(SMOLLM2_EDGE))
    proc = run_invoke("build", "--config", str(SMOLLM2_EDGE), "--work-root", str(tmp_path / "work"),
                      env={env.ENV_VAR: str(tmp_path / "no-such-python")}, timeout=300)
    assert proc.returncode != 0 and "export environment is missing" in proc.stdout + proc.stderr
    assert not (tmp_path / "work" / "smollm2-135m-edge" / "model").exists()  # nothing ran


def test_verify_and_bench_are_the_devices_and_say_so(tmp_path):
    for task in ("verify", "bench"):
        proc = run_invoke(task, "--config", str(SMOLLM2_EDGE), "--work-root", str(tmp_path), timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "built and run on the device, not here" in out, out
        assert "build_engine.sh" in out and not (tmp_path / "smollm2-135m-edge" / "model").exists()
    proc = run_invoke("plan", "--config", str(ORIN), "--work-root", str(tmp_path), timeout=300)
    assert proc.returncode == 0 and "verify, bench, report: not on this machine" in proc.stdout


def test_no_server_image_or_manifests_here(tmp_path):
    for task in ("serve", "image", "deploy-manifests"):
        proc = run_invoke(task, "--config", str(SMOLLM2_EDGE), "--work-root", str(tmp_path), timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "target has no" in out and "device bundle" in out, (task, out)


def test_the_device_commands_use_only_edgellms_documented_flags():
    settings = {"max_batch_size": 2, "max_input_len": 384, "max_seq_len": 512, "max_new_tokens": 32}
    build = device.build_argv(settings)
    documented = set(FACTS["llm_build"]["value"]["flags_in_0_11_0_docs"])
    assert set(build[::2]) <= documented and "--onnxDir" in build[::2]
    assert dict(zip(build[::2], build[1::2]))["--maxBatchSize"] == "2"
    assert dict(zip(build[::2], build[1::2]))["--maxKVCacheCapacity"] == "512"
    assert "cuda" not in json.dumps(build).lower()  # no CUDA-graph flag exists (the facts' llm_build.cuda_graphs)
    run = device.inference_argv(settings)
    assert set(run[::2]) <= set(FACTS["llm_inference"]["value"]["flags_in_0_11_0_docs"])
    schema = FACTS["llm_inference"]["value"]["input_json"]
    prompts = device.prompts(settings, ["hello"])
    assert set(prompts) <= {*schema["required"], *schema["top_level_optional"]} and prompts["batch_size"] == 2
    assert set(prompts["requests"][0]) == {"messages"} and prompts["requests"][0]["messages"][0]["role"] == "user"
    cmake = FACTS["build_on_device"]["value"]["cmake_orin"]
    script = device.build_script(EDGE_PLATFORMS[87], settings)
    assert all(flag in script for flag in cmake), script


def test_the_read_back_comparison_finds_a_layer_off_the_plan():
    check = {"layers": {"a": {"format": "int4_awq", "codes_match": True, "scales_match": True},
                        "b": {"format": "high_precision", "codes_match": True},
                        "c": {"format": "int4_awq", "codes_match": True, "scales_match": False},
                        "d": {"format": None, "why": "no initializer holds it in the ONNX model"}}}
    formats, problems = target.compare(check, {"a": "int4_awq", "b": "int4_awq", "c": "int4_awq", "d": "int4_awq"})
    assert formats == {"a": "int4_awq", "b": "high_precision", "c": "int4_awq", "d": None}
    assert problems == ["b: the plan says int4_awq, the export holds high_precision",
                        "c: scales differ from the checkpoint's", "d: no initializer holds it in the ONNX model"]


def test_the_edge_target_is_registered_and_device_only():
    edge = targets.get("edge")
    assert edge.device_only and edge.serves_hf_checkpoint and edge.requirements(load_config(ORIN).config) == (
        targets.NEEDS_EDGELLM_ENV,)
    assert Path(REPO / ".gitignore").read_text().count(".venv-edgellm") == 1
