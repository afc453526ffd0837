"""ModelOpt exports of the tiny Llama in every format the checkpoint reader reads: the plans, the cases and the
quantize-and-export step that the checkpoint, streaming and vLLM export tests share (the ``exported`` fixture in
conftest.py caches them for the whole session). Calibration and export run in this process (ModelOpt on the
CPU, a second each)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from pipeline import families, records
from pipeline.config import QuantizationSection
from pipeline.formats import HIGH_PRECISION
from pipeline.quant.export_checks import check_export
from pipeline.quant.recipe import calibrate_phase, calibration_phases, modelopt_config

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# base format, format of layer 1's attention q/k/v and down_proj (None: the base format)
CASES = {"int8_sq": ("int8_sq", None), "int8_wo": ("int8_wo", None), "fp8": ("fp8", None),
         "int4_awq": ("int4_awq", None), "w4a8_awq": ("w4a8_awq", None),
         "int4_awq+int8_sq": ("int4_awq", "int8_sq"), "int4_awq+int8_wo": ("int4_awq", "int8_wo")}
WEIGHT_ONLY = ("int8_wo", "int4_awq", "int4_awq+int8_wo")


def plan_for(base: str, other: str | None) -> records.Plan:
    layers = {f"model.layers.{i}.{m}": {"format": base} for i in range(2) for m in LINEARS}
    layers["lm_head"] = {"format": HIGH_PRECISION}
    layers["model.layers.0.mlp.down_proj"] = {"format": HIGH_PRECISION}
    if other:
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            layers[f"model.layers.1.{m}"] = {"format": other}
    return records.Plan.model_validate({"format_version": records.PLAN_FORMAT_VERSION, "layers": layers})


def kept(plan: records.Plan) -> set[str]:
    return set(plan.kept_high_precision())


def quantize_and_export(original, case: str, calib, evals, out_of_tp, kv_cache: str = "none") -> dict:
    """ModelOpt quantizes a copy of ``original`` as ``case`` plans (its KV cache as ``kv_cache``) and exports a
    TensorRT-LLM checkpoint for each tensor-parallel size ``out_of_tp`` names (tp -> a new folder): {"plan",
    "quant", "ckpt" (tp -> folder), "fake_quant_logits" (the fake-quant model's on ``evals``)}."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    base, other = CASES[case]
    plan = plan_for(base, other)
    quant = QuantizationSection(weight_format=base, kv_cache=kv_cache, awq_group_size=32)
    model = copy.deepcopy(original)

    def loop(m):
        for b in range(0, calib.shape[0], 2):
            m(calib[b:b + 2])

    with torch.no_grad():
        mtq.quantize(model, modelopt_config(plan, quant), loop)
        for algorithm, layers in calibration_phases(plan, quant):
            calibrate_phase(model, algorithm, layers, loop)
    entry = {"plan": plan, "quant": quant, "ckpt": {}}
    model_config = json.loads((Path(original.name_or_path) / "config.json").read_text())
    decoder = families.FAMILIES[model_config["model_type"]].decoder_type
    for tp, out in sorted(out_of_tp.items()):
        exported_model = copy.deepcopy(model)
        with torch.no_grad():
            export_tensorrt_llm_checkpoint(exported_model, decoder, torch.float16, export_dir=out,
                                           inference_tensor_parallel=tp)
            if tp == 1:
                # the export fuses q/k/v (one pre-quant scale, one FP8 scale) in the model it is given:
                # this is the fake-quant model the checkpoint encodes
                entry["fake_quant_logits"] = exported_model(evals).logits
        check_export(out, plan, quant, model_config, tp)
        entry["ckpt"][tp] = out
    return entry
