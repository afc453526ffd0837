"""The quantization recipe: the plan turned into ModelOpt's config (a base preset, one entry per layer whose
format differs, the kept layers disabled, the KV-cache quantizers), the calibration phases of a plan that mixes
formats, and the HF -> TensorRT-LLM module names the export writes. The whole-model quantize
(pipeline.quant.quantize) and the layer-streamed one (pipeline.quant.streaming) both quantize with it."""

from __future__ import annotations

import contextlib
import copy
import json

from pipeline.config import QuantizationSection
from pipeline.formats import AWQ_FORMATS, FORMATS, HIGH_PRECISION
from pipeline.records import Plan

# our format -> ModelOpt preset, and the quant_algo its TensorRT-LLM export writes
# TensorRT-LLM splits these on their input dim under tensor parallelism (row-parallel)
ROW_PARALLEL = ("o_proj", "down_proj")


# tokenizer files copied into the HF unified checkpoint, so the LLM API can serve it on its own
# HF module -> TensorRT-LLM checkpoint module (llama family); q/k/v become one fused qkv GEMM
TRTLLM_MODULE = {"q_proj": "attention.qkv", "k_proj": "attention.qkv", "v_proj": "attention.qkv",
                 "o_proj": "attention.dense", "gate_proj": "mlp.fc", "up_proj": "mlp.gate", "down_proj": "mlp.proj"}


def trtllm_name(hf_name: str, moe=None) -> str:
    """model.layers.3.mlp.down_proj -> transformer.layers.3.mlp.proj; lm_head stays lm_head. With ``moe`` (the
    family's, pipeline/families.py): its router -> mlp.router, an expert's fused pair (w1, w3) -> mlp.fc and its
    other linear (w2) -> mlp.proj, each stacked over the experts."""
    if hf_name == "lm_head":
        return "lm_head"
    parts = hf_name.split(".")
    layer = f"transformer.layers.{parts[2]}"
    rel = ".".join(parts[3:])
    if moe is not None and rel == moe.router:
        return f"{layer}.mlp.router"
    if moe is not None and rel.startswith(moe.experts + "."):
        return f"{layer}.mlp.fc" if parts[-1] in moe.fused else f"{layer}.mlp.proj"
    return f"{layer}.{TRTLLM_MODULE[parts[-1]]}"


def _algorithm(fmt: str, quant: QuantizationSection):
    """The calibration algorithm a format gets on its own (its ModelOpt preset's; SmoothQuant with our alpha)."""
    import modelopt.torch.quantization as mtq

    if fmt == "int8_sq":
        return {"method": "smoothquant", "alpha": quant.smoothquant_alpha}
    return copy.deepcopy(getattr(mtq, FORMATS[fmt].modelopt_preset).get("algorithm", "max"))


def _layer_entries(name: str, fmt: str, group: int) -> list[dict]:
    """ModelOpt entries giving one layer the weight and input quantizers of format ``fmt``."""
    import modelopt.torch.quantization as mtq

    entries = []
    for e in copy.deepcopy(getattr(mtq, FORMATS[fmt].modelopt_preset))["quant_cfg"]:
        qn = e.get("quantizer_name")
        if qn in ("*weight_quantizer", "*input_quantizer") and not e.get("parent_class"):
            item = {"quantizer_name": f"{name}.{qn[1:]}"}
            if "cfg" in e:
                item["cfg"] = e["cfg"]
                set_block_size(item["cfg"], group)
            if "enable" in e:
                item["enable"] = e["enable"]
            entries.append(item)
    return entries


def modelopt_config(plan: Plan, quant: QuantizationSection) -> dict:
    """The ordered ModelOpt quantization config for the plan (later entries win, as in ModelOpt).

    The base format's preset first; then, per layer, entries for a format other than the base (and for
    lm_head, which every preset leaves off), or a disable for a layer kept in high precision."""
    import modelopt.torch.quantization as mtq

    base = quant.weight_format
    cfg = copy.deepcopy(getattr(mtq, FORMATS[base].modelopt_preset))
    entries = cfg["quant_cfg"]
    if base == "int8_sq":
        cfg["algorithm"] = {"method": "smoothquant", "alpha": quant.smoothquant_alpha}
    if base in AWQ_FORMATS:
        for e in entries:
            set_block_size(e.get("cfg"), quant.awq_group_size)
    for name, layer in plan.layers.items():
        fmt = layer.format
        if fmt == HIGH_PRECISION:
            entries.append({"quantizer_name": f"{name}.*", "enable": False})
        elif fmt != base or name == "lm_head":
            entries += _layer_entries(name, fmt, quant.awq_group_size)
    formats = plan.quantized_formats()
    if len(formats) > 1:  # mixed: max for all first, then each algorithm on its own layers (calibration_phases)
        cfg["algorithm"] = "max"
    elif formats and formats != {base}:  # every layer moved off the base format: calibrate as that format
        cfg["algorithm"] = _algorithm(next(iter(formats)), quant)
    if quant.kv_cache != "none":
        bits = 8 if quant.kv_cache == "int8" else (4, 3)
        entries.append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": bits, "axis": None},
                        "enable": True})
    return cfg


def calibration_phases(plan: Plan, quant: QuantizationSection) -> list[tuple[object, list[str]]]:
    """For a plan that mixes formats: (algorithm, layers) to run after the first ``max`` calibration, one per
    algorithm other than max (SmoothQuant, AWQ-lite), each on the layers whose format uses it."""
    if len(plan.quantized_formats()) < 2:
        return []
    phases: dict[str, tuple[object, list[str]]] = {}
    for name, layer in plan.layers.items():
        if layer.format == HIGH_PRECISION:
            continue
        algorithm = _algorithm(layer.format, quant)
        if algorithm in ("max", None) or (isinstance(algorithm, dict) and algorithm.get("method") == "max"):
            continue
        key = json.dumps(algorithm, sort_keys=True)
        phases.setdefault(key, (algorithm, []))[1].append(name)
    def method(algorithm) -> str:
        return algorithm if isinstance(algorithm, str) else algorithm.get("method", "")

    return sorted(phases.values(), key=lambda p: (method(p[0]), json.dumps(p[0], sort_keys=True)))


@contextlib.contextmanager
def paused_quantizers(model, keep: tuple[str, ...] = ()):
    """Every enabled quantizer of ``model`` disabled meanwhile (its layer computes in full precision, its scales
    stay), except those under the module prefixes ``keep``; yields the kept ones."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    enabled = [(n, m) for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    paused = [m for n, m in enabled if not n.startswith(keep)] if keep else [m for _, m in enabled]
    for m in paused:
        m.disable()
    try:
        yield [m for n, m in enabled if keep and n.startswith(keep)]
    finally:
        for m in paused:
            m.enable()


def calibrate_phase(model, algorithm, layers: list[str], forward_loop) -> None:
    """One calibration algorithm on some layers only: every other enabled quantizer is paused meanwhile, so
    its scales stay as they are and its layers compute in full precision (as in a single-format calibration)."""
    import modelopt.torch.quantization as mtq

    with paused_quantizers(model, keep=tuple(f"{n}." for n in layers)) as mine:
        for m in mine:  # forget the first max pass: the algorithm collects its own statistics
            m.reset_amax()
            if m._calibrator is not None:
                m._calibrator.reset()
        mtq.calibrate(model, algorithm, forward_loop)


def set_block_size(cfg, group: int) -> None:
    for c in cfg if isinstance(cfg, list) else [cfg]:
        if isinstance(c, dict) and isinstance(c.get("block_sizes"), dict) and -1 in c["block_sizes"]:
            c["block_sizes"][-1] = group
