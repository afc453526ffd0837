"""The TensorRT-LLM checkpoint reader (pipeline.quant.checkpoint) on real ModelOpt exports of a tiny Llama: every
format it reads (INT8 SmoothQuant, INT8 weight-only, FP8, INT4 AWQ, W4A8 AWQ, mixed), tensor parallelism,
and the integrity checks. Calibration and export run in this process (ModelOpt on the CPU, a second each)."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
mtq = pytest.importorskip("modelopt.torch.quantization")

from modelopt_exports import CASES, WEIGHT_ONLY, kept  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.errors import IntegrityError  # noqa: E402
from pipeline.quant.checkpoint import rebuild, unpack_int4  # noqa: E402
from pipeline.quant.export_checks import check_export  # noqa: E402


@pytest.mark.parametrize("case", list(CASES))
def test_rebuilt_model_computes_what_the_fake_quant_model_computes(case, exported, tiny_model_dir, tokens):
    """The bound: the checkpoint stores unquantized weights, norms, embeddings and pre-quant scales in FP16
    (relative rounding 2^-11); everything else (codes, scales) is exact. For weight-only formats that rounding
    is all the difference: max |logit difference| under 2e-3 of the largest logit. With quantized activations
    (INT8 / FP8 inputs) the same rounding moves a few inputs across a quantization step (1/127 of the range
    for INT8, one part in 16 for FP8), so single logits may move by up to a few percent: under 5e-2 of the
    largest logit, while the distributions stay together (mean KL under 1e-4 nats)."""
    e = exported(case)
    model, facts = rebuild(e["ckpt"][1], tiny_model_dir, kept(e["plan"]))
    with torch.no_grad():
        got = model(tokens[1]).logits
    want = e["fake_quant_logits"]
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < (2e-3 if case in WEIGHT_ONLY else 5e-2), rel
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-4
    base, other = CASES[case]
    from pipeline.formats import TRTLLM_QUANT_ALGO

    want_formats = {TRTLLM_QUANT_ALGO[base]: 13 - (4 if other else 0)}
    if other:
        want_formats[TRTLLM_QUANT_ALGO[other]] = 4
    assert facts["formats"] == want_formats
    assert facts["quant_algo"] == ("MIXED_PRECISION" if other else TRTLLM_QUANT_ALGO[base])
    assert facts["high_precision_linears"] == 2 and facts["tp_size"] == 1


@pytest.mark.parametrize("case", ["int8_sq", "fp8", "int4_awq", "int4_awq+int8_sq"])
def test_tensor_parallel_ranks_read_back_to_the_single_rank_model(case, exported, tiny_model_dir, tokens):
    """Two ranks (column-parallel qkv with q|k|v per rank, row-parallel dense/proj split on the input, the
    vocabulary split) joined by the reader give the TP=1 model: the ranks hold the same FP16 values, so the
    logits agree to float rounding."""
    e = exported(case)
    ckpt2 = e["ckpt"][2]
    config = json.loads((ckpt2 / "config.json").read_text())
    assert config["mapping"]["world_size"] == config["mapping"]["tp_size"] == 2
    assert sorted(p.name for p in ckpt2.glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    one, _ = rebuild(e["ckpt"][1], tiny_model_dir, kept(e["plan"]))
    two, facts = rebuild(ckpt2, tiny_model_dir, kept(e["plan"]))
    assert facts["tp_size"] == 2
    with torch.no_grad():
        a, b = one(tokens[1]).logits, two(tokens[1]).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-3 * float(a.abs().max()))


@pytest.mark.parametrize("case", ["int4_awq+int8_sq", "fp8"])
def test_streamed_layers_compute_what_the_rebuilt_model_computes(case, exported, tiny_model_dir, tokens):
    """``rebuild(streamed=True)`` (the cpu runtime's way with a model larger than memory): the decoder layers
    hold no weight until a forward reaches them and none after it, and the logits are bit-equal to the
    model rebuilt whole, on two ranks too; a second forward reads every layer again."""
    e = exported(case)
    for ckpt in (e["ckpt"][1], e["ckpt"][2]):
        whole, _ = rebuild(ckpt, tiny_model_dir, kept(e["plan"]))
        streamed, facts = rebuild(ckpt, tiny_model_dir, kept(e["plan"]), streamed=True)
        layers = streamed.model.layers
        assert all(p.is_meta for p in layers.parameters())
        with torch.no_grad():
            want = whole(tokens[1]).logits
            assert torch.equal(streamed(tokens[1]).logits, want)
            assert all(p.is_meta for p in layers.parameters())
            assert torch.equal(streamed(tokens[1]).logits, want)
        assert streamed.streamed_layers.loads == 2 * len(layers)
        assert facts["formats"] and facts["tp_size"] in (1, 2)


def test_unpack_int4_inverts_modelopt_packing():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-8, 8, (6, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(6, 2, generator=g) + 0.5
    packed = pack_int4_in_uint8(codes.float() * scale.repeat_interleave(32, dim=1), scale, 32).view(torch.int8)
    assert packed.shape == (3, 64)
    assert torch.equal(unpack_int4(packed), codes)


def _tampered(src, tmp_path, edit, config_edit=None, quant_cfg_edit=None):
    out = tmp_path / "tampered"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "rank0.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "rank0.safetensors"))
    if config_edit:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if quant_cfg_edit:
        cfg = json.loads((out / "quant_cfg.json").read_text())
        quant_cfg_edit(cfg)
        (out / "quant_cfg.json").write_text(json.dumps(cfg))
    return out


def test_a_layer_the_plan_keeps_but_the_checkpoint_quantizes_is_refused(exported, tiny_model_dir):
    e = exported("int4_awq")
    with pytest.raises(IntegrityError, match=r"transformer\.layers\.1\.mlp\.proj: the plan keeps "
                                             r"model\.layers\.1\.mlp\.down_proj"):
        rebuild(e["ckpt"][1], tiny_model_dir, kept(e["plan"]) | {"model.layers.1.mlp.down_proj"})
    with pytest.raises(IntegrityError, match=r"the plan quantizes model\.layers\.0\.mlp\.down_proj"):
        rebuild(e["ckpt"][1], tiny_model_dir, kept(e["plan"]) - {"model.layers.0.mlp.down_proj"})


@pytest.mark.parametrize("tensor", ["weights_scaling_factor", "prequant_scaling_factor"])
def test_missing_scales_are_refused_naming_the_layer(tensor, exported, tiny_model_dir, tmp_path):
    e = exported("int4_awq")
    bad = _tampered(e["ckpt"][1], tmp_path, lambda t: t.pop(f"transformer.layers.1.mlp.proj.{tensor}"))
    with pytest.raises(IntegrityError, match=rf"transformer\.layers\.1\.mlp\.proj: W4A16_AWQ weight without {tensor}"):
        rebuild(bad, tiny_model_dir)


def test_missing_activation_scale_of_smoothquant_is_refused(exported, tiny_model_dir, tmp_path):
    e = exported("int8_sq")
    bad = _tampered(e["ckpt"][1], tmp_path,
                    lambda t: t.pop("transformer.layers.0.attention.qkv.activation_scaling_factor"))
    with pytest.raises(IntegrityError, match=r"transformer\.layers\.0\.attention\.qkv: W8A8_SQ_PER_CHANNEL weight "
                                             r"without activation_scaling_factor"):
        rebuild(bad, tiny_model_dir)


def test_wrong_shapes_are_refused_naming_the_layer(exported, tiny_model_dir, tmp_path):
    e = exported("int4_awq")

    def group_scales(t):
        k = "transformer.layers.1.attention.dense.weights_scaling_factor"
        t[k] = t[k][:, :1].contiguous()

    bad = _tampered(e["ckpt"][1], tmp_path, group_scales)
    with pytest.raises(IntegrityError, match=r"transformer\.layers\.1\.attention\.dense: INT4 group scales of shape "
                                             r"\(64, 1\) do not fit a weight of \[64, 64\] with group size 32"):
        rebuild(bad, tiny_model_dir)
    e8 = exported("int8_wo")

    def weight_rows(t):
        k = "transformer.layers.0.mlp.fc.weight"
        t[k] = t[k][:-2].contiguous()
        t["transformer.layers.0.mlp.fc.weights_scaling_factor"] = \
            t["transformer.layers.0.mlp.fc.weights_scaling_factor"][:-2].contiguous()

    shutil.rmtree(tmp_path / "tampered")
    bad = _tampered(e8["ckpt"][1], tmp_path, weight_rows)
    with pytest.raises(IntegrityError, match=r"transformer\.layers\.0\.mlp\.fc: shape \(126, 64\) does not fit "
                                             r"model\.layers\.0\.mlp\.gate_proj"):
        rebuild(bad, tiny_model_dir)


def test_quant_cfg_that_contradicts_the_stored_weights_is_refused(exported, tiny_model_dir, tmp_path):
    e = exported("int4_awq+int8_sq")
    assert json.loads((e["ckpt"][1] / "config.json").read_text())["quantization"]["quant_algo"] == "MIXED_PRECISION"

    def claim_kept_layer(cfg):
        cfg["quantized_layers"]["transformer.layers.0.mlp.proj"] = {"quant_algo": "W8A16"}

    bad = _tampered(e["ckpt"][1], tmp_path, lambda t: None, quant_cfg_edit=claim_kept_layer)
    with pytest.raises(IntegrityError, match=r"transformer\.layers\.0\.mlp\.proj: the checkpoint's config says W8A16 "
                                             r"but the weight is stored as torch\.float16"):
        rebuild(bad, tiny_model_dir)
    (bad / "quant_cfg.json").unlink()
    with pytest.raises(IntegrityError, match="MIXED_PRECISION without quant_cfg.json"):
        rebuild(bad, tiny_model_dir)


def test_unreadable_format_and_missing_rank_are_refused(exported, tiny_model_dir, tmp_path):
    e = exported("int8_wo")
    bad = _tampered(e["ckpt"][1], tmp_path, lambda t: None,
                    config_edit=lambda c: c["quantization"].update(quant_algo="NVFP4"))
    with pytest.raises(IntegrityError, match="quant_algo NVFP4 cannot be read back"):
        rebuild(bad, tiny_model_dir)
    two = exported("int8_sq")["ckpt"][2]
    shutil.copytree(two, tmp_path / "one_rank")
    (tmp_path / "one_rank" / "rank1.safetensors").unlink()
    with pytest.raises(IntegrityError, match="world_size 2 but rank1.safetensors missing"):
        rebuild(tmp_path / "one_rank", tiny_model_dir)


def test_the_stage_refuses_a_quant_cfg_that_differs_from_the_plan(exported, tiny_model_dir, tmp_path):
    """quant_cfg.json must list exactly the plan's quantized GEMMs, each with its format and group size."""
    from pipeline.errors import StageFailed

    e = exported("int4_awq+int8_sq")
    model_config = json.loads((tiny_model_dir / "config.json").read_text())
    facts = check_export(e["ckpt"][1], e["plan"], e["quant"], model_config)
    # 5 GEMMs per decoder layer (q/k/v fused), layer 0's down_proj kept
    assert facts["quant_algo"] == "MIXED_PRECISION" and facts["quant_cfg_layers"] == 9
    edits = {
        "kept layer listed": (lambda c: c["quantized_layers"].update({"lm_head": {"quant_algo": "W8A16"}}),
                              r"lists 1 layer\(s\) the plan keeps in high precision: \['lm_head'\]"),
        "layer missing": (lambda c: c["quantized_layers"].pop("transformer.layers.1.mlp.fc"),
                          r"lacks 1 layer\(s\) the plan quantizes: \['transformer.layers.1.mlp.fc'\]"),
        "wrong format": (lambda c: c["quantized_layers"]["transformer.layers.1.attention.qkv"].update(
            quant_algo="W8A16"), r"transformer.layers.1.attention.qkv is \{'quant_algo': 'W8A16'\}"),
        "wrong group": (lambda c: c["quantized_layers"]["transformer.layers.0.mlp.fc"].update(group_size=64),
                        r"transformer.layers.0.mlp.fc is .*'group_size': 64"),
    }
    for _what, (edit, message) in edits.items():
        if (tmp_path / "tampered").exists():
            shutil.rmtree(tmp_path / "tampered")
        bad = _tampered(e["ckpt"][1], tmp_path, lambda t: None, quant_cfg_edit=edit)
        with pytest.raises(StageFailed, match=message):
            check_export(bad, e["plan"], e["quant"], model_config)
