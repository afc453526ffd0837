"""build stage: the quantized checkpoint -> what a server runs, for the configured target.

- ``cpu``: a self-contained bundle for the reference runtime (pipeline.engines.cpu_runtime): the TensorRT-LLM
  checkpoint (the HF unified one for a family that has no other here, ``Family.trtllm_checkpoint``), the
  model's config and tokenizer files (no weights: those come from the checkpoint), and ``runtime.json``
  (limits and the KV block pool). The bundle is loaded once in a child process and asked for a few greedy
  tokens, so a bundle that cannot serve never reaches publish.
- ``tensorrt`` / ``pytorch``: pipeline.engines.trtllm (``trtllm-build`` engines / LLM-API options; GPU only).

Every target writes ``build_settings.json``: the decisions publish turns into Triton parameters (limits,
KV-cache settings, CUDA-graph batch sizes) plus provenance and the checkpoint's content hash.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional

from pipeline import artifacts, records
from pipeline.fsutil import digest_of_files, list_files, sha256_file
from pipeline.summaries import BuildSummary

log = logging.getLogger(__name__)

# files of the HF model folder the runtime and the tokenizer need (the weights come from the checkpoint)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
               "chat_template.jinja", "chat_template.json")
SMOKE_PROMPT = "The capital of France is"
# build_settings.json's cuda_graphs for a target whose runtime captures none (the cpu runtime, Edge-LLM 0.11)
NO_CUDA_GRAPHS = {"enabled": False, "batch_sizes": [], "enable_padding": False, "cuda_graph_mode": False,
                  "cuda_graph_cache_size": 0}
SMOKE_TOKENS = 8


def checkpoint_sha256(ckpt_dir: Path) -> str:
    """One content digest for a checkpoint folder (names and bytes of every file)."""
    return digest_of_files({rel: sha256_file(ckpt_dir / rel) for rel in list_files(ckpt_dir)})


def build_settings(cfg, target: str, *, artifact_dir: str, kv_algo: Optional[str], cuda_graphs: dict,
                   trtllm_version: Optional[str], provenance: dict, ckpt_hash: str,
                   enable_chunked_context: bool = False) -> records.BuildSettings:
    """build_settings.json, the same shape for every target (publish and the report read it)."""
    b = cfg.build
    return records.BuildSettings.model_validate({
        "target": target, "artifact_dir": artifact_dir,
        "tensor_parallel_size": b.tensor_parallel_size, "pipeline_parallel_size": b.pipeline_parallel_size,
        "enable_chunked_context": enable_chunked_context,
        "max_batch_size": b.max_batch_size, "max_input_len": b.max_input_len, "max_seq_len": b.max_seq_len,
        "max_num_tokens": b.max_num_tokens,
        "kv_cache": {"quant_algo": kv_algo, "tokens_per_block": b.kv_cache.tokens_per_block,
                     "free_gpu_memory_fraction": b.kv_cache.free_gpu_memory_fraction,
                     "enable_block_reuse": b.kv_cache.enable_block_reuse},
        "cuda_graphs": cuda_graphs, "trtllm_version": trtllm_version, "provenance": provenance,
        "checkpoint_sha256": ckpt_hash})


def copy_model_files(model_dir: Path, dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)
            copied.append(name)
    return copied


def build_cpu(ckpt_dir: Path, model_dir: Path, cfg, out_dir: Path) -> BuildSummary:
    """Assemble the cpu bundle, smoke-test it in a child process, write build_settings.json."""
    from pipeline.child import run_in_child
    from pipeline.engines.cpu_runtime import bundle_settings, kv_cache_algo

    t0 = time.perf_counter()
    b = cfg.build
    kv_algo = kv_cache_algo(ckpt_dir)
    bundle = out_dir / artifacts.CPU_BUNDLE_DIR
    shutil.copytree(ckpt_dir, bundle / artifacts.CPU_CHECKPOINT_SUBDIR)
    copy_model_files(model_dir, bundle / artifacts.CPU_MODEL_SUBDIR)
    runtime = bundle_settings(b, kv_algo, cfg.compute)
    (bundle / artifacts.CPU_RUNTIME_FILE).write_text(json.dumps(runtime, indent=2) + "\n")
    smoke, peak_rss = run_in_child(smoke_test, bundle, log_path=out_dir / artifacts.STAGE_LOG_FILE)
    ckpt_hash = checkpoint_sha256(ckpt_dir)
    provenance = {"runtime": "pipeline.engines.cpu_runtime (reference, not TensorRT)", "torch": _version("torch"),
                  "transformers": _version("transformers")}
    settings = build_settings(cfg, "cpu", artifact_dir=artifacts.CPU_BUNDLE_DIR, kv_algo=kv_algo,
                              cuda_graphs=NO_CUDA_GRAPHS, trtllm_version=None, provenance=provenance,
                              ckpt_hash=ckpt_hash)
    records.write_build_settings(out_dir, settings)
    return {"target": "cpu", "checkpoint_sha256": ckpt_hash, "kv_cache_quant_algo": kv_algo,
            "kv_blocks": runtime["num_blocks"], "tokens_per_block": runtime["tokens_per_block"],
            "smoke_test": smoke, "peak_rss_bytes": peak_rss, "timing_s": round(time.perf_counter() - t0, 1)}


def smoke_test(bundle: Path) -> dict:
    """Load the bundle as the server will and generate a few greedy tokens (runs in a child process)."""
    from transformers import AutoTokenizer

    from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(bundle / artifacts.CPU_MODEL_SUBDIR)
    with CpuRuntime.load(bundle) as rt:
        t_load = time.perf_counter() - t0
        ids = tok(SMOKE_PROMPT).input_ids
        out = rt.generate(ids, SamplingParams(max_new_tokens=SMOKE_TOKENS))
        kv_bytes, streamed = rt.pool.bytes, rt.layer_streaming
    return {"prompt": SMOKE_PROMPT, "output": tok.decode(out), "output_ids": out, "load_s": round(t_load, 1),
            "kv_pool_bytes": kv_bytes, "layer_streaming": streamed,
            "generate_s": round(time.perf_counter() - t0 - t_load, 1)}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def build_stage(ctx, ckpt_dir: Path, hf_checkpoint: bool = False) -> BuildSummary:
    """The cpu target's build (pipeline.targets.cpu): the bundle of ``ckpt_dir`` (the TensorRT-LLM checkpoint, or
    the HF unified one for a family with only that export; the runtime reads either)."""
    return build_cpu(ckpt_dir, ctx.upstream("model") / artifacts.MODEL_DIR, ctx.config, ctx.out_dir)
