"""Read an Edge-LLM export back against the checkpoint it came from. Runs in the export environment
(.venv-edgellm: onnx, numpy, safetensors and tensorrt_edgellm), never in the pipeline's: it imports nothing of the
pipeline. Usage: python worker.py REQUEST.json RESULT.json, the request naming ``onnx`` (the exported llm/model.onnx)
and ``checkpoint`` (the HF unified checkpoint folder it was exported from).

What it writes:
- ``checker``: onnx.checker's verdict on the model (by path: the weights are external data);
- ``inputs`` / ``outputs``: each graph input and output with its element type and shape;
- ``layers``: per linear of the checkpoint, the format the export holds it in (from the ONNX initializers' types and
  sizes: int4_awq, int8_sq or high_precision) and whether its codes and scales are the checkpoint's own;
- ``edgellm``: what Edge-LLM's own Python API (tensorrt_edgellm.model.load_model_config) reads of the checkpoint;
- ``runtime_config``: the export's llm/config.json, which the device's llm_build reads.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

PREFIX = "_model."  # Edge-LLM's ONNX initializer names: the checkpoint's tensor names under its wrapper module


def checkpoint_tensors(ckpt: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="np") as f:
            for key in f.keys():
                out[key] = np.asarray(f.get_tensor(key))
    return out


def nibble_counts(packed):
    """How many of each 4-bit code a packed INT4 tensor holds (its bytes' low and high nibbles): the same codes
    in another packing order give the same counts."""
    b = packed.view(np.uint8).ravel()
    return np.bincount(b & 0xF, minlength=16) + np.bincount(b >> 4, minlength=16)


def int4_codes_match(src, exported) -> tuple[bool, int]:
    """Whether the export holds the checkpoint's INT4 codes, and how many zero codes it added as padding.

    ModelOpt packs signed codes (two's complement nibbles: -8..7); Edge-LLM's INT4 GEMM plugin takes them with an
    offset of 8 (code c as c ^ 8, so value 0 is nibble 8), in its own order, its output rows padded to the
    kernel's tile with zeros (a 64-row k_proj of a 128-wide model is stored as 128 rows). So: the export's count
    of each code is the checkpoint's count of that code ^ 8, but for nibble 8, which may hold more (the padding).
    """
    expected = np.roll(nibble_counts(src), 8)  # code c ^ 8 for every c: the halves of 0..15 swap
    diff = nibble_counts(exported) - expected
    padding = int(diff[8])
    diff[8] = 0
    return bool(not diff.any() and padding >= 0), padding


def same(a, b) -> bool:
    """Whether the export's ``b`` holds the checkpoint's ``a`` at the export's precision (ModelOpt writes FP32
    scales, Edge-LLM FP16: each value rounded once, nothing else), allowing a transpose (Edge-LLM stores group
    scales input-major)."""
    a, b = np.asarray(a).astype(b.dtype), np.asarray(b)
    if not np.isfinite(a.astype(np.float32)).all():  # a scale past FP16's range would not survive the cast
        return False
    if a.shape == b.shape and np.array_equal(a, b):
        return True
    return a.ndim == 2 and a.T.shape == b.shape and bool(np.array_equal(a.T, b))


def digest(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def unnamed_weights(onnx_init: dict) -> dict[str, str]:
    """The 2-D floating-point initializers the exporter renamed (torch.onnx folds an FP16 linear's weight into a
    transposed constant ``val_N``), by the digest of their bytes as stored and transposed."""
    out = {}
    for key, array in onnx_init.items():
        if not key.startswith(PREFIX) and array.ndim == 2 and array.dtype in (np.float16, np.float32):
            out[digest(array)] = key
            out[digest(array.T)] = key
    return out


def read_layer(name: str, ckpt: dict, onnx_init: dict, renamed: dict[str, str]) -> dict:
    """The format the export holds linear ``name`` in, and whether its codes and scales are the checkpoint's."""
    weight = onnx_init.get(f"{PREFIX}{name}.weight")
    src = ckpt[f"{name}.weight"]
    if weight is None and src.dtype in (np.float16, np.float32):  # high precision, under the exporter's own name
        found = renamed.get(digest(src.astype(np.float16)))
        if found is not None:
            return {"format": "high_precision", "codes_match": True, "initializer": found}
    if weight is None:
        return {"format": None, "why": "no initializer holds it in the ONNX model"}
    scale_src, scale = ckpt.get(f"{name}.weight_scale"), onnx_init.get(f"{PREFIX}{name}.weight_scale")
    extra = {k: same(ckpt[f"{name}.{k}"], onnx_init[f"{PREFIX}{name}.{k}"])
             for k in ("pre_quant_scale", "input_scale")
             if f"{name}.{k}" in ckpt and f"{PREFIX}{name}.{k}" in onnx_init}
    if weight.dtype in (np.float16, np.float32):
        return {"format": "high_precision", "codes_match": same(src.astype(np.float16), weight.astype(np.float16))}
    if scale is None or scale_src is None:
        return {"format": None, "why": f"a {weight.dtype} weight without its weight_scale"}
    if src.dtype == np.uint8 and weight.size >= src.size:  # INT4: two codes a byte on both sides
        match, padding = int4_codes_match(src, weight)
        return {"format": "int4_awq", "codes_match": match, "padding_codes": padding,
                "scales_match": same(scale_src, scale), **{f"{k}_match": v for k, v in extra.items()}}
    if src.dtype == np.int8 and weight.size == src.size:
        return {"format": "int8_sq", "codes_match": bool(np.array_equal(src, weight) or np.array_equal(src.T, weight)),
                "scales_match": same(scale_src, scale), **{f"{k}_match": v for k, v in extra.items()}}
    return {"format": None, "why": f"checkpoint {src.dtype}{list(src.shape)} against ONNX "
                                   f"{weight.dtype}{list(weight.shape)}"}


def read_fused_qkv(layers: dict, ckpt: dict, renamed: dict[str, str]) -> None:
    """q/k/v kept in high precision: the export concatenates them into one weight (rows q, then k, then v) under
    the exporter's own name. Where the three are not found one by one, look for that concatenation."""
    for name in [n for n in layers if n.endswith(".self_attn.q_proj")]:
        group = [name[: -len("q_proj")] + p for p in ("q_proj", "k_proj", "v_proj")]
        if not all(g in layers and layers[g].get("format") is None for g in group):
            continue
        sources = [ckpt[f"{g}.weight"] for g in group]
        if any(w.dtype not in (np.float16, np.float32) for w in sources):
            continue
        found = renamed.get(digest(np.concatenate(sources).astype(np.float16)))
        if found is not None:
            for g in group:
                layers[g] = {"format": "high_precision", "codes_match": True, "initializer": found, "fused": "qkv"}


def main(request_path: str, result_path: str) -> None:
    import onnx
    from onnx import numpy_helper

    req = json.loads(Path(request_path).read_text())
    model_path, ckpt_dir = Path(req["onnx"]), Path(req["checkpoint"])
    onnx.checker.check_model(str(model_path))  # raises on an invalid model: the build fails with its message
    model = onnx.load(str(model_path), load_external_data=True)

    def io(values):
        return [{"name": v.name, "elem_type": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type),
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]

    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ckpt = checkpoint_tensors(ckpt_dir)
    hf = json.loads((ckpt_dir / "config.json").read_text())
    if "lm_head.weight" not in ckpt and hf.get("tie_word_embeddings"):
        ckpt["lm_head.weight"] = ckpt["model.embed_tokens.weight"]  # stored once, as the embedding
    linears = sorted(k[: -len(".weight")] for k, v in ckpt.items()
                     if k.endswith(".weight") and (v.ndim == 2 or f"{k}_scale" in ckpt) and "embed_tokens" not in k)
    renamed = unnamed_weights(init)
    layers = {name: read_layer(name, ckpt, init, renamed) for name in linears}
    read_fused_qkv(layers, ckpt, renamed)

    from tensorrt_edgellm.model import load_model_config  # Edge-LLM's own reading of the checkpoint

    quant = load_model_config(str(ckpt_dir)).quant
    result = {
        "checker": "ok",
        "inputs": io(model.graph.input), "outputs": io(model.graph.output),
        "custom_ops": sorted({n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")}),
        "layers": layers,
        "edgellm": {"quant_type": quant.quant_type, "kv_cache_quant": quant.kv_cache_quant,
                    "excluded": sorted(quant.excluded or []), "group_size": quant.group_size},
        "runtime_config": json.loads((model_path.parent / "config.json").read_text()),
    }
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
