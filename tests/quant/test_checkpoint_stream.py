"""CheckpointReader, the layer-at-a-time reader under pipeline.quant.checkpoint.rebuild: a forward that reads one
decoder layer at a time gives the logits of the whole rebuilt model, and tensors nothing read are refused.
Checkpoints are real ModelOpt exports of the tiny Llama (calibration and export on the CPU, a second each)."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
mtq = pytest.importorskip("modelopt.torch.quantization")

from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline import records  # noqa: E402
from pipeline.config import QuantizationSection  # noqa: E402
from pipeline.errors import IntegrityError  # noqa: E402
from pipeline.formats import HIGH_PRECISION  # noqa: E402
from pipeline.quant.checkpoint import CheckpointReader, rebuild  # noqa: E402
from pipeline.quant.recipe import calibrate_phase, calibration_phases, modelopt_config  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# case -> (base format, format of layer 1's down_proj, lm_head's format, KV cache, tp, tied word embeddings:
# no lm_head in the checkpoint)
CASES = {
    "int8_sq, quantized lm_head, int8 kv": ("int8_sq", None, "int8_sq", "int8", 1, False),
    "int4_awq + int8_sq, tp 2": ("int4_awq", "int8_sq", HIGH_PRECISION, "none", 2, False),
    "fp8, tied embeddings, tp 2": ("fp8", None, HIGH_PRECISION, "fp8", 2, True),
}


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 512, (4, 32), generator=g), torch.randint(3, 512, (2, 24), generator=g)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, ids, tmp_path_factory):
    """case -> (checkpoint dir, HF model dir, the plan's kept layers), exported on first use."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple] = {}

    def get(case: str):
        if case in cache:
            return cache[case]
        base, other, head, kv, tp, tied = CASES[case]
        model_dir = tiny_model_dir
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        if tied:
            model_dir = tmp_path_factory.mktemp("tied_model")
            model.config.tie_word_embeddings = True
            model.tie_weights()
            model.save_pretrained(model_dir, safe_serialization=True)
        layers = {f"model.layers.{i}.{m}": {"format": base} for i in range(2) for m in LINEARS}
        layers |= {"lm_head": {"format": head}, "model.layers.0.mlp.down_proj": {"format": HIGH_PRECISION}}
        if other:
            layers["model.layers.1.mlp.down_proj"] = {"format": other}
        plan = records.Plan.model_validate({"format_version": records.PLAN_FORMAT_VERSION, "layers": layers})
        quant = QuantizationSection(weight_format=base, kv_cache=kv, awq_group_size=32)

        def loop(m):
            for b in range(0, ids[0].shape[0], 2):
                m(ids[0][b:b + 2])

        out = tmp_path_factory.mktemp("ckpt")
        with torch.no_grad():
            mtq.quantize(model, modelopt_config(plan, quant), loop)
            for algorithm, names in calibration_phases(plan, quant):
                calibrate_phase(model, algorithm, names, loop)
            export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=out, inference_tensor_parallel=tp)
        if tied:  # ModelOpt writes lm_head all the same; a checkpoint that shares the embedding table does not
            for rank in out.glob("rank*.safetensors"):
                tensors = load_file(str(rank))
                del tensors["lm_head.weight"]
                save_file(tensors, str(rank))
        cache[case] = out, model_dir, {n for n, e in layers.items() if e["format"] == HIGH_PRECISION}
        return cache[case]

    return get


def _streamed_logits(reader: CheckpointReader, ids):
    """The forward of sensitivity.analyse: embedding, one decoder layer at a time (built on the meta device,
    discarded after use), the final norm, lm_head."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    config = reader.hf_config
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    embed = reader.embedding()
    hidden = embed[ids]
    rotary = type(skeleton.model.rotary_emb)(config=config)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    cos, sin = rotary(hidden, positions)
    for i, layer in enumerate(skeleton.model.layers):
        reader.load_layer(i, layer)
        hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        layer.to("meta")
    norm = skeleton.model.norm.to_empty(device="cpu")
    norm.weight.copy_(reader.final_norm())
    hidden = norm(hidden)
    head, transform = reader.lm_head(tied_embedding=embed)
    return F.linear(hidden if transform is None else transform(hidden), head)


@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_at_a_time_gives_the_logits_of_the_rebuilt_model(case, checkpoint, ids):
    """The same weights and the same operations in the same order: bit for bit the same logits."""
    ckpt, model_dir, kept = checkpoint(case)
    model, facts = rebuild(ckpt, model_dir, kept)
    reader = CheckpointReader(ckpt, model_dir, kept)
    with torch.no_grad():
        want = model(ids[1]).logits
        got = _streamed_logits(reader, ids[1])
    assert torch.equal(got, want)
    assert reader.finish() == facts
    base, other, head, kv, tp, tied = CASES[case]
    assert facts["tp_size"] == tp and facts["kv_scales"] == (0 if kv == "none" else 2 * 3)  # k, v, kv per layer
    assert facts["quantized_linears"] + facts["high_precision_linears"] == 2 * 7 + (not tied)
    assert bool(model.lm_head._forward_pre_hooks) == (head != HIGH_PRECISION)


def test_a_layer_read_again_into_the_same_module_keeps_one_hook_and_the_facts(checkpoint, ids):
    from transformers import AutoModelForCausalLM

    ckpt, model_dir, kept = checkpoint("int8_sq, quantized lm_head, int8 kv")
    reader = CheckpointReader(ckpt, model_dir, kept)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(reader.hf_config).model.layers[1]
    x = torch.randn(1, 8, reader.hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reader.load_layer(1, layer).mlp(x)
        assert reader.load_layer(1, layer) is layer
        assert torch.equal(layer.mlp(x), want)
    assert all(len(m._forward_pre_hooks) == (1 if n.endswith("_proj") else 0) for n, m in layer.named_modules())
    assert reader.facts["quantized_linears"] == 7 and reader.facts["kv_scales"] == 3


def test_a_tensor_nothing_reads_is_refused_by_finish(checkpoint, ids, tmp_path):
    ckpt, model_dir, kept = checkpoint("int4_awq + int8_sq, tp 2")
    bad = tmp_path / "extra"
    shutil.copytree(ckpt, bad)
    tensors = load_file(str(bad / "rank1.safetensors"))
    tensors["transformer.layers.1.attention.rotary_table"] = torch.zeros(3)
    save_file(tensors, str(bad / "rank1.safetensors"))
    reader = CheckpointReader(bad, model_dir, kept)
    with torch.no_grad():
        _streamed_logits(reader, ids[1])  # every piece reads fine
    with pytest.raises(IntegrityError, match=r"tensors this reader does not know: "
                                             r"\['transformer\.layers\.1\.attention\.rotary_table'\]"):
        reader.finish()
    with pytest.raises(IntegrityError, match="rotary_table"):
        rebuild(bad, model_dir, kept)
    unread = CheckpointReader(ckpt, model_dir, kept)  # a piece the caller never asked for
    unread.embedding()
    unread.final_norm()
    unread.lm_head()
    with pytest.raises(IntegrityError, match=r"does not know: \['transformer\.layers\.0\.attention\.dense\."):
        unread.finish()


def test_the_reader_checks_the_mapping_on_opening(checkpoint, tmp_path):
    ckpt, model_dir, _ = checkpoint("int4_awq + int8_sq, tp 2")
    bad = tmp_path / "pp"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["mapping"].update(pp_size=2, world_size=4)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(IntegrityError, match=r"pipeline-parallel checkpoints \(pp_size 2\) cannot be read back"):
        CheckpointReader(bad, model_dir)
