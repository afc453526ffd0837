"""Read ModelOpt's HF unified checkpoint (what the ``pytorch`` target serves) back as an fp32 HF model that
computes what its quantized GEMMs compute.

The HF unified checkpoint keeps the model's own module names, so one reader serves every family transformers
builds: the model is made from the checkpoint's own config.json (its ``quantization_config`` left out), every
``nn.Linear`` with a quantized weight comes back as its dequantized fp32 weight plus a forward pre-hook that
applies its input transform, and every other tensor (norms, embeddings, biases) is loaded as it is.

Own code, written from what ModelOpt 0.47's ``export_hf_checkpoint`` writes (modelopt/torch/export:
unified_export_hf.py, quant_utils.py ``to_quantized_weight`` / ``pack_int4_in_uint8``) and checked by reading
exports back against the model ModelOpt simulated (tests/quant/test_hf_checkpoint.py):

- formats: ``hf_quant_config.json`` ``quantization``: ``quant_algo`` with ``exclude_modules`` (fnmatch
  patterns) and ``group_size``, or ``MIXED_PRECISION`` with ``quantized_layers`` {module: {quant_algo,
  group_size}} beside them (a module not listed is unquantized);
- per quantized linear, beside ``weight``: ``weight_scale`` (INT8: [out], per output channel; FP8: one value;
  INT4 AWQ: [out, in / group]), ``weight_scale_2`` (W4A8 AWQ: the per-tensor FP8 scale), ``input_scale``
  (one value: amax / 127 for INT8, amax / 448 for FP8) and ``pre_quant_scale`` ([in]: SmoothQuant or AWQ; the
  input is multiplied by it, the weight holds 1 / s). Where the linear reads a norm that can take it (q/k/v
  after the input norm, gate/up after the post-attention norm) ModelOpt folds an AWQ pre-quant scale into the
  norm's weight and writes none; the reader needs nothing for that, the norm is loaded as written;
- INT4 codes: two per byte in U8 of shape [out / 2, in] (row 2r in the low nibble, 2r + 1 in the high one), the
  TensorRT-LLM checkpoint's packing (pipeline.quant.checkpoint ``unpack_int4``); INT8 codes I8, FP8 F8_E4M3;
- the KV cache: ``k_proj.k_scale`` / ``v_proj.v_scale`` (FP8 KV; under those names in Phi-3 too, whose q/k/v
  are one ``qkv_proj``), counted; the rebuilt model does not quantize its KV cache, as the TensorRT-LLM
  checkpoint's reader does not;
- an unquantized linear: its weight in the export's dtype and no scales.

The arithmetic per format is the TensorRT-LLM checkpoint reader's (``_dequantize``, ``_fake_act``): only the
names differ. It checks what it reads: layers the plan keeps in high precision must be unquantized, quantized
ones must carry the scales their format needs, and a tensor no module takes is an IntegrityError.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import artifacts, families
from pipeline.errors import IntegrityError
from pipeline.formats import FORMAT_OF_ALGO
from pipeline.quant.checkpoint import INT4_ALGOS, _dequantize, _fake_act, _hook_input, layer_formats

# the HF unified checkpoint's scale names -> the TensorRT-LLM checkpoint's, which the shared arithmetic reads
SCALE_NAMES = {"weight_scale": "weights_scaling_factor", "weight_scale_2": "weights_scaling_factor_2",
               "input_scale": "activation_scaling_factor", "pre_quant_scale": "prequant_scaling_factor"}
KV_SCALE_NAMES = ("k_scale", "v_scale")


def required_scales(algo: str) -> tuple[str, ...]:
    """The scales a linear of ``algo`` must carry in the HF unified checkpoint (TensorRT-LLM names): its
    format's, less the pre-quant scale, which ModelOpt may have folded into the norm before it."""
    return tuple(k for k in FORMAT_OF_ALGO[algo].checkpoint_scales if k != "prequant_scaling_factor")


def _files(hf_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (the index where there is one, else every file's keys)."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: hf_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    where: dict[str, Path] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            where.update({k: path for k in f.keys()})
    if not where:
        raise IntegrityError(f"{hf_dir} holds no safetensors weights")
    return where


def kv_scales(hf_dir: Path, num_layers: int) -> list[tuple[float, float]]:
    """Each layer's FP8 KV-cache scales (k_scale, v_scale) as the HF unified checkpoint stores them: the
    calibrated amax / 448, not clamped (ModelOpt 0.47 clamps them to at least 1 in its TensorRT-LLM export only,
    quant_utils.py ``get_kv_cache_scaling_factor``). Every layer must have both."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key, path in _files(Path(hf_dir)).items():
        parts = key.split(".")
        if parts[-1] in KV_SCALE_NAMES and parts[:2] == ["model", "layers"]:
            by_file.setdefault(path, []).append(key)
    found: dict[int, dict[str, float]] = {}
    for path, keys in by_file.items():  # each file opened once
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                found.setdefault(int(key.split(".")[2]), {})[key.rsplit(".", 1)[-1]] = float(f.get_tensor(key))
    if sorted(found) != list(range(num_layers)) or any(len(v) != 2 for v in found.values()):
        raise IntegrityError(f"{hf_dir}: an FP8 KV cache needs a k_scale and a v_scale in each of the "
                             f"{num_layers} layers; found {dict(sorted(found.items()))}")
    return [(found[i]["k_scale"], found[i]["v_scale"]) for i in range(num_layers)]


def quant_config(hf_dir: Path) -> dict:
    path = hf_dir / artifacts.HF_QUANT_CONFIG_FILE
    if not path.is_file():
        raise IntegrityError(f"{hf_dir} is not a ModelOpt HF unified checkpoint: no {artifacts.HF_QUANT_CONFIG_FILE}")
    return json.loads(path.read_text()).get("quantization") or {}


def check_unquantized(name: str, w, scales) -> None:
    """An IntegrityError where a linear ``hf_quant_config.json`` leaves unquantized is stored as codes or carries
    quantization scales (``scales``: their names, HF or TensorRT-LLM; a pre-quant scale alone may be there)."""
    import torch

    if w.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn) or \
            set(scales) - {"prequant_scaling_factor", "pre_quant_scale"}:
        raise IntegrityError(f"{name}: unquantized in {artifacts.HF_QUANT_CONFIG_FILE} but stored as {w.dtype} "
                             f"with {sorted(scales)}")


def _linear(name: str, algo: str | None, *, group: int | None, w, present: dict, shape: tuple):
    """One linear's fp32 weight and its input transform (None where the input goes in as it is)."""
    import torch

    if algo is None:
        check_unquantized(name, w, present)
    if algo in INT4_ALGOS and w.dtype == torch.uint8:
        w = w.view(torch.int8)  # the TensorRT-LLM checkpoint's bytes, stored signed there
    weight = _dequantize(name, algo, w=w, s=present, group_size=group, required=required_scales(algo) if algo else None)
    if tuple(weight.shape) != shape:
        raise IntegrityError(f"{name}: weight of shape {tuple(weight.shape)} does not fit the model's {shape}")
    act, pqs = present.get("activation_scaling_factor"), present.get("prequant_scaling_factor")
    if act is None and pqs is None:
        return weight, None
    return weight, _fake_act(algo or "", None if act is None else act.float().reshape(()),
                             None if pqs is None else pqs.float())


def rebuild_hf(hf_dir: Path, kept: set[str] | None = None):
    """The HF unified checkpoint in ``hf_dir`` as an fp32 HF model whose linears compute what its quantized
    GEMMs compute, plus facts (formats read, KV-cache scales, tensors). ``kept``: the module names the plan
    keeps in high precision (checked when given)."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    qcfg = quant_config(hf_dir)
    fmt = layer_formats(qcfg, qcfg.get("quantized_layers"), str(hf_dir), artifacts.HF_QUANT_CONFIG_FILE)
    config = AutoConfig.from_pretrained(hf_dir)
    if hasattr(config, "quantization_config"):  # transformers would hand the model to ModelOpt's own loader
        delattr(config, "quantization_config")
    with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) computed for real
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=families.attn_implementation(config.model_type))
    model.eval()
    where = _files(hf_dir)
    handles: dict[Path, object] = {}

    def get(key: str):
        path = where[key]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(key)  # type: ignore[attr-defined]

    # KV-cache scales sit under k_proj / v_proj whether or not the family has such linears (Phi-3 fuses them)
    kv_scales = {k for k in where if k.rsplit(".", 1)[-1] in KV_SCALE_NAMES}
    unread = set(where) - kv_scales
    state: dict = {}
    transforms = {}
    formats: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or f"{name}.weight" not in where:
            continue  # a tied lm_head is the embedding, below
        algo, group = fmt(name)
        if algo is not None and kept is not None and name in kept:
            raise IntegrityError(f"{name}: the plan keeps it in high precision, the checkpoint quantizes it ({algo})")
        present = {trt: get(f"{name}.{hf}") for hf, trt in SCALE_NAMES.items() if f"{name}.{hf}" in where}
        unread -= {f"{name}.{hf}" for hf in SCALE_NAMES} | {f"{name}.weight"}
        state[f"{name}.weight"], transform = _linear(name, algo, group=group, w=get(f"{name}.weight"), present=present,
                                                     shape=tuple(module.weight.shape))
        if transform is not None:
            transforms[name] = transform
        if algo is not None:
            formats[algo] = formats.get(algo, 0) + 1
    params = dict(model.named_parameters())
    for key in sorted(unread):
        if key not in params:
            raise IntegrityError(f"{hf_dir}: tensor {key} is not a parameter of {type(model).__name__} "
                                 f"nor a scale this reader knows")
        state[key] = get(key).float()
    handles.clear()
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = "lm_head.weight" not in where and bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        model.tie_weights()
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing or unexpected:
        raise IntegrityError(f"{hf_dir}: rebuilt model is missing {missing[:3]} / has extra {unexpected[:3]}")
    for name, transform in transforms.items():
        _hook_input(model.get_submodule(name), transform)
    return model, {"formats": formats, "kv_cache_scales": len(kv_scales), "tensors": len(where),
                   "quant_algo": qcfg.get("quant_algo"), "tied_lm_head": tied}
