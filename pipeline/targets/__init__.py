"""The build targets, by name: the registry every stage asks (``pipeline.targets.get(cfg.build.target)``).

Adding a target: write ``pipeline/targets/<name>.py`` with a subclass of ``pipeline.targets.base.Target`` (its
facts, its config rules, the dotted paths of its build and preflight), then add one line to REGISTRY below.
docs: docs/how-to/add-target.md.
"""

from __future__ import annotations

from pipeline.errors import ConfigError
from pipeline.targets.base import (
    NEEDS_EDGELLM_ENV,
    NEEDS_GPU,
    NEEDS_IMAGE_TRITON,
    NEEDS_TRITON,
    NEEDS_TRTLLM,
    NEEDS_TRTLLM_BUILD,
    NEEDS_VLLM_CPU,
    NEEDS_VLLM_ENV,
    SERVER_IMAGE_TRITON,
    SERVER_TRITON,
    SERVER_TRITON_VLLM,
    SERVER_VLLM_OPENAI,
    SERVING_SETTINGS,
    Target,
    resolve_entry,
)
from pipeline.targets.cpu import CpuTarget
from pipeline.targets.edge import EdgeTarget
from pipeline.targets.pytorch import PytorchTarget
from pipeline.targets.tensorrt import TensorrtTarget
from pipeline.targets.vllm import VllmTarget

__all__ = ["NEEDS_EDGELLM_ENV",
           "NEEDS_GPU", "NEEDS_IMAGE_TRITON", "NEEDS_TRITON", "NEEDS_TRTLLM", "NEEDS_TRTLLM_BUILD", "NEEDS_VLLM_CPU",
           "NEEDS_VLLM_ENV", "REGISTRY", "SERVER_IMAGE_TRITON", "SERVER_TRITON", "SERVER_TRITON_VLLM",
           "SERVER_VLLM_OPENAI", "SERVING_SETTINGS", "Target", "get", "names", "resolve_entry"]

REGISTRY: dict[str, Target] = {t.name: t for t in (
    TensorrtTarget(),
    PytorchTarget(),
    CpuTarget(),
    VllmTarget(),
    EdgeTarget(),
)}


def names() -> tuple[str, ...]:
    """Every registered target's name, in the registry's order."""
    return tuple(REGISTRY)


def get(name: str) -> Target:
    """The target registered as ``name``; a ConfigError naming the registered ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"build.target {name!r} is not a build target; the targets are: "
                          f"{', '.join(REGISTRY)}") from None
