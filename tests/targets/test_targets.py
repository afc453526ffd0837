"""Build targets as plugins (pipeline/targets/): the registry is the one place that knows a target by name, every
target answers the interface the stages ask, its entry points resolve, and a config that the model's family and
the target constrain is completed from those constraints (pipeline/autoconfig.py), every conflict refused at load,
before any stage runs."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, tiny_config

from pipeline import autoconfig, families, targets
from pipeline.config import load_config
from pipeline.errors import ConfigError

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


def _name_comparisons(path: Path) -> list[str]:
    """`x == "vllm"`, `x in ("cpu", "vllm")` and the like in one module: a comparison of a value with a
    registered target's name."""
    names = set(targets.names())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = set()
        for op in operands:
            items = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
            literals |= {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        text = ast.unparse(node)
        if literals & names and "target" in text:
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
            found.append(f"{where}:{node.lineno}: {text}")
    return found


def test_no_code_outside_the_registry_compares_a_targets_name():
    """The stages ask the target (pipeline.targets.get(name)) what differs; only pipeline/targets/ knows names."""
    files = [p for p in (REPO / "pipeline").rglob("*.py") if "targets" not in p.relative_to(REPO).parts[1:2]]
    files += list((REPO / "triton_repo").rglob("*.py")) + [REPO / "tasks.py"]
    found = [hit for p in files for hit in _name_comparisons(p)]
    assert found == [], "\n".join(found)


def test_the_scan_finds_a_planted_comparison(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(cfg):\n    return cfg.build.target in ('cpu', 'vllm')\n")
    assert len(_name_comparisons(planted)) == 1


@pytest.mark.parametrize("name", targets.names())
def test_every_target_answers_the_interface_and_its_entry_points_resolve(name):
    t = targets.get(name)
    assert t.name == name and t.summary and t.artifact_dir and t.frontends.__func__  # noqa: B018
    for entry in (t.build_entry, t.preflight_entry, t.verify_entry):
        if entry is not None:
            assert callable(targets.resolve_entry(entry)), entry
    assert set(t.serving_settings) <= set(targets.SERVING_SETTINGS)
    assert set(t.kv_formats) <= {"int8", "fp8", "none"}
    if t.device_only:  # built here, run on the device: no server of this machine serves it
        assert t.publish_entry and callable(targets.resolve_entry(t.publish_entry)) and not t.default_frontends
        return
    cfg = load_config(REPO / "engine_configs" / "smollm2-135m-cpu.yaml",
                      [f"build.target={name}", "quantization.kv_cache=fp8", "build.cuda_graphs.enabled=false"]
                      + (["vllm.frontends=[triton]"] if name == "vllm" else [])).config
    assert t.docker_stage(cfg) and t.server(t.frontends(cfg)[0])
    with pytest.raises(Exception, match=f"the {name} target is served by one of"):
        t.server("smoke-signals")


def test_an_unregistered_target_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="registered build targets: tensorrt, pytorch, cpu, vllm, edge"):
        load_config(REPO / "engine_configs" / "smollm2-135m-cpu.yaml", ["build.target=tpu"])


# ---------------------------------------------------------------- families that configure themselves


def _local_model(tmp_path: Path, tiny_model_dir: Path, model_type: str) -> Path:
    """The tiny Llama folder with config.json's model_type changed: resolution reads config.json alone."""
    model_dir = tmp_path / model_type
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    return model_dir


@pytest.mark.parametrize("model_type", ["phi3", "gemma3_text", "gemma2", "deepseek_v2"])
def test_a_family_with_only_the_hf_unified_export_gets_it_and_a_kv_cache_it_takes(tmp_path, tiny_model_dir,
                                                                                  model_type):
    loaded = load_config(tiny_config(tmp_path, _local_model(tmp_path, tiny_model_dir, model_type)))
    q = loaded.config.quantization
    assert (q.export_hf_checkpoint, q.kv_cache) == (True, "fp8")
    chosen = loaded.resolution.chosen
    assert "HF unified checkpoint only" in chosen["quantization.export_hf_checkpoint"][1]
    assert "writes no INT8 KV cache" in chosen["quantization.kv_cache"][1]
    assert loaded.origins["quantization.kv_cache"].startswith("chosen: ")


@pytest.mark.parametrize("model_type,target,expert_format", [("mixtral", "cpu", "fp8"), ("qwen3_moe", "cpu", "fp8"),
                                                              ("mixtral", "vllm", "int4_awq")])
def test_experts_get_a_format_the_export_writes_and_the_target_serves(tmp_path, tiny_model_dir, model_type, target,
                                                                       expert_format):
    extra = ["build.target=vllm", "build.cuda_graphs.enabled=false", "vllm.dtype=bfloat16"] if target == "vllm" \
        else []
    loaded = load_config(tiny_config(tmp_path, _local_model(tmp_path, tiny_model_dir, model_type)), extra)
    rule = loaded.config.plan.rules[0]
    experts = families.FAMILIES[model_type].moe.experts
    assert (rule.pattern, rule.format) == (f"*.{experts}.*", expert_format)
    assert loaded.config.plan.rules[-1].pattern == "lm_head"  # the config's own rules after it: the last match wins


def test_a_dense_family_on_its_defaults_is_left_as_the_config_says(tmp_path, tiny_model_dir):
    loaded = load_config(tiny_config(tmp_path, tiny_model_dir))
    assert loaded.resolution.model_type == "llama" and loaded.resolution.chosen == {}
    q = loaded.config.quantization
    assert (q.export_hf_checkpoint, q.kv_cache) == (False, "int8")


def test_the_pytorch_target_gets_its_checkpoint_and_kv_cache_without_asking(tmp_path, tiny_model_dir):
    q = load_config(tiny_config(tmp_path, tiny_model_dir), ["build.target=pytorch"]).config.quantization
    assert (q.export_hf_checkpoint, q.kv_cache) == (True, "fp8")


def test_every_conflict_is_reported_at_once_naming_field_constraint_and_what_works(tmp_path, tiny_model_dir):
    cfg = tiny_config(tmp_path, _local_model(tmp_path, tiny_model_dir, "phi3"))
    with pytest.raises(ConfigError) as err:
        load_config(cfg, ["quantization.export_hf_checkpoint=false", "quantization.kv_cache=int8",
                          "build.target=tensorrt"])
    message = str(err.value)
    assert "model type phi3" in message
    assert "build.target tensorrt: the tensorrt target cannot serve phi3" in message
    assert "use build.target pytorch or cpu or vllm" in message and "pipeline/families.py" in message
    assert "quantization.export_hf_checkpoint: false, but phi3 is exported as the HF unified checkpoint only" in message
    assert "quantization.kv_cache: int8, but ModelOpt's HF unified export writes no INT8 KV cache; use fp8 or none" \
        in message


def test_an_explicit_expert_format_the_export_cannot_write_is_refused_at_load(tmp_path, tiny_model_dir):
    cfg = tiny_config(tmp_path, _local_model(tmp_path, tiny_model_dir, "mixtral"))
    cfg.write_text(cfg.read_text().replace("rules: [{pattern: lm_head, keep_high_precision: true}]",
                                           "rules: [{pattern: '*.experts.*', format: int8_sq}]"))
    with pytest.raises(ConfigError, match=r"plan.rules '\*.experts.\*' gives mixtral's experts int8_sq, which "
                                          r"ModelOpt 0.47's TensorRT-LLM export .* cannot write for stacked experts; "
                                          r"use fp8 or int4_awq or w4a8_awq"):
        load_config(cfg)


def test_an_unsupported_family_is_refused_at_load(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="model type 'gpt_neox' is not a supported family; supported: llama"):
        load_config(tiny_config(tmp_path, _local_model(tmp_path, tiny_model_dir, "gpt_neox")))


def test_the_default_models_family_is_read_from_its_gguf_file():
    loaded = load_config(REPO / "engine_configs" / "smollm2-135m-cpu.yaml")
    assert loaded.resolution.model_type == "llama"


def test_explain_prints_the_target_and_each_chosen_default_with_why(tmp_path, tiny_model_dir):
    from conftest import run_invoke

    cfg = tiny_config(tmp_path, _local_model(tmp_path, tiny_model_dir, "gemma3_text"))
    proc = run_invoke("explain", "--config", str(cfg), "--work-root", str(tmp_path / "work"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target: cpu (the CPU reference runtime" in proc.stdout
    assert "model type: gemma3_text" in proc.stdout
    assert "chosen: quantization.export_hf_checkpoint = True: gemma3_text is exported as the HF unified" in proc.stdout
    assert "chosen: quantization.kv_cache = 'fp8'" in proc.stdout


def test_gguf_architectures_map_to_the_family_table():
    assert set(autoconfig.GGUF_ARCHITECTURES.values()) <= set(families.FAMILIES) | {"qwen2_moe"}
