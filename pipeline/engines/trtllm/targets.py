"""The GPU targets of the build stage: TensorRT engines (``trtllm-build``) and TensorRT-LLM LLM-API options.

- ``build_tensorrt``: ``trtllm-build`` in a child process, log beside the engine, the engine directory
  checked against what was asked, TensorRT's timing cache reused across builds, provenance recorded.
- ``build_pytorch``: the LLM-API options file (``llm_api_options.yaml``) for the HF unified checkpoint.
- ``trtllm_build_argv`` / ``llm_api_options``: what each target passes to TensorRT-LLM, generated from the
  config and checked against the option table (``options.py``) before anything runs.

Both targets first check the machine, the checkpoint and the rules (``preflight.py``, ``rules.py``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from pipeline import artifacts, records
from pipeline.child import log_tail
from pipeline.engines.build import build_settings, checkpoint_sha256
from pipeline.engines.trtllm.options import (
    DYNAMIC_BATCH_WINDOW,
    check_llm_api_options,
    check_trtllm_build_argv,
    trtllm_build_parser,
)
from pipeline.engines.trtllm.preflight import (
    GPU,
    Environment,
    check_checkpoint_matches,
    check_target_requirements,
    facts_from_checkpoint,
    facts_from_hf_checkpoint,
)
from pipeline.engines.trtllm.rules import (
    RULES,
    QuantFacts,
    chunked_context,
    cuda_graph_settings,
    default_gemm_plugin,
    enforce_rules,
    fp8_context_fmha,
    fp8_swiglu_fusion,
    paged_context_fmha,
    reduce_fusion,
)
from pipeline.errors import ConfigError, StageFailed
from pipeline.fsutil import atomic_write_json, atomic_write_text
from pipeline.summaries import BuildSummary

log = logging.getLogger(__package__)  # "pipeline.engines.trtllm": log lines name the package, as before the split

BUILD_LOG_FILE = "trtllm-build.log"


# ====================================================================================== trtllm-build argv, timing cache
def timing_cache_path(cfg, gpu: GPU) -> Path:
    """TensorRT's timing cache for this GPU model and TensorRT-LLM version, shared by every build there."""
    base = cfg.build.timing_cache_dir
    if base is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtllm-pipeline" / "timing-cache"
    label = re.sub(r"[^A-Za-z0-9.]+", "-", gpu.name).strip("-") or "gpu"
    return Path(base) / f"{label}-sm{gpu.sm}-trtllm{cfg.build.trtllm_version}.cache"


def trtllm_build_argv(ckpt_dir: Path, engine_dir: Path, *, cfg, gpu: Optional[GPU], facts: QuantFacts,
                      input_timing_cache: Optional[Path] = None, output_timing_cache: Optional[Path] = None,
                      gpu_count: int = 1) -> list[str]:
    """The trtllm-build arguments (without the program name) for the config, checkpoint and GPU."""
    b = cfg.build
    sm = gpu.sm if gpu else b.target_sm
    switch = {True: "enable", False: "disable"}
    args = ["--checkpoint_dir", str(ckpt_dir), "--output_dir", str(engine_dir),
            "--max_batch_size", str(b.max_batch_size), "--max_input_len", str(b.max_input_len),
            "--max_seq_len", str(b.max_seq_len), "--max_num_tokens", str(b.max_num_tokens),
            "--max_beam_width", str(b.max_beam_width),
            "--kv_cache_type", "paged", "--tokens_per_block", str(b.kv_cache.tokens_per_block),
            "--gpt_attention_plugin", "auto", "--gemm_plugin", default_gemm_plugin(cfg, facts),
            "--context_fmha", "enable", "--remove_input_padding", "enable",
            "--use_paged_context_fmha", switch[paged_context_fmha(b, facts, sm)],
            "--use_fp8_context_fmha", switch[fp8_context_fmha(b, facts, sm)],
            "--multiple_profiles", switch[b.multiple_profiles],
            "--reduce_fusion", switch[reduce_fusion(facts)],
            "--workers", str(max(1, min(facts.world_size, gpu_count))), "--log_level", "info"]
    if fp8_swiglu_fusion(b, facts, sm):
        args += ["--use_fused_mlp", "enable", "--gemm_swiglu_plugin", "fp8"]
    if input_timing_cache is not None:
        args += ["--input_timing_cache", str(input_timing_cache)]
    if output_timing_cache is not None:
        args += ["--output_timing_cache", str(output_timing_cache)]
    problems = check_trtllm_build_argv(args)
    if problems:  # a bug here, not a user error: the argv is generated from a validated config
        raise StageFailed("internal: generated trtllm-build arguments break the option table: " + "; ".join(problems))
    return args


# ====================================================================================== tensorrt target
def check_engine_dir(engine_dir: Path, args: list[str], facts: QuantFacts, trtllm_version: str) -> dict:
    """The engine directory trtllm-build wrote must hold what was asked: config.json (version, the
    checkpoint's quantization and mapping, the build settings) and one non-empty rank{N}.engine per rank."""
    ns = vars(trtllm_build_parser().parse_known_args(args)[0])
    path = engine_dir / "config.json"
    try:
        ec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StageFailed(f"trtllm-build finished but {path} is missing or unreadable ({e})") from None
    problems = _engine_config_problems(ec, ns, facts, trtllm_version)
    engines = {}
    for rank in range(facts.world_size):
        f = engine_dir / f"rank{rank}.engine"
        size = f.stat().st_size if f.is_file() else 0
        if not size:
            problems.append(f"{f.name} missing or empty")
        engines[f.name] = size
    if facts.quant_algo == "MIXED_PRECISION" and not (engine_dir / "quant_cfg.json").is_file():
        problems.append("quant_cfg.json missing (MIXED_PRECISION)")
    if problems:
        raise StageFailed(f"the engine trtllm-build wrote in {engine_dir} is not what was asked: "
                          + "; ".join(problems[:8]))
    return {"engine_version": ec["version"], "engine_files": engines, "engine_bytes": sum(engines.values())}


def _engine_config_problems(ec: dict, ns: dict, facts: QuantFacts, trtllm_version: str) -> list[str]:
    """How the engine's config.json differs from what was asked (``ns``: the parsed trtllm-build arguments)."""
    problems = []
    if ec.get("version") != trtllm_version:
        problems.append(f"engine version {ec.get('version')!r} is not the installed TensorRT-LLM {trtllm_version}")
    pc, bc = ec.get("pretrained_config") or {}, ec.get("build_config") or {}
    q = pc.get("quantization") or {}
    if q.get("kv_cache_quant_algo") != facts.kv_cache_quant_algo:
        problems.append(f"kv_cache_quant_algo {q.get('kv_cache_quant_algo')} (checkpoint: {facts.kv_cache_quant_algo})")
    if q.get("quant_algo") != facts.quant_algo:
        problems.append(f"quant_algo {q.get('quant_algo')} (checkpoint: {facts.quant_algo})")
    world = int((pc.get("mapping") or {}).get("world_size", 1))
    if world != facts.world_size:
        problems.append(f"world_size {world} (checkpoint: {facts.world_size})")
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width"):
        if bc.get(key) != ns[key]:
            problems.append(f"build_config.{key} {bc.get(key)} (asked {ns[key]})")
    if str(bc.get("kv_cache_type", "")).upper() != "PAGED":
        problems.append(f"build_config.kv_cache_type {bc.get('kv_cache_type')} (asked paged)")
    plugin = bc.get("plugin_config") or {}
    if plugin.get("tokens_per_block") != ns["tokens_per_block"]:
        problems.append(f"plugin_config.tokens_per_block {plugin.get('tokens_per_block')} "
                        f"(asked {ns['tokens_per_block']})")
    if plugin.get("use_paged_context_fmha") is not (ns["use_paged_context_fmha"] == "enable"):
        problems.append(f"plugin_config.use_paged_context_fmha {plugin.get('use_paged_context_fmha')} "
                        f"(asked {ns['use_paged_context_fmha']})")
    return problems


def _run_logged(argv: list[str], log_path: Path, cwd: Path) -> int:
    """Run a command with its output in log_path; Ctrl-C stops it too."""
    with open(log_path, "a", encoding="utf-8") as log_f:
        log_f.write("$ " + " ".join(argv) + "\n")
        log_f.flush()
        proc = subprocess.Popen(argv, stdout=log_f, stderr=subprocess.STDOUT, cwd=cwd, stdin=subprocess.DEVNULL)
        try:
            return proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def _provenance(env: Environment, gpu: GPU, ckpt_hash: str, extra: dict) -> dict:
    return {"tensorrt_llm": env.trtllm_version, "tensorrt": env.tensorrt_version, "cuda": env.cuda_version,
            "driver": gpu.driver, "gpu": gpu.name, "gpu_sm": gpu.sm, "gpu_count": len(env.gpus),
            "gpu_memory_mib": gpu.memory_mib, "checkpoint_sha256": ckpt_hash, **extra}


def _check_inputs(cfg, ckpt_dir: Path,
                  read_facts: Callable[[Path], QuantFacts]) -> tuple[Environment, GPU, QuantFacts]:
    """Before either GPU target does any work: this machine (check_target_requirements), the checkpoint
    against the config, and the rules against the GPU found with the checkpoint's own facts; returns the
    machine, its first GPU and the checkpoint's facts."""
    env = check_target_requirements(cfg)
    gpu = env.gpu if env is not None else None
    if env is None or gpu is None:  # check_target_requirements returns one with a GPU for every GPU target
        raise StageFailed(f"internal: a TensorRT-LLM build ran for build.target {cfg.build.target} without a GPU "
                          f"found by check_target_requirements")
    facts = read_facts(ckpt_dir)
    check_checkpoint_matches(cfg, facts)
    enforce_rules(cfg, gpu.sm, facts, gpu_label=f"{gpu.name} (SM {gpu.sm})")
    return env, gpu, facts


def build_tensorrt(ckpt_dir: Path, cfg, out_dir: Path) -> BuildSummary:
    """trtllm-build the TensorRT-LLM checkpoint into out_dir/engine (a child process, log beside it), check
    the engine directory, record provenance, write out_dir/build_settings.json; returns the stage summary."""
    t0 = time.perf_counter()
    env, gpu, facts = _check_inputs(cfg, ckpt_dir, facts_from_checkpoint)
    ckpt_hash = checkpoint_sha256(ckpt_dir)

    engine_dir = out_dir / artifacts.ENGINE_DIR
    cache = timing_cache_path(cfg, gpu)
    cache.parent.mkdir(parents=True, exist_ok=True)
    reused = cache.is_file()
    cache_out = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")  # moved into place only after a good build
    args = trtllm_build_argv(ckpt_dir, engine_dir, cfg=cfg, gpu=gpu, facts=facts,
                             input_timing_cache=cache if reused else None, output_timing_cache=cache_out,
                             gpu_count=len(env.gpus))
    log.info("trtllm-build on %s (SM %d), %d rank(s); timing cache %s (%s)", gpu.name, gpu.sm, facts.world_size,
             cache, "reused" if reused else "new")
    engine = _run_trtllm_build(env, args, facts=facts, out_dir=out_dir, engine_dir=engine_dir, cache=cache,
                               cache_out=cache_out)
    build_s = round(time.perf_counter() - t0, 1)
    shown = [{str(ckpt_dir): "{checkpoint_dir}", str(engine_dir): "{output_dir}"}.get(a, a) for a in args]
    provenance = _provenance(env, gpu, ckpt_hash, {"engine_version": engine["engine_version"],
                                                  "trtllm_build_argv": shown,
                                                  "timing_cache": {"file": cache.name, "reused": reused}})
    atomic_write_json(engine_dir / artifacts.BUILD_PROVENANCE_FILE, provenance)
    settings = build_settings(cfg, "tensorrt", artifact_dir=artifacts.ENGINE_DIR, kv_algo=facts.kv_cache_quant_algo,
                              cuda_graphs=cuda_graph_settings(cfg.build), trtllm_version=env.trtllm_version,
                              provenance=provenance, ckpt_hash=ckpt_hash,
                              enable_chunked_context=chunked_context(cfg.build, facts, gpu.sm))
    records.write_build_settings(out_dir, settings)
    return {"target": "tensorrt", "checkpoint_sha256": ckpt_hash, "quant_algo": facts.quant_algo,
            "kv_cache_quant_algo": facts.kv_cache_quant_algo, "gpu": gpu.name, "gpu_sm": gpu.sm,
            "trtllm_version": env.trtllm_version, "ranks": facts.world_size, "engine_bytes": engine["engine_bytes"],
            "paged_context_fmha": paged_context_fmha(cfg.build, facts, gpu.sm),
            "cuda_graphs": settings.cuda_graphs.model_dump(), "timing_cache_reused": reused, "timing_s": build_s}


def _run_trtllm_build(env: Environment, args: list[str], *, facts: QuantFacts, out_dir: Path, engine_dir: Path,
                      cache: Path, cache_out: Path) -> dict:
    """trtllm-build with its log in out_dir, the engine directory checked, and the timing cache it wrote
    (cache_out) moved into place only after a good build; returns check_engine_dir's summary."""
    if env.trtllm_build is None or env.trtllm_version is None:  # check_target_requirements named them missing
        raise StageFailed("internal: trtllm-build reached without TensorRT-LLM and its trtllm-build command found")
    log_path = out_dir / BUILD_LOG_FILE
    try:
        rc = _run_logged([env.trtllm_build, *args], log_path, cwd=out_dir)
        if rc != 0:
            raise StageFailed(f"trtllm-build exited with code {rc}. Last lines of {log_path}:\n{log_tail(log_path)}")
        engine = check_engine_dir(engine_dir, args, facts, env.trtllm_version)
        if cache_out.is_file():
            os.replace(cache_out, cache)
    finally:
        cache_out.unlink(missing_ok=True)
    return engine


# ====================================================================================== pytorch target
def llm_api_options(cfg) -> dict:
    """The LLM-API options (TorchLlmArgs fields) for the config; checked against LLM_API_OPTIONS."""
    b, q = cfg.build, cfg.quantization
    if q.kv_cache == "int8":
        raise ConfigError(
            "[pytorch_int8_kv] quantization.kv_cache: int8 cannot be served by TensorRT-LLM's LLM API (pytorch "
            "target): kv_cache_config.dtype supports fp8 only. Use kv_cache: fp8 or none, or build.target: "
            f"tensorrt (rule from {RULES['pytorch_int8_kv'].source})")
    cg = cuda_graph_settings(b)
    opts = {
        "max_batch_size": b.max_batch_size,
        "max_num_tokens": b.max_num_tokens,
        "max_seq_len": b.max_seq_len,
        "max_input_len": b.max_input_len,
        "tensor_parallel_size": b.tensor_parallel_size,
        "pipeline_parallel_size": b.pipeline_parallel_size,
        "kv_cache_config": {"dtype": "fp8" if q.kv_cache == "fp8" else "auto",
                            "free_gpu_memory_fraction": b.kv_cache.free_gpu_memory_fraction,
                            "enable_block_reuse": b.kv_cache.enable_block_reuse,
                            "tokens_per_block": b.kv_cache.tokens_per_block},
        "cuda_graph_config": ({"batch_sizes": cg["batch_sizes"], "enable_padding": cg["enable_padding"]}
                              if cg["enabled"] else None),
    }
    problems = check_llm_api_options(opts)
    if problems:
        raise StageFailed("internal: generated LLM-API options break the option table: " + "; ".join(problems))
    return opts


def serving_llm_api_options(opts: dict, triton) -> dict:
    """The build's LLM-API options with the config's serving keys applied (publish writes them into the
    repository; ``opts`` unchanged where the triton section sets none): ``max_running`` caps max_batch_size and
    the CUDA-graph batch sizes (the cap itself captured too), ``scheduler_policy`` and ``adaptive_batch`` set
    scheduler_config (TensorRT-LLM's dynamic batch tuning: batch size and max_num_tokens from moving averages
    of the requests' lengths), ``kv_cache_free_gpu_memory_fraction`` the KV cache's share."""
    out = copy.deepcopy(opts)
    if triton.max_running is not None:
        out["max_batch_size"] = min(out["max_batch_size"], triton.max_running)
        graphs = out.get("cuda_graph_config")
        if graphs:
            sizes = [s for s in graphs["batch_sizes"] if s < out["max_batch_size"]] + [out["max_batch_size"]]
            graphs["batch_sizes"] = sizes
    if triton.kv_cache_free_gpu_memory_fraction is not None:
        out["kv_cache_config"]["free_gpu_memory_fraction"] = triton.kv_cache_free_gpu_memory_fraction
    scheduler = {}
    if triton.scheduler_policy is not None:
        scheduler["capacity_scheduler_policy"] = triton.scheduler_policy.upper()
    if triton.adaptive_batch:
        scheduler["dynamic_batch_config"] = {"enable_batch_size_tuning": True, "enable_max_num_tokens_tuning": True,
                                             "dynamic_batch_moving_average_window": DYNAMIC_BATCH_WINDOW}
    if scheduler:
        out["scheduler_config"] = scheduler
    problems = check_llm_api_options(out)
    if problems:
        raise ConfigError("the serving settings (triton section) make LLM-API options TensorRT-LLM would refuse: "
                          + "; ".join(problems))
    return out


def build_pytorch(hf_ckpt_dir: Path, cfg, out_dir: Path) -> BuildSummary:
    """out_dir/llm_api: the HF unified checkpoint and llm_api_options.yaml for TensorRT-LLM's LLM API;
    plus out_dir/build_settings.json. Nothing is compiled: the server loads the checkpoint with these options."""
    t0 = time.perf_counter()
    env, gpu, facts = _check_inputs(cfg, hf_ckpt_dir, facts_from_hf_checkpoint)
    opts = llm_api_options(cfg)
    ckpt_hash = checkpoint_sha256(hf_ckpt_dir)
    dest = out_dir / artifacts.LLM_API_DIR
    shutil.copytree(hf_ckpt_dir, dest / artifacts.LLM_API_CHECKPOINT_DIR)
    header = (f"# TensorRT-LLM {env.trtllm_version} LLM-API options (pytorch backend), written by the pipeline's "
              f"build stage for {cfg.name}.\n# Serve {artifacts.LLM_API_CHECKPOINT_DIR}/ with them, e.g. trtllm-serve "
              f"{artifacts.LLM_API_CHECKPOINT_DIR} --extra_llm_api_options {artifacts.LLM_API_OPTIONS_FILE}\n")
    atomic_write_text(dest / artifacts.LLM_API_OPTIONS_FILE, header + yaml.safe_dump(opts, sort_keys=False))
    provenance = _provenance(env, gpu, ckpt_hash, {"llm_api_options": opts})
    settings = build_settings(cfg, "pytorch", artifact_dir=artifacts.LLM_API_DIR, kv_algo=facts.kv_cache_quant_algo,
                              cuda_graphs=cuda_graph_settings(cfg.build), trtllm_version=env.trtllm_version,
                              provenance=provenance, ckpt_hash=ckpt_hash)
    records.write_build_settings(out_dir, settings)
    return {"target": "pytorch", "checkpoint_sha256": ckpt_hash, "quant_algo": facts.quant_algo,
            "kv_cache_quant_algo": facts.kv_cache_quant_algo, "gpu": gpu.name, "gpu_sm": gpu.sm,
            "trtllm_version": env.trtllm_version, "llm_api_options": opts,
            "timing_s": round(time.perf_counter() - t0, 1)}


def build_tensorrt_stage(ctx, ckpt_dir: Path, hf_checkpoint: bool = False) -> BuildSummary:
    """The tensorrt target's build (pipeline.targets.tensorrt): trtllm-build on the TensorRT-LLM checkpoint."""
    return build_tensorrt(ckpt_dir, ctx.config, ctx.out_dir)


def build_pytorch_stage(ctx, ckpt_dir: Path, hf_checkpoint: bool = False) -> BuildSummary:
    """The pytorch target's build (pipeline.targets.pytorch): LLM-API options beside the HF unified checkpoint."""
    return build_pytorch(ckpt_dir, ctx.config, ctx.out_dir)
