"""The inputs: where the model comes from (``model``) and the text it is calibrated and evaluated on (``text``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from pipeline import constants
from pipeline.config.base import Strict

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


class HubSource(Strict):
    kind: Literal["hub"]
    repo_id: str = Field(description="Hub repository id, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    # A branch or tag is resolved to its commit sha at download time and recorded; a sha pins it.
    revision: str
    include: tuple[str, ...] = constants.HUB_DEFAULT_INCLUDE
    exclude: tuple[str, ...] = ()
    allow_pickle: bool = False  # *.bin / *.pt weights run code when loaded: refused unless set
    cache_dir: Optional[Path] = None  # default: huggingface_hub's cache (HF_HOME / HF_HUB_CACHE)

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: str) -> str:
        if not _REPO_ID_RE.match(v) or ".." in v or len(v) > 96:
            raise ValueError("must look like 'owner/name' (letters, digits, '.', '_', '-')")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not v or v != v.strip() or any(c.isspace() for c in v) or ".." in v or v.startswith("/"):
            raise ValueError("must be a branch, tag or 40-character commit sha (no spaces, no '..')")
        return v

    @model_validator(mode="after")
    def _pickle(self) -> "HubSource":
        pickles = [p for p in self.include if p.endswith(constants.PICKLE_SUFFIXES)]
        if pickles and not self.allow_pickle:
            raise ValueError(
                f"include asks for pickle weights {pickles}; they execute code when loaded. "
                "Use the repository's safetensors, or set allow_pickle: true if you trust it"
            )
        return self

    @property
    def pinned(self) -> bool:
        return bool(_SHA_RE.match(self.revision))


class LocalSource(Strict):
    kind: Literal["local"]
    path: Path  # an HF-format folder: config.json, *.safetensors, tokenizer files


class GGUFFileSource(Strict):
    kind: Literal["gguf_file"]
    path: Path


class GGUFPackageSource(Strict):
    kind: Literal["gguf_package"]
    package: str  # an installed Python package that carries a GGUF file; found, never imported
    file: str

    @field_validator("file")
    @classmethod
    def _file(cls, v: str) -> str:
        if "/" in v or "\\" in v or v.startswith(".") or not v.endswith(".gguf"):
            raise ValueError("must be a plain .gguf file name inside the package (no directories)")
        return v


ModelSource = Annotated[
    Union[HubSource, LocalSource, GGUFFileSource, GGUFPackageSource], Field(discriminator="kind")
]


class ModelSection(Strict):
    source: ModelSource
    # dtype of the prepared HF folder's weights. "auto": the source's own (float32 for a GGUF, whose
    # dequantized weights are not exactly representable in 16 bits).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    trust_remote_code: Literal[False] = False  # remote code is never run by this pipeline


class PydocTopicsText(Strict):
    """English prose from the standard library's pydoc_data.topics: on every Python install."""

    kind: Literal["pydoc_topics"]


class FilesText(Strict):
    """Plain UTF-8 text files; each file is one document."""

    kind: Literal["files"]
    paths: tuple[Path, ...] = Field(min_length=1)


class DatasetText(Strict):
    """Rows of a dataset read with Hugging Face ``datasets``; each row's ``text_field`` is one document.

    Either a Hub dataset at a pinned commit (e.g. what ModelOpt calibrates on: cnn_dailymail, config ``3.0.0``,
    split ``train``, field ``article``), or local data files, which make one split, ``train``.
    No code from a dataset repository runs: a dataset that needs a loading script is refused.
    """

    kind: Literal["dataset"]
    repo_id: Optional[str] = None
    # a commit, never a branch or tag: those move, and the calibration set would move with them unseen
    revision: Optional[str] = None
    name: Optional[str] = None  # the dataset's config, e.g. "3.0.0" for cnn_dailymail
    files: tuple[Path, ...] = ()
    format: Optional[Literal["parquet", "jsonl", "json", "arrow", "csv"]] = None  # jsonl and json: one reader
    split: str = "train"
    text_field: str
    # render each row with the model's chat template (for instruct models): a list of {role, content}
    # messages as it is, a string as one user message
    chat: bool = False

    @field_validator("repo_id")
    @classmethod
    def _repo_id(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not _REPO_ID_RE.match(v) or ".." in v or len(v) > 96):
            raise ValueError("must look like 'owner/name' (letters, digits, '.', '_', '-')")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _SHA_RE.match(v):
            raise ValueError(
                "must be a 40-character commit sha of the dataset repository (a branch or tag moves, and the "
                "calibration set with it); copy one from the dataset's commit history on the Hub"
            )
        return v

    @model_validator(mode="after")
    def _one_origin(self) -> "DatasetText":
        if (self.repo_id is None) == (not self.files):
            raise ValueError("give either repo_id (a Hub dataset) or files (local data files), not "
                             + ("both" if self.files else "neither"))
        if self.repo_id is not None:
            if self.revision is None:
                raise ValueError(f"repo_id {self.repo_id} needs revision: a 40-character commit sha of the "
                                 "dataset repository")
            if self.format is not None:
                raise ValueError("format is for local files; a Hub dataset's files say what they are")
        else:
            if self.format is None:
                raise ValueError("files need format: one of parquet, jsonl, json, arrow, csv")
            if self.revision is not None or self.name is not None:
                raise ValueError("revision and name pick a Hub dataset's commit and config; local files have neither")
        return self


TextSource = Annotated[Union[PydocTopicsText, FilesText, DatasetText], Field(discriminator="kind")]


class TokenSet(Strict):
    num_samples: int = Field(ge=1, le=100_000)
    seq_len: int = Field(ge=8, le=131_072)


class TextSection(Strict):
    """Calibration and evaluation text: one source, split by document so the two never overlap."""

    source: TextSource
    seed: int = 0
    calibration: TokenSet = TokenSet(num_samples=32, seq_len=256)
    evaluation: TokenSet = TokenSet(num_samples=16, seq_len=256)
