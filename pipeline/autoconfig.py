"""Families and targets that configure themselves: the defaults a config leaves unset, chosen from what the
model's family and the build target can take, and every conflict with what the config sets, found at once.

``load_config`` reads the model's type (``probe_model_type``: config.json of a local folder, a GGUF file's
architecture, or the Hub cache's config.json) and calls ``resolve`` on the merged YAML before validating it.
Each field ``resolve`` fills is one the config does not set, and comes with why (``invoke explain`` prints it):

- ``quantization.export_hf_checkpoint``: true where the HF unified checkpoint is what gets served (the pytorch
  target) or the only one that can be written (a family without a TensorRT-LLM checkpoint here,
  ``Family.trtllm_checkpoint``);
- ``quantization.kv_cache``: none for unquantized weights; fp8 where the HF unified checkpoint is written
  (ModelOpt's HF export refuses an INT8 KV cache) or the target runs no INT8 KV cache (``Target.kv_formats``);
- a plan rule giving a mixture-of-experts family's experts a format ModelOpt's TensorRT-LLM export writes for
  stacked experts (``formats.MOE_EXPORT_FORMATS``) and the target serves, where the weight format is not one.

A value the config sets that breaks one of these constraints is a conflict; so is a family the target cannot
serve. ``resolve`` returns every conflict, each naming the field, the constraint, its source and what would
work; ``load_config`` raises them together as one ConfigError, before any stage runs.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline import families, targets
from pipeline.formats import MOE_EXPORT_FORMATS, NO_QUANT

# GGUF general.architecture -> transformers model_type, where they differ (transformers' GGUF loader maps the same)
GGUF_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text",
                      "deepseek2": "deepseek_v2"}
FAMILY_TABLE = "pipeline/families.py"  # where a family's constraints are written down


@dataclass
class Resolution:
    """What ``resolve`` decided: {dotted field: (value, why)} for each default it filled, and the conflicts."""

    model_type: Optional[str]
    chosen: dict[str, tuple[Any, str]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)


_UNSET = object()


def _lookup(raw: dict, dotted: str) -> Any:
    """The merged YAML's value at ``dotted``; _UNSET where the config does not set it."""
    node: Any = raw
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _UNSET
        node = node[key]
    return node


def _get(raw: dict, dotted: str) -> Any:
    value = _lookup(raw, dotted)
    return None if value is _UNSET else value


def _is_set(raw: dict, dotted: str) -> bool:
    return _lookup(raw, dotted) is not _UNSET


def _put(raw: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def resolve(raw: dict, model_type: Optional[str], defaults: dict[str, Any]) -> Resolution:
    """The defaults to fill into ``raw`` (the merged YAML, overrides applied) and the conflicts, for a model of
    ``model_type`` (None: not known yet; only the target's constraints apply). ``defaults``: the schema's own
    default of each field read here (``quantization.weight_format``, ``quantization.kv_cache``,
    ``build.target`` and what a target's ``serves_format`` reads)."""
    res = Resolution(model_type)

    def value(dotted: str) -> Any:
        return _get(raw, dotted) if _is_set(raw, dotted) else defaults[dotted]

    name = value("build.target")
    if name not in targets.REGISTRY:
        return res  # the schema's own error names the registered targets
    target = targets.get(name)
    fam = families.FAMILIES.get(model_type) if model_type else None
    if model_type and fam is None:
        res.conflicts.append(families.unsupported_message(model_type))
        return res
    if fam is not None and name not in fam.targets:
        res.conflicts.append(f"build.target {name}: {families.cannot_serve_message(fam, name)} "
                             f"(constraint from the family table, {FAMILY_TABLE})")
    weights = value("quantization.weight_format")

    # the HF unified checkpoint: served by the target, or the only export the family has
    hf_why = None
    if weights != NO_QUANT and target.serves_hf_checkpoint:
        hf_why = f"the {name} target serves the HF unified checkpoint"
    elif fam is not None and not fam.trtllm_checkpoint and weights != NO_QUANT:  # (quantize refuses the baseline)
        because = fam.why_not or "no TensorRT-LLM checkpoint of it can be written here"
        hf_why = f"{model_type} is exported as the HF unified checkpoint only ({because}; family table, {FAMILY_TABLE})"
    export_hf = value("quantization.export_hf_checkpoint")
    if hf_why and not _is_set(raw, "quantization.export_hf_checkpoint"):
        res.chosen["quantization.export_hf_checkpoint"] = (True, hf_why)
        export_hf = True
    elif hf_why and export_hf is False:
        res.conflicts.append(f"quantization.export_hf_checkpoint: false, but {hf_why}; set it to true (or leave it "
                             f"unset)")
        export_hf = True  # what would work: the KV format is judged against it

    # the KV-cache format: one the export writes and the target runs
    kv_set = _is_set(raw, "quantization.kv_cache")
    kv = value("quantization.kv_cache")
    if weights == NO_QUANT and not kv_set:
        res.chosen["quantization.kv_cache"] = (NO_QUANT, "weight_format none builds the unquantized baseline")
    else:
        takes = [f for f in target.kv_formats if not (export_hf and f == "int8")]
        why = []
        if export_hf:
            why.append("ModelOpt's HF unified export writes no INT8 KV cache")
        if "int8" not in target.kv_formats:
            why.append(f"the {name} target runs KV caches in {' or '.join(target.kv_formats)} only")
        if kv not in takes and not kv_set:
            pick = "fp8" if "fp8" in takes else takes[0]
            res.chosen["quantization.kv_cache"] = (pick, "; ".join(why) + (" (fp8 keeps it quantized)" if pick == "fp8"
                                                                           else ""))
        elif kv not in takes:
            res.conflicts.append(f"quantization.kv_cache: {kv}, but {'; '.join(why)}; use {' or '.join(takes)}")

    # mixture-of-experts: the experts in a format the TensorRT-LLM export writes for stacked experts
    if fam is not None and fam.moe is not None and fam.trtllm_checkpoint and weights != NO_QUANT:
        res.conflicts += _experts(raw, res, fam=fam, target=target, weights=weights, setting=value)
    return res


def _experts(raw: dict, res: Resolution, *, fam: families.Family, target: targets.Target, weights: str,
             setting: Callable[[str], Any]) -> list[str]:
    """The experts' plan rule where the weight format cannot be written for them; the conflicts of rules that set
    them to such a format."""
    assert fam.moe is not None
    servable = [f for f in MOE_EXPORT_FORMATS if target.serves_format(f, setting)]
    # one expert's linears, as the plan names them
    probes = [f"model.layers.0.{fam.moe.experts}.0.{linear}" for linear in (*fam.moe.fused, fam.moe.down)]
    rules = _get(raw, "plan.rules") or []

    def matches(rule: Any, name: str) -> bool:
        return isinstance(rule, dict) and fnmatch.fnmatchcase(name, str(rule.get("pattern", "")))

    matching = [r for r in rules if any(matches(r, p) for p in probes)]
    covered = all(any(matches(r, p) for r in rules) for p in probes)
    source = "ModelOpt 0.47's TensorRT-LLM export (pipeline/formats.py MOE_EXPORT_FORMATS)"
    conflicts = [f"plan.rules {r['pattern']!r} gives {fam.model_type}'s experts {r['format']}, which {source} "
                 f"cannot write for stacked experts; use {' or '.join(servable)}, or keep them in high precision"
                 for r in matching if r.get("format") not in (None, *MOE_EXPORT_FORMATS)]
    if covered or weights in MOE_EXPORT_FORMATS:
        return conflicts
    if not servable:
        return [f"quantization.weight_format {weights}: {fam.model_type}'s experts need one of "
                f"{', '.join(MOE_EXPORT_FORMATS)} ({source}), and the {target.name} target serves none of them here"]
    rule = {"pattern": f"*.{fam.moe.experts}.*", "format": servable[0]}
    # first: the last matching rule wins (pipeline/quant/plan.py), so the config's own rules still decide the
    # experts they name
    res.chosen["plan.rules"] = ([rule, *rules], f"{fam.model_type}'s experts in {servable[0]}: {source} writes "
                                                 f"stacked experts in {', '.join(MOE_EXPORT_FORMATS)} only, not "
                                                 f"{weights}")
    return conflicts


def apply(raw: dict, origins: dict[str, str], res: Resolution) -> None:
    """Fill the chosen defaults into ``raw``, each recorded in ``origins`` as chosen."""
    for dotted, (value, why) in res.chosen.items():
        _put(raw, dotted, value)
        origins[dotted] = f"chosen: {why}"


# ---------------------------------------------------------------- the model's type, before any download


def probe_model_type(source: Any, gguf_path: Optional[Path] = None) -> Optional[str]:
    """The model_type of the config's model source without downloading it: a local folder's config.json, a GGUF
    file's ``general.architecture``, or a Hub repository's config.json in the local Hub cache at its revision.
    None where it is not known yet (a Hub model not in the cache: the stages check it once it is downloaded).
    ``gguf_path``: the file of a ``gguf_package`` source."""
    kind = getattr(source, "kind", None)
    try:
        if kind == "local":
            return json.loads((Path(source.path) / "config.json").read_text()).get("model_type")
        if kind in ("gguf_file", "gguf_package"):
            path = Path(source.path) if kind == "gguf_file" else gguf_path
            return _gguf_model_type(path) if path is not None else None
        if kind == "hub":
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source.repo_id, "config.json", revision=source.revision,
                                            cache_dir=source.cache_dir)
            return json.loads(Path(cached).read_text()).get("model_type") if isinstance(cached, str) else None
    except (OSError, ValueError, KeyError):
        return None
    return None


# GGUF's metadata value types (ggml's docs/gguf.md, "File Structure"): the struct code of each fixed-size one;
# 8 is a string (u64 length, then bytes) and 9 an array (u32 element type, u64 count, then the elements)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_model_type(path: Path) -> Optional[str]:
    arch = gguf_architecture(path)
    return GGUF_ARCHITECTURES.get(arch, arch) if arch is not None else None


def gguf_architecture(path: Path) -> Optional[str]:
    """A GGUF file's ``general.architecture``, read from its header alone: the metadata is walked key by key up
    to that one (gguf's GGUFReader parses every field, the whole vocabulary included, seconds for a 49k-token
    tokenizer, on every config load). None where the file has no such key; ValueError where it is not GGUF."""
    import struct

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack("<I", f.read(4))
        order = "<" if version < 0x10000 else ">"  # a big-endian file's version reads byte-swapped

        def read(code: str):
            size = struct.calcsize(code)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: the GGUF header ends early")
            return struct.unpack(order + code, data)[0]

        def string() -> bytes:
            return f.read(read("Q"))

        def skip(kind: int) -> None:
            if kind in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            elif kind == _GGUF_STRING:
                f.seek(read("Q"), 1)
            elif kind == _GGUF_ARRAY:
                element, count = read("I"), read("Q")
                if element in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[element]), 1)
                else:
                    for _ in range(count):
                        skip(element)
            else:
                raise ValueError(f"{path}: unknown GGUF metadata value type {kind}")

        _tensors, keys = read("Q"), read("Q")
        for _ in range(keys):
            key, kind = string(), read("I")
            if key == b"general.architecture" and kind == _GGUF_STRING:
                return string().decode()
            skip(kind)
    return None
