"""One copy of a tied embedding in the TensorRT-LLM checkpoint.

ModelOpt 0.47's ``export_tensorrt_llm_checkpoint`` writes a model that ties its word embeddings with both
``transformer.vocab_embedding.weight`` and ``lm_head.weight``, the same bytes twice, and
``share_embedding_table: false`` (SmolLM2-135M: 54.0 MiB more than the plan's linears, 29 %). TensorRT-LLM
reads such a checkpoint without ``lm_head.weight``: ``PretrainedModel.load`` lets it be missing when the
rank holds ``vocab_embedding.weight``, and ``build`` always runs the ``share_embedding`` pass, which points
lm_head at the embedding when their shapes and dtypes agree (tests/data/upstream/trtllm_shared_embedding.json).
This project's readers (pipeline.quant.checkpoint, the vLLM export) take the embedding for a tied model's
lm_head too. So where every rank's lm_head holds exactly the embedding's bytes (unquantized, same dtype and
shape: both split on the vocabulary), lm_head is dropped and ``share_embedding_table`` set, as upstream's
own converters write a shared table. A quantized lm_head, or one that differs, stays.

A rank file is rewritten by copying its other tensors' bytes (a safetensors file is an 8-byte header
length, a JSON header of dtype, shape and data offsets, then the data): never more than a chunk in memory,
written beside it and moved into place.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

HEAD, EMBEDDING = "lm_head.weight", "transformer.vocab_embedding.weight"
_CHUNK = 16 * 2**20


def _header(path: Path) -> tuple[dict, int]:
    """(the safetensors header, the offset where the data starts)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _same_bytes(path: Path, a: dict, b: dict, data_start: int) -> bool:
    (a0, a1), (b0, b1) = a["data_offsets"], b["data_offsets"]
    if a["dtype"] != b["dtype"] or a["shape"] != b["shape"] or a1 - a0 != b1 - b0:
        return False
    with open(path, "rb") as fa, open(path, "rb") as fb:
        fa.seek(data_start + a0)
        fb.seek(data_start + b0)
        left = a1 - a0
        while left:
            n = min(left, _CHUNK)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def _without(path: Path, drop: str) -> None:
    """Rewrite the rank file ``path`` without tensor ``drop`` (atomically)."""
    header, start = _header(path)
    kept = {k: v for k, v in header.items() if k not in (drop, "__metadata__")}
    offset, new = 0, {}
    for name, entry in sorted(kept.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        new[name] = {**entry, "data_offsets": [offset, offset + size]}
        offset += size
    if "__metadata__" in header:
        new["__metadata__"] = header["__metadata__"]
    blob = json.dumps(new, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(struct.pack("<Q", len(blob)) + blob)
        for name in sorted(kept, key=lambda k: kept[k]["data_offsets"][0]):
            a0, a1 = kept[name]["data_offsets"]
            src.seek(start + a0)
            left = a1 - a0
            while left:
                chunk = src.read(min(left, _CHUNK))
                dst.write(chunk)
                left -= len(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


def share_tied_embedding(ckpt: Path, model_config: dict) -> dict:
    """Drop ``lm_head.weight`` from the checkpoint at ``ckpt`` where the model ties its word embeddings and every
    rank's lm_head is a byte-for-byte copy of its embedding; set ``share_embedding_table``. Returns what it
    found: {"lm_head_shares_embedding": bool, "bytes_saved": int, "why": str}."""
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    ranks = sorted(ckpt.glob("rank*.safetensors"))
    if not model_config.get("tie_word_embeddings"):
        return {"lm_head_shares_embedding": False, "bytes_saved": 0, "why": "the model does not tie its embeddings"}
    if (cfg.get("mapping") or {}).get("pp_size", 1) != 1:
        return {"lm_head_shares_embedding": False, "bytes_saved": 0,
                "why": "pipeline parallel: the embedding and lm_head are on different ranks"}
    saved = 0
    for path in ranks:
        header, start = _header(path)
        if HEAD not in header:  # already shared (a checkpoint written so)
            continue
        if EMBEDDING not in header or any(k.startswith("lm_head.") and k != HEAD for k in header):
            return {"lm_head_shares_embedding": False, "bytes_saved": 0, "why": "lm_head is quantized"}
        if not _same_bytes(path, header[HEAD], header[EMBEDDING], start):
            return {"lm_head_shares_embedding": False, "bytes_saved": 0,
                    "why": f"lm_head differs from the embedding in {path.name}"}
    for path in ranks:
        header, _ = _header(path)
        if HEAD in header:
            saved += header[HEAD]["data_offsets"][1] - header[HEAD]["data_offsets"][0]
            _without(path, HEAD)
    cfg["share_embedding_table"] = True
    tmp = cfg_path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=4))
    os.replace(tmp, cfg_path)
    return {"lm_head_shares_embedding": True, "bytes_saved": saved,
            "why": "the model ties its embeddings; one copy written"}


def embedding_bytes(ckpt: Path) -> int:
    """The vocabulary embedding's bytes over all the ranks of the checkpoint at ``ckpt``."""
    total = 0
    for path in sorted(ckpt.glob("rank*.safetensors")):
        entry = _header(path)[0].get(EMBEDDING)
        if entry:
            total += entry["data_offsets"][1] - entry["data_offsets"][0]
    return total
