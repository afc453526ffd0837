"""Layer-streamed quantize (pipeline.quant.streaming) against the in-memory path, on the same plan: the same
checkpoint (config, quant_cfg.json and every tensor bit-equal) and the same accuracy figures, for one format,
a mixed plan, and tensor parallelism; and what a bound too small for streaming gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_config as _tiny_config
from safetensors import safe_open

from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError
from pipeline.runner import Runner
from pipeline.stages import STAGES

pytest.importorskip("modelopt.torch.quantization")

LOOSE = ("quantization.accuracy.max_perplexity_increase_pct=1000", "quantization.accuracy.min_top1_agreement=0",
         "quantization.accuracy.max_kl_divergence=100")
MIXED = ("sensitivity.formats=[int4_awq, int8_sq]", "quantization.weight_format=int4_awq",
         "quantization.awq_group_size=32", "quantization.kv_cache=int8", "sensitivity.threshold=5",
         "plan.rules=[{pattern: lm_head, keep_high_precision: true}, "
         "{pattern: 'model.layers.1.self_attn.[qkv]_proj', format: int8_sq}, "
         "{pattern: 'model.layers.1.mlp.down_proj', format: int8_sq}, "
         "{pattern: 'model.layers.0.mlp.up_proj', keep_high_precision: true}]")


def _quantize(cfg: Path, work: Path, streaming: str, *overrides: str) -> Path:
    Runner(load_config(cfg, [f"compute.layer_streaming={streaming}", *overrides]), STAGES, work).run(
        ["quantize"], echo=lambda _: None)
    return work / "tiny" / "quantize"


def _tensors(ckpt: Path) -> dict:
    out = {}
    for f in sorted(ckpt.glob("rank*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({f"{f.name}:{k}": sf.get_tensor(k) for k in sf.keys()})
    return out


def _bytes(t):
    import torch

    return t.reshape(-1).view(torch.uint8)


def _config(ckpt: Path) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    q = config.get("quantization") or {}
    if "exclude_modules" in q:  # ModelOpt writes list(set(...)): the order is the hash's
        q["exclude_modules"] = sorted(q["exclude_modules"])
    return config


CASES = {
    "int8_sq, int8 KV, kept layers": ("outlier", ("quantization.kv_cache=int8", "sensitivity.threshold=0.1")),
    "fp8, fp8 KV, lm_head quantized": ("tiny", ("quantization.weight_format=fp8", "quantization.kv_cache=fp8",
                                                 "sensitivity.formats=[fp8]", "plan.rules=[]",
                                                 "sensitivity.threshold=5")),
    "mixed int4 AWQ + int8 SQ": ("tiny", MIXED),
    "int8_sq, tensor parallel 2": ("tiny", ("build.target=tensorrt", "build.tensor_parallel_size=2",
                                            "sensitivity.threshold=5")),
    # lm_head kept and tied to the embedding: written once by both paths (pipeline.quant.tied_head)
    "int8_sq, tied embeddings": ("tied", ("sensitivity.threshold=5",)),
}


def _tied_model(tmp_path: Path, tokenizer_dir: Path) -> Path:
    """The tiny Llama's shape with tied word embeddings."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True))
    out = tmp_path / "tied_model"
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_checkpoint_is_bit_equal_to_the_in_memory_one(tmp_path, tiny_model_dir, outlier_model_dir, case):
    which, overrides = CASES[case]
    model = {"outlier": outlier_model_dir, "tiny": tiny_model_dir}.get(which) or _tied_model(tmp_path, tiny_model_dir)
    cfg = _tiny_config(tmp_path, model)
    whole = _quantize(cfg, tmp_path / "whole", "never", *overrides, *LOOSE)
    streamed = _quantize(cfg, tmp_path / "streamed", "always", *overrides, *LOOSE)
    a, b = whole / "trtllm_checkpoint", streamed / "trtllm_checkpoint"
    assert _config(a) == _config(b)
    assert (a / "quant_cfg.json").is_file() == (b / "quant_cfg.json").is_file()
    if (a / "quant_cfg.json").is_file():
        assert json.loads((a / "quant_cfg.json").read_text()) == json.loads((b / "quant_cfg.json").read_text())
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    unequal = [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
               or not _bytes(ta[k]).equal(_bytes(tb[k]))]
    assert not unequal, unequal[:5]
    sa = json.loads((whole / "manifest.json").read_text())["summary"]
    sb = json.loads((streamed / "manifest.json").read_text())["summary"]
    assert sb["layer_streaming"] is True and sa["layer_streaming"] is False
    for key in ("perplexity_original", "perplexity_quantized", "top1_agreement", "kl_divergence", "tokens"):
        assert sb["accuracy"][key] == sa["accuracy"][key], key
    for key, value in sa["accuracy"]["from_checkpoint"].items():
        assert sb["accuracy"]["from_checkpoint"][key] == value, key
    assert sb["checkpoint"]["read_back"] == sa["checkpoint"]["read_back"]
    assert sb["checkpoint"]["lm_head_shares_embedding"] is sa["checkpoint"]["lm_head_shares_embedding"] is \
        (which == "tied")
    assert not (streamed / "layer_exports").exists()
    # the greedy generations, both models streamed: the original model's text is the in-memory run's
    ga = json.loads((whole / "accuracy.json").read_text())["generations"]
    gb = json.loads((streamed / "accuracy.json").read_text())["generations"]
    assert len(gb) == 3 and [g["original"] for g in gb] == [g["original"] for g in ga]
    assert all(g["quantized"] for g in gb)


def test_a_bound_too_small_for_the_whole_model_streams_and_one_too_small_for_a_layer_is_refused(
        tmp_path, tiny_model_dir):
    """A bound below the in-memory estimate streams (auto), or is refused (never); one below a decoder layer
    (the tiny model's is 0.1 MB) is refused before any work, naming the layer's size."""
    from pipeline import compute
    from pipeline.quant.memory import check_host_memory, quantize_streams

    cfg = load_config(_tiny_config(tmp_path, tiny_model_dir)).config
    need = check_host_memory(tiny_model_dir, cfg.quantization, compute.Bound(2**40, "x"),
                             cfg.text.evaluation.seq_len)
    assert quantize_streams(tiny_model_dir, cfg, compute.Bound(need, "test")) is False
    assert quantize_streams(tiny_model_dir, cfg, compute.Bound(need - 1, "test")) is True
    never = cfg.model_copy(update={"compute": cfg.compute.model_copy(update={"layer_streaming": "never"})})
    with pytest.raises(InputError, match="layer_streaming"):
        quantize_streams(tiny_model_dir, never, compute.Bound(need - 1, "test"))
    with pytest.raises(ConfigError, match="one decoder layer of this model is"):
        quantize_streams(tiny_model_dir, cfg, compute.Bound(50_000, "test"))
    hf = cfg.model_copy(update={"quantization": cfg.quantization.model_copy(update={"export_hf_checkpoint": True})})
    with pytest.raises(InputError, match="HF unified checkpoint"):
        quantize_streams(tiny_model_dir, hf, compute.Bound(need - 1, "test"))
    tasks = load_config(_tiny_config(tmp_path, tiny_model_dir), [
        f'quantization.accuracy.tasks=[{{name: t, path: "{tiny_model_dir}"}}]']).config
    with pytest.raises(InputError, match="does not fit the memory bound .* quantization.accuracy.tasks scores the "
                                         "whole original and quantized models"):
        quantize_streams(tiny_model_dir, tasks, compute.Bound(need - 1, "test"))


def test_the_read_back_takes_the_reference_in_a_gpus_bfloat16(tmp_path, tiny_model_dir):
    """On a GPU the streamed pass's reference (the original's final hidden states) is in bfloat16, the reference
    dtype there, and the read-back's head in float32: seen on an H200, the product refused the mix. The same
    read-back here on the CPU, with the reference in both dtypes, against the in-memory path's figures."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline import artifacts
    from pipeline.quant import streaming
    from pipeline.records import read_plan

    out = _quantize(_tiny_config(tmp_path, tiny_model_dir), tmp_path / "w", "never", *LOOSE)
    work = out.parent
    evals = load_file(str(work / "text" / artifacts.EVALUATION_TOKENS_FILE))[artifacts.TOKENS_KEY]
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        hidden = model.model(evals).last_hidden_state
    table = json.loads((work / "sensitivity" / artifacts.SENSITIVITY_TABLE_JSON).read_text())
    names = [l["name"] for l in table["layers"]]
    kept = set(read_plan(work / "plan" / artifacts.PLAN_FILE, names).kept_high_precision())
    ckpt = out / artifacts.TRTLLM_CHECKPOINT_DIR
    fp32, _ = streaming.read_back_streamed(ckpt, tiny_model_dir, kept=kept, evals=evals, reference_final_hidden=hidden,
                                           device="cpu")
    bf16, _ = streaming.read_back_streamed(ckpt, tiny_model_dir, kept=kept, evals=evals,
                                           reference_final_hidden=hidden.to(torch.bfloat16), device="cpu")
    whole = json.loads((out / "manifest.json").read_text())["summary"]["accuracy"]["from_checkpoint"]
    assert fp32["perplexity_quantized"] == bf16["perplexity_quantized"] == whole["perplexity_quantized"]
    assert fp32["perplexity_original"] == pytest.approx(bf16["perplexity_original"], rel=0.01)
