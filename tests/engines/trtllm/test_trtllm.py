"""The GPU targets (pipeline/engines/trtllm/), without a GPU or TensorRT-LLM: contract tests of every shipped
profile against the option table and rules, one test per validity rule, GPU/requirements detection, and the
tensorrt path end to end through `invoke build` against stand-ins for `trtllm-build` and `nvidia-smi`
(tests/bin/, installed under those names in a temporary PATH directory) that record and check what they are
called with. The point is the orchestration, not TensorRT: no engine is built here."""

from __future__ import annotations

import json
import re
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_invoke, tiny_config

from pipeline.config import load_config
from pipeline.engines.trtllm import options, preflight, rules, targets
from pipeline.engines.trtllm.preflight import GPU
from pipeline.engines.trtllm.rules import QuantFacts
from pipeline.errors import ConfigError, EnvironmentProblem, InputError, StageFailed

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

CONFIGS = sorted((REPO / "engine_configs").glob("*.yaml"))
GPU_CONFIGS = [p for p in CONFIGS if load_config(p).config.build.target in ("tensorrt", "pytorch")]
STANDIN_BIN = REPO / "tests" / "bin"
STANDIN_TRTLLM_VERSION = "1.2.1"


def _cfg(name: str, *overrides: str):
    return load_config(REPO / "engine_configs" / name, list(overrides)).config


def _rules(cfg, sm, facts=None) -> set[str]:
    return {rule for rule, _ in rules.validity_problems(cfg, sm, facts)}


# ---------------------------------------------------------------------------------------------- stand-ins


def _install(src: Path, dest: Path) -> None:
    """Copy a stand-in script, pointing its shebang at this Python (which has the pipeline installed)."""
    text = src.read_text().split("\n", 1)[1]
    dest.write_text(f"#!{sys.executable}\n{text}")
    dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def make_standins(root: Path, trtllm_build: bool = True, gpu: bool = True,
                  trtllm_version: str | None = STANDIN_TRTLLM_VERSION) -> dict:
    """A PATH dir with stand-in `trtllm-build` / `nvidia-smi`, and a site dir with a stand-in `tensorrt_llm`
    distribution (metadata only; importing it raises). Returns the environment to run with."""
    bin_dir, site = root / "standin-bin", root / "standin-site"
    bin_dir.mkdir(parents=True)
    site.mkdir()
    if trtllm_build:
        _install(STANDIN_BIN / "trtllm-build-recorder", bin_dir / "trtllm-build")
    if gpu:
        _install(STANDIN_BIN / "nvidia-smi-standin", bin_dir / "nvidia-smi")
    if trtllm_version:
        pkg = site / "tensorrt_llm"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(
            "raise ImportError('stand-in tensorrt_llm from tests/engines/trtllm/test_trtllm.py: "
            "metadata only, never imported')\n")
        for dist, version in (("tensorrt_llm", trtllm_version), ("tensorrt", "10.13.0")):
            info = site / f"{dist}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                           f"Summary: STAND-IN for tests (not NVIDIA's package)\n")
    return {"PATH": str(bin_dir), "PYTHONPATH": str(site), "TRTLLM_BUILD_RECORD": str(root / "trtllm-build.jsonl"),
            "CUDA_VERSION": "12.9.0", "STANDIN_GPU_NAME": "NVIDIA H100 80GB HBM3", "STANDIN_GPU_COMPUTE_CAP": "9.0",
            "STANDIN_GPU_COUNT": "1"}


@pytest.fixture
def standins(tmp_path, monkeypatch):
    """Stand-ins active in this process: PATH, sys.path and the stand-in environment variables."""
    def activate(**kwargs) -> dict:
        env = make_standins(tmp_path / "standins", **kwargs)
        for key, value in env.items():
            if key == "PYTHONPATH":  # this process finds the stand-in package; so does the stand-in trtllm-build
                monkeypatch.syspath_prepend(value)
            monkeypatch.setenv(key, value)
        return env
    return activate


def _records(env: dict) -> list[dict]:
    path = Path(env["TRTLLM_BUILD_RECORD"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _synthetic_checkpoint(path: Path, quant_algo="FP8", kv="FP8", tp=1) -> Path:
    """A TensorRT-LLM checkpoint folder as quantize writes it (config.json + rank files; the weights are
    placeholder bytes: the stand-in trtllm-build only reads config.json)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 2,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}}))
    for rank in range(tp):
        (path / f"rank{rank}.safetensors").write_bytes(f"placeholder weights of rank {rank}".encode())
    return path


# ---------------------------------------------------------------------------------------------- the table


def test_option_table_names_types_and_sources():
    for name, opt in options.TRTLLM_BUILD_OPTIONS.items():
        assert re.fullmatch(r"--[a-z_0-9]+", name), name
        assert opt.kind in ("int", "path", "choice", "flag"), name
        assert (opt.kind == "choice") == bool(opt.choices), name
        assert opt.source.startswith(("tensorrt_llm/", "docs")), name
    # the 1.2 facts the rest relies on
    assert options.TRTLLM_BUILD_OPTIONS["--kv_cache_type"].choices == ("continuous", "paged", "disabled")
    assert "fp8" in options.TRTLLM_BUILD_OPTIONS["--gemm_plugin"].choices
    assert "--paged_kv_cache" not in options.TRTLLM_BUILD_OPTIONS  # deprecated: --kv_cache_type paged
    for rule in rules.RULES.values():
        assert rule.text and rule.source
    assert {r["id"] for r in rules.rules_table()} == set(rules.RULES)


def test_argv_checker_refuses_what_trtllm_build_would():
    ok = ["--checkpoint_dir", "c", "--output_dir", "o", "--tokens_per_block", "32"]
    assert options.check_trtllm_build_argv(ok) == []
    assert "unknown option" in options.check_trtllm_build_argv(ok + ["--paged_kv_cache", "enable"])[0]
    assert "invalid choice" in " ".join(options.check_trtllm_build_argv(ok + ["--gemm_plugin", "int8"]))
    assert "invalid choice" in " ".join(options.check_trtllm_build_argv(ok + ["--use_paged_context_fmha", "true"]))
    assert "more than once" in " ".join(options.check_trtllm_build_argv(ok + ["--output_dir", "p"]))
    assert "--checkpoint_dir is required" in options.check_trtllm_build_argv(["--output_dir", "o"])
    assert "positive" in " ".join(options.check_trtllm_build_argv(ok + ["--max_batch_size", "0"]))


def test_cuda_graph_batch_sizes():
    b = _cfg("llama-3.1-8b-h100-fp8.yaml").build
    assert rules.cuda_graph_batch_sizes(b) == [1, 2, 4, 8, 16, 32, 64, 128]
    odd = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.max_batch_size=48", "bench.concurrency=[1,8]").build
    assert rules.cuda_graph_batch_sizes(odd) == [1, 2, 4, 8, 16, 32, 48]
    explicit = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.cuda_graphs.batch_sizes=[1,8,64]").build
    assert rules.cuda_graph_batch_sizes(explicit) == [1, 8, 64]
    assert rules.cuda_graph_settings(explicit) == {"enabled": True, "batch_sizes": [1, 8, 64], "enable_padding": True,
                                                   "cuda_graph_mode": True, "cuda_graph_cache_size": 3}
    one = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.max_batch_size=1", "bench.concurrency=[1]").build
    assert rules.cuda_graph_batch_sizes(one) == [1]
    off = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.cuda_graphs.enabled=false").build
    assert rules.cuda_graph_settings(off) == {"enabled": False, "batch_sizes": [], "enable_padding": False,
                                              "cuda_graph_mode": False, "cuda_graph_cache_size": 0}


# ---------------------------------------------------------------------------------------------- shipped configs


def test_the_shipped_gpu_profiles():
    names = {p.name for p in GPU_CONFIGS}
    assert {"llama-3.1-8b-h100-fp8.yaml", "llama-3.1-8b-a100-int8sq.yaml", "mistral-7b-l40s-int4awq.yaml",
            "llama-3.1-70b-h100x4-fp8-tp4.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_contract(path):
    loaded = load_config(path)
    cfg, b = loaded.config, loaded.config.build
    if b.target in ("cpu", "vllm", "edge"):
        assert preflight.check_target_requirements(cfg) is None  # these targets need nothing of this module
        if b.target == "edge":  # the Jetson profile: TensorRT Edge-LLM (tests/targets/test_edge.py)
            return
        preflight.preflight(loaded)
        return
    # pinned to a real commit, sized for a named GPU, on the 1.2 line (the Jetson profile: refused, see
    # tests/engines/trtllm/test_upstream_contract.py)
    assert cfg.model.source.kind == "hub" and cfg.model.source.pinned, "GPU profiles pin a 40-character revision"
    if b.target_sm == rules.JETSON_ORIN_SM:
        assert [r for r, _ in rules.validity_problems(cfg, b.target_sm)] == ["trtllm_release_line"]
        return
    assert b.target_gpu and b.target_sm and b.trtllm_version.startswith("1.2.")
    assert rules.validity_problems(cfg, b.target_sm) == []
    facts = rules.facts_from_config(cfg)
    gpu = GPU(b.target_gpu, b.target_sm, "570.00")
    gpus = b.tensor_parallel_size * b.pipeline_parallel_size
    args = targets.trtllm_build_argv(Path("ckpt"), Path("engine"), cfg=cfg, gpu=gpu, facts=facts,
                                     input_timing_cache=Path("in.cache"), output_timing_cache=Path("out.cache"),
                                     gpu_count=gpus)
    assert options.check_trtllm_build_argv(args) == []
    opts = dict(zip(args[::2], args[1::2]))
    assert set(opts) <= set(options.TRTLLM_BUILD_OPTIONS)
    assert opts["--kv_cache_type"] == "paged" and opts["--tokens_per_block"] == str(b.kv_cache.tokens_per_block)
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        assert opts[f"--{key}"] == str(getattr(b, key))
    assert opts["--workers"] == str(gpus)
    assert opts["--multiple_profiles"] == ("enable" if b.multiple_profiles else "disable")
    assert opts["--input_timing_cache"] == "in.cache" and opts["--output_timing_cache"] == "out.cache"
    kv = facts.kv_cache_quant_algo
    assert opts["--gemm_plugin"] == ("disable" if facts.quant_algo in ("FP8", "W8A8_SQ_PER_CHANNEL") else "auto")
    if kv == "INT8":
        assert opts["--use_paged_context_fmha"] == "disable" and not b.kv_cache.enable_block_reuse
    if b.kv_cache.enable_block_reuse:
        assert opts["--use_paged_context_fmha"] == "enable"
    if facts.quant_algo == "FP8" and kv == "FP8" and b.target_sm >= 89:
        assert opts["--use_fp8_context_fmha"] == "enable" and opts["--use_paged_context_fmha"] == "enable"
    # the same profile through the LLM API (pytorch target), where its KV cache allows
    if kv == "INT8":
        with pytest.raises(ConfigError, match="int8 cannot be served by TensorRT-LLM's LLM API"):
            targets.llm_api_options(cfg)
    else:
        llm = load_config(path, ["build.target=pytorch", "quantization.export_hf_checkpoint=true"]).config
        assert rules.validity_problems(llm, b.target_sm) == []
        api = targets.llm_api_options(llm)
        assert options.check_llm_api_options(api) == []
        assert api["kv_cache_config"]["dtype"] == ("fp8" if kv == "FP8" else "auto")
        assert api["kv_cache_config"]["tokens_per_block"] == b.kv_cache.tokens_per_block
        assert api["tensor_parallel_size"] == b.tensor_parallel_size
        if b.cuda_graphs.enabled:
            assert api["cuda_graph_config"] == {"batch_sizes": rules.cuda_graph_batch_sizes(b),
                                                "enable_padding": b.cuda_graphs.enable_padding}
        else:
            assert api["cuda_graph_config"] is None


def test_llm_api_option_checker():
    good = targets.llm_api_options(_cfg("llama-3.1-8b-h100-fp8.yaml", "build.target=pytorch",
                                        "quantization.export_hf_checkpoint=true"))
    assert options.check_llm_api_options(good) == []
    unknown = options.check_llm_api_options({**good, "cuda_graph_batch_sizes": [1]})
    assert "unknown option cuda_graph_batch_sizes" in unknown[0]
    bad_kv = {**good, "kv_cache_config": {**good["kv_cache_config"], "dtype": "int8"}}
    assert "allowed ['auto', 'fp8']" in options.check_llm_api_options(bad_kv)[0]
    bad_frac = {**good, "kv_cache_config": {**good["kv_cache_config"], "free_gpu_memory_fraction": 1.5}}
    assert "between 0 and 1" in options.check_llm_api_options(bad_frac)[0]
    too_big = {**good, "cuda_graph_config": {"batch_sizes": [1, 512], "enable_padding": True}}
    assert "beyond max_batch_size" in options.check_llm_api_options(too_big)[0]
    assert options.check_llm_api_options({**good, "cuda_graph_config": None}) == []


# ---------------------------------------------------------------------------------------------- each rule


RULE_CASES = {
    # rule id: (config, overrides, sm to check against)
    "trtllm_release_line": ("llama-3.1-8b-h100-fp8.yaml", ["build.trtllm_version=1.3.0"], 90),
    "int8_kv_paged_context_fmha": ("llama-3.1-8b-a100-int8sq.yaml", ["build.use_paged_context_fmha=true"], 80),
    "block_reuse_needs_paged_context_fmha": ("llama-3.1-8b-a100-int8sq.yaml",
                                             ["build.kv_cache.enable_block_reuse=true"], 80),
    "fp8_kv_paged_context_fmha": ("mistral-7b-l40s-int4awq.yaml", ["build.use_paged_context_fmha=true"], 89),
    "fp8_needs_sm89": ("llama-3.1-8b-h100-fp8.yaml", [], 80),
    "int8_int4_need_sm80": ("llama-3.1-8b-a100-int8sq.yaml", [], 75),
    "bf16_needs_sm80": ("mistral-7b-l40s-int4awq.yaml", ["build.dtype=bfloat16"], 75),
    "blackwell_int8": ("llama-3.1-8b-a100-int8sq.yaml", [], 100),
    "max_num_tokens_bounds": ("llama-3.1-8b-a100-int8sq.yaml", ["build.max_num_tokens=300000"], 80),
    "chunked_context_needs_paged_context_fmha": ("llama-3.1-8b-a100-int8sq.yaml", ["build.chunked_context=true"], 80),
    "chunked_context_max_num_tokens": ("llama-3.1-8b-h100-fp8.yaml", ["build.max_num_tokens=8200"], 90),
    "fp8_swiglu_fusion": ("llama-3.1-8b-a100-int8sq.yaml", ["build.fp8_swiglu_fusion=true"], 80),
    "gemm_plugin_fp8": ("llama-3.1-8b-a100-int8sq.yaml", ["build.gemm_plugin=fp8"], 80),
}
ARGV_RULE_CASES = {
    "tokens_per_block_pow2": ["--tokens_per_block", "48"],
    "opt_num_tokens_multiple_profiles": ["--multiple_profiles", "enable", "--opt_num_tokens", "64"],
    "paged_context_fmha_needs_paged_kv": ["--use_paged_context_fmha", "enable", "--context_fmha", "disable"],
    "max_input_len_bounds": ["--max_input_len", "2048", "--max_seq_len", "1024"],
}
OTHER_RULE_TESTS = {  # rules whose trigger needs more than a config and a GPU: tested below by name
    "trtllm_version_installed": "test_installed_trtllm_must_be_the_pinned_version",
    "target_gpu": "test_a_profile_refuses_another_gpu",
    "pytorch_int8_kv": "test_pytorch_target_refuses_int8_kv",
    "checkpoint_matches_config": "test_checkpoint_must_match_the_config",
}


def test_every_rule_has_a_test_that_triggers_it():
    assert set(RULE_CASES) | set(ARGV_RULE_CASES) | set(OTHER_RULE_TESTS) == set(rules.RULES)
    for name in OTHER_RULE_TESTS.values():
        assert callable(globals()[name])


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_rule_triggers(rule):
    name, overrides, sm = RULE_CASES[rule]
    profile = _cfg(name)
    assert rules.validity_problems(profile, profile.build.target_sm) == []  # valid on its own GPU
    assert rule in _rules(_cfg(name, *overrides), sm)
    cfg = _cfg(name, *overrides)
    with pytest.raises(ConfigError, match=rf"\[{rule}\]"):
        rules.enforce_rules(cfg, sm)


@pytest.mark.parametrize("rule", sorted(ARGV_RULE_CASES))
def test_argv_rule_triggers(rule):
    base = ["--checkpoint_dir", "c", "--output_dir", "o"]
    assert options.check_trtllm_build_argv(base) == []
    problems = options.check_trtllm_build_argv(base + ARGV_RULE_CASES[rule])
    assert any(p.startswith(f"[{rule}]") for p in problems), problems


def test_rule_details():
    # tokens_per_block: the config refuses a non-power of two before anything else sees it
    with pytest.raises(ConfigError, match="power of two"):
        _cfg("llama-3.1-8b-h100-fp8.yaml", "build.kv_cache.tokens_per_block=48")
    # FP8 KV + paged context FMHA: also refused below SM 89 with FP8 weights
    h100 = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.use_paged_context_fmha=true")
    assert "fp8_kv_paged_context_fmha" in _rules(h100, 86) and "fp8_kv_paged_context_fmha" not in _rules(h100, 90)
    # ... and unset, it is simply off there, which takes block reuse with it
    assert "block_reuse_needs_paged_context_fmha" in _rules(_cfg("llama-3.1-8b-h100-fp8.yaml"), 86)
    # Blackwell: INT4 weight-only rejected on SM 100-119, not on SM 120; FP8 fine on both
    awq = _cfg("mistral-7b-l40s-int4awq.yaml")
    assert "blackwell_int8" in _rules(awq, 100) and "blackwell_int8" not in _rules(awq, 120)
    assert _rules(_cfg("llama-3.1-8b-h100-fp8.yaml"), 100) == set()
    # max_num_tokens below tokens_per_block
    assert "max_num_tokens_bounds" in _rules(_cfg("llama-3.2-1b-jetson-orin-edge.yaml", "build.target=tensorrt",
                                                   "build.max_num_tokens=16"), 87)
    # a MIXED_PRECISION checkpoint is judged by every algo in quant_cfg.json
    mixed = QuantFacts("MIXED_PRECISION", "FP8", frozenset({"FP8", "W8A16"}))
    assert "blackwell_int8" in _rules(_cfg("llama-3.1-8b-h100-fp8.yaml"), 100, mixed)


def test_pytorch_target_refuses_int8_kv():
    a100 = _cfg("llama-3.1-8b-a100-int8sq.yaml")
    with pytest.raises(ConfigError, match=r"\[pytorch_int8_kv\]"):
        targets.llm_api_options(a100)
    as_pytorch = a100.model_copy(update={"build": a100.build.model_copy(update={"target": "pytorch"})})
    assert "pytorch_int8_kv" in _rules(as_pytorch, 80)
    with pytest.raises(ConfigError, match="not supported by the pytorch target"):  # the config says so first
        _cfg("llama-3.1-8b-a100-int8sq.yaml", "build.target=pytorch")


def test_checkpoint_must_match_the_config(tmp_path):
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml")
    preflight.check_checkpoint_matches(cfg, preflight.facts_from_checkpoint(_synthetic_checkpoint(tmp_path / "ok")))
    for name, kwargs, said in (("kv", {"kv": "INT8"}, "kv_cache_quant_algo is INT8"),
                               ("weights", {"quant_algo": "W8A8_SQ_PER_CHANNEL"}, "quant_algo is W8A8_SQ_PER_CHANNEL"),
                               ("tp", {"tp": 2}, "mapping tp_size=2")):
        facts = preflight.facts_from_checkpoint(_synthetic_checkpoint(tmp_path / name, **kwargs))
        with pytest.raises(InputError, match=said):
            preflight.check_checkpoint_matches(cfg, facts)


# ---------------------------------------------------------------------------------------------- requirements


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert preflight.detect_gpus() is None and preflight.detect_gpu() is None


def test_gpu_detection_reads_nvidia_smi(tmp_path, monkeypatch):
    env = make_standins(tmp_path, trtllm_build=False, trtllm_version=None)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("STANDIN_GPU_NAME", "NVIDIA L40S")
    monkeypatch.setenv("STANDIN_GPU_COMPUTE_CAP", "8.9")
    monkeypatch.setenv("STANDIN_GPU_COUNT", "2")
    gpus = preflight.detect_gpus()
    assert gpus == (GPU("NVIDIA L40S", 89, "570.000.00", 81559),) * 2
    assert preflight.detect_gpu().sm == 89


def test_requirements_on_a_machine_without_gpu_or_trtllm(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no trtllm-build
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml")
    with pytest.raises(EnvironmentProblem) as e:
        preflight.check_target_requirements(cfg, before_work=True)
    msg = str(e.value)
    assert "an NVIDIA GPU (H100-SXM-80GB, SM 90): nvidia-smi is not on PATH" in msg
    assert "TensorRT-LLM 1.2.1 with its trtllm-build command: the Python package tensorrt_llm is not installed" in msg
    assert "Triton TensorRT-LLM container image" in msg and "--set build.target=cpu" in msg
    assert "Nothing has been downloaded or quantized." in msg
    pytorch = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.target=pytorch", "quantization.export_hf_checkpoint=true")
    with pytest.raises(EnvironmentProblem, match="its LLM API serves this target"):
        preflight.check_target_requirements(pytorch)


def test_requirements_name_only_what_is_missing(standins):
    standins(trtllm_version=None)  # a GPU, no TensorRT-LLM
    with pytest.raises(EnvironmentProblem) as e:
        preflight.check_target_requirements(_cfg("llama-3.1-8b-h100-fp8.yaml"))
    assert "NVIDIA GPU" not in str(e.value) and "tensorrt_llm is not installed" in str(e.value)


def test_requirements_need_trtllm_build_on_path(standins):
    standins(trtllm_build=False)
    with pytest.raises(EnvironmentProblem, match="tensorrt_llm 1.2.1 is installed but trtllm-build is not on PATH"):
        preflight.check_target_requirements(_cfg("llama-3.1-8b-h100-fp8.yaml"))


def test_requirements_met(standins):
    standins()
    env = preflight.check_target_requirements(_cfg("llama-3.1-8b-h100-fp8.yaml"))
    assert env.trtllm_version == "1.2.1" and env.tensorrt_version == "10.13.0" and env.cuda_version == "12.9.0"
    assert env.gpu == GPU("NVIDIA H100 80GB HBM3", 90, "570.000.00", 81559)
    assert env.trtllm_build.endswith("trtllm-build")


def test_installed_trtllm_must_be_the_pinned_version(standins):
    standins(trtllm_version="1.2.0")
    with pytest.raises(EnvironmentProblem, match="has TensorRT-LLM 1.2.0, but build.trtllm_version is 1.2.1"):
        preflight.check_target_requirements(_cfg("llama-3.1-8b-h100-fp8.yaml"))


def test_a_profile_refuses_another_gpu(standins, monkeypatch):
    standins()
    monkeypatch.setenv("STANDIN_GPU_NAME", "NVIDIA A100-SXM4-80GB")
    monkeypatch.setenv("STANDIN_GPU_COMPUTE_CAP", "8.0")
    with pytest.raises(ConfigError, match=r"\[target_gpu\] this machine's GPU is NVIDIA A100-SXM4-80GB \(SM 80\)"):
        preflight.check_target_requirements(_cfg("llama-3.1-8b-h100-fp8.yaml"))
    # without a target_sm the profile is judged by the GPU found: FP8 on SM 80 breaks the rules
    with pytest.raises(ConfigError, match=r"\[fp8_needs_sm89\]"):
        preflight.check_target_requirements(_cfg("llama-3.1-8b-h100-fp8.yaml", "build.target_sm=null"))


def test_invoke_build_gpu_profile_without_gpu_fails_fast(tmp_path):
    """On this machine (no GPU, no TensorRT-LLM) a GPU profile stops at once, before the download."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    for task in ("build", "all"):
        t0 = time.monotonic()
        proc = run_invoke(task, "--config", str(REPO / "engine_configs" / "llama-3.1-8b-h100-fp8.yaml"),
                          "--work-root", str(tmp_path / "work"), env={"PATH": str(empty)}, timeout=120)
        took = time.monotonic() - t0
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "build.target tensorrt cannot run on this machine" in proc.stderr
        assert "an NVIDIA GPU" in proc.stderr and "TensorRT-LLM 1.2.1" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert took < 60, took
        work = tmp_path / "work" / "llama-3.1-8b-h100-fp8"
        assert not (work / "model").exists() and not (work / ".staging").exists()


# ---------------------------------------------------------------------------------------------- the targets


def test_build_tensorrt_tensor_parallel(standins, monkeypatch, tmp_path):
    env = standins()
    monkeypatch.setenv("STANDIN_GPU_COUNT", "2")
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.tensor_parallel_size=2",
               f"build.timing_cache_dir={tmp_path / 'tc'}")
    ckpt = _synthetic_checkpoint(tmp_path / "ckpt", tp=2)
    out = tmp_path / "stage"
    out.mkdir()
    summary = targets.build_tensorrt(ckpt, cfg, out)
    (rec,) = _records(env)
    assert rec["problems"] == []
    opts = dict(zip(rec["argv"][::2], rec["argv"][1::2]))
    assert opts["--workers"] == "2" and opts["--checkpoint_dir"] == str(ckpt)
    assert opts["--output_dir"] == str(out / "engine")
    assert "--input_timing_cache" not in opts and opts["--output_timing_cache"].startswith(str(tmp_path / "tc"))
    engine = out / "engine"
    assert sorted(p.name for p in engine.iterdir()) == ["build_provenance.json", "config.json", "rank0.engine",
                                                        "rank1.engine"]
    assert summary["ranks"] == 2 and summary["gpu_sm"] == 90 and summary["paged_context_fmha"] is True
    cache_files = [p.name for p in (tmp_path / "tc").iterdir()]
    assert cache_files == ["NVIDIA-H100-80GB-HBM3-sm90-trtllm1.2.1.cache"]  # moved into place, no temp left


def test_build_tensorrt_failure_keeps_the_log_and_the_cache(standins, monkeypatch, tmp_path):
    standins()
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml", f"build.timing_cache_dir={tmp_path / 'tc'}")
    ckpt = _synthetic_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "stage"
    out.mkdir()
    monkeypatch.setenv("STANDIN_TRTLLM_BUILD_FAIL", "1")
    with pytest.raises(StageFailed, match="trtllm-build exited with code 1") as e:
        targets.build_tensorrt(ckpt, cfg, out)
    assert "failing on purpose" in str(e.value)  # the log's tail
    assert (out / targets.BUILD_LOG_FILE).is_file()
    assert list((tmp_path / "tc").iterdir()) == []  # no timing cache from a failed build, no temp file left
    assert not (out / "build_settings.json").exists()


def test_build_tensorrt_checks_the_checkpoint_before_running(standins, tmp_path):
    env = standins()
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml", f"build.timing_cache_dir={tmp_path / 'tc'}")
    out = tmp_path / "stage"
    out.mkdir()
    with pytest.raises(InputError, match="kv_cache_quant_algo is INT8"):
        targets.build_tensorrt(_synthetic_checkpoint(tmp_path / "ckpt", kv="INT8"), cfg, out)
    assert _records(env) == []  # trtllm-build never ran


def test_engine_dir_check_catches_a_wrong_engine(tmp_path):
    facts = QuantFacts("FP8", "FP8", frozenset({"FP8"}))
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml")
    args = targets.trtllm_build_argv(Path("c"), tmp_path, cfg=cfg, gpu=GPU("H100", 90, "x"), facts=facts)
    good = {"version": "1.2.1",
            "pretrained_config": {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
                                  "mapping": {"world_size": 1}},
            "build_config": {"max_batch_size": 128, "max_input_len": 6144, "max_seq_len": 8192, "max_num_tokens": 8192,
                             "max_beam_width": 1, "kv_cache_type": "PAGED",
                             "plugin_config": {"tokens_per_block": 32, "use_paged_context_fmha": True}}}
    (tmp_path / "config.json").write_text(json.dumps(good))
    (tmp_path / "rank0.engine").write_bytes(b"x")
    assert targets.check_engine_dir(tmp_path, args, facts, "1.2.1")["engine_bytes"] == 1
    with pytest.raises(StageFailed, match="engine version '1.2.1' is not the installed TensorRT-LLM 1.2.0"):
        targets.check_engine_dir(tmp_path, args, facts, "1.2.0")
    bad = json.loads(json.dumps(good))
    bad["build_config"]["plugin_config"]["tokens_per_block"] = 64
    bad["pretrained_config"]["quantization"]["kv_cache_quant_algo"] = None
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(StageFailed, match="kv_cache_quant_algo None.*tokens_per_block 64"):
        targets.check_engine_dir(tmp_path, args, facts, "1.2.1")
    (tmp_path / "config.json").write_text(json.dumps(good))
    (tmp_path / "rank0.engine").write_bytes(b"")
    with pytest.raises(StageFailed, match="rank0.engine missing or empty"):
        targets.check_engine_dir(tmp_path, args, facts, "1.2.1")


def test_build_pytorch_writes_llm_api_options(standins, tmp_path):
    standins()
    cfg = _cfg("llama-3.1-8b-h100-fp8.yaml", "build.target=pytorch", "quantization.export_hf_checkpoint=true")
    hf = tmp_path / "hf_checkpoint"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(b"placeholder weights")
    (hf / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    out = tmp_path / "stage"
    out.mkdir()
    summary = targets.build_pytorch(hf, cfg, out)
    text = (out / "llm_api" / "llm_api_options.yaml").read_text()
    opts = yaml.safe_load(text)
    assert options.check_llm_api_options(opts) == []
    assert opts["kv_cache_config"] == {"dtype": "fp8", "free_gpu_memory_fraction": 0.9, "enable_block_reuse": True,
                                       "tokens_per_block": 32}
    assert opts["cuda_graph_config"] == {"batch_sizes": [1, 2, 4, 8, 16, 32, 64, 128], "enable_padding": True}
    assert (out / "llm_api" / "checkpoint" / "hf_quant_config.json").is_file()
    settings = json.loads((out / "build_settings.json").read_text())
    assert settings["target"] == "pytorch" and settings["artifact_dir"] == "llm_api"
    assert settings["kv_cache"]["quant_algo"] == "FP8" and settings["trtllm_version"] == "1.2.1"
    assert summary["llm_api_options"] == opts
    (hf / "hf_quant_config.json").unlink()
    with pytest.raises(InputError, match="export_hf_checkpoint: true"):
        targets.build_pytorch(hf, cfg, tmp_path / "other")


# ---------------------------------------------------------------------------------------------- end to end

SETTINGS_KEYS = {"target", "artifact_dir", "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                 "kv_cache", "cuda_graphs", "trtllm_version", "provenance", "checkpoint_sha256",
                 "tensor_parallel_size", "pipeline_parallel_size", "enable_chunked_context"}


@pytest.mark.e2e
def test_invoke_build_tensorrt_end_to_end(tmp_path, tiny_model_dir):
    """download -> sensitivity -> plan -> quantize on the tiny model for an FP8 / FP8-KV H100 profile (real),
    then `invoke build` against the stand-in trtllm-build and nvidia-smi: the argv it was given, the engine
    dir it wrote, provenance, build_settings.json, and the timing cache reused by a second build."""
    path = tiny_config(tmp_path, tiny_model_dir)
    doc = yaml.safe_load(path.read_text())
    doc["sensitivity"]["formats"] = ["fp8"]
    doc["quantization"] = {"weight_format": "fp8", "kv_cache": "fp8",
                           "accuracy": {"max_perplexity_increase_pct": 50, "min_top1_agreement": 0.5}}
    doc["build"].update({"target": "tensorrt", "target_gpu": "H100 (stand-in)", "target_sm": 90,
                         "dtype": "float16", "timing_cache_dir": str(tmp_path / "timing-cache"),
                         "kv_cache": {"tokens_per_block": 16}})
    path.write_text(yaml.safe_dump(doc))
    work_root = tmp_path / "work"
    proc = run_invoke("quantize", "--config", str(path), "--work-root", str(work_root), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    env = make_standins(tmp_path / "standins")
    proc = run_invoke("build", "--config", str(path), "--work-root", str(work_root), env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "quantize: up to date" in proc.stdout and "build: done" in proc.stdout
    (rec,) = _records(env)
    assert rec["problems"] == []
    args = rec["argv"]
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--kv_cache_type"] == "paged" and opts["--tokens_per_block"] == "16"
    assert opts["--use_paged_context_fmha"] == "enable" and opts["--use_fp8_context_fmha"] == "enable"
    assert opts["--gemm_plugin"] == "disable" and opts["--workers"] == "1" and opts["--multiple_profiles"] == "enable"
    assert opts["--max_batch_size"] == "4" and opts["--max_seq_len"] == "128" and opts["--max_num_tokens"] == "256"
    assert "--input_timing_cache" not in opts

    build = work_root / "tiny" / "build"
    ckpt = work_root / "tiny" / "quantize" / "trtllm_checkpoint"
    engine = build / "engine"
    assert {p.name for p in engine.iterdir()} == {"config.json", "rank0.engine", "build_provenance.json"}
    assert (build / "trtllm-build.log").read_text().count("[stand-in] Engine serialized: rank0.engine") == 1
    engine_cfg = json.loads((engine / "config.json").read_text())
    assert engine_cfg["pretrained_config"] == json.loads((ckpt / "config.json").read_text())
    settings = json.loads((build / "build_settings.json").read_text())
    assert set(settings) == SETTINGS_KEYS
    assert settings["target"] == "tensorrt" and settings["artifact_dir"] == "engine"
    assert settings["kv_cache"] == {"quant_algo": "FP8", "tokens_per_block": 16, "free_gpu_memory_fraction": 0.9,
                                    "enable_block_reuse": True}
    assert settings["cuda_graphs"] == {"enabled": True, "batch_sizes": [1, 2, 4], "enable_padding": True,
                                       "cuda_graph_mode": True, "cuda_graph_cache_size": 3}
    assert settings["trtllm_version"] == "1.2.1"
    prov = settings["provenance"]
    assert prov == json.loads((engine / "build_provenance.json").read_text())
    assert prov["tensorrt_llm"] == "1.2.1" and prov["tensorrt"] == "10.13.0" and prov["cuda"] == "12.9.0"
    assert prov["gpu"] == "NVIDIA H100 80GB HBM3" and prov["gpu_sm"] == 90 and prov["driver"] == "570.000.00"
    assert prov["checkpoint_sha256"] == settings["checkpoint_sha256"] and len(settings["checkpoint_sha256"]) == 64
    assert prov["trtllm_build_argv"][:4] == ["--checkpoint_dir", "{checkpoint_dir}", "--output_dir", "{output_dir}"]
    manifest = json.loads((build / "manifest.json").read_text())
    assert manifest["summary"]["target"] == "tensorrt" and manifest["summary"]["timing_cache_reused"] is False

    # a second build (forced) reads the timing cache the first one wrote
    proc = run_invoke("build", "--config", str(path), "--work-root", str(work_root), "--force", env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    second = _records(env)[1]
    cache = dict(zip(second["argv"][::2], second["argv"][1::2]))["--input_timing_cache"]
    assert Path(cache).parent == tmp_path / "timing-cache" and Path(cache).is_file()
    assert json.loads((build / "manifest.json").read_text())["summary"]["timing_cache_reused"] is True
