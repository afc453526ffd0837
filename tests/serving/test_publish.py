"""The publish stage on build folders laid out as the build stage writes them (build_settings.json + the
target's artifact): generated configs parsed back, the GPU targets' parameters against the build's
decisions (contract), versions and their pruning, an atomic swap that a kill cannot tear, and every refusal.

The engine and checkpoint files here are stand-ins (publish only copies them); loading and serving a real
repository is tests/serving/test_verify.py's job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config, tree_snapshot

from pipeline import artifacts, records, targets
from pipeline.config import load_config
from pipeline.errors import ConfigError, EnvironmentProblem, InputError, UserError
from pipeline.fsutil import digest_of_files, list_files, sha256_file
from pipeline.serving import publish as pub

pytest.importorskip("tritonclient.grpc.model_config_pb2")

ENGINE_STAND_IN = b"stand-in for rank0.engine: publish copies it, nothing loads it\n"

# triton.watchdog's defaults, as the Python tensorrt_llm models read them (triton_repo/common/llm_serving.py)
WATCHDOG_DEFAULTS = {"watchdog_errors_per_minute": "5", "watchdog_memory_mb_per_s": "1.0",
                     "watchdog_memory_window_s": "300"}


def make_build(work: Path, target: str, tokenizer_dir: Path, **overrides) -> Path:
    """<work>/build as the build stage leaves it for ``target``, and <work>/model/hf_model's tokenizer."""
    build = work / "build"
    artifact = build / targets.get(target).artifact_dir
    artifact.mkdir(parents=True)
    hf = work / "model" / "hf_model"
    hf.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, hf / f.name)
    if target == "cpu":
        (artifact / "runtime.json").write_text(json.dumps({"max_batch_size": 4}))
        (artifact / "checkpoint").mkdir()
        (artifact / "checkpoint" / "config.json").write_text("{}")
        (artifact / "checkpoint" / "rank0.safetensors").write_bytes(b"\0" * 64)
        shutil.copytree(tokenizer_dir, artifact / "model")
    elif target == "tensorrt":
        (artifact / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": {}}))
        (artifact / "rank0.engine").write_bytes(ENGINE_STAND_IN)
    elif target == "vllm":
        (artifact / artifacts.VLLM_ENGINE_FILE).write_text(json.dumps({
            "engine_args": {"max_num_seqs": 4, "served_model_name": "llm"}, "env": {},
            "server_module": "vllm.entrypoints.launchers.api_server.entry", "server_flags": ["--max-num-seqs", "4"]}))
        (artifact / "config.json").write_text("{}")
        (artifact / "model.safetensors").write_bytes(b"\0" * 64)
    else:
        (artifact / artifacts.LLM_API_OPTIONS_FILE).write_text(yaml.safe_dump({
            "max_batch_size": 4, "max_num_tokens": 256, "max_seq_len": 128,
            "cuda_graph_config": {"batch_sizes": [1, 2, 4], "enable_padding": True},
            "kv_cache_config": {"dtype": "fp8", "free_gpu_memory_fraction": 0.85, "enable_block_reuse": False,
                                "tokens_per_block": 32}}))
        (artifact / "checkpoint").mkdir()
        (artifact / "checkpoint" / "config.json").write_text("{}")
        (artifact / "checkpoint" / "hf_quant_config.json").write_text("{}")
    settings = {
        "target": target, "artifact_dir": targets.get(target).artifact_dir,
        "max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256,
        "kv_cache": {"quant_algo": "FP8" if target == "pytorch" else "INT8", "tokens_per_block": 32,
                     "free_gpu_memory_fraction": 0.85, "enable_block_reuse": False},
        "cuda_graphs": {"enabled": target != "cpu", "batch_sizes": [1, 2, 4] if target != "cpu" else [],
                        "enable_padding": target != "cpu", "cuda_graph_mode": target == "tensorrt",
                        "cuda_graph_cache_size": 3 if target == "tensorrt" else 0},
        "trtllm_version": None if target == "cpu" else "1.2.1",
        "provenance": {"gpu": "stand-in"} if target != "cpu" else {"runtime": "pipeline.engines.cpu_runtime"},
        "checkpoint_sha256": "ab" * 32,
    }
    settings.update(overrides)
    (build / artifacts.BUILD_SETTINGS_FILE).write_text(json.dumps(settings))
    return build


TARGET_SETS = {
    "cpu": [],
    "tensorrt": ["build.target=tensorrt"],
    "pytorch": ["build.target=pytorch", "quantization.export_hf_checkpoint=true", "quantization.kv_cache=fp8"],
    "vllm": ["build.target=vllm", "build.cuda_graphs.enabled=false"],
}


@pytest.fixture
def setup(tmp_path, tiny_model_dir, tiny_tokenizer_dir):
    """(load(target, *overrides) -> config, work dir, publish(config) -> (summary, snapshot))."""
    yaml_path = tiny_config(tmp_path, tiny_model_dir)
    work = tmp_path / "work" / "tiny"
    made = {}

    def load(target="cpu", *overrides, **build_overrides):
        if target not in made:
            shutil.rmtree(work / "build", ignore_errors=True)
            shutil.rmtree(work / "model", ignore_errors=True)
            made.clear()
            made[target] = make_build(work, target, tiny_tokenizer_dir, **build_overrides)
        return load_config(yaml_path, TARGET_SETS[target] + list(overrides)).config

    counter = iter(range(1000))

    def run(config, name="tiny"):
        out = work / ".staging" / f"publish-{next(counter)}"
        out.mkdir(parents=True)
        summary = pub.publish(config, name, work_dir=work, build_dir=work / "build",
                              model_dir=work / "model" / "hf_model", out_dir=out)
        return summary, out / artifacts.MODEL_REPOSITORY_DIR

    return load, work, run


def _configs(repo: Path) -> dict:
    return {p.parent.name: pub.read_config(p) for p in repo.glob("*/config.pbtxt")}


def _params(msg) -> dict:
    return {k: v.string_value for k, v in msg.parameters.items()}


def _io(msg) -> tuple:
    return ([(i.name, i.data_type, list(i.dims), i.optional, list(i.reshape.shape)) for i in msg.input],
            [(o.name, o.data_type, list(o.dims)) for o in msg.output])


def test_cpu_repository_configs_parse_back_and_wire_the_ensemble(setup):
    load, work, run = setup
    summary, snap = run(load("cpu"))
    names = pub.model_names("llm")
    assert summary["version"] == 1 and summary["target"] == "cpu"
    configs = _configs(snap)
    assert set(configs) == set(names.all())
    for name, msg in configs.items():
        assert msg.name == name
        assert pub.config_text(msg) == (snap / name / "config.pbtxt").read_text()  # what was written parses back
        assert "${" not in (snap / name / "config.pbtxt").read_text()
    ens = configs["llm"]
    assert ens.platform == "ensemble" and ens.max_batch_size == 4
    steps = [s.model_name for s in ens.ensemble_scheduling.step]
    assert steps == [names.preprocessing, names.unary, names.postprocessing]
    assert [i.name for i in ens.input][:2] == ["text_input", "max_tokens"]
    assert all(i.optional for i in ens.input[2:])
    assert configs[names.tensorrt_llm].model_transaction_policy.decoupled
    assert not configs[names.unary].model_transaction_policy.decoupled
    assert not ens.model_transaction_policy.decoupled
    # the streaming model: an ensemble of the engine model alone, which takes text (no decoupled BLS hop)
    stream = configs[names.stream]
    assert stream.platform == "ensemble" and [s.model_name for s in stream.ensemble_scheduling.step] == [
        names.tensorrt_llm]
    assert [i.name for i in stream.input] == [i.name for i in ens.input]
    step = stream.ensemble_scheduling.step[0]
    assert dict(step.input_map) == {("runtime_" + i.name if i.name in ("top_k", "top_p") else i.name): i.name
                                    for i in stream.input}
    assert dict(step.output_map) == {"text_output": "text_output", "output_ids": "output_ids"}
    assert not list((snap / names.stream / "1").iterdir())  # an ensemble's version folder is empty
    llm = configs[names.tensorrt_llm]
    llm_inputs = {i.name: i for i in llm.input}
    assert set(step.input_map) <= set(llm_inputs) and {"text_output", "output_ids"} <= {o.name for o in llm.output}
    assert all(llm_inputs[n].optional for n in ("input_ids", "input_lengths", "request_output_len", "text_input"))
    assert llm.backend == "python" and _params(llm) == {"bundle_dir": "cpu_bundle", "cpu_threads": "0",
                                                        "adaptive_batch_target_ms": "0", "max_running": "0",
                                                        "prefill_chunk_tokens": "0", "priority_levels": "0",
                                                        "default_priority_level": "0", **WATCHDOG_DEFAULTS,
                                                        "tokenizer_dir": "tokenizer", "add_special_tokens": "true",
                                                        "apply_chat_template": "false", "max_input_len": "64",
                                                        "max_seq_len": "128"}
    assert (snap / names.tensorrt_llm / "1" / "tokenizer" / "tokenizer.json").is_file()
    assert not any(m.dynamic_batching.priority_levels for m in configs.values())
    assert "priority" not in {i.name for m in configs.values() for i in m.input}  # one class: no input for it
    assert _params(configs[names.preprocessing])["max_input_len"] == "64"
    v1 = snap / names.tensorrt_llm / "1"
    assert (v1 / "model.py").read_text() == (pub.TRITON_SOURCE / "tensorrt_llm_cpu" / "model.py").read_text()
    assert (v1 / "cpu_bundle" / "runtime.json").is_file()
    assert (snap / names.preprocessing / "1" / "tokenizer" / "tokenizer.json").is_file()
    assert (snap / "llm" / "1").is_dir() and not list((snap / "llm" / "1").iterdir())


def test_provenance_follows_the_contract_and_the_live_repository_matches(setup):
    load, work, run = setup
    summary, snap = run(load("cpu"))
    prov = json.loads((snap / artifacts.PROVENANCE_FILE).read_text())
    assert set(prov) >= {"pipeline_version", "config_name", "model_name", "version", "model_source", "plan_sha256",
                         "quantization", "checkpoint_sha256", "build", "repository_digest"}
    assert prov["config_name"] == "tiny" and prov["model_name"] == "llm" and prov["version"] == 1
    assert prov["quantization"] == {"weight_format": "int8_sq", "kv_cache": "int8"}
    assert prov["build"]["target"] == "cpu" and prov["checkpoint_sha256"] == "ab" * 32
    files = {rel: sha256_file(snap / rel) for rel in list_files(snap) if rel != artifacts.PROVENANCE_FILE}
    assert prov["repository_digest"] == digest_of_files(files)
    live = work / artifacts.DEFAULT_REPOSITORY_DIR
    assert summary["repository_dir"] == str(live)
    assert {r for r in list_files(live) if r != artifacts.PROVENANCE_FILE} == set(files)
    assert json.loads((live / artifacts.PROVENANCE_FILE).read_text())["versions"] == [1]


@pytest.mark.parametrize("target", ["tensorrt", "pytorch"])
def test_gpu_targets_parse_and_match_the_build_decisions(setup, target):
    """Contract: for the GPU targets the repository parses and carries exactly the build stage's settings."""
    load, work, run = setup
    config = load(target, "triton.serving_repository_path=/models", "build.trtllm_version=1.2.1")
    summary, snap = run(config)
    settings = json.loads((work / "build" / artifacts.BUILD_SETTINGS_FILE).read_text())
    names = pub.model_names("llm")
    configs = _configs(snap)
    llm = configs[names.tensorrt_llm]
    params = _params(llm)
    as_cpu = records.BuildSettings.model_validate({**settings, "target": "cpu"})
    cpu_io = _io(pub.build_model_configs(config.triton, as_cpu, names=names, version=1,
                                         serving_root="/models")[names.tensorrt_llm])
    if target == "tensorrt":  # the tensorrtllm backend's I/O: the token part of the Python models', required
        text = {"text_input", "max_tokens", "stop_words", "apply_chat_template", "text_output"}
        token_io = ([(n, t, d, o and n not in ("input_ids", "input_lengths", "request_output_len"), r)
                     for n, t, d, o, r in cpu_io[0] if n not in text], [o for o in cpu_io[1] if o[0] not in text])
        assert _io(llm) == token_io  # one I/O for every target: everything around tensorrt_llm is shared
        assert configs[names.stream].backend == "python"  # the streaming model calls it by BLS (it takes no text)
    else:
        assert _io(llm) == cpu_io
        assert configs[names.stream].platform == "ensemble"
    assert llm.max_batch_size == settings["max_batch_size"]
    assert llm.model_transaction_policy.decoupled
    if target == "tensorrt":
        kv, graphs = settings["kv_cache"], settings["cuda_graphs"]
        assert llm.backend == "tensorrtllm"
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["kv_cache_free_gpu_mem_fraction"] == str(kv["free_gpu_memory_fraction"])
        assert params["enable_kv_cache_reuse"] == str(kv["enable_block_reuse"]).lower()
        assert params["cuda_graph_mode"] == str(graphs["cuda_graph_mode"]).lower()
        assert params["cuda_graph_cache_size"] == str(graphs["cuda_graph_cache_size"])
        assert params["exclude_input_in_output"] == "true" and params["max_beam_width"] == "1"
        path = params["gpt_model_path"]
        assert path == f"/models/{names.tensorrt_llm}/1/engine"
        engine = snap / path[len("/models/"):]
        assert (engine / "rank0.engine").read_bytes() == ENGINE_STAND_IN
        assert not (snap / names.tensorrt_llm / "1" / "model.py").exists()
    else:
        assert llm.backend == "python" and llm.instance_group[0].kind == llm.instance_group[0].KIND_MODEL
        assert params == {"checkpoint_dir": "checkpoint", "llm_api_options": artifacts.LLM_API_OPTIONS_FILE,
                          **WATCHDOG_DEFAULTS, **{k: v for k, v in _params(configs[names.preprocessing]).items()}}
        v1 = snap / names.tensorrt_llm / "1"
        assert (v1 / artifacts.LLM_API_OPTIONS_FILE).read_bytes() == \
            (work / "build" / "llm_api" / artifacts.LLM_API_OPTIONS_FILE).read_bytes()
        assert (v1 / "checkpoint" / "hf_quant_config.json").is_file()
        code = (v1 / "model.py").read_text()
        assert "import tensorrt_llm" not in code.split("class ")[0]  # never imported at module level
        assert "from tensorrt_llm import" in code
    prov = json.loads((snap / artifacts.PROVENANCE_FILE).read_text())
    assert prov["build"] == {"target": target, "trtllm_version": "1.2.1", "provenance": {"gpu": "stand-in"},
                             "world_size": 1, "server_ranks": 1, "tensorrt_llm_model": names.tensorrt_llm}


def test_the_serving_keys_reach_the_gpu_targets_runtime_without_a_rebuild(setup):
    """triton.max_running / scheduler_policy / kv_cache_free_gpu_memory_fraction / adaptive_batch (what `invoke
    tune` chooses on a GPU): written into the published LLM-API options or backend parameters; the build's own
    files stay as they are."""
    load, work, run = setup
    keys = ["triton.scheduler_policy=max_utilization", "triton.kv_cache_free_gpu_memory_fraction=0.95"]
    _, snap = run(load("pytorch", "triton.max_running=2", "triton.adaptive_batch=true", *keys))
    names = pub.model_names("llm")
    built = yaml.safe_load((work / "build" / "llm_api" / artifacts.LLM_API_OPTIONS_FILE).read_text())
    text = (snap / names.tensorrt_llm / "1" / artifacts.LLM_API_OPTIONS_FILE).read_text()
    served = yaml.safe_load(text)
    assert "changed: cuda_graph_config, kv_cache_config, max_batch_size, scheduler_config" in text.splitlines()[0]
    assert served["max_batch_size"] == 2 and built["max_batch_size"] == 4
    assert served["cuda_graph_config"]["batch_sizes"] == [1, 2]
    assert served["kv_cache_config"]["free_gpu_memory_fraction"] == 0.95
    assert served["scheduler_config"]["capacity_scheduler_policy"] == "MAX_UTILIZATION"
    assert served["scheduler_config"]["dynamic_batch_config"]["enable_batch_size_tuning"] is True
    _, snap = run(load("tensorrt", *keys))
    params = _params(_configs(snap)[names.tensorrt_llm])
    assert params["batch_scheduler_policy"] == "max_utilization"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.95"


def test_a_vllm_repository_serves_one_export_to_triton_and_to_vllms_server(setup):
    """The vllm target publishes every model of the other targets, its tensorrt_llm model being the vLLM
    Python-backend model (same I/O) over the export, and vLLM's OpenAI server starts from that same folder."""
    from pipeline.serving import launch

    load, work, run = setup
    config = load("vllm")
    summary, snap = run(config)
    names = pub.model_names("llm")
    configs = _configs(snap)
    assert set(configs) == set(names.all())
    llm = configs[names.tensorrt_llm]
    settings = json.loads((work / "build" / artifacts.BUILD_SETTINGS_FILE).read_text())
    as_cpu = records.BuildSettings.model_validate({**settings, "target": "cpu"})
    cpu_io = _io(pub.build_model_configs(config.triton, as_cpu, names=names, version=1,
                                         serving_root="/models")[names.tensorrt_llm])
    assert _io(llm) == cpu_io and llm.backend == "python"
    assert _params(llm) == {"model_dir": artifacts.VLLM_MODEL_DIR, "priority_levels": "0",
                            "default_priority_level": "0", **WATCHDOG_DEFAULTS,
                            **_params(configs[names.preprocessing])}  # it takes text too: the tokenizer's settings
    v1 = snap / names.tensorrt_llm / "1"
    assert (v1 / "model.py").read_text() == (pub.TRITON_SOURCE / "tensorrt_llm_vllm" / "model.py").read_text()
    assert "import vllm" not in (v1 / "model.py").read_text().split("class ")[0]  # imported when the model loads
    folder, engine = launch.vllm_model(snap)
    assert folder == v1 / artifacts.VLLM_MODEL_DIR and engine["server_flags"] == ["--max-num-seqs", "4"]
    assert (folder / "model.safetensors").is_file()


def test_tenants_on_the_vllm_target_reach_its_model_and_the_gate_ships_beside_it(setup):
    """tenants on the vllm target (served by Triton alone): every client-facing model and the vLLM model take a
    tenant input, the vLLM model reads the tenants as a parameter, and pipeline/tenancy.py is copied beside its
    code. That copy imports in an interpreter without this project (vLLM's environment has none), where its
    refusals are plain ValueErrors (a 400), and admits by share there."""
    load, work, run = setup
    names = pub.model_names("llm")
    config = load("vllm", "vllm.frontends=[triton]", "tenants=[{name: a, kv_share: 0.5, max_concurrency: 2}]")
    _, snap = run(config)
    configs = _configs(snap)
    for name in (names.ensemble, names.stream, names.unary, names.tensorrt_llm):
        assert "tenant" in {i.name for i in configs[name].input}, name
    assert json.loads(_params(configs[names.tensorrt_llm])["tenants"]) == [
        {"name": "a", "kv_share": 0.5, "max_concurrency": 2}]
    v1 = snap / names.tensorrt_llm / "1"
    assert (v1 / "tenancy.py").read_bytes() == (pub.SHIPPED_MODULES[0]).read_bytes()
    probe = textwrap.dedent("""
        import os
        import sys
        sys.path.insert(0, os.getcwd())  # as model.py puts its folder first
        from tenancy import InputError, TenantBook, TenantGate, TenantSpec
        assert "pipeline" not in sys.modules and InputError is ValueError
        gate = TenantGate(TenantBook([TenantSpec("a", kv_share=0.5)], 10, slots=4), block_tokens=32)
        started = []
        for key in range(3):
            gate.submit("a", key, tokens=64, priority=0, start=lambda key=key: started.append(key))
        try:
            gate.submit("zz", 9, tokens=64, priority=0, start=lambda: None)
        except ValueError as e:
            print(started, gate.waiting(), e)
        """)
    # -I -S: no site-packages, where this project is installed
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], cwd=v1, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[0, 1] 1 unknown tenant 'zz'"), done.stdout  # 2 + 2 of a's 5 blocks; 1 waits


def test_max_running_on_the_vllm_target_is_the_served_engine_records_max_num_seqs(setup):
    """triton.max_running on the vllm target: the repository's engine record (what Triton's vLLM model and
    `launch vllm` start vLLM from) carries it as max_num_seqs, in the engine arguments and the server's flags; the
    build's record, linked into the repository otherwise, is left as the build wrote it. Unset: the build's."""
    from pipeline.serving import launch

    load, work, run = setup
    names = pub.model_names("llm")
    built = work / "build" / artifacts.VLLM_MODEL_DIR / artifacts.VLLM_ENGINE_FILE
    _, snap = run(load("vllm"))
    served = snap / names.tensorrt_llm / "1" / artifacts.VLLM_MODEL_DIR / artifacts.VLLM_ENGINE_FILE
    assert served.read_bytes() == built.read_bytes()
    before = built.read_bytes()
    _, snap = run(load("vllm", "triton.max_running=2"))
    version = json.loads((snap / artifacts.PROVENANCE_FILE).read_text())["version"]  # 2: another content
    served = snap / names.tensorrt_llm / str(version) / artifacts.VLLM_MODEL_DIR / artifacts.VLLM_ENGINE_FILE
    record = json.loads(served.read_text())
    assert record["engine_args"]["max_num_seqs"] == 2 and record["engine_args"]["served_model_name"] == "llm"
    assert record["server_flags"] == ["--max-num-seqs", "2", "--served-model-name", "llm"]
    assert built.read_bytes() == before and json.loads(before)["engine_args"]["max_num_seqs"] == 4
    argv = launch.vllm_argv("python3", snap, "127.0.0.1", 8000)
    assert argv[argv.index("--max-num-seqs") + 1] == "2"
    with pytest.raises(ConfigError, match="adaptive_batch.*vLLM's scheduler fills its batch"):
        load("vllm", "triton.adaptive_batch=true")


def test_adaptive_batch_reaches_the_cpu_model_as_its_step_target(setup):
    load, work, run = setup
    names = pub.model_names("llm")
    _, snap = run(load("cpu"))
    assert _params(_configs(snap)[names.tensorrt_llm])["adaptive_batch_target_ms"] == "0"  # off by default
    _, snap = run(load("cpu", "sla.p99_itl_ms=150", "triton.adaptive_batch=true", "triton.prefill_chunk_tokens=16"))
    assert _params(_configs(snap)[names.tensorrt_llm])["adaptive_batch_target_ms"] == "150.0"
    assert _params(_configs(snap)[names.tensorrt_llm])["prefill_chunk_tokens"] == "16"


def test_request_classes_reach_every_model_on_the_way_to_the_runtime(setup):
    """triton.priority_levels 3, default 2: the ensemble and the streaming model take a `priority` input, the
    ensemble maps it to the unary step and that model to tensorrt_llm, which reads the levels as parameters;
    every Triton-queued model orders its queue by the same levels."""
    load, work, run = setup
    names = pub.model_names("llm")
    _, snap = run(load("cpu", "triton.priority_levels=3", "triton.default_priority_level=2"))
    configs = _configs(snap)
    for name in (names.ensemble, names.stream, names.unary, names.tensorrt_llm):
        assert "priority" in {i.name for i in configs[name].input}, name
    step = next(s for s in configs[names.ensemble].ensemble_scheduling.step if s.model_name == names.unary)
    assert step.input_map["priority"] == "priority"
    assert {k: v for k, v in _params(configs[names.tensorrt_llm]).items() if "priority" in k} == {
        "priority_levels": "3", "default_priority_level": "2"}
    queued = [m for m in configs.values() if m.HasField("dynamic_batching")]
    assert {m.name for m in queued} == {names.preprocessing, names.tensorrt_llm, names.postprocessing, names.unary}
    assert all((m.dynamic_batching.priority_levels, m.dynamic_batching.default_priority_level) == (3, 2)
               for m in queued)


def setup_yaml(work: Path) -> Path:
    return work.parent.parent / "tiny.yaml"


def test_each_publish_adds_a_version_and_old_ones_are_pruned(setup):
    load, work, run = setup
    config = load("cpu", "triton.keep_versions=3")
    live = work / artifacts.DEFAULT_REPOSITORY_DIR
    for expect in (1, 2, 3, 4):
        summary, snap = run(config)
        assert summary["version"] == expect
        assert pub._versions(snap / "llm_tensorrt_llm") == [expect]  # the stage's snapshot: this version only
    names = pub.model_names("llm")
    for name in names.all():
        assert pub._versions(live / name) == [2, 3, 4], name
    prov = json.loads((live / artifacts.PROVENANCE_FILE).read_text())
    assert prov["version"] == 4 and prov["versions"] == [2, 3, 4]
    assert [h["version"] for h in prov["history"]] == [2, 3, 4]
    a = live / names.tensorrt_llm / "2" / "cpu_bundle" / "checkpoint" / "rank0.safetensors"
    b = live / names.tensorrt_llm / "4" / "cpu_bundle" / "checkpoint" / "rank0.safetensors"
    assert a.read_bytes() == b.read_bytes()
    assert not list(live.parent.glob(f".{live.name}.publishing*"))


KILL_AT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from pipeline.serving import publish as pub
    from pipeline.config import load_config

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(pub, sys.argv[1], die)
    work = Path(sys.argv[3])
    out = work / ".staging" / "publish-killed"
    out.mkdir(parents=True)
    config = load_config(sys.argv[2], sys.argv[4:]).config
    pub.publish(config, "tiny", work_dir=work, build_dir=work / "build", model_dir=work / "model" / "hf_model",
                out_dir=out)
    """)


@pytest.mark.parametrize("point", ["exchange_dirs", "_copy_tokenizer"])
def test_a_publish_killed_midway_leaves_the_previous_repository(setup, point):
    load, work, run = setup
    config = load("cpu")
    run(config)
    live = work / artifacts.DEFAULT_REPOSITORY_DIR
    before = tree_snapshot(live)
    proc = subprocess.run([sys.executable, "-c", KILL_AT, point, str(setup_yaml(work)), str(work)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert tree_snapshot(live) == before  # not a file touched: the server still sees version 1, whole
    summary, _ = run(config)  # the next publish clears what the killed one left and goes on
    assert summary["version"] == 2
    assert not list(live.parent.glob(f".{live.name}.publishing*"))


def test_refuses_a_target_the_build_did_not_make(setup):
    load, work, run = setup
    config = load("tensorrt")
    cpu = load_config(setup_yaml(work), []).config
    with pytest.raises(InputError, match="target/engine mismatch.*'cpu'.*'tensorrt' build"):
        run(cpu)
    (work / "build" / "engine" / "rank0.engine").unlink()
    with pytest.raises(InputError, match="target/engine mismatch.*rank0.engine"):
        run(config)
    assert not (work / artifacts.DEFAULT_REPOSITORY_DIR).exists()


def test_refuses_an_engine_from_another_tensorrt_llm(setup):
    load, work, run = setup
    config = load("tensorrt", "build.trtllm_version=1.2.1", trtllm_version="1.1.0")
    with pytest.raises(InputError, match=r"built with TensorRT-LLM 1\.1\.0.*serves 1\.2\.1 \(build\.trtllm_version\)"):
        run(config)
    image_says = load("tensorrt", "build.trtllm_version=1.1.0", "image.base_tag=26.07-trtllm-python-py3")
    with pytest.raises(InputError, match=r"serves 1\.2\.1 \(image\.base_tag 26\.07"):
        run(image_says)
    summary, _ = run(load("tensorrt", "build.trtllm_version=1.1.0"))
    assert summary["version"] == 1


def test_refuses_unsafe_model_names(setup):
    load, work, run = setup
    with pytest.raises(ConfigError, match="triton.model_name"):
        load("cpu", "triton.model_name=../escape")
    with pytest.raises(InputError, match="not a safe directory name"):
        run(load("cpu", "triton.model_name=with.dot"))
    with pytest.raises(InputError, match="not a safe directory name"):
        pub.model_names("x" * 90)


def test_refuses_a_destination_holding_models_it_did_not_write(setup, tmp_path):
    load, work, run = setup
    dest = tmp_path / "served"
    (dest / "someone_elses" / "1").mkdir(parents=True)
    (dest / "someone_elses" / "config.pbtxt").write_text('name: "someone_elses"\n')
    (dest / "llm" / "7").mkdir(parents=True)
    (dest / "llm" / "config.pbtxt").write_text('name: "llm"\n')
    before = tree_snapshot(dest)
    config = load("cpu", f"triton.repository_dir={dest}")
    with pytest.raises(UserError, match="did not write: llm, someone_elses.*overwrite: true to replace llm"):
        run(config)
    assert tree_snapshot(dest) == before
    summary, _ = run(load("cpu", f"triton.repository_dir={dest}", "triton.overwrite=true"))
    assert summary["version"] == 8 and summary["foreign_models_kept"] == ["someone_elses"]
    assert (dest / "someone_elses" / "config.pbtxt").read_text() == 'name: "someone_elses"\n'
    assert pub._versions(dest / "llm") == [8]  # the replaced model's own versions are not kept
    # from now on the models are this pipeline's; the other one is still not
    with pytest.raises(UserError, match="did not write: someone_elses"):
        run(load("cpu", f"triton.repository_dir={dest}"))
    # another config publishing into the same place is someone else too
    with pytest.raises(UserError, match="config 'tiny'"):
        run(load("cpu", f"triton.repository_dir={dest}", "triton.overwrite=false"), name="other-config")


def test_refuses_a_destination_the_runner_would_replace(setup):
    load, work, run = setup
    with pytest.raises(InputError, match="overlaps the publish stage folder"):
        run(load("cpu", f"triton.repository_dir={work / 'publish' / 'model_repository'}"))
    with pytest.raises(ConfigError, match="absolute path"):
        load("cpu", "triton.repository_dir=relative/repo")


def test_reload_asks_the_configured_server_and_says_when_it_cannot(setup):
    load, work, run = setup
    from pipeline.serving.ports import free_port

    config = load("cpu", f"triton.server_url=http://127.0.0.1:{free_port()}")
    with pytest.raises(EnvironmentProblem, match="published, but the server .* could not be reached"):
        run(config)
    assert pub._versions(work / artifacts.DEFAULT_REPOSITORY_DIR / "llm") == [1]


def test_the_atomic_exchange_swaps_two_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "new").write_text("new")
    (b / "old").write_text("old")
    pub.exchange_dirs(a, b)
    assert os.listdir(b) == ["new"] and os.listdir(a) == ["old"]


def _llm_io():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llm_io", pub.TRITON_SOURCE / "common" / "llm_io.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stop_words_layout_round_trips():
    llm_io = _llm_io()
    words = [[5, 6], [7], [8, 9, 10]]
    arr = llm_io.words_to_list(words)
    assert arr.tolist() == [[5, 6, 7, 8, 9, 10], [2, 3, 6, -1, -1, -1]]
    assert llm_io.list_to_words(arr) == words
    assert llm_io.list_to_words(llm_io.words_to_list([])) == []
    assert llm_io.ends_with_any([1, 8, 9, 10], words) and not llm_io.ends_with_any([9, 10, 1], words)


def test_the_prompter_tokenizes_and_refuses_as_the_preprocessing_model_did(tiny_tokenizer_dir):
    """llm_io.Prompter: the preprocessing model's work, which the streaming model now does itself (the real-server
    checks of both paths: test_verify.py)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    prompter = _llm_io().Prompter(tok, {"add_special_tokens": "true", "apply_chat_template": "false",
                                        "max_input_len": "12", "max_seq_len": "20"})
    text = "The statement is about loops"
    ids = prompter.prompt_ids(text, 4)
    assert ids == tok(text).input_ids and 0 < len(ids) <= 12
    assert prompter.pad_id == (tok.pad_token_id if tok.pad_token_id is not None else prompter.eos_id)
    cases = {("", 4, None): "text_input is empty", (text * 5, 4, None): "max_input_len=12",
             (text, 0, None): "at least 1", (text, 20, None): "max_seq_len=20", (text, 4, True): "no chat template"}
    for (t, n, chat), words in cases.items():
        with pytest.raises(ValueError, match=words):
            prompter.prompt_ids(t, n, chat)
    stop = prompter.stop_words([b"loops", "", "classes"])  # bytes as a STRING tensor holds them; empty skipped
    assert _llm_io().list_to_words(stop) == [tok("loops", add_special_tokens=False).input_ids,
                                             tok("classes", add_special_tokens=False).input_ids]


def test_the_models_dump_their_stacks_on_the_signal_the_pipeline_sends():
    from pipeline.serving.server import STACKS_SIGNAL

    assert _llm_io().STACKS_SIGNAL == STACKS_SIGNAL


class _TritonError:
    """The two members of pb_utils.TritonError that relayed_error uses: pb_utils exists only inside a Triton
    Python-backend stub process (the relay through a real server: test_verify.py's tenants test)."""

    INTERNAL, INVALID_ARG, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message, code=INTERNAL):
        self._message, self.code = message, code

    def message(self):
        return self._message


def test_the_serving_models_read_the_tenant_header_the_servers_forward():
    from pipeline.tenancy import TENANT_HEADER, TENANT_HEADER_ARGS

    assert _llm_io().TENANT_HEADER == TENANT_HEADER and all(TENANT_HEADER in a for a in TENANT_HEADER_ARGS)


def test_a_relayed_engine_error_gets_its_kind_back_from_its_words():
    """BLS resets a callee's error code (server issue 7804); the relaying models restore it from how the engine
    model words each kind (triton_repo/common/llm_serving.py)."""
    llm_io = _llm_io()
    pb = type("pb_utils", (), {"TritonError": _TritonError})
    cases = {"tenant a has 2 requests in flight, its max_concurrency; retry after 3 s": "UNAVAILABLE",
             "the model is not ready: its watchdog stopped the server (x); retry once it is restarted": "UNAVAILABLE",
             "RuntimeError: cpu runtime failed on request 3": "INTERNAL",
             "KeyError: 'x'": "INTERNAL",
             "unknown tenant 'zz': this deployment serves a, b": "INVALID_ARG",
             "priority 5 is outside 1..2 (1 the highest; 0 or none: the default level 2)": "INVALID_ARG"}
    assert {m: llm_io.relayed_error(_TritonError(m), pb).code for m in cases} == cases


def test_streamed_pieces_concatenate_to_the_full_decode(tiny_tokenizer_dir):
    """llm_io.TextStream, the streaming models' detokenizer: new ids decoded in the context of the last shown ones,
    a piece that ends inside a multi-byte character held back; the tokens behind the pieces are the tokens sent."""
    import threading

    from transformers import AutoTokenizer

    llm_io = _llm_io()
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    text = "Grüße aus Köln — 日本語 and plain words, café."
    ids = tok(text, add_special_tokens=False).input_ids
    stream = llm_io.TextStream(tok, threading.Lock())
    pieces = [p for p in (stream.push([t]) for t in ids) if p is not None]
    assert stream.flush() is None  # nothing held back at the end
    assert "".join(t for t, _ in pieces) == llm_io.decode(tok, ids) == text
    assert [t for _, behind in pieces for t in behind] == ids
    assert len(pieces) < len(ids)  # some characters spanned several byte tokens and were held back
    cut = llm_io.TextStream(tok, threading.Lock())  # a sequence that ends inside a character: flushed as it decodes
    held = [cut.push([t]) for t in tok("日", add_special_tokens=False).input_ids[:1]]
    assert held == [None] and cut.flush() is not None


def test_a_stub_freezes_what_it_made_at_start_and_still_collects_what_comes_after():
    """llm_io.freeze_heap, run in a fresh interpreter as a stub's initialize runs it: garbage made before it is
    collected, everything alive then is frozen (never walked by a full collection again), and a cycle made after
    it is still collected."""
    code = textwrap.dedent(f"""
        import gc, importlib.util, weakref
        spec = importlib.util.spec_from_file_location("llm_io", {str(pub.TRITON_SOURCE / "common" / "llm_io.py")!r})
        llm_io = importlib.util.module_from_spec(spec); spec.loader.exec_module(llm_io)
        class Node: pass
        def cycle():
            a, b = Node(), Node(); a.b, b.a = b, a; return weakref.ref(a)
        gc.disable()  # only freeze_heap and the explicit collect below may collect
        before = cycle(); kept = [Node() for _ in range(1000)]
        frozen = llm_io.freeze_heap()
        assert before() is None, "garbage from before the freeze was not collected"
        assert frozen == gc.get_freeze_count() > 1000, frozen
        after = cycle(); gc.collect()
        assert after() is None, "a cycle made after the freeze was not collected"
        print("ok", frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_a_streaming_request_asks_about_cancellation_at_most_every_cancel_check_s():
    """llm_io.CancelCheck against a request that counts the questions (a stand-in: the real one is a Triton request
    inside a stub; the models' cancellation on a real server is test_verify.py's _cancel_grpc_streams)."""
    import time

    llm_io = _llm_io()

    class Request:
        asked, cancelled = 0, False

        def is_cancelled(self):
            self.asked += 1
            return self.cancelled

    request = Request()
    check = llm_io.CancelCheck(request)
    assert not any(check() for _ in range(1000)) and request.asked == 1  # one question for a burst of tokens
    request.cancelled = True
    deadline = time.monotonic() + 10 * llm_io.CANCEL_CHECK_S
    while not check():
        assert time.monotonic() < deadline, "a cancelled request was not seen within 10 x CANCEL_CHECK_S"
    assert request.asked == 2
