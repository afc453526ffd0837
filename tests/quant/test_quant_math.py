"""Our fake-quant arithmetic against NVIDIA ModelOpt's own quantizers on the same inputs, and the whole
sensitivity table against errors measured on a model ModelOpt really quantized (SmoothQuant, with the
export's fusion of q/k/v and gate/up)."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.quant import quant_math as qm

mtq = pytest.importorskip("modelopt.torch.quantization")
from modelopt.torch.quantization.config import QuantizerAttributeConfig  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 576, generator=g) * torch.linspace(0.05, 40, 576)  # outlier-heavy channels
    w = torch.randn(1536, 576, generator=g) * 0.05
    return x, w


def _modelopt(cfg: dict, t: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    q = TensorQuantizer(QuantizerAttributeConfig(**cfg))
    if amax is None:  # let ModelOpt calibrate its own amax (max calibrator)
        q.enable_calib()
        q.disable_quant()
        q(t)
        q.load_calib_amax()
        q.disable_calib()
        q.enable_quant()
    else:
        q.amax = amax
    return q(t)


def test_int8_per_tensor_matches_modelopt_exactly(tensors):
    x, _ = tensors
    assert torch.equal(_modelopt({"num_bits": 8, "axis": None}, x), qm.int_fake_quant(x, x.abs().amax()))


def test_int8_values_beyond_the_calibrated_amax_saturate_as_modelopt_does(tensors):
    """An activation larger than any the calibration saw: ModelOpt's range is not narrow, so -amax * 128 / 127
    and below come out as -128 steps, as vLLM's INT8 kernels saturate (the checkpoint readers'
    activations; found reading an HF unified export back)."""
    x, _ = tensors
    amax = x.abs().amax() / 4
    ours = qm.int_fake_quant(x, amax)
    assert torch.equal(_modelopt({"num_bits": 8, "axis": None}, x, amax), ours)
    assert (float(ours.min()) == pytest.approx(-128 / 127 * float(amax))
            and float(ours.max()) == pytest.approx(float(amax)))


def test_int8_per_channel_weights_match_modelopt_exactly(tensors):
    _, w = tensors
    assert torch.equal(_modelopt({"num_bits": 8, "axis": 0}, w), qm.int_fake_quant(w, qm.per_channel_amax(w)))


def test_fp8_matches_modelopt_exactly(tensors):
    x, w = tensors
    assert torch.equal(_modelopt({"num_bits": (4, 3), "axis": None}, x), qm.fp8_fake_quant(x, x.abs().amax()))
    assert torch.equal(_modelopt({"num_bits": (4, 3), "axis": None}, w), qm.fp8_fake_quant(w, w.abs().amax()))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_blocks_match_modelopt_exactly(tensors, group):
    _, w = tensors
    cfg = {"num_bits": 4, "block_sizes": {-1: group, "type": "static"}}
    w = w[:, :512]  # 576 (SmolLM2's width) is not a multiple of 128
    assert torch.equal(_modelopt(cfg, w), qm.group_fake_quant(w, group))


def test_group_size_must_divide_width(tensors):
    _, w = tensors
    with pytest.raises(ValueError, match="does not divide"):
        qm.group_fake_quant(w, 100)


def _linear_inputs(model, ids):
    """Every linear's input and reference output, from an unquantized forward over ids."""
    captured = {}

    def hook(name):
        def f(module, inputs, output):
            captured[name] = (inputs[0].detach().clone(), output.detach().clone())
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return captured


def _rel(ref, out):
    return float((ref - out).norm() / ref.norm())


@pytest.mark.parametrize("target", ["cpu", "pytorch"])
@pytest.mark.parametrize("fmt", ["int8_sq", "int8_w8a8", "fp8", "int8_wo"])
def test_sensitivity_table_equals_errors_of_a_modelopt_quantized_model(tiny_model_dir, fmt, target):
    """The table's per-layer error = the error of the same layer in a model ModelOpt quantized (and, for the
    layers the target's checkpoint fuses, resmoothed as ModelOpt's export does), on the same calibration
    data: q/k/v for the TensorRT-LLM checkpoint (cpu, tensorrt), q/k/v and gate/up for the HF unified one."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion
    from transformers import AutoModelForCausalLM

    from pipeline.config import QuantizationSection, SensitivitySection
    from pipeline.quant.sensitivity import analyse, fusion_groups_for

    ids = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    alpha = 0.5
    table = analyse(tiny_model_dir, ids.numpy(), section=SensitivitySection(formats=(fmt,)),
                    quant=QuantizationSection(smoothquant_alpha=alpha), fusion_groups=fusion_groups_for(target))
    ours = {l["name"]: l["errors"][fmt]["error"] for l in table["layers"]}

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    captured = _linear_inputs(model, ids)
    cfg = {"int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "int8_w8a8": mtq.INT8_DEFAULT_CFG, "fp8": mtq.FP8_DEFAULT_CFG,
           "int8_wo": mtq.INT8_WEIGHT_ONLY_CFG}[fmt]
    cfg = copy.deepcopy(cfg)
    cfg["quant_cfg"] = [e for e in cfg["quant_cfg"] if e.get("quantizer_name") != "*lm_head*"]  # measure lm_head too
    if fmt == "int8_sq":
        cfg["algorithm"] = {"method": "smoothquant", "alpha": alpha}
    with torch.no_grad():
        mtq.quantize(model, cfg, lambda m: m(ids))
        for layer in model.model.layers:
            preprocess_linear_fusion([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            if target == "pytorch":
                preprocess_linear_fusion([layer.mlp.gate_proj, layer.mlp.up_proj])
        modules = dict(model.named_modules())
        for name, (x, ref) in captured.items():
            theirs = _rel(ref, modules[name](x))
            assert ours[name] == pytest.approx(theirs, rel=1e-6, abs=1e-8), name
    assert len(ours) == len(captured) == 2 * 7 + 1
