"""download stage, text part: calibration and evaluation token sets from real English text.

Documents are shuffled with the configured seed; the evaluation set takes documents first, the
calibration set takes from the rest, so the two never share a document, and changing the calibration
size leaves the evaluation set as it was. Each set is a packed token stream (documents separated by the
EOS token) cut into ``num_samples`` rows of ``seq_len`` tokens, saved as int64 safetensors, with a JSONL
twin a person can read.
"""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline import artifacts
from pipeline.config import FilesText, LoadedConfig, PydocTopicsText, TextSection
from pipeline.errors import InputError
from pipeline.fsutil import HashCache, sha256_bytes

log = logging.getLogger(__name__)

_UNDERLINE = re.compile(r"^[*=\-~^\"#+]{3,}\s*$")


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


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


def load_documents(source) -> list[Document]:
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


def text_fingerprint(loaded: LoadedConfig, hash_cache: HashCache) -> dict:
    """Digest of the source text itself: pydoc topics differ between Python versions, files get edited."""
    docs = load_documents(loaded.config.text.source)
    return {"documents": len(docs), "sha256": sha256_bytes("\0".join(d.doc_id + "\n" + d.text for d in docs).encode())}


def prepare_text(section: TextSection, tokenizer_dir: Path, out_dir: Path) -> dict:
    import numpy as np
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    sep = tok.eos_token_id
    if sep is None:
        raise InputError("the model's tokenizer has no EOS token to separate documents with")
    docs = load_documents(section.source)
    random.Random(section.seed).shuffle(docs)

    def take(needed: int, pool: list[Document]) -> tuple[list[int], list[str], list[Document]]:
        stream: list[int] = []
        used: list[str] = []
        while pool and len(stream) < needed:
            doc = pool.pop(0)
            stream += tok(doc.text, add_special_tokens=False).input_ids + [sep]
            used.append(doc.doc_id)
        return stream, used, pool

    ev, cal = section.evaluation, section.calibration
    ev_stream, ev_docs, rest = take(ev.num_samples * ev.seq_len, list(docs))
    cal_stream, cal_docs, _ = take(cal.num_samples * cal.seq_len, rest)
    have_ev, have_cal = len(ev_stream), len(cal_stream)
    if have_ev < ev.num_samples * ev.seq_len or have_cal < cal.num_samples * cal.seq_len:
        total = have_ev + have_cal
        raise InputError(
            f"text source has {len(docs)} documents, about {total} tokens; evaluation needs "
            f"{ev.num_samples}x{ev.seq_len} and calibration {cal.num_samples}x{cal.seq_len} tokens from "
            f"separate documents. Lower text.*.num_samples / seq_len, or add text files."
        )
    assert not set(ev_docs) & set(cal_docs)

    summary = {"tokenizer_eos_id": sep, "source_documents": len(docs)}
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
        summary[name] = {"num_samples": ts.num_samples, "seq_len": ts.seq_len, "tokens": int(ids.size),
                         "documents": used}
    log.info("text: evaluation %d docs, calibration %d docs", len(ev_docs), len(cal_docs))
    return summary
