"""vLLM's engine arguments, from the config, and its server's flags (what vLLM cannot serve is refused when the
config loads: pipeline.config, from the facts in pipeline.formats). The build records both beside the export
(``vllm_engine.json``); ``pipeline.serving.launch vllm`` starts the server from that record, in the image as
in verify and bench.

Names are vLLM 0.32's ``EngineArgs`` fields (``vllm/engine/arg_utils.py``), the same names its offline
``LLM(**kwargs)`` takes; its server's flags are those names with dashes (``--max-num-seqs``), booleans as
``--flag`` / ``--no-flag``. tests/engines/vllm/test_vllm.py parses the argv with vLLM's own server parser in the serving
environment, so a renamed or dropped flag fails there, not at a user's server start.

Facts of vLLM 0.32.0 this module relies on (read in its source):
- the CPU attention backend (``v1/attention/backends/cpu_attn.py``) takes KV-cache dtypes auto / fp8 /
  fp8_e4m3 / fp8_e5m2 and block sizes that are multiples of 32; its KV cache is sized by the environment
  variable ``VLLM_CPU_KVCACHE_SPACE`` (GiB, ``vllm/envs.py``), not by ``gpu_memory_utilization``;
- there is no ``--swap-space`` (the V1 engine recomputes preempted requests); ``--kv-offloading-size`` (GiB)
  keeps KV blocks in host memory;
- ``--enforce-eager`` turns off CUDA graphs and torch.compile (on the CPU: compilation only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from pipeline.fsutil import atomic_write_json

# vLLM 0.32's server entry point (vllm/entrypoints/launchers/api_server/entry.py main(); the older
# vllm.entrypoints.openai.api_server re-exports it with a deprecation warning). Run as a module: the `vllm`
# console script looks up a distribution named `vllm`, and the registry's CPU build is `vllm-cpu`.
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
QUANTIZED_KV = ("int8", "fp8")
# the tenants' admission on the OpenAI server: an ASGI middleware class vLLM 0.32 imports by this dotted path
# (--middleware; entrypoints/serve/middleware/register.py adds a class with app.add_middleware), from the vLLM
# model's code folder that pipeline.serving.launch puts on PYTHONPATH where the served record has tenants
TENANT_MIDDLEWARE = "tenant_admission.TenantAdmission"
# Series vLLM 0.32's OpenAI server exports on /metrics that the deployment reads (the alert rules,
# pipeline/release/alerts.py; the HPA's queue): v1/metrics/loggers.py, and the API's http_requests_total from
# prometheus-fastapi-instrumentator (entrypoints/serve/instrumentator/metrics.py). A counter's samples end in
# _total. verify checks the real server has each.
METRIC_SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "http_requests_total")


def kv_cache_dtype(cfg) -> str:
    """vLLM's KV-cache dtype: the config's, else fp8 where the plan quantizes the KV cache (INT8 or FP8)."""
    if cfg.vllm.kv_cache_dtype is not None:
        return cfg.vllm.kv_cache_dtype
    return "fp8" if cfg.quantization.kv_cache in QUANTIZED_KV else "auto"


def engine_args(cfg) -> dict:
    """EngineArgs fields (the offline LLM's keyword arguments and, with dashes, the server's flags)."""
    b, v = cfg.build, cfg.vllm
    args = {"dtype": v.dtype, "max_model_len": b.max_seq_len, "max_num_seqs": b.max_batch_size,
            "max_num_batched_tokens": b.max_num_tokens, "block_size": b.kv_cache.tokens_per_block,
            "kv_cache_dtype": kv_cache_dtype(cfg), "tensor_parallel_size": b.tensor_parallel_size,
            "enable_prefix_caching": b.kv_cache.enable_block_reuse, "enforce_eager": not b.cuda_graphs.enabled,
            "served_model_name": v.served_model_name or cfg.triton.model_name}
    if v.device == "cuda":
        args["gpu_memory_utilization"] = v.gpu_memory_utilization
    if v.kv_offloading_gib is not None:
        args["kv_offloading_size"] = v.kv_offloading_gib
    return args


def served_record(record: dict, triton, tenants: Sequence[dict] = ()) -> dict:
    """The build's engine record (``vllm_engine.json``) as served: the triton section's ``max_running`` as
    ``max_num_seqs`` (at most the build's, which the config checks), in the engine arguments and the server's flags;
    with ``tenants`` (the config's, as dicts), those under ``tenants`` and the OpenAI server's flags loading their
    admission (TENANT_MIDDLEWARE, beside the vLLM model's code: triton_repo/tensorrt_llm_vllm/tenant_admission.py).
    Unchanged where neither is set."""
    served, notes = dict(record), {}
    built = record["engine_args"].get("max_num_seqs")
    if triton.max_running is not None and built != triton.max_running:
        served["engine_args"] = {**record["engine_args"], "max_num_seqs": triton.max_running}
        served["server_flags"] = server_flags(served["engine_args"])
        notes["max_num_seqs"] = f"triton.max_running (the build's: {built})"
    if tenants:
        served["tenants"] = [dict(t) for t in tenants]
        served["server_flags"] = [*served["server_flags"], "--middleware", TENANT_MIDDLEWARE]
        notes["tenants"] = "tenants: admitted by their share on the OpenAI server (--middleware)"
    if notes:
        served["served"] = notes
    return served


def apply_served(triton, path: Path, tenants: Sequence[dict] = ()) -> None:
    """Publish: the engine record at ``path`` (linked from the build) replaced by its ``served_record``, where that
    differs; the build's own file is left as it is."""
    record = json.loads(path.read_text())
    served = served_record(record, triton, tenants)
    if served != record:
        path.unlink()  # the link goes, not the build's file
        atomic_write_json(path, served)


def engine_env(cfg) -> dict[str, str]:
    """Environment variables vLLM reads instead of arguments."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm.cpu_kv_cache_gib)} if cfg.vllm.device == "cpu" else {}


def offline_args(args: dict) -> dict:
    """The offline LLM's keyword arguments: the server-only ones left out."""
    return {k: v for k, v in args.items() if k != "served_model_name"}


def server_flags(args: dict) -> list[str]:
    """The OpenAI server's flags for ``args``."""
    flags = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags
