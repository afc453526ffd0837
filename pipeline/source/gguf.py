"""GGUF file -> a normal HF folder (safetensors, config, tokenizer), checked against the GGUF itself.

transformers dequantizes GGUF weights into a regular model; what needs care is what it gets wrong or
leaves out (transformers 4.57):
- the tokenizer it builds adds a BOS token even when the GGUF says ``tokenizer.ggml.add_bos_token: false``
  (SmolLM2's does), and its slow-tokenizer save path writes a bogus ``tokenizer.model``. We save a plain
  fast tokenizer (``tokenizer.json``) whose pre/post-processing follows the GGUF metadata;
- special tokens and the chat template are taken from the GGUF metadata;
- the model is re-created from a clean config (no GGUF leftovers) and saved with tied embeddings re-tied.
The result is verified, not assumed: every tensor equals the GGUF-loaded one bit for bit, token pieces
equal the GGUF vocabulary's, and greedy generations of the saved folder equal the GGUF-loaded model's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline import console
from pipeline.errors import InputError, StageFailed

log = logging.getLogger(__name__)

# Probe texts for the tokenizer and generation checks: prose, code, digits, whitespace, non-ASCII.
PROBE_TEXTS = (
    "The capital of France is",
    "def add(a, b):\n    return a + b  # 42 apples, 3.14159\n",
    "  Leading spaces, naïve café, 東京, emoji 🙂 and tabs\tend.",
)
GREEDY_PROMPTS = ("The capital of France is", "Once upon a time, there was")
GREEDY_NEW_TOKENS = 16


def read_gguf_metadata(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means the file is not usable GGUF
        raise InputError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    def value(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:  # noqa: BLE001
            return default

    tokens = value("tokenizer.ggml.tokens", [])
    return {
        "architecture": value("general.architecture"),
        "name": value("general.name"),
        "license": value("general.license"),
        "tokenizer_model": value("tokenizer.ggml.model"),
        "add_bos_token": bool(value("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(value("tokenizer.ggml.add_eos_token", False)),
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "unk_token_id": value("tokenizer.ggml.unknown_token_id"),
        "pad_token_id": value("tokenizer.ggml.padding_token_id"),
        "chat_template": value("tokenizer.chat_template"),
        "context_length": value(f"{value('general.architecture')}.context_length"),
        "tokens": tokens,
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
    }


def _token(meta: dict, key: str) -> str | None:
    idx = meta.get(key)
    return meta["tokens"][idx] if idx is not None and 0 <= idx < len(meta["tokens"]) else None


def _fixed_tokenizer(gguf_tok, meta: dict):
    """A PreTrainedTokenizerFast over the GGUF vocabulary whose special-token handling follows the GGUF."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = gguf_tok.backend_tokenizer
    bos, eos = _token(meta, "bos_token_id"), _token(meta, "eos_token_id")
    single, special = "$A", []
    if meta["add_bos_token"] and bos is not None:
        single = f"{bos} {single}"
        special.append((bos, meta["bos_token_id"]))
    if meta["add_eos_token"] and eos is not None:
        single = f"{single} {eos}"
        special.append((eos, meta["eos_token_id"]))
    steps = [processors.TemplateProcessing(single=single, pair=f"{single} $B", special_tokens=special)]
    if meta["tokenizer_model"] == "gpt2":
        steps.insert(0, processors.ByteLevel(trim_offsets=False))
    backend.post_processor = processors.Sequence(steps)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token(meta, "unk_token_id"),
        pad_token=_token(meta, "pad_token_id"),
        chat_template=meta["chat_template"],
        model_max_length=int(meta["context_length"] or 2048),
        clean_up_tokenization_spaces=False,
    )


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Write an HF folder for gguf_path into out_dir; return the checks' figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    meta = read_gguf_metadata(gguf_path)
    log.info("GGUF %s: architecture %s, tensor types %s", gguf_path.name, meta["architecture"], meta["tensor_types"])
    folder, name = str(gguf_path.parent), gguf_path.name
    steps = console.Step("model: load the GGUF", total=3)
    try:
        gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise InputError(
            f"transformers cannot load {gguf_path.name} (architecture {meta['architecture']!r}): {e}"
        ) from None
    gguf_model.eval()

    # A clean model from a clean config: no GGUF quantization leftovers, no source path baked in.
    steps.advance(what="model: write the HF folder")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    if hasattr(config, "_model_name_or_path"):  # general.name from the GGUF, not a path we want recorded
        del config._model_name_or_path
    config.bos_token_id, config.eos_token_id = meta["bos_token_id"], meta["eos_token_id"]
    config.pad_token_id = meta["pad_token_id"]
    config.dtype = torch.float32
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=meta["bos_token_id"], eos_token_id=meta["eos_token_id"], pad_token_id=meta["pad_token_id"]
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = _fixed_tokenizer(gguf_tok, meta)
    tokenizer.save_pretrained(out_dir)
    del model

    steps.advance(what="model: check the conversion (tensors, tokenizer, greedy outputs)")
    checks = verify_conversion(out_dir, gguf_model, gguf_tok, meta)
    steps.stop()
    return {"gguf": {k: v for k, v in meta.items() if k != "tokens"} | {"vocab_size": len(meta["tokens"])},
            "checks": checks}


def verify_conversion(out_dir: Path, gguf_model, gguf_tok, meta: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out_dir)

    ref_state, got_state = gguf_model.state_dict(), saved.state_dict()
    if set(ref_state) != set(got_state):
        raise StageFailed(f"GGUF conversion: tensor names differ: {sorted(set(ref_state) ^ set(got_state))[:5]}")
    unequal = [k for k in ref_state if not torch.equal(ref_state[k], got_state[k])]
    if unequal:
        raise StageFailed(f"GGUF conversion: {len(unequal)} tensors differ from the GGUF's, e.g. {unequal[:3]}")

    drop_bos = not meta["add_bos_token"]
    for text in PROBE_TEXTS:
        ids = tok(text).input_ids
        gguf_ids = gguf_tok(text).input_ids
        if drop_bos and gguf_ids[:1] == [meta["bos_token_id"]]:
            gguf_ids = gguf_ids[1:]  # transformers' GGUF tokenizer adds BOS against the file's metadata
        if ids != gguf_ids:
            raise StageFailed(f"GGUF conversion: tokenization of {text!r} differs: {ids[:8]} vs {gguf_ids[:8]}")
        pieces = tok.convert_ids_to_tokens(ids)
        vocab = [meta["tokens"][i] for i in ids]
        if pieces != vocab:
            raise StageFailed(f"GGUF conversion: token pieces of {text!r} differ from the GGUF vocabulary")
        if tok.decode(ids) != text:
            raise StageFailed(f"GGUF conversion: decode(encode({text!r})) does not round-trip")

    generations = {}
    with torch.no_grad():
        for prompt in console.track(GREEDY_PROMPTS, "model: greedy outputs, GGUF against HF"):
            ids = torch.tensor([tok(prompt).input_ids])
            args = dict(max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids),
                        pad_token_id=meta["pad_token_id"])
            ours = saved.generate(ids, **args)[0].tolist()
            ref = gguf_model.generate(ids, **args)[0].tolist()
            if ours != ref:
                raise StageFailed(f"GGUF conversion: greedy output for {prompt!r} differs from the GGUF model's")
            generations[prompt] = tok.decode(ours[ids.shape[1]:])
    return {
        "tensors_compared": len(ref_state),
        "tensors_bit_equal": True,
        "tokenizer_probes_equal": len(PROBE_TEXTS),
        "bos_added_by_transformers_dropped": drop_bos,
        "greedy_generations_equal": generations,
    }
