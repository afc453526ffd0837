"""What this machine and the build's inputs offer the GPU targets, checked before anything runs.

- ``detect_gpus`` / ``detect_environment``: the GPUs (``nvidia-smi``) and the TensorRT-LLM, TensorRT and CUDA
  versions, read from the installed distributions' metadata (``tensorrt_llm`` is found with
  ``importlib.util.find_spec``, never imported).
- ``check_target_requirements(cfg)``: a GPU, TensorRT-LLM 1.2.x (and ``trtllm-build`` for the tensorrt
  target), the version the profile pins, and the validity rules against the detected GPU. The build stage's
  ``preflight`` calls it before ``invoke build`` / ``invoke all`` download or quantize anything.
- ``facts_from_checkpoint`` / ``facts_from_hf_checkpoint`` / ``check_checkpoint_matches``: the quantized
  checkpoint the build reads must carry what the config asked quantize for.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from pipeline import targets
from pipeline.engines.trtllm.options import SUPPORTED_RELEASE, TRTLLM_BUILD
from pipeline.engines.trtllm.rules import RULES, QuantFacts, enforce_rules, facts_from_config
from pipeline.errors import ConfigError, EnvironmentProblem, InputError

log = logging.getLogger(__package__)  # "pipeline.engines.trtllm": log lines name the package, as before the split

NVIDIA_SMI = "nvidia-smi"



# ====================================================================================== this machine
@dataclass(frozen=True)
class GPU:
    name: str
    sm: int  # compute capability x 10 (H100: 90)
    driver: str
    memory_mib: Optional[int] = None


@dataclass(frozen=True)
class Environment:
    """What this machine offers the GPU targets (versions read from package metadata, never by importing)."""

    gpus: tuple[GPU, ...]
    trtllm_version: Optional[str]
    tensorrt_version: Optional[str]
    cuda_version: Optional[str]
    trtllm_build: Optional[str]  # path of the trtllm-build command

    @property
    def gpu(self) -> Optional[GPU]:
        return self.gpus[0] if self.gpus else None


def detect_gpus(timeout_s: float = 20.0) -> Optional[tuple[GPU, ...]]:
    """The GPUs ``nvidia-smi`` reports (name, SM, driver), or None when there is no driver / no GPU."""
    exe = shutil.which(NVIDIA_SMI)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap,driver_version,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("nvidia-smi failed: %s", e)
        return None
    if out.returncode != 0:
        log.warning("nvidia-smi exited %s: %s", out.returncode, (out.stderr or out.stdout).strip()[:300])
        return None
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not re.fullmatch(r"\d+\.\d+", parts[1]):
            continue
        major, minor = parts[1].split(".")
        mem = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
        gpus.append(GPU(parts[0], int(major) * 10 + int(minor), parts[2], mem))
    return tuple(gpus) or None


def detect_gpu() -> Optional[GPU]:
    gpus = detect_gpus()
    return gpus[0] if gpus else None


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def detect_environment() -> Environment:
    trtllm = None
    if importlib.util.find_spec("tensorrt_llm") is not None:
        trtllm = _dist_version("tensorrt_llm", "tensorrt-llm") or "unknown"
    return Environment(
        gpus=detect_gpus() or (),
        trtllm_version=trtllm,
        tensorrt_version=_dist_version("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt-cu12-libs",
                                       "tensorrt-cu13-libs"),
        # CUDA_VERSION is set by NVIDIA's CUDA container images (the Triton images are built on them)
        cuda_version=os.environ.get("CUDA_VERSION") or _dist_version("nvidia-cuda-runtime-cu12",
                                                                     "nvidia-cuda-runtime-cu13",
                                                                     "nvidia-cuda-runtime"),
        trtllm_build=shutil.which(TRTLLM_BUILD),
    )


# ====================================================================================== the checkpoint
def facts_from_checkpoint(ckpt_dir: Path) -> QuantFacts:
    """quant_algo, kv_cache_quant_algo and mapping of a TensorRT-LLM checkpoint (config.json, quant_cfg.json)."""
    path = ckpt_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable TensorRT-LLM checkpoint config ({e}). Rerun `invoke quantize`.") \
            from None
    q = cfg.get("quantization") or {}
    algo = q.get("quant_algo")
    layer_algos = {algo} if algo and algo != "MIXED_PRECISION" else set()
    if algo == "MIXED_PRECISION":
        try:
            layers = json.loads((ckpt_dir / "quant_cfg.json").read_text()).get("quantized_layers", {})
        except (OSError, ValueError) as e:
            raise InputError(f"{ckpt_dir}: MIXED_PRECISION without a readable quant_cfg.json ({e})") from None
        layer_algos = {v.get("quant_algo") for v in layers.values() if v.get("quant_algo")}
    m = cfg.get("mapping") or {}
    hidden = cfg.get("hidden_size")
    return QuantFacts(algo, q.get("kv_cache_quant_algo"), frozenset(layer_algos), int(m.get("tp_size", 1)),
                      int(m.get("pp_size", 1)), str(path), architecture=cfg.get("architecture"),
                      hidden_size=int(hidden) if hidden else None)


def facts_from_hf_checkpoint(hf_dir: Path) -> QuantFacts:
    """The same facts from an HF unified checkpoint (ModelOpt's hf_quant_config.json)."""
    path = hf_dir / "hf_quant_config.json"
    try:
        q = json.loads(path.read_text()).get("quantization") or {}
    except (OSError, ValueError) as e:
        raise InputError(
            f"{hf_dir}: no readable HF unified checkpoint ({path.name}: {e}). The pytorch target serves it: set "
            f"quantization.export_hf_checkpoint: true and rerun `invoke quantize`.") from None
    algo = q.get("quant_algo")
    layers = q.get("quantized_layers") or {}
    layer_algos = {v.get("quant_algo") for v in layers.values() if v.get("quant_algo")} if layers else \
        ({algo} if algo else set())
    return QuantFacts(algo, q.get("kv_cache_quant_algo"), frozenset(layer_algos), origin=str(path))


def check_checkpoint_matches(cfg, facts: QuantFacts) -> None:
    """The checkpoint must carry what the config asked quantize for (KV cache, weights, mapping)."""
    want = facts_from_config(cfg)
    problems = []
    if facts.kv_cache_quant_algo != want.kv_cache_quant_algo:
        problems.append(f"kv_cache_quant_algo is {facts.kv_cache_quant_algo} but quantization.kv_cache "
                        f"{cfg.quantization.kv_cache} means {want.kv_cache_quant_algo}")
    if facts.quant_algo not in (want.quant_algo, "MIXED_PRECISION"):
        problems.append(f"quant_algo is {facts.quant_algo} but quantization.weight_format "
                        f"{cfg.quantization.weight_format} means {want.quant_algo}")
    if facts.origin.endswith("config.json") and (facts.tp_size, facts.pp_size) != (want.tp_size, want.pp_size):
        problems.append(f"mapping tp_size={facts.tp_size} pp_size={facts.pp_size} but the build asks for "
                        f"tensor_parallel_size={want.tp_size} pipeline_parallel_size={want.pp_size}")
    if problems:
        raise InputError(f"build: the quantized checkpoint ({facts.origin}) does not match the config: "
                         + "; ".join(problems) + ". Rerun `invoke quantize` (or `invoke build --force`).")


# ====================================================================================== requirements
def check_target_requirements(cfg, before_work: bool = False) -> Optional[Environment]:
    """Check that this machine can build the config's GPU target; returns what it found (None for cpu).

    Order: the config against the rules for the GPU it names (ConfigError: fixable anywhere), then what the
    machine lacks (EnvironmentProblem, with exactly what is needed), then the rules against the GPU found."""
    b = cfg.build
    if not targets.get(b.target).gpu_only:  # the others need nothing of TensorRT-LLM
        return None
    enforce_rules(cfg, b.target_sm, gpu_label=f"{b.target_gpu or 'the target GPU'} (SM {b.target_sm})"
                  if b.target_sm else "")
    env = detect_environment()
    missing = _missing_requirements(b, env)
    if missing:
        raise EnvironmentProblem(
            f"build.target {b.target} cannot run on this machine; it needs:\n"
            + "\n".join(f"  - {m}" for m in missing)
            + f"\nRun it inside the Triton TensorRT-LLM container image that carries TensorRT-LLM {b.trtllm_version} "
              f"(tritonserver:<yy.mm>-trtllm-python-py3, or the tensorrtllm_backend build of {b.trtllm_version}), "
              f"on a GPU machine with the GPUs passed in (docker run --gpus all ...). Without a GPU, build the "
              f"CPU reference bundle instead: --set build.target=cpu."
            + (" Nothing has been downloaded or quantized." if before_work else ""))
    gpu = env.gpu
    # _missing_requirements named a missing GPU or TensorRT-LLM, and the raise above stopped there
    assert gpu is not None and env.trtllm_version is not None
    if env.trtllm_version != b.trtllm_version:
        raise EnvironmentProblem(
            f"this machine has TensorRT-LLM {env.trtllm_version}, but build.trtllm_version is {b.trtllm_version}: "
            f"an engine only loads under the TensorRT / TensorRT-LLM it was built with ('serialization version "
            f"mismatch'). Use the image with TensorRT-LLM {b.trtllm_version}, or set build.trtllm_version to "
            f"{env.trtllm_version} if that is what will serve it"
            + (" (it must be a 1.2.x release)." if not env.trtllm_version.startswith(SUPPORTED_RELEASE) else "."))
    if b.target_sm is not None and gpu.sm != b.target_sm:
        raise ConfigError(
            f"[target_gpu] this machine's GPU is {gpu.name} (SM {gpu.sm}), but the profile targets "
            f"{b.target_gpu or 'another GPU'} (build.target_sm: {b.target_sm}); a TensorRT engine is built for the "
            f"GPU it is built on. Build on the target GPU, or use/derive a profile for this one "
            f"(--set build.target_sm={gpu.sm}) (rule from {RULES['target_gpu'].source})")
    enforce_rules(cfg, gpu.sm, gpu_label=f"{gpu.name} (SM {gpu.sm})")
    if len(env.gpus) < b.tensor_parallel_size * b.pipeline_parallel_size:
        log.warning("this machine has %d GPU(s); the engine's %d ranks build here one after another, but "
                    "serving needs %d GPUs", len(env.gpus), b.tensor_parallel_size * b.pipeline_parallel_size,
                    b.tensor_parallel_size * b.pipeline_parallel_size)
    return env


def _missing_requirements(b, env: Environment) -> list[str]:
    """What this machine lacks for the build section's GPU target: a GPU, TensorRT-LLM, trtllm-build."""
    missing = []
    if not env.gpus:
        why = "nvidia-smi is not on PATH (no NVIDIA driver)" if shutil.which(NVIDIA_SMI) is None else \
            "nvidia-smi reports no GPU"
        target = f" ({b.target_gpu + ', ' if b.target_gpu else ''}SM {b.target_sm})" if b.target_sm else ""
        missing.append(f"an NVIDIA GPU{target}: {why}")
    engine = targets.get(b.target).engine_per_rank
    what = "TensorRT-LLM " + b.trtllm_version + (" with its trtllm-build command" if engine else
                                                 " (its LLM API serves this target)")
    if env.trtllm_version is None:
        missing.append(f"{what}: the Python package tensorrt_llm is not installed")
    elif engine and env.trtllm_build is None:
        missing.append(f"{what}: tensorrt_llm {env.trtllm_version} is installed but trtllm-build is not on PATH")
    return missing


def preflight(loaded) -> None:
    """The build stage's preflight: for a GPU target, stop before any stage runs if this machine cannot
    build it (or the config breaks the rules for its GPU)."""
    check_target_requirements(loaded.config, before_work=True)
