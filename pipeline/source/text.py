"""download stage, text part: calibration and evaluation token sets from real English text.

Sources: the standard library's pydoc topics, plain text files, or the rows of a dataset read with Hugging
Face ``datasets`` (a Hub dataset at a pinned commit, or local parquet/jsonl/json/arrow/csv files), optionally
rendered with the model's chat template. Documents are shuffled with the configured seed; the evaluation set
takes documents first, the calibration set takes from the rest, so the two never share a document, and
changing the calibration size leaves the evaluation set as it was. Each set is a packed token stream
(documents separated by the EOS token) cut into ``num_samples`` rows of ``seq_len`` tokens, saved as int64
safetensors, with a JSONL twin a person can read.
"""

from __future__ import annotations

import json
import logging
import random
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pipeline import artifacts, constants
from pipeline.config import DatasetText, FilesText, LoadedConfig, PydocTopicsText, TextSection, TextSource
from pipeline.errors import EnvironmentProblem, InputError
from pipeline.fsutil import HashCache, sha256_bytes
from pipeline.source.hub import offline
from pipeline.summaries import TextSummary

log = logging.getLogger(__name__)

_UNDERLINE = re.compile(r"^[*=\-~^\"#+]{3,}\s*$")


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


class Documents(Protocol):
    """What prepare_text reads: a count and documents by position (a list, or a dataset's rows read when taken)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Document: ...


def _pydoc_prose(raw: str) -> str:
    """Keep the prose paragraphs of a pydoc topic: drop indented code/grammar blocks and heading rules."""
    keep = []
    for para in re.split(r"\n\s*\n", raw):
        lines = [ln for ln in para.splitlines() if ln.strip() and not _UNDERLINE.match(ln)]
        if not lines or any(ln[:1].isspace() for ln in lines):
            continue
        text = " ".join(ln.strip() for ln in lines)
        letters = sum(c.isalpha() or c.isspace() for c in text)
        if len(text) >= 80 and letters / len(text) > 0.85:
            keep.append(text)
    return "\n\n".join(keep)


def load_documents(source: TextSource, tokenizer: Any = None) -> Documents:
    """The source's documents; ``tokenizer`` (the model's) renders a dataset's rows when ``chat: true``."""
    if isinstance(source, DatasetText):
        return _dataset_documents(source, tokenizer)
    return _text_documents(source)


def _text_documents(source: PydocTopicsText | FilesText) -> list[Document]:
    if isinstance(source, PydocTopicsText):
        from pydoc_data import topics

        docs = [Document(f"pydoc:{k}", _pydoc_prose(v)) for k, v in sorted(topics.topics.items())]
    elif isinstance(source, FilesText):
        docs = []
        for p in source.paths:
            try:
                docs.append(Document(f"file:{p.name}", p.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                raise InputError(f"text.source.paths: {p} is not UTF-8 text") from None
    else:  # pragma: no cover - the config schema admits no other kind
        raise InputError(f"unknown text source {source!r}")
    return [d for d in docs if d.text.strip()]


# how each local-file format is read: the packaged ``datasets`` builder of that name
_DATASET_BUILDERS = {"parquet": "parquet", "jsonl": "json", "json": "json", "arrow": "arrow", "csv": "csv"}


class _DatasetRows:
    """One column of a dataset split as documents, each row read and rendered only when taken: a split of
    300k news articles is shuffled by position without its text ever being held in memory."""

    def __init__(self, rows: Any, source: DatasetText, tokenizer: Any):
        self._rows = rows
        self._source = source
        self._tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int, /) -> Document:
        value = self._rows[index][self._source.text_field]
        return Document(f"{self._source.split}[{index}]", _row_text(value, index, self._source, self._tokenizer))


def _is_chat(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def _row_text(value: object, index: int, source: DatasetText, tokenizer: Any) -> str:
    """A row's text; with ``chat: true`` the chat template's rendering of it (a string as one user message)."""
    where = f"text.source.text_field '{source.text_field}', row {index} of split '{source.split}'"
    if value is None or isinstance(value, str) and not value.strip():
        return ""  # an empty row: skipped when the sets are taken
    if isinstance(value, str):
        if not source.chat:
            return value
        return tokenizer.apply_chat_template([{"role": "user", "content": value}], tokenize=False)
    if _is_chat(value):
        if not source.chat:
            raise InputError(f"{where} is a list of chat messages: set text.source.chat: true to render it "
                             f"with the model's chat template")
        return tokenizer.apply_chat_template(value, tokenize=False)
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise InputError(f"{where} holds {type(value).__name__} ({shown}), not text or a list of chat messages "
                     f"({{role, content}}). Point text_field at a text column.")


def _dataset_documents(source: DatasetText, tokenizer: Any) -> _DatasetRows:
    if source.chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("text.source.chat is true, but the model's tokenizer has no chat template: set "
                         "chat: false, or use the instruct model whose template the text should be rendered with")
    if source.repo_id is not None:
        where = f"Hub dataset {source.repo_id}@{source.revision}" + (f" (config {source.name})" if source.name else "")
        splits = _hub_dataset(source, where)
    else:
        where = f"text.source.files ({source.format})"
        splits = _local_dataset(source, where)
    if source.split not in splits:
        raise InputError(f"{where} has no split '{source.split}'; its splits: {', '.join(sorted(splits))}. "
                         f"Set text.source.split to one of them.")
    rows = splits[source.split]
    if source.text_field not in rows.column_names:
        raise InputError(f"{where}, split '{source.split}', has no field '{source.text_field}'; its fields: "
                         f"{', '.join(rows.column_names)}. Set text.source.text_field to one of them.")
    log.info("text: %s, split %s: %d rows", where, source.split, len(rows))
    return _DatasetRows(rows.select_columns([source.text_field]), source, tokenizer)


def _hub_dataset(source: DatasetText, where: str) -> Any:
    """All splits of the Hub dataset at its pinned commit, downloaded once into the ``datasets`` cache."""
    import datasets

    try:
        splits = datasets.load_dataset(source.repo_id, source.name, revision=source.revision, keep_in_memory=False)
    except datasets.exceptions.DatasetNotFoundError as e:
        raise InputError(f"{where}: {e} Check text.source.repo_id and revision; a private or gated dataset "
                         f"needs {constants.HF_TOKEN_ENV} with access to it.") from None
    except ConnectionError:
        if offline():
            raise InputError(f"{where} is not in the local datasets cache and {constants.HF_OFFLINE_ENV} is set. "
                             f"Load it once with network access, or unset {constants.HF_OFFLINE_ENV}.") from None
        raise EnvironmentProblem(f"Could not reach the Hugging Face Hub for {where}. Check the network or "
                                 f"HF_ENDPOINT, or set {constants.HF_OFFLINE_ENV}=1 to use the local cache.") from None
    # an unknown config (the message lists them), or a dataset that needs a loading script: datasets 3.x refuses
    # it without trust_remote_code (ValueError), 4.x at all (RuntimeError); either way its message says so
    except (datasets.exceptions.DatasetsError, ValueError, RuntimeError) as e:
        raise InputError(f"{where}: {e}") from None
    # offline, datasets falls back to the newest cached copy of *any* commit; the cache folder names the commit
    cached = {Path(f["filename"]).parent.name for ds in splits.values() for f in ds.cache_files}
    if cached != {source.revision}:
        raise InputError(f"{where}: the datasets cache holds commit(s) {', '.join(sorted(cached))}, not the "
                         f"pinned one. Load it once with network access ({constants.HF_OFFLINE_ENV} unset).")
    return splits


def _local_dataset(source: DatasetText, where: str) -> Any:
    """The local files as one split, ``train``, read into memory through a throwaway cache: ``datasets``
    keys its cache by path and mtime, and would serve stale rows for a file replaced by one with the same
    mtime (``cp -p``, ``rsync -t``, unpacking an archive)."""
    import datasets

    assert source.format is not None  # the schema requires it with files
    with tempfile.TemporaryDirectory(prefix="text-dataset-") as cache:
        try:
            return datasets.load_dataset(_DATASET_BUILDERS[source.format],
                                         data_files=[str(p) for p in source.files], cache_dir=cache,
                                         keep_in_memory=True)
        except (datasets.exceptions.DatasetsError, ValueError) as e:
            cause = e.__cause__ or e
            raise InputError(f"{where}: cannot read them as {source.format}: {type(cause).__name__}: {cause}. "
                             f"Check text.source.format and the files.") from None


def text_fingerprint(loaded: LoadedConfig, hash_cache: HashCache) -> dict:
    """Content identity of the source text, taken before the stage runs: the digest of the text itself for
    pydoc topics (they differ between Python versions) and text files; a Hub dataset's pinned commit; the
    sha256 of local data files (through the hash cache: an unchanged multi-GB parquet is not read again)."""
    source = loaded.config.text.source
    if isinstance(source, DatasetText):
        if source.repo_id is not None:
            return {"kind": "dataset", "repo_id": source.repo_id, "revision": source.revision}
        return {"kind": "dataset", "files": {str(p): hash_cache.sha256(p) for p in source.files}}
    docs = _text_documents(source)
    return {"documents": len(docs), "sha256": sha256_bytes("\0".join(d.doc_id + "\n" + d.text for d in docs).encode())}


def prepare_text(section: TextSection, tokenizer_dir: Path, out_dir: Path) -> TextSummary:
    import numpy as np
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    sep = tok.eos_token_id
    if sep is None:
        raise InputError("the model's tokenizer has no EOS token to separate documents with")
    docs = load_documents(section.source, tok)
    # positions are shuffled, not documents: the same permutation, and a dataset's rows are read only when taken
    order = list(range(len(docs)))
    random.Random(section.seed).shuffle(order)
    pool = iter(order)

    def take(needed: int) -> tuple[list[int], list[str]]:
        stream: list[int] = []
        used: list[str] = []
        while len(stream) < needed and (index := next(pool, None)) is not None:
            doc = docs[index]
            if not doc.text.strip():
                continue  # an empty dataset row
            stream += tok(doc.text, add_special_tokens=False).input_ids + [sep]
            used.append(doc.doc_id)
        return stream, used

    ev, cal = section.evaluation, section.calibration
    ev_needed, cal_needed = ev.num_samples * ev.seq_len, cal.num_samples * cal.seq_len
    ev_stream, ev_docs = take(ev_needed)
    cal_stream, cal_docs = take(cal_needed)
    if len(ev_stream) < ev_needed or len(cal_stream) < cal_needed:
        total = len(ev_stream) + len(cal_stream)  # every document was taken
        raise InputError(
            f"text source has {len(docs)} documents, {total} tokens in all (with one EOS after each); "
            f"evaluation asks for {ev.num_samples}x{ev.seq_len} = {ev_needed} and calibration for "
            f"{cal.num_samples}x{cal.seq_len} = {cal_needed} tokens, from separate documents. "
            f"Lower text.*.num_samples / seq_len, or give text.source more text."
        )
    assert not set(ev_docs) & set(cal_docs)

    sets: dict[str, dict] = {}
    for name, stream, used, ts, tensor_file, text_file in (
        ("evaluation", ev_stream, ev_docs, ev, artifacts.EVALUATION_TOKENS_FILE, artifacts.EVALUATION_TEXT_FILE),
        ("calibration", cal_stream, cal_docs, cal, artifacts.CALIBRATION_TOKENS_FILE, artifacts.CALIBRATION_TEXT_FILE),
    ):
        ids = np.asarray(stream[: ts.num_samples * ts.seq_len], dtype=np.int64).reshape(ts.num_samples, ts.seq_len)
        # no safetensors metadata: a multi-key metadata map is written in a different order from run to run,
        # which would make identical token sets hash differently (which documents were used is in the manifest)
        save_file({artifacts.TOKENS_KEY: ids}, str(out_dir / tensor_file))
        with open(out_dir / text_file, "w", encoding="utf-8") as f:
            for i, row in enumerate(ids):
                f.write(json.dumps({"index": i, "text": tok.decode(row.tolist())}, ensure_ascii=False) + "\n")
        sets[name] = {"num_samples": ts.num_samples, "seq_len": ts.seq_len, "tokens": int(ids.size),
                         "documents": used}
    log.info("text: evaluation %d docs, calibration %d docs", len(ev_docs), len(cal_docs))
    return {"tokenizer_eos_id": sep, "source_documents": len(docs), "calibration": sets["calibration"],
            "evaluation": sets["evaluation"]}
