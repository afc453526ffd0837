"""Where the model stages run and how much memory they may hold (the ``compute`` config section).

- ``check_device``: ``device: cuda`` on a machine without an NVIDIA GPU stops before any work (exit 3), from
  the driver's /proc entries, without importing torch.
- ``host_memory_bound`` / ``gpu_memory_bound``: the bounds a stage must stay under: the configured ones, else
  what this process may use here (the memory cgroup's limit where one is set, else the available RAM; a
  GPU's free memory) less the configured margin.
- ``resolve_device`` / ``reference_dtype`` / ``peak_gpu_bytes``: run inside the stage's child process (they
  import torch): the device ``auto`` resolves to, the dtype the high-precision reference uses there, and the
  peak GPU memory to record.
- ``decoder_layer_bytes`` / ``model_bytes``: sizes read from the safetensors headers (no tensor is loaded),
  for the checks a stage makes against its bound before it starts.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.errors import ConfigError, EnvironmentProblem

NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")  # one entry per GPU while the NVIDIA driver is loaded
NVIDIA_DEV_DIR = Path("/dev")  # /dev/nvidia0, ...: one node per GPU (beside nvidiactl, nvidia-uvm, ...)
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes a page-rounded 2^63 for "no limit"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8,
               "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def nvidia_gpu_count() -> int:
    """GPUs the NVIDIA driver shows this machine (container): its entries under /proc, else its device nodes
    /dev/nvidia0, /dev/nvidia1, ... (a sandboxed kernel such as gVisor passes the nodes but no /proc/driver);
    0 without the driver."""
    try:
        return sum(1 for _ in NVIDIA_GPUS_DIR.iterdir())
    except OSError:
        return sum(1 for p in NVIDIA_DEV_DIR.glob("nvidia*") if p.name[len("nvidia"):].isdigit())


def check_device(section) -> None:
    """``compute.device: cuda`` needs an NVIDIA GPU here: refuse before any work, in well under a second."""
    if section.device == "cuda" and nvidia_gpu_count() == 0:
        raise EnvironmentProblem(
            "compute.device is cuda, but this machine has no NVIDIA GPU (no driver entries under "
            f"{NVIDIA_GPUS_DIR}). Run on a GPU machine (in a container: pass the GPUs in, e.g. docker run "
            "--gpus all), or set compute.device: auto (or cpu) to run the model stages on the CPU.")


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _meminfo(key: str) -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_limit_files() -> list[Path]:
    """The memory-limit files of this process's cgroup and of each ancestor (limits nest: the smallest holds),
    from /proc/self/cgroup: cgroup v2 (``0::/path`` -> memory.max) and v1 (``N:memory:/path`` ->
    memory/<path>/memory.limit_in_bytes)."""
    files: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return files
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = CGROUP_ROOT / "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        for parent in (rel, *rel.parents):
            files.append(base / parent / name)
    return files


def _host_limit() -> tuple[int, str, Optional[Path]]:
    """(bytes, where the figure comes from, the cgroup limit file or None): the smallest of the memory-cgroup
    limits over this process's cgroup and its ancestors, and the available RAM (MemAvailable)."""
    found: list[tuple[int, str, Optional[Path]]] = [
        (v, f"the memory cgroup's limit ({f})", f) for f in _cgroup_limit_files()
        if (v := _read_int(f)) is not None and v < UNLIMITED]
    available = _meminfo("MemAvailable")
    if available is not None:
        found.append((available, "the available RAM (MemAvailable)", None))
    if not found:
        raise EnvironmentProblem("cannot tell how much memory this machine has (no /proc/meminfo): set "
                                 "compute.max_host_memory")
    return min(found, key=lambda x: x[0])


def host_memory_limit() -> tuple[int, str]:
    """(bytes this process may use, where the figure comes from): the smallest of the memory-cgroup limits
    over this process's cgroup and its ancestors, and the available RAM (MemAvailable)."""
    limit, source, _ = _host_limit()
    return limit, source


def cgroup_anon_bytes(limit_file: Path) -> int:
    """Anonymous memory the processes of the cgroup of ``limit_file`` hold now (its memory.stat: ``total_rss``
    under cgroup v1, ``anon`` under v2); page cache is left out (the kernel reclaims it before the limit)."""
    key = "anon" if limit_file.name == "memory.max" else "total_rss"
    try:
        for line in (limit_file.parent / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class Bound:
    bytes: int
    source: str

    def text(self) -> str:
        return f"{gib(self.bytes)} ({self.source})"


def gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def host_memory_bound(section) -> Bound:
    """The host memory a model stage's child may hold, computed in the parent before it starts:
    compute.max_host_memory, else this process's limit less the margin. Under a memory cgroup the limit is
    shared by every process in it, this one included (it waits for the stage's child): what they hold already
    is taken off first."""
    if section.max_host_memory is not None:
        return Bound(int(section.max_host_memory), "compute.max_host_memory")
    limit, source, limit_file = _host_limit()
    if limit_file is not None:
        held = cgroup_anon_bytes(limit_file)
        if held:
            limit -= held
            source += f" less the {gib(held)} its processes hold"
    return Bound(int(limit * (1 - section.memory_margin)),
                 f"{source} less compute.memory_margin {section.memory_margin:g}")


def gpu_memory_bound(section, free_bytes: int) -> Bound:
    """GPU memory per GPU (called in the child, which knows the free memory): the configured figure, else the
    free memory less the margin."""
    if section.max_gpu_memory is not None:
        return Bound(int(section.max_gpu_memory), "compute.max_gpu_memory")
    return Bound(int(free_bytes * (1 - section.memory_margin)),
                 f"free GPU memory less compute.memory_margin {section.memory_margin:g}")


# ---------------------------------------------------------------- in the child (torch imported)


def resolve_device(section) -> str:
    """"cuda" or "cpu": what ``compute.device`` means on this machine (auto: CUDA when torch sees a GPU)."""
    import torch

    if section.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if section.device == "cuda":
        raise EnvironmentProblem("compute.device is cuda, but torch sees no GPU here (torch "
                                 f"{torch.__version__}: a CPU-only build, or no GPU passed in)")
    return "cpu"


def reference_dtype(device: str, cpu_dtype: str) -> str:
    """The high-precision reference's dtype: bfloat16 on a GPU that has it (SM 80+), float16 on older GPUs;
    on a CPU the configured one (float32 by default: CPU half-precision GEMMs are slow and lossy)."""
    if device != "cuda":
        return cpu_dtype
    import torch

    return "bfloat16" if torch.cuda.get_device_capability()[0] >= 8 else "float16"


def peak_gpu_bytes() -> Optional[int]:
    """The largest peak of allocated memory over the GPUs this process used; None when it used none."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))


def compute_record(device: str, dtype: str, bound: Bound) -> dict:
    """What a model stage records in its manifest about where it ran."""
    return {"device": device, "dtype": dtype, "host_memory_bound_bytes": bound.bytes,
            "host_memory_bound_source": bound.source, "peak_gpu_bytes": peak_gpu_bytes()}


# ---------------------------------------------------------------- the allocator


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc's C library, for its allocator controls; None elsewhere (looked up once: find_library runs ldconfig)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc malloc_trim; a no-op elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def return_freed_memory_to_the_os() -> None:
    """glibc raises its mmap threshold as large blocks are freed, then keeps whole-calibration-set
    activations in the heap after their last use, so the peak RSS grows with every layer's temporaries.
    A fixed 32 MiB threshold keeps big tensors mmapped (returned on free) and mid-size ones reused.
    Measured on SmolLM2 (2 cores): 1 MiB was 55 % slower (page faults) for 6 % less peak RSS; glibc's
    default used ~20 % more memory. No-op off glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD


# ---------------------------------------------------------------- sizes from the safetensors headers


def _tensor_sizes(model_dir: Path) -> dict[str, tuple[str, int]]:
    """{tensor name: (dtype, element count)} from every *.safetensors header in model_dir."""
    out: dict[str, tuple[str, int]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in meta["shape"]:
                count *= d
            out[name] = (meta["dtype"], count)
    return out


def decoder_layer_bytes(model_dir: Path, dtype: str) -> int:
    """The largest decoder layer's parameters in ``dtype`` (the unit the stages stream)."""
    per_layer: dict[str, int] = {}
    for name, (_, count) in _tensor_sizes(model_dir).items():
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            key = ".".join(parts[: i + 2])
            per_layer[key] = per_layer.get(key, 0) + count
    return max(per_layer.values(), default=0) * DTYPE_BYTES[dtype]


def model_bytes(model_dir: Path, dtype: str) -> int:
    """Every parameter of the model in ``dtype``."""
    return sum(count for _, count in _tensor_sizes(model_dir).values()) * DTYPE_BYTES[dtype]


def check_layer_fits(model_dir: Path, dtype: str, bound: Bound, stage: str) -> int:
    """Refuse, before any work, a bound that cannot hold one decoder layer; returns the layer's size."""
    layer = decoder_layer_bytes(model_dir, dtype)
    if layer > bound.bytes:
        raise ConfigError(
            f"{stage}: one decoder layer of this model is {gib(layer)} in {dtype}, more than the memory bound "
            f"{bound.text()}. Raise compute.max_host_memory (or compute.memory_margin lower), or run on a "
            f"machine with more memory or with a GPU (compute.device: cuda).")
    return layer

