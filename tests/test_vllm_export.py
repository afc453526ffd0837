"""The vLLM export (pipeline.engines.vllm.export) on real ModelOpt exports of the tiny Llama: what it writes is
compressed-tensors W8A8 with the plan's kept layers ignored, and it computes what the TensorRT-LLM checkpoint
computes, with SmoothQuant folded into the norms and rows before each linear.

The model built here from the export is this test's own reading of the compressed-tensors format (vLLM 0.32,
``compressed_tensors_w8a8_int8.py``: W = code * weight_scale; x quantized with the static input_scale,
round-to-nearest, clamped to [-128, 127]), not the export's code. vLLM itself loading the export is
tests/test_vllm.py."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("modelopt.torch.quantization")

from safetensors.torch import load_file  # noqa: E402
from test_checkpoint import _kept, exported, tokens  # noqa: E402,F401 - the ModelOpt exports, shared

from pipeline.errors import InputError  # noqa: E402
from pipeline.quant.checkpoint import rebuild  # noqa: E402

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _model_from_export(folder, model_dir):
    """An fp32 HF model computing what the compressed-tensors export says (independent of the export code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = {}
    for shard in sorted(folder.glob("*.safetensors")):  # one file, or shards (the index is checked by the caller)
        state.update(load_file(str(shard)))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()
    weights = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        base = name[:-len(".weight")]
        if t.dtype == torch.int8:
            weights[name] = t.float() * state[f"{base}.weight_scale"].float()
            scale = float(state[f"{base}.input_scale"])
            model.get_submodule(base).register_forward_pre_hook(
                lambda m, a, s=scale: ((a[0] / s).round().clamp(-128, 127) * s,))
        else:
            weights[name] = t.float()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def _reference_without_act_quant_on(model, ckpt, names):
    """The rebuilt checkpoint with the input of ``names`` only smoothed, not INT8-rounded: what the export
    computes for a linear it had to write in high precision (its smoothing not foldable)."""
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    for name in names:
        i = int(name.split(".")[2])
        s = tensors[f"transformer.layers.{i}.attention.dense.prequant_scaling_factor"].float()
        module = model.get_submodule(name)
        module._forward_pre_hooks.clear()
        module.register_forward_pre_hook(lambda m, a, s=s: (a[0] * s,))
    return model


@pytest.mark.parametrize("tp", [1, 2])
def test_export_computes_what_the_checkpoint_computes(exported, tiny_model_dir, tokens, tmp_path, tp):  # noqa: F811
    """INT8 SmoothQuant, fp32 export: the same logits as the rebuilt checkpoint (its o_proj inputs smoothed but
    not rounded: with grouped-query attention their smoothing cannot go into v_proj, so the export writes them
    in high precision). Folding the scales elsewhere changes float rounding only; an input sitting on a
    rounding boundary may move one INT8 step, so logits agree within 1e-2 of the largest and the
    distributions within 1e-5 nats."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported("int8_sq")
    ckpt = e["ckpt"][tp]
    facts = export_for_vllm(ckpt, tiny_model_dir, tmp_path / "vllm", dtype="float32")
    # 2 layers x 7 linears + lm_head = 15; the plan keeps lm_head and layer 0's down_proj; both o_proj are
    # written in high precision (4 heads share 2 KV heads with different smoothing)
    assert facts["quantized_linears"] == 11 and facts["high_precision_linears"] == 4
    unfoldable = facts["dequantized_smoothing_not_foldable"]
    assert unfoldable == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert facts["smoothing_folded_into"] == {"input_layernorm": 2, "post_attention_layernorm": 2, "up_proj rows": 1}

    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "int-quantized"
    assert sorted(q["ignore"]) == sorted(["lm_head", "model.layers.0.mlp.down_proj", *unfoldable])
    group = q["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "tensor"
    assert group["input_activations"]["dynamic"] is False
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert state["model.layers.1.self_attn.q_proj.weight"].dtype == torch.int8
    assert state["model.layers.1.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert state["model.layers.1.self_attn.q_proj.input_scale"].shape == (1,)
    assert "model.layers.1.self_attn.o_proj.weight_scale" not in state

    want_model, _ = rebuild(ckpt, tiny_model_dir, _kept(e["plan"]))
    want_model = _reference_without_act_quant_on(want_model, e["ckpt"][1], unfoldable)
    got_model = _model_from_export(tmp_path / "vllm", tiny_model_dir)
    with torch.no_grad():
        want, got = want_model(tokens[1]).logits, got_model(tokens[1]).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-5


def test_kept_layers_and_norms_are_written_in_the_serving_dtype(exported, tiny_model_dir, tmp_path):  # noqa: F811
    """dtype bfloat16 (vLLM's on a CPU): the plan's high-precision layers, the folded norms and the embedding
    are bf16; codes stay INT8 and scales fp32."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported("int8_sq")
    facts = export_for_vllm(e["ckpt"][1], tiny_model_dir, tmp_path / "bf16", dtype="bfloat16")
    state = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                 "model.embed_tokens.weight"):
        assert state[name].dtype == torch.bfloat16, name
    assert state["model.layers.0.mlp.gate_proj.weight"].dtype == torch.int8
    assert state["model.layers.0.mlp.gate_proj.weight_scale"].dtype == torch.float32
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and facts["dtype"] == "bfloat16"


def test_a_format_vllm_cannot_run_is_refused_before_export(exported, tiny_model_dir, tmp_path):  # noqa: F811
    """An FP8 checkpoint reaching the export (the config check refuses the config first) is refused naming the
    layer and the format, and nothing is written."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported("fp8")
    with pytest.raises(InputError, match="FP8 cannot be exported for vLLM"):
        export_for_vllm(e["ckpt"][1], tiny_model_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its .partial sibling


def test_a_large_export_is_written_in_shards_with_an_index(exported, tiny_model_dir, tokens, tmp_path):  # noqa: F811
    """Shards of at most ~64 KiB pending (the tiny model is ~0.6 MB): several files and an index mapping every
    tensor to the file that holds it, and the same logits as the single-file export."""
    from pipeline.engines.vllm.export import INDEX_FILE, export_for_vllm

    e = exported("int8_sq")
    one = export_for_vllm(e["ckpt"][1], tiny_model_dir, tmp_path / "one", dtype="float32")
    many = export_for_vllm(e["ckpt"][1], tiny_model_dir, tmp_path / "many", dtype="float32", max_shard_bytes=64 * 1024)
    assert one["weight_files"] == 1 and many["weight_files"] > 3
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    shards = sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards
    held = {k: s for s in shards for k in load_file(str(tmp_path / "many" / s))}
    assert held == index["weight_map"]
    assert set(held) == set(load_file(str(tmp_path / "one" / "model.safetensors")))
    with torch.no_grad():
        a = _model_from_export(tmp_path / "one", tiny_model_dir)(tokens[1]).logits
        b = _model_from_export(tmp_path / "many", tiny_model_dir)(tokens[1]).logits
    assert torch.equal(a, b)


def test_the_build_checks_reference_figures_are_the_same_streamed(exported, tiny_model_dir, tokens):  # noqa: F811
    """The vLLM check's reference (simulated greedy tokens and logits, simulated and original top-1 tokens) with
    one decoder layer held at a time, as on a model larger than the memory bound: the same figures."""
    from pipeline.engines.vllm.target import reference_figures

    e = exported("int8_sq")
    prompts, evaluation = [[5, 17, 99, 3], [300, 12, 8]], tokens[1].tolist()
    whole = reference_figures(e["ckpt"][1], tiny_model_dir, prompts, evaluation, 6, 2, streamed=False)
    streamed = reference_figures(e["ckpt"][1], tiny_model_dir, prompts, evaluation, 6, 2, streamed=True)
    assert streamed == whole
    assert [len(r) for r in whole["sim_top1"]] == [len(s) - 1 for s in evaluation] == [len(r) for r in whole["original_top1"]]
    assert [len(tokens) for tokens, _ in whole["greedy"]] == [6, 6] or any(2 in t for t, _ in whole["greedy"])
