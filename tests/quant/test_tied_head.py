"""One copy of a tied embedding (pipeline.quant.tied_head): ModelOpt writes a tied model's lm_head as a second
copy of the embedding; the stage drops it where TensorRT-LLM reads the checkpoint without it
(tests/data/upstream/trtllm_shared_embedding.json), and the checkpoint still computes the same logits."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import tiny_config
from safetensors import safe_open
from upstream_facts import upstream

from pipeline.config import load_config
from pipeline.quant.tied_head import EMBEDDING, HEAD, share_tied_embedding
from pipeline.runner import Runner
from pipeline.stages import STAGES

pytest.importorskip("modelopt.torch.quantization")

LOOSE = ("quantization.accuracy.max_perplexity_increase_pct=1000", "quantization.accuracy.min_top1_agreement=0",
         "quantization.accuracy.max_kl_divergence=100")


def _tied_llama(tmp_path, tiny_tokenizer_dir, tied=True):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=tied))
    out = tmp_path / ("tied_model" if tied else "untied_model")
    model.save_pretrained(out, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return model, out


def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_a_tied_lm_head_is_written_once_and_the_checkpoint_computes_the_same_logits(tmp_path, tiny_tokenizer_dir):
    """ModelOpt's export over two ranks (the embedding and lm_head both split on the vocabulary): lm_head is a
    byte copy of the embedding on each rank; after the drop each rank file is smaller by exactly that tensor,
    every other tensor is unchanged, and the rebuilt model's logits are the same to the bit."""
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from pipeline.quant.checkpoint import rebuild

    model, model_dir = _tied_llama(tmp_path, tiny_tokenizer_dir)
    before = tmp_path / "before"
    with torch.no_grad():
        export_tensorrt_llm_checkpoint(model.eval(), "llama", torch.float16, export_dir=before,
                                       inference_tensor_parallel=2)
    assert json.loads((before / "config.json").read_text())["share_embedding_table"] is False
    after = tmp_path / "after"
    shutil.copytree(before, after)
    found = share_tied_embedding(after, json.loads((model_dir / "config.json").read_text()))
    assert found["lm_head_shares_embedding"] is True
    for rank in ("rank0.safetensors", "rank1.safetensors"):
        old, new = _tensors(before / rank), _tensors(after / rank)
        assert torch.equal(old[HEAD], old[EMBEDDING]) and old[HEAD].shape == (256, 64)
        assert set(old) - set(new) == {HEAD}
        assert all(torch.equal(old[k], new[k]) for k in new)
        assert (before / rank).stat().st_size - (after / rank).stat().st_size >= old[HEAD].numel() * 2
    assert found["bytes_saved"] == 2 * 256 * 64 * 2
    assert json.loads((after / "config.json").read_text())["share_embedding_table"] is True
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [rebuild(ckpt, model_dir)[0](ids).logits for ckpt in (before, after)]
    assert torch.equal(logits[0], logits[1])
    # upstream reads it so: a missing lm_head is allowed beside vocab_embedding, and build shares the table
    facts = upstream("trtllm_shared_embedding.json")
    assert facts["load_exemption"]["missing_allowed"] == HEAD
    assert facts["load_exemption"]["when_present"] == "vocab_embedding.weight"


def test_an_untied_or_quantized_lm_head_stays(tmp_path, tiny_tokenizer_dir):
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    model, model_dir = _tied_llama(tmp_path, tiny_tokenizer_dir, tied=False)
    ckpt = tmp_path / "untied"
    with torch.no_grad():
        export_tensorrt_llm_checkpoint(model.eval(), "llama", torch.float16, export_dir=ckpt,
                                       inference_tensor_parallel=1)
    size = (ckpt / "rank0.safetensors").stat().st_size
    found = share_tied_embedding(ckpt, json.loads((model_dir / "config.json").read_text()))
    assert found == {"lm_head_shares_embedding": False, "bytes_saved": 0,
                     "why": "the model does not tie its embeddings"}
    assert (ckpt / "rank0.safetensors").stat().st_size == size
    # a tied model whose lm_head was changed (quantized, or smoothed) is not a copy: it stays
    tensors = _tensors(ckpt / "rank0.safetensors")
    tensors[HEAD] = tensors[EMBEDDING] * 1.5
    from safetensors.torch import save_file

    save_file(tensors, str(ckpt / "rank0.safetensors"))
    found = share_tied_embedding(ckpt, {"tie_word_embeddings": True})
    assert found["lm_head_shares_embedding"] is False and "differs" in found["why"]
    assert HEAD in _tensors(ckpt / "rank0.safetensors")


def test_the_quantize_stage_writes_a_tied_model_at_the_size_the_plan_counts(tmp_path, tiny_tokenizer_dir):
    """INT8 SmoothQuant with lm_head kept (the embedded default's plan): the checkpoint holds the plan's linears
    (lm_head among them, stored once as the embedding) and small tensors (norms, scales), and says so."""
    _, model_dir = _tied_llama(tmp_path, tiny_tokenizer_dir)
    cfg = tiny_config(tmp_path, model_dir)
    work = tmp_path / "work"
    Runner(load_config(cfg, ["build.target=tensorrt", *LOOSE]), STAGES, work).run(["quantize"], echo=lambda _: None)
    ckpt = work / "tiny" / "quantize" / "trtllm_checkpoint"
    assert HEAD not in _tensors(ckpt / "rank0.safetensors")
    summary = json.loads((work / "tiny" / "quantize" / "manifest.json").read_text())["summary"]
    facts = summary["checkpoint"]
    assert facts["lm_head_shares_embedding"] is True and facts["embedding_bytes"] == 512 * 64 * 2
    plan = json.loads((work / "tiny" / "plan" / "manifest.json").read_text())["summary"]
    planned = plan["weight_bytes_planned"]
    # on this 2-layer model the norms and per-channel scales are 10 % of the bytes; on SmolLM2 under 1 %
    assert planned <= summary["checkpoint_bytes"] <= 1.15 * planned
