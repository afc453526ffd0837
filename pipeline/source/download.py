"""download stage, model part: any model source -> one checked HF-format folder.

Sources: the Hugging Face Hub at a revision resolved to a commit sha (``pipeline.source.hub``), a local HF
folder, or a GGUF file (on disk, or inside an installed package) converted once (``pipeline.source.gguf``).
Whatever the source, the folder is then inspected: config readable, tokenizer loadable, and every tensor the
architecture needs present in the safetensors files — completeness is verified, not assumed.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import struct
from pathlib import Path

from pipeline import artifacts, constants, families
from pipeline.config import (
    GGUFFileSource,
    HubSource,
    LoadedConfig,
    LocalSource,
    ModelSection,
    gguf_package_file,
)
from pipeline.errors import InputError
from pipeline.fsutil import HashCache, list_files
from pipeline.summaries import ModelSummary

log = logging.getLogger(__name__)


def model_fingerprint(loaded: LoadedConfig, hash_cache: HashCache) -> dict:
    """Content identity of the model source, computed before the stage runs (and again after)."""
    src = loaded.config.model.source
    if isinstance(src, HubSource):
        from pipeline.source.hub import resolve_revision

        return {"kind": "hub", "repo_id": src.repo_id, "commit": resolve_revision(src)}
    if isinstance(src, LocalSource):
        files = [f for f in list_files(src.path) if _wanted_local(f)]
        return {"kind": "local", "files": {f: hash_cache.sha256(src.path / f) for f in files}}
    path = src.path if isinstance(src, GGUFFileSource) else gguf_package_file(src)
    return {"kind": "gguf", "file": path.name, "sha256": hash_cache.sha256(path)}


def _wanted_local(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return "/" not in rel and any(fnmatch.fnmatch(name, p) for p in constants.HUB_DEFAULT_INCLUDE)


def prepare_model(section: ModelSection, out_dir: Path) -> ModelSummary:
    """Write the HF-format model into out_dir/hf_model; return the summary recorded in the manifest."""
    model_dir = out_dir / artifacts.MODEL_DIR
    model_dir.mkdir(parents=True)
    src = section.source
    if isinstance(src, HubSource):
        from pipeline.source.hub import fetch_snapshot, resolve_revision

        origin = fetch_snapshot(src, resolve_revision(src), model_dir)
    elif isinstance(src, LocalSource):
        pickles = [f for f in list_files(src.path) if f.endswith(constants.PICKLE_SUFFIXES)]
        copied = [f for f in list_files(src.path) if _wanted_local(f)]
        if not any(f.endswith(".safetensors") for f in copied):
            hint = (f" It has pickle weights ({', '.join(pickles[:3])}); convert them to safetensors first."
                    if pickles else "")
            raise InputError(f"model.source.path {src.path}: no *.safetensors weights.{hint}")
        for f in copied:
            shutil.copy2(src.path / f, model_dir / f)
        origin = {"kind": "local", "files": copied}
    else:
        from pipeline.source.gguf import convert_gguf

        path = src.path if isinstance(src, GGUFFileSource) else gguf_package_file(src)
        origin = {"kind": "gguf", "file": path.name, **convert_gguf(path, model_dir)}
    if section.dtype != "auto":
        _cast_weights(model_dir, section.dtype)
    facts = inspect_hf_folder(model_dir)
    log.info("model ready: %s", json.dumps(facts))
    return {"source": origin, "model": facts}


def _cast_weights(model_dir: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    for f in model_dir.glob("*.safetensors*"):
        f.unlink()
    model.save_pretrained(model_dir, safe_serialization=True)


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InputError(f"{path.name} is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise InputError(f"{path.name} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise InputError(f"{path.name} has a corrupt safetensors header") from None
    header.pop("__metadata__", None)
    size = path.stat().st_size
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise InputError(f"{path.name} is truncated: its header promises {8 + n + end} bytes, the file has {size}")
    return header


def inspect_hf_folder(model_dir: Path) -> dict:
    """Check an HF folder is complete and loadable; return its key facts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as e:
        raise InputError(f"config.json in the model folder is not usable by transformers: {e}") from None
    families.family(config.model_type)  # a family outside the table is refused before its weights are read
    try:
        AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise InputError(f"the model folder has no usable tokenizer: {e}") from None

    tensors: dict[str, dict] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(_safetensors_header(f))
    with torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        except ValueError as e:
            raise InputError(f"transformers has no causal-LM class for this config: {e}") from None
    expected = set(skeleton.state_dict())
    tied = getattr(config, "tie_word_embeddings", False)
    missing = sorted(k for k in expected - set(tensors) if not (tied and k == "lm_head.weight"))
    if missing:
        raise InputError(
            f"the model's safetensors files are incomplete: {len(missing)} tensor(s) missing, e.g. "
            f"{', '.join(missing[:3])}"
        )
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        log.warning("safetensors hold %d tensors the model does not use, e.g. %s", len(unexpected), unexpected[:3])
    dtypes = sorted({v["dtype"] for v in tensors.values()})
    numel = sum(_numel(v["shape"]) for k, v in tensors.items() if k in expected)
    return {
        "architecture": (config.architectures or [type(skeleton).__name__])[0],
        "model_type": config.model_type,
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "tie_word_embeddings": tied,
        "weight_dtypes": dtypes,
        "num_parameters": numel,
        "weight_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
