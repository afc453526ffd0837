"""Which TensorRT-LLM (and TensorRT) each Triton TensorRT-LLM container tag carries.

Publish reads it to know what will serve a build; the image stage to pick a base image that can load it.
"""

from __future__ import annotations

from typing import Optional

# Triton TensorRT-LLM image tag -> (TensorRT-LLM, TensorRT) inside it, from the upstream server repository's
# compatibility matrix (docs/introduction/compatibility.md, read in November 2026). An engine only loads under
# the TensorRT-LLM and TensorRT it was built with. TensorRT-LLM 1.2.x (the last line with trtllm-build) ships
# from 26.03 on. Add a row when a new tag is released; a tag not listed needs image.base_trtllm_version.
TRITON_TAG_SUFFIX = "-trtllm-python-py3"
TRITON_TRTLLM_TAGS: dict[str, tuple[str, str]] = {
    "26.07-trtllm-python-py3": ("1.2.1", "10.14.1.48"),
    "26.06-trtllm-python-py3": ("1.2.1", "10.14.1.48"),
    "26.05-trtllm-python-py3": ("1.2.1", "10.14.1.48"),
    "26.04-trtllm-python-py3": ("1.2.1", "10.14.1.48"),
    "26.03-trtllm-python-py3": ("1.2.0", "10.14.1.48"),
    "26.02-trtllm-python-py3": ("1.1.0", "10.13.3.9"),
    "26.01-trtllm-python-py3": ("1.1.0", "10.13.3.9"),
    "25.12-trtllm-python-py3": ("1.1.0", "10.13.3.9"),
    "25.11-trtllm-python-py3": ("1.0.3.2510", "10.13.3.9"),
    "25.10-trtllm-python-py3": ("1.0.0", "10.11.0.33"),
    "25.09-trtllm-python-py3": ("1.0.0", "10.11.0.33"),
    "25.08-trtllm-python-py3": ("0.21.0", "10.11.0.33"),
    "25.07-trtllm-python-py3": ("0.20.0", "10.10.0.31"),
    "25.06-trtllm-python-py3": ("0.20.0", "10.10.0.31"),
    "25.05-trtllm-python-py3": ("0.19.0", "10.9.0.34"),
    "25.04-trtllm-python-py3": ("0.18.2", "10.9.0.34"),
    "25.03-trtllm-python-py3": ("0.18.0", "10.9.0.34"),
}


def triton_tags_for(trtllm_version: str) -> list[str]:
    """Tags of the table that carry this TensorRT-LLM version, newest first."""
    return sorted((t for t, (v, _) in TRITON_TRTLLM_TAGS.items() if v == trtllm_version), reverse=True)


def trtllm_version_of_tag(tag: str) -> Optional[str]:
    row = TRITON_TRTLLM_TAGS.get(tag.split("@", 1)[0])
    return row[0] if row else None
