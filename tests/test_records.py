"""The hand-off files' records: each writer's file reads back through its reader unchanged, and a missing,
malformed or mistyped file is an InputError that names the file and the task that writes it again."""

import json

import pytest

from pipeline import artifacts, records
from pipeline.errors import InputError

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

BUILD = {"target": "cpu", "artifact_dir": "cpu_bundle", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
         "enable_chunked_context": False, "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512,
         "max_num_tokens": None,
         "kv_cache": {"quant_algo": None, "tokens_per_block": 32, "free_gpu_memory_fraction": 0.9,
                      "enable_block_reuse": False},
         "cuda_graphs": {"enabled": False, "batch_sizes": [], "enable_padding": False, "cuda_graph_mode": False,
                         "cuda_graph_cache_size": 0},
         "trtllm_version": None, "provenance": {}, "checkpoint_sha256": "ab" * 32}
PROVENANCE = {"config_name": "tiny", "pipeline_version": "0.1", "model_name": "llm", "models": ["llm"], "version": 2,
              "quantization": {"weight_format": "int8_sq", "kv_cache": None}, "checkpoint_sha256": "cd" * 32,
              "build": {"target": "cpu", "trtllm_version": None, "world_size": 1, "server_ranks": 1,
                        "tensorrt_llm_model": "llm_tensorrt_llm", "provenance": {}},
              "repository_digest": "sha256:" + "ef" * 32, "versions": [1, 2],
              "history": [{"version": 1, "repository_digest": "sha256:" + "01" * 32, "checkpoint_sha256": "cd" * 32}]}
PLAN = {"format_version": 1, "base_format": "int8_sq", "kv_cache": "int8", "decision_column": "int8_sq",
        "mode": "threshold", "threshold": 0.05, "budget": None,
        "layers": {"model.layers.0.mlp.down_proj": {"format": "high_precision", "error": 0.2, "reason": "sensitive"},
                   "model.layers.0.mlp.up_proj": {"format": "int8_sq", "error": 0.01, "reason": "below threshold"}},
        "summary": {"layers": 2, "kept_high_precision": 1}}
ACCURACY = {"accuracy": {"tokens": 512, "perplexity_original": 12.5, "perplexity_quantized": 12.75,
                         "perplexity_increase_pct": 2.0, "top1_agreement": 0.97, "kl_divergence": 0.01,
                         "from_checkpoint": {"perplexity_quantized": 12.75, "kv_cache_quantized": False}},
            "generations": [{"prompt": "Hello", "original": " world", "quantized": " world"}]}
VERIFY = {"ok": True, "model_name": "llm", "version": 2, "target": "cpu",
          "server": {"startup_s": 3.5, "binary": "nvidia-pytriton tritonserver", "log": "tritonserver.log"},
          "reference": "the CPU runtime", "reference_s": 1.5, "prompts": ["Hello"], "max_tokens": 8,
          "latency": {"e2e_ms": {"p50": 10.0}}, "checks": [{"name": "generate", "ok": True}]}
BENCH = {"format_version": 1, "tool": "pipeline.serving.bench", "settings": {"concurrency": [1, 2]},
         "definitions": {"knee": "the lowest level ..."}, "sla": None, "bench_s": 12.5,
         "targets": [{"label": "this build", "levels": [], "knee": {}}], "cross_check": {"agree": True}}

# (record, its file in its stage folder, how its writer formats it, the task that writes it again)
JSON_FILES = [
    (records.BuildSettings, records.read_build_settings, records.write_build_settings, artifacts.BUILD_SETTINGS_FILE,
     BUILD, "build", dict(indent=2, sort_keys=True), "\n"),
    (records.Provenance, records.read_provenance, records.write_provenance, artifacts.PROVENANCE_FILE,
     PROVENANCE, "publish", dict(indent=2, sort_keys=True), "\n"),
    (records.Accuracy, records.read_accuracy, records.write_accuracy, artifacts.ACCURACY_FILE,
     ACCURACY, "quantize", dict(indent=2), ""),
    (records.VerifyResults, records.read_verify_results, records.write_verify_results, artifacts.VERIFY_RESULTS_FILE,
     VERIFY, "verify", dict(indent=2), "\n"),
    (records.BenchResults, records.read_bench_results, records.write_bench_results, artifacts.BENCH_RESULTS_FILE,
     BENCH, "bench", dict(indent=2), "\n"),
]
IDS = [f[3] for f in JSON_FILES]


@pytest.mark.parametrize("record,read,write,name,data,task,dumps,end", JSON_FILES, ids=IDS)
def test_a_written_file_is_the_on_disk_format_and_reads_back(tmp_path, record, read, write, name, data, task, dumps,
                                                             end):
    write(tmp_path, record.model_validate(data))
    assert (tmp_path / name).read_text() == json.dumps(data, **dumps) + end  # the format the stages wrote before
    assert read(tmp_path).model_dump(exclude_unset=True) == data


@pytest.mark.parametrize("record,read,write,name,data,task,dumps,end", JSON_FILES, ids=IDS)
def test_a_malformed_file_names_itself_and_the_rerun(tmp_path, record, read, write, name, data, task, dumps, end):
    path = tmp_path / name
    path.write_text("{not json")
    with pytest.raises(InputError, match=rf"{name} is unreadable .*`invoke {task} --force`"):
        read(tmp_path)
    path.write_text("[1, 2]")
    with pytest.raises(InputError, match=rf"{name} is not a mapping .*`invoke {task} --force`"):
        read(tmp_path)
    first = next(iter(data))  # a field every file of it has
    wrong = {k: v for k, v in data.items() if k != first}
    path.write_text(json.dumps(wrong))
    with pytest.raises(InputError,
                       match=rf"{name}: missing or mistyped field\(s\): {first}: .*`invoke {task} --force`"):
        read(tmp_path)


@pytest.mark.parametrize("record,read,write,name,data,task,dumps,end", JSON_FILES, ids=IDS)
def test_a_missing_file_says_what_to_run(tmp_path, record, read, write, name, data, task, dumps, end):
    with pytest.raises(InputError, match=rf"`invoke {task}`"):
        read(tmp_path)


def test_a_file_from_a_newer_pipeline_keeps_the_fields_it_adds(tmp_path):
    (tmp_path / artifacts.VERIFY_RESULTS_FILE).write_text(json.dumps({**VERIFY, "added_later": [1]}))
    got = records.read_verify_results(tmp_path)
    assert got.ok and got.model_extra == {"added_later": [1]}


def test_a_mistyped_field_is_named(tmp_path):
    (tmp_path / artifacts.PROVENANCE_FILE).write_text(json.dumps({**PROVENANCE, "version": "2"}))
    with pytest.raises(InputError,
                       match=r"provenance.json: missing or mistyped field\(s\): version: .*publish --force"):
        records.read_provenance(tmp_path)


def test_the_plan_is_written_as_yaml_in_build_order_and_reads_back(tmp_path):
    path = tmp_path / artifacts.PLAN_FILE
    records.write_plan(path, records.Plan.model_validate(PLAN), "# a header\n")
    text = path.read_text()
    assert text.startswith("# a header\nformat_version: 1\nbase_format: int8_sq\n")
    assert text.index("budget:") < text.index("layers:") < text.index("summary:")
    plan = records.read_plan(path, list(PLAN["layers"]))
    assert plan.model_dump(exclude_unset=True) == PLAN
    assert plan.kept_high_precision() == ["model.layers.0.mlp.down_proj"]
    assert plan.quantized_formats() == {"int8_sq"}


def test_a_hand_edited_plan_needs_only_the_formats(tmp_path):
    path = tmp_path / artifacts.PLAN_FILE
    path.write_text("format_version: 1\nlayers:\n  a: {format: fp8}\n  b: {format: high_precision, error: 1}\n")
    plan = records.read_plan(path, ["a", "b"])
    assert [layer.format for layer in plan.layers.values()] == ["fp8", "high_precision"]
    assert plan.layers["b"].error == 1.0


@pytest.mark.parametrize("text,problem", [
    ("format_version: 1\nlayers:\n  a: {format: int3}\n",
     r"layers\.a\.format: .*format 'int3' is not one of high_precision"),
    ("format_version: 2\nlayers:\n  a: {format: fp8}\n", r"format_version: .*format_version must be 1"),
    ("format_version: 1\n", r"layers: Field required"),
    ("format_version: 1\nlayers: [a, b]\n", r"layers: "),
    ("layers: {a: {format: fp8}\n", r"is unreadable"),
])
def test_a_bad_plan_edit_names_the_field_and_the_fix(tmp_path, text, problem):
    path = tmp_path / artifacts.PLAN_FILE
    path.write_text(text)
    with pytest.raises(InputError, match=rf"(?s){artifacts.PLAN_FILE}.*{problem}.*`invoke sensitivity --force`"):
        records.read_plan(path)


def test_a_plan_for_other_layers_is_refused(tmp_path):
    path = tmp_path / artifacts.PLAN_FILE
    records.write_plan(path, records.Plan.model_validate(PLAN), "")
    with pytest.raises(InputError, match=r"do not match the model's: missing \['c'\], unknown \['model.layers.0.mlp"
                                         r".*invoke sensitivity --force"):
        records.read_plan(path, ["c", "model.layers.0.mlp.up_proj"])


def test_the_launcher_reads_what_the_provenance_record_holds(tmp_path):
    """serving/launch.py runs in the Triton base image with the standard library only, so it reads
    provenance.json itself: it must find there what the record says."""
    from pipeline.serving import launch

    prov = records.Provenance.model_validate({**PROVENANCE, "build": {**PROVENANCE["build"], "server_ranks": 4}})
    records.write_provenance(tmp_path, prov)
    assert launch.read_serving_needs(tmp_path) == (prov.build.server_ranks, prov.build.tensorrt_llm_model) \
        == (4, "llm_tensorrt_llm")
