"""What `invoke image`, `release` and `deploy-manifests` read: the ``alerts`` and ``image`` sections."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator

from pipeline.config.base import Strict

_IMAGE_REPO_RE = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
_IMAGE_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_BASE_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}(@sha256:[0-9a-f]{64})?$")


class AlertsSection(Strict):
    """Thresholds of the alert rules `invoke deploy-manifests` renders (pipeline/release/alerts.py)."""

    queue_waiting: int = Field(32, ge=1)  # requests waiting per pod; 32: the HPA's scale-out target
    kv_cache_used_fraction: float = Field(0.9, gt=0, le=1)
    error_ratio: float = Field(0.05, gt=0, lt=1)  # failed / all requests over 5 minutes
    missed_scrapes: int = Field(3, ge=1, le=40)  # target down after this many missed scrapes (15 s apart)
    restarts_in_15m: int = Field(2, ge=0)
    gpu_util_percent: float = Field(95, gt=0, le=100)
    mem_copy_util_percent: float = Field(90, gt=0, le=100)
    for_minutes: int = Field(5, ge=1, le=120)  # how long a condition holds before its alert fires
    # quality of service over the last minute's requests, as the Python-backend serving models export it
    # (cpu and pytorch targets; triton_repo/common/llm_serving.py): end-to-end P99 / P50, and jitter (std / mean)
    latency_p99_over_p50: float = Field(3.0, gt=1)
    latency_jitter: float = Field(0.5, gt=0)
    # a tenant's KV-cache blocks reserved / its share of the pool, per pod (deployments with a `tenants:` section);
    # 0.8: the number operators watch (tenant_quota_usage / tenant_quota_limit > 0.8)
    tenant_quota_fraction: float = Field(0.8, gt=0, le=1)


class ImageSection(Strict):
    """`invoke image` / `release` / `deploy-manifests` (pipeline/release/image.py, pipeline/release/deploy.py)."""

    # Where the image is tagged and pushed: <registry>/<path>/<name>. None: the local name
    # "trtllm-pipeline", which `--push` refuses (it would go to the default public registry).
    repository: Optional[str] = None
    # GPU targets: the repository of the Triton TensorRT-LLM images (the vendor's catalogue path
    # nvidia/tritonserver behind its registry, or your mirror of it). Required for tensorrt/pytorch; no
    # default, so no registry is ever chosen for you.
    base_repository: Optional[str] = None
    # None: the newest tag in pipeline.serving.image_tags.TRITON_TRTLLM_TAGS that carries the TensorRT-LLM version the
    # published build recorded. "<tag>" or "<tag>@sha256:<digest>" to pin the base by digest.
    base_tag: Optional[str] = None
    # The TensorRT-LLM version inside base_tag, for a tag the table does not know (a custom build).
    base_trtllm_version: Optional[str] = None
    # None: <model>-<quant>-trtllm<version>-<short repository digest>, derived from the published build.
    tag: Optional[str] = None
    platform: Literal["linux/amd64", "linux/arm64"] = "linux/amd64"
    # cpu image: a pip config file (index, mirror, credentials) handed to the build as a BuildKit secret,
    # so it never lands in a layer; e.g. one that adds the CPU-only torch wheel index (the default index's
    # x86_64 torch is a multi-GB CUDA build). Absolute, or relative to the current directory.
    pip_config: Optional[Path] = None

    @field_validator("repository", "base_repository")
    @classmethod
    def _repository(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not _IMAGE_REPO_RE.match(v) or len(v) > 255):
            raise ValueError("must be an image repository without tag: lowercase [host[:port]/]path/name")
        return v

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _IMAGE_TAG_RE.match(v):
            raise ValueError("must be a Docker tag: letters, digits, '_', '.', '-', at most 128, "
                             "not starting with '.' or '-'")
        return v

    @field_validator("base_tag")
    @classmethod
    def _base_tag(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _BASE_TAG_RE.match(v):
            raise ValueError("must be a tag, optionally pinned by digest: '26.07-trtllm-python-py3' or "
                             "'26.07-trtllm-python-py3@sha256:<64 hex>'")
        return v
