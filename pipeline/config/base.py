"""What every config section shares: the strict base model, the plain-name type and the format names."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # usable as a directory / Triton model name
SAFE_NAME_RE = re.compile(SAFE_NAME)


def _safe_name(v: str) -> str:
    if not SAFE_NAME_RE.match(v):
        raise ValueError(
            "must be a plain name usable as a directory: letters, digits, '.', '_', '-', starting with a "
            "letter or digit, at most 64 characters (no '/', no '..')"
        )
    return v


SafeName = Annotated[str, AfterValidator(_safe_name)]

# The names of pipeline.formats (static for the schema and type checkers; tests/test_formats.py keeps them equal)
WeightFormat = Literal["none", "int8_sq", "int8_wo", "fp8", "int4_awq", "w4a8_awq"]
SensitivityFormat = Literal["int8_w8a8", "int8_sq", "int8_wo", "fp8", "int4_awq"]
KVCacheFormat = Literal["none", "int8", "fp8"]
Dtype = Literal["float32", "float16", "bfloat16"]
Frontend = Literal["openai", "triton"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
