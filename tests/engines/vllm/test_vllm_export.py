"""The vLLM export (pipeline.engines.vllm.export) on real ModelOpt exports of the tiny Llama: what it writes is
compressed-tensors (W8A8 for INT8 SmoothQuant, FP8 W8A8, W8A16 and W4A16 pack-quantized for INT8 weight-only
and INT4 AWQ, a group per format for a mixed plan) with the plan's kept layers ignored, and it computes what
the TensorRT-LLM checkpoint computes, with SmoothQuant's and AWQ's pre-quant scales folded into the norms and
rows before each linear.

The model built here from the export is this test's own reading of the compressed-tensors format (vLLM 0.32,
``compressed_tensors_w8a8_int8.py``: W = code * weight_scale; x quantized with the static input_scale,
round-to-nearest, clamped to [-128, 127]; ``compressed_tensors_w8a8_fp8.py``: W = fp8 * weight_scale, x cast
to E4M3 after dividing by the static input_scale; ``compressed_tensors_wNa16.py`` with compressed-tensors'
``unpack_from_int32``: 32 / bits fields per int32 word, lowest first, each code + 2^(bits - 1); W = code *
the scale of its group or channel), not the export's code. What vLLM itself makes of each export's config and
tensors is asked of vLLM in its own environment (``tests/bin/vllm-scheme-probe``); vLLM serving an export is
tests/engines/vllm/test_vllm.py."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("modelopt.torch.quantization")

from conftest import REPO  # noqa: E402
from modelopt_exports import kept, quantize_and_export  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pipeline import families  # noqa: E402
from pipeline.errors import InputError  # noqa: E402
from pipeline.quant.checkpoint import rebuild  # noqa: E402

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _model_from_export(folder, model_dir):
    """An fp32 HF model computing what the compressed-tensors export says (independent of the export code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = {}
    for shard in sorted(folder.glob("*.safetensors")):  # one file, or shards (the index is checked by the caller)
        state.update(load_file(str(shard)))
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,  # Gemma 2: eager, its soft-cap applied
                                             attn_implementation=families.attn_implementation(config.model_type)).eval()
    weights = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".input_scale", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):  # INT4 / INT8: int32 words, activations not quantized
            base = name[:-len(".weight_packed")]
            out_f, in_f = state[f"{base}.weight_shape"].tolist()
            per_word = in_f // t.shape[1]
            bits = 32 // per_word
            # [out, words] each: the j-th input of every word
            fields = [(t >> (bits * j)) & ((1 << bits) - 1) for j in range(per_word)]
            codes = torch.stack(fields, dim=2).reshape(out_f, in_f).float() - 2 ** (bits - 1)
            scale = state[f"{base}.weight_scale"].float()
            weights[f"{base}.weight"] = codes * scale.repeat_interleave(in_f // scale.shape[1], dim=1)
            continue
        base = name[:-len(".weight")]
        if t.dtype == torch.float8_e4m3fn:
            weights[name] = t.float() * state[f"{base}.weight_scale"].float()
            scale = float(state[f"{base}.input_scale"])
            model.get_submodule(base).register_forward_pre_hook(
                lambda m, a, s=scale: ((a[0] / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,))
        elif t.dtype == torch.int8:
            weights[name] = t.float() * state[f"{base}.weight_scale"].float()
            scale = float(state[f"{base}.input_scale"])
            model.get_submodule(base).register_forward_pre_hook(
                lambda m, a, s=scale: ((a[0] / s).round().clamp(-128, 127) * s,))
        else:
            weights[name] = t.float()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = json.loads((folder / "config.json").read_text())["tie_word_embeddings"]
    if tied:
        model.tie_weights()
    assert not unexpected and all("rotary" in m or tied and m == "lm_head.weight" for m in missing), (missing,
                                                                                                       unexpected)
    return model


def _assert_the_same_model(want, got) -> None:
    """Logits of the export's model (``got``) against the reference's: within 1 % of the largest, and a mean KL
    divergence under 1e-5 (activation rounding flips a few INT8 steps, no more)."""
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-5


def _reference_without_act_quant_on(model, ckpt, names):
    """The rebuilt checkpoint with the input of ``names`` only smoothed, not INT8-rounded: what the export
    computes for a linear it had to write in high precision (its smoothing not foldable). o_proj is
    row-parallel: its pre-quant scale is split over the ranks along its input."""
    ranks = [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(len(list(ckpt.glob("rank*.safetensors"))))]
    for name in names:
        i = int(name.split(".")[2])
        s = torch.cat([t[f"transformer.layers.{i}.attention.dense.prequant_scaling_factor"].float() for t in ranks])
        module = model.get_submodule(name)
        module._forward_pre_hooks.clear()
        module.register_forward_pre_hook(lambda m, a, s=s: (a[0] * s,))
    return model


def _reference_with_requantized_up(model, ckpt, names, group):
    """The rebuilt checkpoint with each of ``names`` (an up_proj) reading gate_proj's AWQ-scaled input: its
    float weight times s_up / s_gate on the input columns, quantized again to INT4 (groups of ``group``
    along the input, round to nearest, scale amax / 7), written here independently of the export."""
    from safetensors import safe_open

    def tensor(key):  # gate and up are column-parallel: every rank holds the same input scale
        with safe_open(str(ckpt / "rank0.safetensors"), framework="pt") as f:
            return f.get_tensor(key).float()

    for name in names:
        i = int(name.split(".")[2])
        s_gate = tensor(f"transformer.layers.{i}.mlp.fc.prequant_scaling_factor")
        s_up = tensor(f"transformer.layers.{i}.mlp.gate.prequant_scaling_factor")
        module = model.get_submodule(name)
        w = module.weight.detach() * (s_up / s_gate)[None, :]
        g = w.reshape(w.shape[0], -1, group)
        scale = g.abs().amax(-1, keepdim=True) / 7
        module.weight.data = ((g / scale).round().clamp(-8, 7) * scale).reshape(w.shape)
        module._forward_pre_hooks.clear()
        module.register_forward_pre_hook(lambda m, a, s=s_gate: (a[0] * s,))
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
    facts = export_for_vllm(ckpt, tiny_model_dir, out_dir=tmp_path / "vllm", dtype="float32")
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

    want_model, _ = rebuild(ckpt, tiny_model_dir, kept(e["plan"]))
    want_model = _reference_without_act_quant_on(want_model, e["ckpt"][1], unfoldable)
    got_model = _model_from_export(tmp_path / "vllm", tiny_model_dir)
    with torch.no_grad():
        want, got = want_model(tokens[1]).logits, got_model(tokens[1]).logits
    _assert_the_same_model(want, got)


def test_kept_layers_and_norms_are_written_in_the_serving_dtype(exported, tiny_model_dir, tmp_path):  # noqa: F811
    """dtype bfloat16 (vLLM's on a CPU): the plan's high-precision layers, the folded norms and the embedding
    are bf16; codes stay INT8 and scales fp32."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported("int8_sq")
    facts = export_for_vllm(e["ckpt"][1], tiny_model_dir, out_dir=tmp_path / "bf16", dtype="bfloat16")
    state = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                 "model.embed_tokens.weight"):
        assert state[name].dtype == torch.bfloat16, name
    assert state["model.layers.0.mlp.gate_proj.weight"].dtype == torch.int8
    assert state["model.layers.0.mlp.gate_proj.weight_scale"].dtype == torch.float32
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and facts["dtype"] == "bfloat16"


def test_a_format_vllm_cannot_run_is_refused_before_export(exported, tiny_model_dir, tmp_path):  # noqa: F811
    """A W4A8 AWQ checkpoint reaching the export (the config check refuses the config first) is refused naming
    the layer and the format, and nothing is written."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported("w4a8_awq")
    with pytest.raises(InputError, match="W4A8_AWQ cannot be exported for vLLM"):
        export_for_vllm(e["ckpt"][1], tiny_model_dir, out_dir=tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its .partial sibling


def test_a_large_export_is_written_in_shards_with_an_index(exported, tiny_model_dir, tokens, tmp_path):  # noqa: F811
    """Shards of at most ~64 KiB pending (the tiny model is ~0.6 MB): several files and an index mapping every
    tensor to the file that holds it, and the same logits as the single-file export."""
    from pipeline.engines.vllm.export import INDEX_FILE, export_for_vllm

    e = exported("int8_sq")
    one = export_for_vllm(e["ckpt"][1], tiny_model_dir, out_dir=tmp_path / "one", dtype="float32")
    many = export_for_vllm(e["ckpt"][1], tiny_model_dir, out_dir=tmp_path / "many", dtype="float32",
                           max_shard_bytes=64 * 1024)
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
    whole = reference_figures(e["ckpt"][1], tiny_model_dir, prompt_ids=prompts, evaluation=evaluation, max_tokens=6,
                              end_id=2, streamed=False)
    streamed = reference_figures(e["ckpt"][1], tiny_model_dir, prompt_ids=prompts, evaluation=evaluation, max_tokens=6,
                                 end_id=2, streamed=True)
    assert streamed == whole
    assert ([len(r) for r in whole["sim_top1"]] == [len(s) - 1 for s in evaluation]
            == [len(r) for r in whole["original_top1"]])
    assert [len(tokens) for tokens, _ in whole["greedy"]] == [6, 6] or any(2 in t for t, _ in whole["greedy"])


@pytest.mark.parametrize("case, tp", [("int4_awq", 1), ("int4_awq", 2), ("int4_awq+int8_sq", 1)])
def test_int4_awq_exports_as_packed_w4a16_computing_what_the_checkpoint_computes(  # noqa: F811
        exported, tiny_model_dir, tokens, tmp_path, case, tp):  # noqa: F811
    """INT4 AWQ (group 32): the checkpoint's codes and group scales packed as compressed-tensors W4A16, AWQ's
    pre-quant scales folded; joined across 2 ranks the same. With no activation rounding the export computes
    the rebuilt checkpoint's logits to float rounding. A mixed plan (INT4 with INT8 SmoothQuant in layer 1's
    q/k/v and down_proj) gets a config group per format: INT4, the format of most layers, targets Linear, and
    the INT8 layers are named in theirs."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported(case)
    facts = export_for_vllm(e["ckpt"][tp], tiny_model_dir, out_dir=tmp_path / "vllm", dtype="float32")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    packed = state["model.layers.0.mlp.gate_proj.weight_packed"]
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (128, 64 // 8)
    assert state["model.layers.0.mlp.gate_proj.weight_shape"].tolist() == [128, 64]
    assert tuple(state["model.layers.0.mlp.gate_proj.weight_scale"].shape) == (128, 64 // 32)
    q = json.loads((tmp_path / "vllm" / "config.json").read_text())["quantization_config"]
    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False}
    if case == "int4_awq":
        assert q["format"] == "pack-quantized" and list(q["config_groups"]) == ["group_0"]
        group = q["config_groups"]["group_0"]
        assert group["targets"] == ["Linear"] and group["weights"] == int4 and group["input_activations"] is None
    else:
        int4_group, int8_group = q["config_groups"]["group_0"], q["config_groups"]["group_1"]
        assert q["format"] == "mixed-precision" and int4_group["targets"] == ["Linear"]
        assert int8_group["format"] == "int-quantized" and int4_group["format"] == "pack-quantized"
        assert int4_group["weights"] == int4
        assert sorted(int8_group["targets"]) == [f"model.layers.1.{m}" for m in
                                                 ("mlp.down_proj", "self_attn.k_proj", "self_attn.q_proj",
                                                  "self_attn.v_proj")]
        assert state["model.layers.1.self_attn.q_proj.weight"].dtype == torch.int8
    unfoldable = facts["dequantized_smoothing_not_foldable"]
    assert set(q["ignore"]) == {"lm_head", "model.layers.0.mlp.down_proj", *unfoldable}

    # AWQ searched gate's and up's scales apart; vLLM runs them as one GEMM on one input: up takes gate's
    # scale and is quantized again (INT4 layers only)
    requantized = facts["int4_requantized_to_share_a_prequant_scale"]
    assert requantized == [f"model.layers.{i}.mlp.up_proj" for i in (0, 1)]

    want_model, _ = rebuild(e["ckpt"][tp], tiny_model_dir, kept(e["plan"]))
    int8_unfoldable = [n for n in unfoldable if case != "int4_awq" and n.startswith("model.layers.1.")]
    want_model = _reference_without_act_quant_on(want_model, e["ckpt"][1], int8_unfoldable)
    want_model = _reference_with_requantized_up(want_model, e["ckpt"][tp], requantized, group=32)
    got_model = _model_from_export(tmp_path / "vllm", tiny_model_dir)
    with torch.no_grad():
        want, got = want_model(tokens[1]).logits, got_model(tokens[1]).logits
    bound = 1e-4 if case == "int4_awq" else 1e-2  # INT8 activations may move one rounding step
    assert float((got - want).abs().max() / want.abs().max()) < bound


def test_a_fused_pair_in_two_formats_is_written_in_high_precision_exactly():
    """A plan may keep up_proj in high precision and give gate_proj INT4 (TensorRT-LLM runs them apart, vLLM
    as one GEMM): gate is dequantized, its AWQ scale folded into its columns, and computes what it did."""
    from pipeline.engines.vllm.export import ExportFacts, Linear, one_format

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (64, 128), generator=g, dtype=torch.int8)
    scales = torch.rand(64, 128 // 32, generator=g) + 0.1
    prequant = torch.rand(128, generator=g) + 0.5
    x = torch.randn(3, 128, generator=g)
    want = (x * prequant) @ (codes.float() * scales.repeat_interleave(32, dim=1)).T
    gate = Linear(codes, scales, prequant=prequant, algo="W4A16_AWQ", group_size=32)
    up = Linear(torch.randn(64, 128, generator=g))
    facts = ExportFacts()
    one_format({"gate": gate, "up": up}, facts)
    assert not gate.quantized and gate.algo is None and gate.prequant is None and facts.unfused == ["gate"]
    assert torch.allclose(x @ gate.weight.T, want, rtol=1e-5, atol=1e-5)
    one_format({"gate": gate, "up": up}, facts)  # one format already: nothing to do
    assert facts.unfused == ["gate"]


@pytest.mark.parametrize("case, tp", [("fp8", 1), ("fp8", 2), ("int8_wo", 1), ("int8_wo", 2), ("int4_awq+int8_wo", 1)])
def test_fp8_and_int8_weight_only_export_computing_what_the_checkpoint_computes(  # noqa: F811
        exported, tiny_model_dir, tokens, tmp_path, case, tp):  # noqa: F811
    """FP8: the checkpoint's E4M3 values, its one weight scale per tensor written per output channel (exact) and
    its static input scale: compressed-tensors W8A8 FP8, float-quantized. INT8 weight-only: the codes packed
    four to an int32 with per-channel scales (W8A16, pack-quantized). Neither has a pre-quant scale to fold;
    joined across 2 ranks the same. The export computes the rebuilt checkpoint's logits: to float rounding
    without activation rounding, within an FP8 step of an input with it. A plan mixing INT4 AWQ with INT8
    weight-only in layer 1's q/k/v and down_proj names the INT8 layers in their group."""
    from pipeline.engines.vllm.export import export_for_vllm

    e = exported(case)
    facts = export_for_vllm(e["ckpt"][tp], tiny_model_dir, out_dir=tmp_path / "vllm", dtype="float32")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    q = json.loads((tmp_path / "vllm" / "config.json").read_text())["quantization_config"]
    # INT4 o_proj under grouped-query attention: AWQ's smoothing not foldable, written in high precision (exact)
    unfoldable = facts["dequantized_smoothing_not_foldable"]
    assert unfoldable == ([] if case in ("fp8", "int8_wo") else [f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)])
    assert set(q["ignore"]) == {"lm_head", "model.layers.0.mlp.down_proj", *unfoldable}
    channel8 = {"num_bits": 8, "symmetric": True, "strategy": "channel", "dynamic": False}
    group = q["config_groups"]["group_0"]
    if case == "fp8":
        weight, scale = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.gate_proj.weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (128, 1)
        assert scale.dtype == torch.float32 and bool((scale == scale[0]).all())  # the checkpoint's one scale
        assert state["model.layers.1.mlp.gate_proj.input_scale"].shape == (1,)
        assert q["format"] == group["format"] == "float-quantized" and group["targets"] == ["Linear"]
        assert group["weights"] == {"type": "float", **channel8}
        assert group["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                              "dynamic": False}
        assert facts["input_scale_raised_to_its_fused_gemms"] == []  # gate and up read one input: one scale
    else:
        name = "model.layers.1.self_attn.q_proj" if case == "int8_wo" else "model.layers.1.mlp.down_proj"
        packed = state[f"{name}.weight_packed"]
        out_f, in_f = state[f"{name}.weight_shape"].tolist()
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (out_f, in_f // 4)
        assert tuple(state[f"{name}.weight_scale"].shape) == (out_f, 1)
        int8_group = group if case == "int8_wo" else q["config_groups"]["group_1"]
        assert int8_group["weights"] == {"type": "int", **channel8} and int8_group["input_activations"] is None
        assert int8_group["format"] == "pack-quantized"
        if case != "int8_wo":
            assert q["format"] == "mixed-precision" and group["targets"] == ["Linear"]
            assert group["weights"]["num_bits"] == 4
            assert sorted(int8_group["targets"]) == [f"model.layers.1.{m}" for m in
                                                     ("mlp.down_proj", "self_attn.k_proj", "self_attn.q_proj",
                                                      "self_attn.v_proj")]

    want_model, _ = rebuild(e["ckpt"][tp], tiny_model_dir, kept(e["plan"]))
    requantized = facts["int4_requantized_to_share_a_prequant_scale"]
    want_model = _reference_with_requantized_up(want_model, e["ckpt"][tp], requantized, group=32)
    got_model = _model_from_export(tmp_path / "vllm", tiny_model_dir)
    with torch.no_grad():
        want, got = want_model(tokens[1]).logits, got_model(tokens[1]).logits
    assert float((got - want).abs().max() / want.abs().max()) < (1e-2 if case == "fp8" else 1e-4)
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-5


SCHEME_OF = {torch.int8: "CompressedTensorsW8A8Int8", torch.float8_e4m3fn: "CompressedTensorsW8A8Fp8"}
SHARDS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _vllm_layers(num_layers: int) -> dict:
    """vLLM's Llama linears -> the export's linears they load (a fused one: its shards, in order)."""
    layers = {"lm_head": ["lm_head"]}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for fused, parts in SHARDS.items():
            layers[f"{p}.{fused}"] = [f"{p}.{part}" for part in parts]
        for single in ("self_attn.o_proj", "mlp.down_proj"):
            layers[f"{p}.{single}"] = [f"{p}.{single}"]
    return layers


@pytest.mark.parametrize("case", ["int8_sq", "fp8", "int8_wo", "int4_awq+int8_wo"])
def test_vllm_reads_each_export_as_written(exported, tiny_model_dir, tmp_path, case):  # noqa: F811
    """vLLM 0.32 itself, in its own environment, on each export's config.json: every linear gets the scheme of
    the format written for it (the kept ones none), static input scales where the format has them, and the
    parameters its scheme creates for the layer are the export's tensors, by name, shape and dtype (a fused
    layer's shards stacked). INT8 weight-only has no kernel on a CPU (vLLM says so creating its weights),
    which is why the config check gives it vllm.device cuda only."""
    import subprocess

    from pipeline.engines.vllm import runtime
    from pipeline.engines.vllm.export import export_for_vllm
    from pipeline.errors import EnvironmentProblem

    try:
        python = runtime.serving_python()
    except EnvironmentProblem as e:
        pytest.skip(f"vLLM's serving environment is not installed here ({e})")
    e = exported(case)
    export_for_vllm(e["ckpt"][1], tiny_model_dir, out_dir=tmp_path / "vllm", dtype="bfloat16")
    proc = subprocess.run([python, str(REPO / "tests" / "bin" / "vllm-scheme-probe"), str(tmp_path / "vllm"),
                           str(tmp_path / "probe.json")], env=runtime.child_env({}), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probe = json.loads((tmp_path / "probe.json").read_text())
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    layers = _vllm_layers(2)
    assert set(probe) == set(layers)
    for name, parts in layers.items():
        got = probe[name]
        first = parts[0]
        if f"{first}.weight_scale" not in state:
            assert got["scheme"] is None, (name, got)  # kept in high precision: vLLM's unquantized linear
            continue
        packed = f"{first}.weight_packed" in state
        want = "CompressedTensorsWNA16" if packed else SCHEME_OF[state[f"{first}.weight"].dtype]
        assert got["scheme"] == want, name
        if not packed:
            assert got["static_input"] is True and got["input"]["strategy"] == "tensor", name
            assert got["input"]["dynamic"] is False
        bits = 32 * state[f"{first}.weight_packed"].shape[1] // state[f"{first}.weight_shape"][1] if packed else 8
        assert got["weights"]["num_bits"] == bits, name
        if bits == 8 and packed:  # INT8 W8A16: no CPU kernel in vLLM 0.32
            assert "error" in got and "CPUWNA16LinearKernel" in got["error"], got
            continue
        assert "error" not in got, got
        params = got["params"]
        for suffix in ("weight", "weight_packed", "weight_scale"):
            if f"{first}.{suffix}" in state:
                tensors = [state[f"{part}.{suffix}"] for part in parts]
                assert params[suffix][0] == [sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]], (name, suffix)
                assert params[suffix][1] == str(tensors[0].dtype).replace("torch.", ""), (name, suffix)
        if f"{first}.input_scale" in state:  # FP8: one per shard (vLLM takes the largest); INT8: one for the layer
            assert params["input_scale"][0] == [len(parts) if got["scheme"].endswith("Fp8") else 1], name
            assert len({float(state[f"{part}.input_scale"]) for part in parts}) == 1, name  # so any load order is right


@pytest.mark.parametrize("family, tp", [("qwen2", 1), ("qwen2", 2), ("qwen2_mha", 1), ("qwen3", 2)])
def test_qwen_exports_carry_their_biases_and_qk_norms(tiny_tokenizer_dir, tokens, tmp_path, family, tp):  # noqa: F811
    """Qwen2's q/k/v biases (joined across ranks as the rows are) and Qwen3's per-head q/k RMSNorms are written
    beside the INT8 weights, and the export computes the rebuilt checkpoint's logits. With one KV head per
    query head (qwen2_mha) o_proj's smoothing folds into v_proj's rows, and v_proj's bias is scaled with them."""
    from tiny_families import qwen2, qwen3, saved
    from transformers import AutoModelForCausalLM

    from pipeline.engines.vllm.export import export_for_vllm

    torch.manual_seed(0)
    maker = {"qwen2": qwen2, "qwen2_mha": lambda: qwen2(kv_heads=4), "qwen3": qwen3}[family]
    model_dir = saved(maker(), tmp_path / "model", tiny_tokenizer_dir)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calib, evals = tokens
    e = quantize_and_export(original, "int8_sq", calib, evals, {n: tmp_path / f"ckpt{n}" for n in {1, tp}})
    facts = export_for_vllm(e["ckpt"][tp], model_dir, out_dir=tmp_path / "vllm", dtype="float32")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    if family.startswith("qwen2"):
        for m in "qkv":
            assert state[f"model.layers.1.self_attn.{m}_proj.bias"].dtype == torch.float32
    else:
        assert tuple(state["model.layers.1.self_attn.q_norm.weight"].shape) == (32,)  # head size
    unfoldable = facts["dequantized_smoothing_not_foldable"]
    folded_into_v = facts["smoothing_folded_into"].get("v_proj rows", 0)
    assert (folded_into_v, len(unfoldable)) == ((2, 0) if family == "qwen2_mha" else (0, 2))
    want_model, _ = rebuild(e["ckpt"][tp], model_dir, kept(e["plan"]))
    want_model = _reference_without_act_quant_on(want_model, e["ckpt"][1], unfoldable)  # reads rank 0 whole
    got_model = _model_from_export(tmp_path / "vllm", model_dir)
    with torch.no_grad():
        want, got = want_model(evals).logits, got_model(evals).logits
    _assert_the_same_model(want, got)


# family -> (the MoE block in a decoder layer, the experts' (gate, down, up) names, experts, the MoE layers)
MOE_LAYOUT = {"mixtral": ("block_sparse_moe", ("w1", "w2", "w3"), 4, (0, 1)),
              "qwen3_moe": ("mlp", ("gate_proj", "down_proj", "up_proj"), 8, (0,))}  # layer 1: mlp_only_layers


def _group_of(quantization_config: dict, name: str) -> dict:
    """The config group that takes ``name`` as vLLM matches them: a group naming it, else the one targeting
    the class (Linear)."""
    groups = quantization_config["config_groups"].values()
    return next((g for g in groups if name in g["targets"]), None) or next(g for g in groups
                                                                            if g["targets"] == ["Linear"])


_AMX = bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("family, fmt, tp, group_size", [
    ("mixtral", "int4_awq", 2, 32), ("mixtral", "fp8", 1, 32), ("qwen3_moe", "int4_awq", 1, 32),
    # the one case vLLM 0.32 runs INT4 experts on a CPU (tests/data/upstream/vllm_cpu_branches.json)
    pytest.param("mixtral", "int4_awq", 1, 64, marks=pytest.mark.skipif(
        not _AMX,
        reason="needs AMX (amx_tile), this CPU lacks it: vLLM's CPU kernel for INT4 experts runs only there"))])
def test_moe_experts_are_exported_as_vllm_loads_them(tiny_tokenizer_dir, tmp_path, family, fmt, tp, group_size):
    """A tiny Mixtral or Qwen3-MoE quantized through `invoke quantize` for the vllm target (attention INT8
    SmoothQuant, experts INT4 AWQ or FP8, the router in high precision): the export writes every expert under
    its HF name, the router unquantized and in the ignore list, the experts in one config group (FP8 experts
    per tensor, as vLLM's FP8 MoE takes static input scales), a dense layer of an MoE model as a dense MLP
    (Qwen3-MoE's mlp_only_layers), and it computes what the checkpoint computes: ModelOpt gives a layer's AWQ
    experts one pre-quant scale per expert type, which folds into the norm (up/gate) and each expert's up rows
    (down) exactly."""
    from conftest import run_invoke, tiny_config
    from tiny_families import mixtral, qwen3_moe, saved, with_rules

    from pipeline import artifacts
    from pipeline.engines.vllm.export import export_for_vllm

    torch.manual_seed(0)
    model = mixtral(intermediate=128) if family == "mixtral" else qwen3_moe()
    model_dir = saved(model, tmp_path / "model", tiny_tokenizer_dir)
    cfg = with_rules(tiny_config(tmp_path, model_dir), f"{{pattern: '*.experts.*', format: {fmt}}}")
    sets = ("build.target=vllm", f"build.tensor_parallel_size={tp}", f"quantization.awq_group_size={group_size}",
            *(("vllm.device=cuda",) if fmt == "fp8" else ("vllm.device=cpu", "build.cuda_graphs.enabled=false")))
    work = tmp_path / "work"
    proc = run_invoke("quantize", "--config", str(cfg), "--work-root", str(work),
                      *(a for s in sets for a in ("--set", s)), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ckpt = work / "tiny" / "quantize" / artifacts.TRTLLM_CHECKPOINT_DIR
    facts = export_for_vllm(ckpt, model_dir, out_dir=tmp_path / "vllm", dtype="float32")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    q = json.loads((tmp_path / "vllm" / "config.json").read_text())["quantization_config"]
    block, names, n_experts, moe_layers = MOE_LAYOUT[family]
    experts = [f"model.layers.{i}.{block}.experts.{e}.{n}" for i in moe_layers for e in range(n_experts)
               for n in names]
    routers = [f"model.layers.{i}.{block}.gate" for i in moe_layers]
    assert set(routers) <= set(q["ignore"]) and not set(experts) & set(q["ignore"])
    for r in routers:
        assert state[f"{r}.weight"].dtype == torch.float32 and f"{r}.weight_scale" not in state
    assert all(_group_of(q, e) == _group_of(q, experts[0]) for e in experts)
    group = _group_of(q, experts[0])
    if fmt == "fp8":
        assert group["weights"]["strategy"] == "tensor" and group["weights"]["type"] == "float"
        assert group["input_activations"] == {**group["input_activations"], "strategy": "tensor", "dynamic": False}
        assert tuple(state[f"{experts[0]}.weight_scale"].shape) == (1,)
        assert state[f"{experts[0]}.weight"].dtype == torch.float8_e4m3fn
    else:
        assert group["weights"]["strategy"] == "group" and group["weights"]["group_size"] == group_size
        assert state[f"{experts[0]}.weight_packed"].dtype == torch.int32
    dense = 2 - len(moe_layers)  # a dense layer's gate/up/down: INT8 SmoothQuant
    assert ("model.layers.1.mlp.down_proj.weight" if dense else f"model.layers.1.{block}.gate.weight") in state
    # the experts, q/k/v of both layers, a dense layer's MLP (o_proj in high precision: 4 heads share 2 KV heads,
    # whose smoothing does not fold into v_proj), the routers and lm_head
    assert facts["quantized_linears"] == len(experts) + 6 + 3 * dense
    assert facts["high_precision_linears"] == 2 + len(routers) + 1
    if fmt == "int4_awq":
        assert facts["smoothing_folded_into"] == {"input_layernorm": 2, "post_attention_layernorm": 2,
                                                  "expert up rows": n_experts * len(moe_layers),
                                                  **({"up_proj rows": 1} if dense else {})}
        assert facts["int4_requantized_to_share_a_prequant_scale"] == []
    _assert_vllm_builds_the_experts(tmp_path / "vllm", state, fmt, family, group["weights"].get("group_size"))
    # the build's check before the export: INT4 experts vLLM runs on no CPU kernel here (without AMX; with AMX, a
    # group of 32, as here: tests/data/upstream/vllm_cpu_branches.json)
    from pipeline.config import load_config
    from pipeline.engines.vllm import runtime
    from pipeline.errors import EnvironmentProblem

    int4_layers = [f"transformer.layers.{i}.mlp" for i in moe_layers] if fmt == "int4_awq" else []
    assert runtime.int4_expert_layers(ckpt) == int4_layers
    if int4_layers:  # (FP8 experts are refused on vllm.device cpu by the config check)
        cpu = load_config(cfg, sets).config
        why = runtime.cpu_int4_experts_refusal(runtime.cpu_features(), cpu.quantization.awq_group_size)
        if why is None:
            runtime.check_cpu_experts(cpu, ckpt)
        else:
            with pytest.raises(EnvironmentProblem, match=re.escape(f"INT4 AWQ, and {why}")):
                runtime.check_cpu_experts(cpu, ckpt)
    unfoldable = facts["dequantized_smoothing_not_foldable"]
    assert unfoldable == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    want_model, _ = rebuild(ckpt, model_dir)
    want_model = _reference_without_act_quant_on(want_model, ckpt, unfoldable)
    got_model = _model_from_export(tmp_path / "vllm", model_dir)
    ids = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = want_model(ids).logits, got_model(ids).logits
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-2, rel
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-5


def _assert_vllm_builds_the_experts(folder, state, fmt, family, group_size):
    """vLLM 0.32 itself, in its own environment: the routers unquantized, and each layer's experts built by its
    fused-MoE factory with the MoE method of the format (FP8: per-tensor weight scales, one per expert and
    shard, and static input scales; INT4: WNA16 group-wise). Its CPU INT4 MoE kernel needs AMX and takes no group
    of 32: where it cannot run (``runtime.cpu_int4_experts_refusal``) vLLM refuses the layer, which the probe
    records."""
    import subprocess

    from pipeline.engines.vllm import runtime
    from pipeline.errors import EnvironmentProblem

    try:
        python = runtime.serving_python()
    except EnvironmentProblem as e:
        pytest.skip(f"vLLM's serving environment is not installed here ({e})")
    proc = subprocess.run([python, str(REPO / "tests" / "bin" / "vllm-scheme-probe"), str(folder),
                           str(folder.parent / "probe.json")], env=runtime.child_env({}), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probe = json.loads((folder.parent / "probe.json").read_text())
    block, names, n, moe_layers = MOE_LAYOUT[family]
    w1 = state[f"model.layers.0.{block}.experts.0.{names[0]}.{'weight' if fmt == 'fp8' else 'weight_packed'}"]
    for i in moe_layers:
        assert probe[f"model.layers.{i}.{block}.gate"]["scheme"] is None
        got = probe[f"model.layers.{i}.{block}.experts"]
        if fmt == "fp8":
            assert got["method"] == "CompressedTensorsW8A8Fp8MoEMethod" and "error" not in got, got
            assert got["params"]["w13_weight"] == [[n, 2 * w1.shape[0], w1.shape[1]], "float8_e4m3fn"]
            assert got["params"]["w13_weight_scale"][0] == [n, 2]  # one per expert and shard, as written
            assert got["params"]["w13_input_scale"][0] == got["params"]["w2_input_scale"][0] == [n]
        else:
            assert got["method"] == "CompressedTensorsWNA16MoEMethod", got
            assert got["amx"] == runtime.cpu_features().amx  # the serving environment's torch says the same
            if runtime.cpu_int4_experts_refusal(runtime.cpu_features(), group_size):
                assert "No WNA16 MoE backend" in got["error"], got
                continue
            assert got["params"]["w13_weight_packed"] == [[n, 2 * w1.shape[0], w1.shape[1]], "int32"], got


# ---------------------------------------------------------------- families with the HF unified checkpoint only

def _written_order(name: str) -> tuple:
    """The export writes a layer's attention, then its MLP (the router first), then lm_head."""
    parts = name.split(".")
    return (int(parts[2]) if name.startswith("model.layers.") else 1 << 30, "mlp" in parts, "gate" not in parts)


HF_PRESETS = {"int8_sq": "INT8_SMOOTHQUANT_CFG", "int4_awq": "INT4_AWQ_CFG", "fp8": "FP8_DEFAULT_CFG"}


@pytest.mark.parametrize("family, fmt", [("phi3", "int8_sq"), ("phi3", "int4_awq"), ("gemma3_text", "int8_sq"),
                                         ("gemma3_text", "fp8"), ("gemma2", "int8_sq"), ("deepseek_v2", "int8_sq"),
                                         ("deepseek_v2", "int4_awq")])
def test_a_family_with_only_an_hf_unified_checkpoint_is_exported_from_it(tiny_tokenizer_dir, tmp_path, family, fmt):
    """Phi-3, Gemma 3 and DeepSeek-V2 quantized by ModelOpt and exported as the HF unified checkpoint (the only
    export of them here): the vLLM export written from it computes what that checkpoint's read-back computes (the
    gate's model). Phi-3's qkv_proj and gate_up_proj stay one linear each, down_proj's smoothing going into
    gate_up_proj's up rows; Gemma 3's (1 + w) norms take q/k/v's and gate/up's smoothing (its MLP reads
    pre_feedforward_layernorm), its other norms are written as they were, its lm_head stays tied. DeepSeek-V2's
    o_proj smoothing goes into kv_b_proj's value rows (one KV head per query head: it always folds), kv_b_proj's
    into kv_a_layernorm, and the router, every routed expert and the shared experts read the post-attention
    norm, which takes their one smoothing, the router (unquantized, ignored) its inverse; every expert is written
    under its own name."""
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from tiny_families import MAKERS, saved

    from pipeline.engines.vllm.export_hf import export_hf_for_vllm
    from pipeline.quant.hf_checkpoint import rebuild_hf
    from pipeline.quant.recipe import set_block_size

    torch.manual_seed(0)
    original = MAKERS[family]().eval()
    model_dir = saved(original, tmp_path / "model", tiny_tokenizer_dir)
    preset = copy.deepcopy(getattr(mtq, HF_PRESETS[fmt]))
    for item in preset["quant_cfg"]:
        set_block_size(item.get("cfg"), 16 if family == "deepseek_v2" else 32)  # experts 32 wide, kv_b_proj 32
    ids = torch.randint(3, 500, (4, 48), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(original)
    with torch.no_grad():
        mtq.quantize(model, preset, lambda m: m(ids))
        export_hf_checkpoint(model, torch.float16, export_dir=tmp_path / "hf")
    facts = export_hf_for_vllm(tmp_path / "hf", model_dir, out_dir=tmp_path / "vllm", dtype="float32")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    source = load_file(str(tmp_path / "hf" / "model.safetensors"))
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())

    smoothed = fmt != "fp8"
    mla = family == "deepseek_v2"
    attention = {"phi3": ["self_attn.qkv_proj"], "gemma3_text": [f"self_attn.{m}_proj" for m in "qkv"],
                 "gemma2": [f"self_attn.{m}_proj" for m in "qkv"],
                 "deepseek_v2": ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                                 "self_attn.o_proj"]}[family]
    mlp = (["mlp.gate_up_proj", "mlp.down_proj"] if family == "phi3"
           else [f"mlp.{m}_proj" for m in ("gate", "up", "down")])
    experts = [f"mlp.{e}.{m}_proj" for e in (*(f"experts.{i}" for i in range(8)), "shared_experts")
               for m in ("gate", "up", "down")] if mla else mlp
    quantized = [f"model.layers.0.{n}" for n in attention + mlp] + [f"model.layers.1.{n}" for n in attention + experts]
    # o_proj (Phi-3, Gemma 3): 4 query heads share each KV head and want different smoothing, so it is written in
    # high precision. DeepSeek-V2 with INT4 AWQ: ModelOpt folded the shared experts' AWQ scale into the norm that
    # the router and the routed experts (which keep theirs) read too, so the shared experts are written in high
    # precision, exactly
    unfoldable = [f"model.layers.{i}.self_attn.o_proj" for i in range(2)] if smoothed and not mla else \
        [f"model.layers.1.mlp.shared_experts.{m}_proj" for m in ("gate", "up")] if fmt == "int4_awq" else []
    assert facts["dequantized_smoothing_not_foldable"] == unfoldable
    # latent attention's kv_b_proj: in high precision, as vLLM runs it
    kv_b = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(2)] if mla else []
    assert facts["dequantized_kv_b_proj_of_latent_attention"] == kv_b
    quantized = [n for n in quantized if n not in unfoldable + kv_b]
    assert facts["quantized_linears"] == len(quantized) + (2 if not smoothed else 0)
    if smoothed and mla:
        assert facts["smoothing_folded_into"]["kv_b_proj value rows"] == 2  # o_proj's, exactly, in every case
        assert facts["smoothing_folded_into"]["up_proj rows"] == 1 + 8 + 1
        if fmt == "int8_sq":
            assert facts["smoothing_folded_into"] == {"input_layernorm": 2, "kv_b_proj value rows": 2,
                                                      "post_attention_layernorm": 2, "up_proj rows": 1 + 8 + 1}
    elif smoothed:
        mlp_norm = "pre_feedforward_layernorm" if family.startswith("gemma") else "post_attention_layernorm"
        assert facts["smoothing_folded_into"] == {"input_layernorm": 2, mlp_norm: 2, "up_proj rows": 2}
    weight = "weight_packed" if fmt == "int4_awq" else "weight"
    for name in quantized:
        assert f"{name}.{weight}" in state and f"{name}.weight_scale" in state, name
    if family == "phi3":
        assert not any(".q_proj." in k or ".gate_proj." in k for k in state)
        assert config["tie_word_embeddings"] is False and "lm_head" in config["quantization_config"]["ignore"]
    elif mla:
        assert config["quantization_config"]["ignore"] == sorted(unfoldable + kv_b + ["model.layers.1.mlp.gate",
                                                                                     "lm_head"], key=_written_order)
        assert state["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    else:
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm",
                     *(("self_attn.q_norm",) if family == "gemma3_text" else ())):
            key = f"model.layers.1.{norm}.weight"
            assert torch.equal(state[key], source[key].float()), key
        assert config["tie_word_embeddings"] is True and "lm_head.weight" not in state

    want, _ = rebuild_hf(tmp_path / "hf")
    for name in unfoldable + kv_b:  # written in high precision, smoothed: its input no longer rounded
        module = want.get_submodule(name)
        module._forward_pre_hooks.clear()
        if f"{name}.pre_quant_scale" in source:
            smoothing = source[f"{name}.pre_quant_scale"].float()
            module.register_forward_pre_hook(lambda m, a, s=smoothing: (a[0] * s,))
    got = _model_from_export(tmp_path / "vllm", model_dir)
    with torch.no_grad():
        want_logits, got_logits = want(ids).logits, got(ids).logits
    _assert_the_same_model(want_logits, got_logits)


def test_the_calibrated_kv_cache_scales_are_the_ones_vllm_serves_with(tiny_tokenizer_dir, tokens, tmp_path):  # noqa: F811
    """INT8 SmoothQuant with an INT8 KV cache, as the default config calibrates it, exported for vLLM's FP8 KV
    cache: vLLM 0.32 on this CPU loads the export and each attention layer's kernels get the calibrated scales
    (the checkpoint's amax / 448, not vLLM's fallback of 1.0), read back from the model inside vLLM's worker."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from pipeline.engines.vllm import runtime
    from pipeline.engines.vllm.export import export_for_vllm
    from pipeline.errors import EnvironmentProblem

    try:
        python = runtime.serving_python()
    except EnvironmentProblem as e:
        pytest.skip(f"vLLM's serving environment is not installed here ({e})")
    if not runtime.cpu_runs_vllm():
        pytest.skip("vLLM's CPU build keeps no FP8 KV cache without AVX-512 or AMX")
    if runtime.cpu_features().amx:  # seen on a 2-core AMX machine (head sizes 32 and 64 alike). The diagnosis,
        # read from vLLM 0.32's _C.abi3.so and a gdb run with the AMX dispatch forced on a CPU without AMX (not run
        # on an AMX CPU): Linux lets a process run AMX tile instructions only after it asked for the tile state
        # (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), else SIGILL; only oneDNN asks, when it first
        # creates a matmul, which vLLM does for linears of 1 MiB or more. This model's are all smaller (the
        # lm_head, 512 x 128 bf16, is 128 KiB), so vLLM's AMX attention kernel (cpu_attention's TileGemm
        # init_tile_config, taken for bf16 at blocks of 32) is the first AMX user, unasked. Real models' lm_heads
        # are far over 1 MiB (SmolLM2's 56 MB: the e2e test serves its calibrated FP8 KV cache on AMX)
        pytest.skip("on an AMX CPU vLLM 0.32's worker dies of SIGILL (exit -4) at this tiny Llama's first step: "
                    "its AMX attention kernel runs before anything in the process asked Linux for AMX's tile "
                    "state, which oneDNN does only for linears of 1 MiB or more (this model has none)")
    torch.manual_seed(0)  # heads 32 wide: vLLM's CPU attention keeps an FP8 KV cache for those
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, model_dir / f.name)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    e = quantize_and_export(original, "int8_sq", *tokens, {1: tmp_path / "ckpt"}, kv_cache="int8")
    ckpt = load_file(str(e["ckpt"][1] / "rank0.safetensors"))
    # K's and V's own scales (ModelOpt's two quantizers, which the gate measured), as FP8 scales of the same amax
    calibrated = {i: [float(ckpt[f"transformer.layers.{i}.attention.{kv}_cache_scaling_factor"]) * 127 / 448
                      for kv in "kv"] for i in range(2)}
    assert all(abs(s - 1.0) > 1e-3 for kv in calibrated.values() for s in kv), calibrated  # not the fallback

    facts = export_for_vllm(e["ckpt"][1], model_dir, out_dir=tmp_path / "vllm", dtype="bfloat16", kv_scales=True)
    qc = json.loads((tmp_path / "vllm" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                     "dynamic": False}
    assert facts["kv_cache_scales"] == {f"model.layers.{i}.self_attn": pytest.approx(calibrated[i])
                                        for i in range(2)}
    args = {"dtype": "bfloat16", "max_model_len": 128, "max_num_seqs": 2, "max_num_batched_tokens": 128,
            "block_size": 32, "kv_cache_dtype": "fp8", "enforce_eager": True}
    got = runtime.run_worker(python, {"model": str(tmp_path / "vllm"), "engine_args": args, "prompts": [[1, 5, 9]],
                                      "max_tokens": 2, "evaluation": []},
                             {"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path / "worker.log", timeout_s=900)
    assert got["kv_cache"]["dtype"] == "fp8"
    served = got["kv_cache"]["scales"]
    assert set(served) == {f"model.layers.{i}.self_attn.attn" for i in range(2)}, served
    for i in range(2):  # vLLM keeps them in fp32: exact
        assert served[f"model.layers.{i}.self_attn.attn"] == pytest.approx(calibrated[i], rel=1e-6), served
    # without the scales (the export before this fix) vLLM runs the same cache at 1.0
    export_for_vllm(e["ckpt"][1], model_dir, out_dir=tmp_path / "vllm_without", dtype="bfloat16")
    got = runtime.run_worker(python, {"model": str(tmp_path / "vllm_without"), "engine_args": args,
                                      "prompts": [[1, 5, 9]], "max_tokens": 2, "evaluation": []},
                             {"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path / "worker_without.log", timeout_s=900)
    assert all(kv == [1.0, 1.0] for kv in got["kv_cache"]["scales"].values()), got["kv_cache"]
