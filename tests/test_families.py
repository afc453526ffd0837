"""The model families beyond Llama (pipeline/families.py), each as a tiny random-weight model built from the
family's real config shape (no network): the whole stage chain through verify on a real Triton server (cpu
target), the checkpoint reader's rebuilt model against ModelOpt's simulated one, and the CPU runtime's greedy
tokens against the rebuilt model's. Refusals: a family outside the table, a target that cannot serve one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_invoke, tiny_config

from pipeline import artifacts, families
from pipeline.errors import InputError

pytest.importorskip("modelopt.torch.quantization")
pytest.importorskip("pytriton", reason="nvidia-pytriton provides the server")

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], [8, 8, 8, 9, 10, 11, 400, 401, 402, 20, 21]]


def _qwen2():
    """Qwen2.5-0.5B's shape, scaled down: q/k/v biases, tied word embeddings, GQA."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True))
    for layer in model.model.layers:  # random init leaves biases at 0: give them weight, as trained ones have
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data.normal_(0.0, 0.5)
    return model


def _qwen3():
    """Qwen3-0.6B's shape, scaled down: per-head q/k RMSNorms, a head size that is not hidden / heads, tied
    word embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                         tie_word_embeddings=True))
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.data.normal_(1.0, 0.2)
        layer.self_attn.k_norm.weight.data.normal_(1.0, 0.2)
    return model


MAKERS = {"qwen2": _qwen2, "qwen3": _qwen3}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def verified(request, tmp_path_factory, tiny_tokenizer_dir):
    """`invoke verify` on the family's tiny model: (family, its work dir)."""
    import torch

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp(request.param)
    model_dir = root / "model"
    MAKERS[request.param]().save_pretrained(model_dir, safe_serialization=True)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy2(f, model_dir / f.name)
    cfg = tiny_config(root, model_dir)
    proc = run_invoke("verify", "--config", str(cfg), "--work-root", str(root / "work"), timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return request.param, root / "work" / "tiny"


def _summary(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "manifest.json").read_text())["summary"]


def test_every_stage_through_verify_on_a_real_server(verified):
    family, work = verified
    verify = _summary(work, "verify")
    assert verify["all_ok"] and verify["checks"] >= 7, verify
    table = json.loads((work / "sensitivity" / artifacts.SENSITIVITY_TABLE_JSON).read_text())
    assert table["model"]["model_type"] == family


def test_the_rebuilt_checkpoint_computes_what_modelopt_simulated(verified):
    """The reader's model (biases, q/k norms and tied embeddings read back) against ModelOpt's simulated
    quantized model, on the same evaluation tokens: the same perplexity to 0.1 % and the same top-1 tokens
    but for near-ties (the export rounds weights to fp16)."""
    _, work = verified
    acc = _summary(work, "quantize")["accuracy"]
    rebuilt = acc["from_checkpoint"]
    assert abs(rebuilt["perplexity_quantized"] - acc["perplexity_quantized"]) <= 1e-3 * acc["perplexity_quantized"]
    assert rebuilt["top1_agreement"] >= 0.98 and rebuilt["kl_divergence"] < 1e-4, acc


def test_the_cpu_runtime_gives_the_rebuilt_models_greedy_tokens(verified):
    from pipeline.engines import reference
    from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams

    _, work = verified
    bundle = work / "build" / "cpu_bundle"
    model, algo, scales = reference.load_reference(bundle)
    params = SamplingParams(max_new_tokens=12, end_id=-1)
    with CpuRuntime.load(bundle) as rt:
        batched = [r.result(timeout=120) for r in [rt.submit(p, params) for p in PROMPTS]]
        solo = [rt.generate(p, params) for p in PROMPTS]
    for p, s, b in zip(PROMPTS, solo, batched):
        want = reference.greedy(model, p, 12, algo, scales)
        assert reference.compare(s, want)["equal"], (p, s, want.tokens)
        assert reference.compare(b, want)["ok"], (p, b, want.tokens)


def test_a_family_outside_the_table_and_a_target_that_cannot_serve_one_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(InputError, match=r"'gemma2' is not a supported family; supported: llama"):
        families.family("gemma2")
    with pytest.raises(InputError, match="the vllm target cannot serve qwen2 .*use build.target tensorrt or "
                                         "pytorch or cpu"):
        families.family("qwen2", "vllm")
    assert families.family("qwen3", "cpu").decoder_type == "qwen"
    # at the first stage that reads the model, before any compute
    model_dir = tmp_path / "gemma"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    proc = run_invoke("sensitivity", "--config", str(tiny_config(tmp_path, model_dir)), "--work-root",
                      str(tmp_path / "work"), timeout=600)
    assert proc.returncode != 0 and "model type 'gemma2' is not a supported family" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
