"""The GPU serving contract checked against upstream's own facts, not against this project's reading of them.

tests/data/upstream/*.json hold what TensorRT-LLM's and the tensorrtllm backend's source says (each file
names its repository, commit and paths, and says where a release tag commit could not be pinned): every
parameter key the backend reads and whether a missing one fails the load, its input/output tensors, the
trtllm-build flag table, the LLM-API fields, the HF unified checkpoint fields, and the serving guidance
(Blackwell rejections, the launcher's shape, GEMM-plugin advice). The tests below generate what the
pipeline would hand a GPU (trtllm-build argv for every shipped profile, the Triton configs of a tensorrt
publish, the LLM-API options and SamplingParams call of the pytorch target, the multi-GPU launch command)
and hold it to those facts.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import json
from pathlib import Path

import pytest
from upstream_facts import parse_trtllm_build_argv, upstream

from pipeline import formats
from pipeline.config import load_config
from pipeline.constants import REPO_ROOT
from pipeline.engines.build import build_settings
from pipeline.engines.trtllm import options, rules, targets
from pipeline.engines.trtllm.preflight import GPU
from pipeline.records import BuildSettings
from pipeline.serving import launch

pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from pipeline.serving import publish as pub  # noqa: E402  (needs tritonclient)

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

GPU_PROFILES = [p for p in sorted((REPO_ROOT / "engine_configs").glob("*.yaml"))
                if load_config(p).config.build.target in ("tensorrt", "pytorch")
                and not rules.validity_problems(load_config(p).config, load_config(p).config.build.target_sm)]
# What each profile's checkpoint config.json will say (ModelOpt's export): architecture and hidden size of the
# model it names. The rules read these from the checkpoint; before quantize they are not known.
CHECKPOINT_FACTS = {"Llama-3.1-70B": ("LlamaForCausalLM", 8192), "Llama-3.1-8B": ("LlamaForCausalLM", 4096),
                    "Llama-3.2-1B": ("LlamaForCausalLM", 2048), "Mistral-7B": ("MistralForCausalLM", 4096),
                    "Qwen2.5-7B": ("Qwen2ForCausalLM", 3584)}


def profile_facts(cfg) -> rules.QuantFacts:
    repo = cfg.model.source.repo_id
    arch, hidden = next(v for k, v in CHECKPOINT_FACTS.items() if k in repo)
    return dataclasses.replace(rules.facts_from_config(cfg), architecture=arch, hidden_size=hidden)


# ====================================================================================== trtllm-build
def profile_argv(path: Path) -> tuple[list[str], object, rules.QuantFacts]:
    cfg = load_config(path).config
    b = cfg.build
    facts = profile_facts(cfg)
    gpu = GPU(b.target_gpu, b.target_sm, "570.00")
    args = targets.trtllm_build_argv(Path("ckpt"), Path("engine"), cfg=cfg, gpu=gpu, facts=facts,
                                     input_timing_cache=Path("in.cache"), output_timing_cache=Path("out.cache"),
                                     gpu_count=facts.world_size)
    return args, cfg, facts


@pytest.mark.parametrize("path", GPU_PROFILES, ids=lambda p: p.stem)
def test_every_trtllm_build_argument_is_in_upstreams_flag_table(path):
    args, cfg, facts = profile_argv(path)
    v, problems = parse_trtllm_build_argv(args)
    assert problems == [], f"trtllm-build would refuse: {problems}"
    assert v["kv_cache_type"] == "paged"  # not the deprecated --paged_kv_cache
    # gemm plugin per format: off for FP8 and INT8 SmoothQuant (ModelOpt's reference build, the FP8 guide)
    advice = upstream("serving_guidance.json")
    legacy = " ".join(advice["modelopt_reference_build_flags"]["legacy_tensorrt_llm_build"]["facts"])
    assert "use_qdq = quant_algo in ['FP8', 'W8A8_SQ_PER_CHANNEL']" in legacy
    if facts.quant_algo in ("FP8", "W8A8_SQ_PER_CHANNEL"):
        assert v["gemm_plugin"] == "disable"
    # reduce_fusion only where the builder keeps it
    kept = advice["reduce_fusion_builder_condition"]["kept_when"]
    assert kept.startswith("tp_size > 1 AND architecture in")
    arches = {a.strip() for a in kept.split("{")[1].rstrip("}").split(",")}
    assert (v["reduce_fusion"] == "enable") == (facts.tp_size > 1 and facts.architecture in arches)
    # the FP8 SwiGLU fusion: FP8 weights, Hopper, fused MLP on
    if v.get("gemm_swiglu_plugin") == "fp8":
        assert facts.quant_algo == "FP8" and cfg.build.target_sm == 90 and v["use_fused_mlp"] == "enable"


def test_the_fp8_swiglu_fusion_runs_only_where_a_profile_opts_in_and_tp_llama_gets_the_reduce_fusion():
    """Upstream's FP8 guide: the fusion "can slightly reduce accuracy ... because one quantization scaling factor
    is discarded", arithmetic the accuracy gate (which measures the checkpoint) never sees: off by default, even
    for the large FP8 Hopper profile upstream advises it for; on when the profile says so."""
    doc = upstream("serving_guidance.json")["fp8_swiglu_fusion"]["accuracy_cost"]
    assert "one quantization scaling factor is discarded" in doc["quote"] and doc["commit"].startswith("cb4c622c")
    for path in GPU_PROFILES:
        args, cfg, _ = profile_argv(path)
        assert ("--gemm_swiglu_plugin" in args) == cfg.build.fp8_swiglu_fusion, path.name
    large = REPO_ROOT / "engine_configs" / "llama-3.1-70b-h100x4-fp8-tp4.yaml"
    args, _, _ = profile_argv(large)
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--reduce_fusion"] == "enable" and "--gemm_swiglu_plugin" not in opts
    assert opts["--gemm_plugin"] == "disable" and opts["--workers"] == "4"
    cfg = load_config(large, ["build.fp8_swiglu_fusion=true"]).config
    facts = profile_facts(cfg)
    args = targets.trtllm_build_argv(Path("ckpt"), Path("engine"), cfg=cfg, gpu=GPU(cfg.build.target_gpu, 90, "570.00"),
                                     facts=facts, input_timing_cache=Path("in.cache"),
                                     output_timing_cache=Path("out.cache"), gpu_count=facts.world_size)
    v, problems = parse_trtllm_build_argv(args)
    assert problems == [] and v["gemm_swiglu_plugin"] == "fp8" and v["use_fused_mlp"] == "enable"
    args, _, _ = profile_argv(REPO_ROOT / "engine_configs" / "llama-3.1-8b-a100-int8sq.yaml")
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--reduce_fusion"] == "disable" and "--gemm_swiglu_plugin" not in opts


def test_the_jetson_profile_is_refused_before_any_work_with_what_exists_for_orin():
    facts = upstream("trtllm_jetson.json")
    assert "kv_cache_type" in json.dumps(facts["q1_trtllm_build_options_v012"])
    assert "No Jetson support found" in facts["q2_awq_and_triton"]["triton_on_jetson"]
    # the Jetson profile is the edge target's (TensorRT Edge-LLM, tests/targets/test_edge.py); as a TensorRT-LLM
    # build on the Jetson line it is refused before any work
    jetson = ["build.target=tensorrt", "build.trtllm_version=0.12.0-jetson"]
    cfg = load_config(REPO_ROOT / "engine_configs" / "llama-3.2-1b-jetson-orin-edge.yaml", jetson).config
    b = cfg.build
    assert (b.max_batch_size, b.max_seq_len, b.cuda_graphs.enabled) == (2, 512, False)  # the seeds' edge settings
    problems = dict(rules.validity_problems(cfg, b.target_sm))
    assert "v0.12.0-jetson" in problems["trtllm_release_line"] and "no Jetson build" in problems["trtllm_release_line"]
    # a 1.2 version on an Orin is refused just the same: 1.2 has no Jetson build
    one_two = load_config(REPO_ROOT / "engine_configs" / "llama-3.2-1b-jetson-orin-edge.yaml",
                          ["build.target=tensorrt", "build.trtllm_version=1.2.1"]).config
    assert "v0.12.0-jetson" in dict(rules.validity_problems(one_two, 87))["trtllm_release_line"]


def test_the_projects_option_table_is_a_subset_of_upstreams():
    facts = upstream("trtllm_build_flags.json")
    theirs = {f["name"]: f for f in facts["flags"] + facts["plugin_flags"]}
    for name, opt in options.TRTLLM_BUILD_OPTIONS.items():
        assert name in theirs, name
        if opt.kind == "choice" and theirs[name].get("choices"):
            assert set(opt.choices) <= set(theirs[name]["choices"]), name


def test_blackwell_rejections_follow_upstreams_quant_mode_mapping():
    facts = upstream("serving_guidance.json")["blackwell_quant_rejection"]["quant_mode_mapping"]["facts"]
    every_algo = upstream("hf_unified_checkpoint.json")["quant_algo_enum"]["QuantAlgo"]
    rejected, accepted = set(), set()
    for line in facts:  # "A, B -> what mode.py makes of them => REJECTED" (or "not rejected"); "W8A8_SQ_*" globs
        head = line.split("->")[0].split("=>")[0].replace("/", ",")
        algos = {a for p in head.split(",") if p.strip() and " " not in p.strip()
                 for a in fnmatch.filter(every_algo, p.strip())}
        (accepted if "not rejected" in line.lower() else rejected if "REJECTED" in line else set()).update(algos)
    assert "W4A8_AWQ" in rejected
    assert rejected <= rules.BLACKWELL_REJECTED_ALGOS
    assert not (accepted & rules.BLACKWELL_REJECTED_ALGOS)
    cfg = load_config(REPO_ROOT / "engine_configs" / "llama-3.1-8b-h100-fp8.yaml",
                      ["quantization.weight_format=w4a8_awq"]).config
    problems = dict(rules.validity_problems(cfg, 100))
    assert "W4A8_AWQ" in problems["blackwell_int8"] and "w4a8_awq" not in problems["blackwell_int8"]


# ====================================================================================== the tensorrt_llm model
def tensorrt_configs(path: Path, *overrides: str) -> tuple[dict, pub.ModelNames, BuildSettings]:
    """The Triton configs publish writes for a profile's tensorrt build (settings as the build writes them)."""
    cfg = load_config(path, ["triton.serving_repository_path=/models", *overrides]).config
    facts = profile_facts(cfg)
    settings = build_settings(cfg, "tensorrt", artifact_dir="engine", kv_algo=facts.kv_cache_quant_algo,
                              cuda_graphs=rules.cuda_graph_settings(cfg.build), trtllm_version=cfg.build.trtllm_version,
                              provenance={}, ckpt_hash="ab" * 32,
                              enable_chunked_context=rules.chunked_context(cfg.build, facts, cfg.build.target_sm))
    names = pub.model_names(cfg.triton.model_name)
    return pub.build_model_configs(cfg.triton, settings, names=names, version=1,
                                   serving_root="/models"), names, settings


def _backend_parses(kind: str, value: str) -> bool:
    """Whether the backend's typed GetParameter accepts a string (tensorrtllm_backend_parameters.json semantics)."""
    try:
        if kind.startswith(("int", "uint", "size_t")):
            int(value)
        elif kind.startswith("float"):
            float(value)
        elif kind.startswith("bool"):
            return value in ("True", "true", "TRUE", "1", "False", "false", "FALSE", "0")
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("path", GPU_PROFILES, ids=lambda p: p.stem)
def test_the_tensorrt_llm_model_has_every_parameter_the_backend_needs_and_only_known_ones(path):
    configs, names, _ = tensorrt_configs(path)
    facts = upstream("tensorrtllm_backend_parameters.json")
    written = {k: v.string_value for k, v in configs[names.tensorrt_llm].parameters.items()}
    missing = [k for k in facts["unguarded_keys"] if k not in written]
    assert missing == [], f"the backend fails to load without {missing}"
    known = {p["key"]: p for p in facts["parameters"]}
    unknown = set(written) - set(known) - set(facts["template_parameters_not_read_by_cpp"]["keys"])
    assert unknown == set(), f"keys the backend does not read: {unknown}"
    assert not set(written) & set(facts["orchestrator_only_keys"])  # leader mode: see serving/launch.py
    for key, value in written.items():
        if key in known:
            assert _backend_parses(known[key]["type"], value), f"{key}={value!r} is not a {known[key]['type']}"
    assert written["gpt_model_type"] in ("V1", "v1", "inflight_batching", "inflight_fused_batching")
    assert written["batch_scheduler_policy"] in ("max_utilization", "guaranteed_no_evict")
    assert written["guided_decoding_backend"] == "" and written["xgrammar_tokenizer_info_path"] == ""  # off
    assert written["tokenizer_dir"] == f"/models/{names.preprocessing}/1/tokenizer"


def test_chunked_context_is_on_with_paged_context_fmha_and_needs_a_block_multiple():
    fp8 = REPO_ROOT / "engine_configs" / "llama-3.1-8b-h100-fp8.yaml"
    configs, names, settings = tensorrt_configs(fp8)
    assert configs[names.tensorrt_llm].parameters["enable_chunked_context"].string_value == "true"
    int8 = REPO_ROOT / "engine_configs" / "llama-3.1-8b-a100-int8sq.yaml"  # INT8 KV: no paged context FMHA
    configs, names, _ = tensorrt_configs(int8)
    assert configs[names.tensorrt_llm].parameters["enable_chunked_context"].string_value == "false"
    cfg = load_config(fp8, ["build.max_num_tokens=8200"]).config
    problems = dict(rules.validity_problems(cfg, 90))
    assert "Use max_num_tokens 8192 or 8224" in problems["chunked_context_max_num_tokens"]
    cfg = load_config(fp8, ["build.max_num_tokens=8200", "build.chunked_context=false"]).config
    assert rules.validity_problems(cfg, 90) == []


def _io(msg) -> tuple[dict, dict]:
    dtype = pb2.DataType.Name
    return ({i.name: (dtype(i.data_type), list(i.dims), list(i.reshape.shape) if i.HasField("reshape") else None,
                      i.optional) for i in msg.input},
            {o.name: (dtype(o.data_type), list(o.dims)) for o in msg.output})


def test_the_tensorrt_llm_models_tensors_are_the_backends():
    configs, names, _ = tensorrt_configs(GPU_PROFILES[0])
    ours_in, ours_out = _io(configs[names.tensorrt_llm])
    theirs = upstream("tensorrtllm_backend_tensors.json")["tensorrt_llm"]
    their_in = {t["name"]: t for t in theirs["inputs"]}
    their_out = {t["name"]: t for t in theirs["outputs"]}
    assert set(ours_in) <= set(their_in), f"inputs the backend does not read: {set(ours_in) - set(their_in)}"
    required = {n for n, t in their_in.items() if not t["optional"]}
    assert required <= set(ours_in)
    for name, (dtype, dims, reshape, _) in ours_in.items():
        t = their_in[name]
        assert (dtype, dims) == (t["data_type"], t["dims"]), name
        assert reshape == t.get("reshape"), name
    assert "seed" in ours_in and "random_seed" not in ours_in
    for name, (dtype, dims) in ours_out.items():
        assert (dtype, dims) == (their_out[name]["data_type"], their_out[name]["dims"]), name


def test_the_ensembles_client_inputs_are_named_and_typed_as_upstreams():
    configs, names, _ = tensorrt_configs(GPU_PROFILES[0])
    ours, outs = _io(configs[names.ensemble])
    theirs = {t["name"]: t for t in upstream("tensorrtllm_backend_tensors.json")["ensemble"]["inputs"]}
    shared = set(ours) & set(theirs)
    assert {"text_input", "max_tokens", "stop_words", "end_id", "temperature", "top_k", "top_p", "seed"} <= shared
    for name in shared:
        assert (ours[name][0], ours[name][1]) == (theirs[name]["data_type"], theirs[name]["dims"]), name
    assert {n for n, t in theirs.items() if not t["optional"]} <= set(ours)
    assert outs["text_output"] == ("TYPE_STRING", [-1])
    # every ensemble step feeds each model a tensor of the type that model declares
    tensors = {n: v[0] for n, v in ours.items()}
    for step in configs[names.ensemble].ensemble_scheduling.step:
        model_in, model_out = _io(configs[step.model_name])
        for theirs_name, ours_name in step.input_map.items():
            assert tensors[ours_name] == model_in[theirs_name][0], (step.model_name, theirs_name)
        for theirs_name, ours_name in step.output_map.items():
            tensors[ours_name] = model_out[theirs_name][0]


# ====================================================================================== multi-GPU launch
def test_a_tensor_parallel_repository_starts_one_rank_per_gpu_as_upstreams_launcher_does():
    shape = upstream("serving_guidance.json")["mpi_world_size"]["launch_script"]["command_shape"]
    assert shape.startswith("mpirun --allow-run-as-root") and "--load-model=" in shape
    configs, names, settings = tensorrt_configs(REPO_ROOT / "engine_configs" / "llama-3.1-70b-h100x4-fp8-tp4.yaml")
    world = settings.tensor_parallel_size * settings.pipeline_parallel_size
    assert world == 4  # the executor checks MPI size == TP * PP (worldConfig.cpp)
    flags = ["--model-repository=/models", "--http-port=8000", "--disable-auto-complete-config"]
    argv = launch.server_argv("tritonserver", flags, world, names.tensorrt_llm)
    assert argv[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = " ".join(argv[2:]).split(" : ")
    assert len(ranks) == world
    prefixes = set()
    for rank, text in enumerate(ranks):
        words = text.split()
        assert words[:3] == ["-n", "1", "tritonserver"] and set(flags) <= set(words)
        prefixes |= {w for w in words if w.startswith(launch.SHM_PREFIX_FLAG)}
        loads = [w for w in words if w.startswith("--load-model=")]
        if rank == 0:
            assert loads == [] and "--model-control-mode=explicit" not in words  # rank 0 serves every model
        else:
            assert loads == [f"--load-model={names.tensorrt_llm}"] and "--model-control-mode=explicit" in words
    assert len(prefixes) == world  # each rank its own Python-backend shared memory
    assert launch.server_argv("tritonserver", flags, 1, names.tensorrt_llm) == ["tritonserver", *flags]


def test_the_gpu_image_starts_through_the_launcher_and_reads_provenance(tmp_path):
    from pipeline import artifacts

    assert launch.PROVENANCE_FILE == artifacts.PROVENANCE_FILE
    entry = next(line for line in (REPO_ROOT / "Dockerfile").read_text().split("FROM ")[1].splitlines()
                 if line.startswith("ENTRYPOINT"))
    assert '"python3", "-m", "pipeline.serving.launch", "tritonserver"' in entry
    # publish writes server_ranks: world_size for the tensorrt target's engine per rank (Target.engine_per_rank)
    build = {"target": "tensorrt", "world_size": 4, "server_ranks": 4, "tensorrt_llm_model": "m_x"}
    (tmp_path / "provenance.json").write_text(json.dumps({"build": build}))
    assert launch.read_serving_needs(tmp_path) == (4, "m_x")
    (tmp_path / "provenance.json").write_text(json.dumps({"build": {**build, "target": "pytorch", "server_ranks": 1}}))
    assert launch.read_serving_needs(tmp_path) == (1, "m_x")  # the LLM API starts its own ranks


# ====================================================================================== the pytorch target
def test_the_pytorch_targets_llm_api_options_and_sampling_params_are_upstream_fields():
    facts = upstream("llm_api_fields.json")
    names = lambda section: {f["name"] for f in facts[section]["fields"]}  # noqa: E731
    top = names("BaseLlmArgs") | names("TorchLlmArgs")
    nested = {"kv_cache_config": names("KvCacheConfig"), "cuda_graph_config": names("CudaGraphConfig"),
              "scheduler_config": names("SchedulerConfig"), "dynamic_batch_config": names("DynamicBatchConfig")}

    def check(table: dict) -> None:
        for key, kind in table.items():
            if isinstance(kind, dict):
                assert {k for k in kind if k != "nullable"} <= nested[key], key
                check({k: v for k, v in kind.items() if k != "nullable"})

    assert set(options.LLM_API_OPTIONS) <= top, set(options.LLM_API_OPTIONS) - top
    check(options.LLM_API_OPTIONS)
    tree = ast.parse((REPO_ROOT / "triton_repo" / "tensorrt_llm_pytorch" / "model.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "_sampling"]
    assert calls, "the SamplingParams call was not found"
    passed = {k.arg for k in calls[0].keywords}
    assert passed <= names("SamplingParams"), passed - names("SamplingParams")
    assert "seed" in passed


def test_the_hf_unified_checkpoint_names_algos_the_loader_knows():
    facts = upstream("hf_unified_checkpoint.json")
    algos = set(facts["quant_algo_enum"]["QuantAlgo"])
    for fmt, algo in formats.TRTLLM_QUANT_ALGO.items():
        assert algo is None or algo in algos, fmt
    for kv in formats.KV_CACHE_ALGOS.values():
        assert kv is None or kv in facts["quant_algo_enum"]["KV_CACHE_QUANT_ALGO_LIST"]
    read = {f["json_path"] for f in facts["fields_read"]}
    assert {"quantization.quant_algo", "quantization.kv_cache_quant_algo", "quantization.quantized_layers"} <= read


def test_phi3s_fused_linears_are_planned_in_the_formats_the_pytorch_backend_loads():
    """Phi-3 on the pytorch target: TensorRT-LLM's own Phi3ForCausalLM.load_weights splits qkv_proj and
    gate_up_proj and hands the halves per-tensor scales only; the family table allows exactly the formats that
    survive that (pytorch_fused_loaders.json), and the quantize stage refuses the others before any work."""
    from pipeline import families

    facts = upstream("pytorch_fused_loaders.json")["phi3"]
    fused, loadable = families.FAMILIES["phi3"].fused_formats
    assert set(fused) == {f.rsplit(".", 1)[-1] for f in facts["fused_linears"]}
    assert set(loadable) == {f for f, how in facts["formats"].items() if how.startswith("loads:")}
    assert set(facts["formats"]) == set(formats.FORMATS)  # every format the pipeline writes was looked at
    assert "pre_quant_scale" in facts["not_carried"] and not formats.FORMATS["fp8"].awq


def test_the_serving_keys_reach_the_llm_api_and_the_backend_as_upstream_names_and_values():
    """triton.max_running / scheduler_policy / kv_cache_free_gpu_memory_fraction / adaptive_batch, as publish
    hands them to each GPU target: the pytorch target's LLM-API options, the tensorrt target's parameters."""
    facts = upstream("llm_api_fields.json")
    fp8 = REPO_ROOT / "engine_configs" / "llama-3.1-8b-h100-fp8.yaml"
    keys = ["triton.scheduler_policy=max_utilization", "triton.kv_cache_free_gpu_memory_fraction=0.95"]
    cfg = load_config(fp8, ["build.target=pytorch", "quantization.export_hf_checkpoint=true",
                            "triton.max_running=48", "triton.adaptive_batch=true", *keys]).config
    built = targets.llm_api_options(cfg)
    served = targets.serving_llm_api_options(built, cfg.triton)
    assert options.check_llm_api_options(served) == []
    assert served["max_batch_size"] == 48 and built["max_batch_size"] == 128
    assert served["cuda_graph_config"]["batch_sizes"] == [1, 2, 4, 8, 16, 32, 48]  # none beyond the batch limit
    assert served["kv_cache_config"]["free_gpu_memory_fraction"] == 0.95
    policy = next(f for f in facts["SchedulerConfig"]["fields"] if f["name"] == "capacity_scheduler_policy")
    assert served["scheduler_config"]["capacity_scheduler_policy"] in policy["enum_values"]
    dynamic = served["scheduler_config"]["dynamic_batch_config"]
    # DynamicBatchConfig's three fields have no default upstream: all are written
    assert set(dynamic) == {f["name"] for f in facts["DynamicBatchConfig"]["fields"]}
    assert dynamic["dynamic_batch_moving_average_window"] == facts["DynamicBatchConfig"]["window_default"]["value"]
    assert targets.serving_llm_api_options(built, load_config(fp8, ["build.target=pytorch",
                                           "quantization.export_hf_checkpoint=true"]).config.triton) == built
    # the tensorrt target: the same keys as the backend's parameters, values it parses
    cfg = load_config(fp8, keys).config
    facts = rules.facts_from_config(cfg)
    settings = build_settings(cfg, "tensorrt", artifact_dir="engine", kv_algo=facts.kv_cache_quant_algo,
                              cuda_graphs=rules.cuda_graph_settings(cfg.build), trtllm_version=cfg.build.trtllm_version,
                              provenance={}, ckpt_hash="ab" * 32, enable_chunked_context=True)
    names = pub.model_names(cfg.triton.model_name)
    params = pub.build_model_configs(cfg.triton, settings, names=names, version=1,
                                     serving_root="/models")[names.tensorrt_llm].parameters
    backend = {p["key"]: p for p in upstream("tensorrtllm_backend_parameters.json")["parameters"]}
    assert params["batch_scheduler_policy"].string_value == "max_utilization"
    assert "max_utilization" in backend["batch_scheduler_policy"]["note"]  # accepted: max_utilization | ...
    assert params["kv_cache_free_gpu_mem_fraction"].string_value == "0.95"
    assert _backend_parses(backend["kv_cache_free_gpu_mem_fraction"]["type"], "0.95")


# ====================================================================================== request classes
def test_request_classes_use_tritons_levels_and_only_the_cpu_runtime_reads_them():
    """Triton's priority levels are dynamic_batching fields, 1 the highest (publish sets them there); a
    Python-backend model cannot read a request's Triton priority, so the class travels as the `priority` input;
    the tensorrtllm backend has no such input and sets no executor priority, and the pinned LLM API's
    generate_async takes none, so triton.priority_levels is refused there with the reason; vLLM orders its
    queue the lower value first, as Triton's levels (tests/data/upstream/request_priority.json)."""
    facts = upstream("request_priority.json")
    assert "1 is the highest" in facts["triton_priority_levels"]["facts"]["order"]
    fields = pb2.ModelDynamicBatching.DESCRIPTOR.fields_by_name
    assert {"priority_levels", "default_priority_level"} <= set(fields)
    assert "priority_levels" not in pb2.ModelSequenceBatching.DESCRIPTOR.fields_by_name
    assert "priority" not in {t["name"] for t in upstream("tensorrtllm_backend_tensors.json")["tensorrt_llm"]["inputs"]}
    assert "no priority" in facts["python_backend_reads_no_priority"]["facts"]["accessors"]
    reasons = {"tensorrt": "sets no executor request priority", "pytorch": "generate_async takes no priority"}
    configs = {"tensorrt": (GPU_PROFILES[0], ["build.target=tensorrt"]),
               "pytorch": (GPU_PROFILES[0], ["build.target=pytorch", "quantization.export_hf_checkpoint=true"])}
    for target, (path, sets) in configs.items():
        load_config(path, sets)  # valid without request classes
        with pytest.raises(Exception, match=rf"triton\.priority_levels: .*{reasons[target]}"):
            load_config(path, [*sets, "triton.priority_levels=2"])


# ====================================================================================== model families
def test_the_pytorch_target_is_offered_only_for_architectures_the_backend_lists():
    """A family gets the pytorch target only where TensorRT-LLM's PyTorch backend lists its architecture on the
    1.2 line; DeepSeek-V2 is listed nowhere up to 1.3.0rc13, so it is not offered that target (its refusal
    says why)."""
    from pipeline import families
    from pipeline.errors import InputError

    facts = upstream("pytorch_backend_models.json")
    on_12 = set(facts["listed"]["unversioned_1.2_line"]) | set(facts["listed"]["docs_source_89336fbf"])
    offered = {f.hf_architecture for f in families.FAMILIES.values() if "pytorch" in f.targets}
    assert offered <= on_12, offered - on_12
    deepseek = families.FAMILIES["deepseek_v2"]
    assert deepseek.hf_architecture not in on_12 and "pytorch" not in deepseek.targets
    assert "unversioned_1.2_line" in facts["deepseek_v2"]["absent_from"]
    with pytest.raises(InputError, match="TensorRT-LLM 1.2's PyTorch backend does not list DeepseekV2ForCausalLM"):
        families.family("deepseek_v2", "pytorch")
