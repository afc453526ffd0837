"""Layer-streamed quantize: calibration, accuracy gate, export and read-back one decoder layer at a time.

The in-memory path (quantize.py) holds the whole model in fp32 three or four times. A model that does not
fit the host memory bound so (or any model, with ``compute.layer_streaming: always``) is streamed instead,
with the same ModelOpt calibration and the same ModelOpt export, and never more than one decoder layer's
weights in memory:

1. the model is a skeleton on the meta device; a decoder layer's weights are read from the safetensors files
   when its turn comes and dropped after (``WeightStore``);
2. one pass over the layers, holding the hidden states of the calibration set and of the evaluation set
   (an original and a quantized stream). For layer i:
   - its original outputs for the calibration and the evaluation sets (the next layer's inputs:
     calibration sees full-precision activations, as in ModelOpt's whole-model calibration, where the
     quantizers only collect statistics);
   - ModelOpt quantizes it (``mtq.quantize`` with the plan's config, then the calibration phases of a plan
     that mixes formats) on its calibration inputs, in batches of gate.EVAL_BATCH as the whole-model
     loop runs them. The layer sits in a holder whose module names are the model's
     (``model.layers.<i>....``), so the plan's per-layer entries match unchanged. Each phase has its own
     calibration stream: in the whole-model calibration, phase k sees the model as the phases before it
     left it (an AWQ phase rescales weights: the same function, other roundings), quantizers paused;
   - the quantized layer advances the quantized evaluation stream;
   - ModelOpt exports it: ``export_tensorrt_llm_checkpoint`` of a one-layer model of the same config
     holding it (a vocabulary of EXPORT_VOCAB rows, dropped; the last layer's export carries the real
     embedding, final norm and lm_head), into a scratch folder;
3. lm_head is calibrated on the final norm of the calibration stream, before the last export; the gate
   compares the two evaluation streams' logits batch by batch (nothing reaches the checkpoint folder if it
   fails);
4. the checkpoint: each rank file is the per-layer exports' tensors renamed to their layer and copied byte
   for byte, one at a time (``concat_safetensors``); config.json is the last export's with the model's layer
   count, and the quantization section that ModelOpt's own ``process_layer_quant_config`` makes of every
   layer's format (quant_cfg.json for a mixed plan);
5. the read-back: a second pass over the written checkpoint (``checkpoint.CheckpointReader``), in a second
   child process (quantize.run_stage) so that the first pass's heap does not add to its peak.

The streamed checkpoint is bit-equal to the in-memory one: every tensor, config.json, quant_cfg.json and the
accuracy figures, on SmolLM2's default config and in tests/quant/test_streaming.py (INT8 SmoothQuant, FP8 with
lm_head quantized, mixed INT4 AWQ + INT8 SmoothQuant, tensor parallelism 2). The stage log names the peak RSS
after each layer and step.
The greedy generations for reading compare the original model and the written checkpoint, both with their
decoder layers streamed (``streamed_original``, ``checkpoint.rebuild(streamed=True)``).
Not streamed yet: the HF unified checkpoint (refused with layer streaming).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from pipeline import families
from pipeline.compute import return_freed_memory_to_the_os, trim_heap
from pipeline.errors import InputError, StageFailed
from pipeline.formats import AWQ_FORMATS
from pipeline.quant import gate, recipe
from pipeline.records import Plan

log = logging.getLogger(__name__)

EXPORT_VOCAB = 64  # the vocabulary of the one-layer models a decoder layer is exported in (a multiple of 64:
#                    ModelOpt pads an AWQ model's vocabulary to one)
LINEAR_MODULES = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1,
                           "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class WeightStore:
    """Reads tensors by name from the model folder's safetensors files, one at a time."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self._open = safe_open
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {k: model_dir / v for k, v in weight_map.items()}
        else:
            self.files = {}
            for f in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():
                        self.files[k] = f

    def get(self, name: str, dtype, device="cpu"):
        if name not in self.files:
            raise InputError(f"tensor {name} is not in the model's safetensors files")
        with self._open(str(self.files[name]), framework="pt") as sf:
            return sf.get_tensor(name).to(device=device, dtype=dtype)

    def head_name(self) -> str:
        """lm_head's weight, or the embedding's when they are tied."""
        return "lm_head.weight" if "lm_head.weight" in self.files else "model.embed_tokens.weight"

    def load_module(self, module, prefix: str, dtype, device="cpu") -> None:
        """Materialise a meta-device module from the files (its parameters only) on ``device``."""
        import torch

        module.to_empty(device=device)
        with torch.no_grad():
            for name, param in module.named_parameters(recurse=True):
                param.copy_(self.get(f"{prefix}.{name}", dtype, device))


def skeleton(config, dtype):
    """The model on the meta device (no memory), for its module tree and its decoder layers."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class Streams:
    """Hidden states of a set of sequences on their way through the decoder layers, with their rotary
    position embeddings; a layer runs over them BATCH sequences at a time."""

    def __init__(self, rotary, hidden, batch: int):
        import torch

        self.hidden, self.batch = hidden, batch
        self.positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        self.pos_emb = rotary(hidden, self.positions)

    def through(self, layer, hidden=None):
        """The layer's outputs for ``hidden`` (default: the stream's own states)."""
        import torch

        hidden = self.hidden if hidden is None else hidden
        out = torch.empty_like(hidden)
        for a in range(0, hidden.shape[0], self.batch):
            y = layer(hidden[a:a + self.batch], attention_mask=None, position_ids=self.positions,
                      position_embeddings=self.pos_emb)
            out[a:a + self.batch] = y[0] if isinstance(y, tuple) else y
        return out


def _holder(**modules):
    """An empty module holding ``modules`` under their names (``model.layers.<i>`` or ``lm_head``), so
    ModelOpt sees the module names of the whole model."""
    import torch.nn as nn

    root = nn.Module()
    for path, module in modules.items():
        parent = root
        *parents, leaf = path.split(".")
        for p in parents:
            if not hasattr(parent, p):
                parent.add_module(p, nn.ModuleDict() if p == "layers" else nn.Module())
            parent = getattr(parent, p)
        if isinstance(parent, nn.ModuleDict):
            parent[leaf] = module
        else:
            parent.add_module(leaf, module)
    return root


@contextlib.contextmanager
def _weights_may_all_stay(yes: bool):
    """ModelOpt refuses a config asking for weight quantization that quantizes no weight of the model it is
    given (a pattern that matches nothing). A decoder layer the plan keeps whole in high precision is such a
    model here, legitimately (its KV-cache quantizers still calibrate): its own switch, for that call only."""
    key = "MODELOPT_SKIP_WEIGHT_QUANT_CHECK"
    before = os.environ.get(key)
    if yes:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if yes:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before


# ---------------------------------------------------------------- safetensors, streamed


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {"header": header, "data_start": 8 + n}


def concat_safetensors(parts: Sequence[tuple[Path, Callable[[str], Optional[str]]]], dest: Path) -> int:
    """One safetensors file of the tensors of ``parts`` [(file, rename)], each renamed by ``rename`` (None:
    left out), copied byte for byte one at a time (never more than one tensor in memory). Tensors are laid out
    widest dtype first, then by name, so each starts aligned to its element size. Returns the tensor count."""
    entries = []
    for path, rename in parts:
        h = safetensors_header(path)
        for name, meta in h["header"].items():
            new = rename(name)
            if new is not None:
                start, end = meta["data_offsets"]
                entries.append((new, path, h["data_start"] + start, end - start, meta))
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise StageFailed(f"assembling {dest.name}: a tensor name appears twice")
    entries.sort(key=lambda e: (-SAFETENSORS_DTYPE_BYTES[e[4]["dtype"]], e[0]))
    header, offset = {}, 0
    for new, _, _, size, meta in entries:
        header[new] = {"dtype": meta["dtype"], "shape": meta["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(dest, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for _, path, start, size, _ in entries:
            with open(path, "rb") as src:
                src.seek(start)
                shutil.copyfileobj(_Limited(src, size), out, 16 << 20)
    return len(entries)


class _Limited:
    """A file object that reads at most ``left`` bytes of ``f``."""

    def __init__(self, f, left: int):
        self.f, self.left = f, left

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


# ---------------------------------------------------------------- the checkpoint's config, from the layers


def module_formats(export_dir: Path, modules: list[str]) -> dict[str, tuple[Optional[str], Optional[int]]]:
    """{module: (ModelOpt format name or None, AWQ group size)} of an export, as its config says."""
    from pipeline.formats import FORMAT_OF_ALGO
    from pipeline.quant.checkpoint import _layer_formats as layer_formats

    qcfg = json.loads((export_dir / "config.json").read_text()).get("quantization") or {}
    fmt = layer_formats(export_dir, qcfg)
    out: dict[str, tuple[Optional[str], Optional[int]]] = {}
    for m in modules:
        algo, group = fmt(m)
        out[m] = (None, None) if algo is None else (FORMAT_OF_ALGO[algo].name, group)
    return out


def quantization_section(formats: dict[str, tuple[Optional[str], Optional[int]]], kv_cache_quant_algo,
                         shared_embedding: bool):
    """config.json's quantization section and quant_cfg.json (None unless mixed) for the whole model, made by
    ModelOpt's own process_layer_quant_config from every module's format, then completed as its
    convert_to_tensorrt_llm_config does: the first layer's KV-cache format, and lm_head excluded when it is
    the shared embedding of a quantized model (modelopt/torch/export/tensorrt_llm_utils.py)."""
    from modelopt.torch.export.quant_utils import process_layer_quant_config

    layer_config: dict[str, object] = {}  # {"<module>.quantization": format, "<module>.awq_block_size": g}
    for m, (fmt, group) in formats.items():
        layer_config[f"{m}.quantization"] = fmt
        if group:
            layer_config[f"{m}.awq_block_size"] = group
    quant = process_layer_quant_config(layer_config)
    if shared_embedding and any(fmt is not None for fmt, _ in formats.values()):
        quant.setdefault("exclude_modules", []).append("lm_head")
    quant["kv_cache_quant_algo"] = kv_cache_quant_algo
    if "quantized_layers" in quant:  # mixed: config.json names the algorithms, quant_cfg.json the layers
        return {k: quant[k] for k in ("quant_algo", "kv_cache_quant_algo")}, quant
    return quant, None


# ---------------------------------------------------------------- the stage's work, streamed


def export_layer(config, layer, *, index: int, out_dir: Path, decoder_type: str, dtype, tp: int,
                 head: Optional[dict] = None) -> Path:
    """ModelOpt's TensorRT-LLM export of one (quantized) decoder layer, in a one-layer model of ``config``;
    ``head``: {"embed", "norm", "lm_head"} for the export that carries them (else a small vocabulary)."""
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    if head is None:
        cfg.vocab_size = EXPORT_VOCAB
    model = skeleton(cfg, torch.float32)
    model.model.layers[0] = layer
    if head is None:
        model.model.embed_tokens.to_empty(device="cpu")
        model.model.norm.to_empty(device="cpu")
        torch.nn.init.zeros_(model.model.embed_tokens.weight)
        torch.nn.init.ones_(model.model.norm.weight)
        if not cfg.tie_word_embeddings:
            model.lm_head.to_empty(device="cpu")
            torch.nn.init.zeros_(model.lm_head.weight)
        else:
            model.tie_weights()
    else:
        model.model.embed_tokens.weight = head["embed"]
        model.model.norm.weight = head["norm"]
        model.lm_head = head["lm_head"]
    folder = out_dir / f"layer{index}"
    with torch.no_grad():
        export_tensorrt_llm_checkpoint(model, decoder_type, dtype, export_dir=folder, inference_tensor_parallel=tp)
    return folder


def _layer_name(index: int, last: bool, name: str) -> Optional[str]:
    """A tensor of a one-layer export, renamed to its layer; the embedding, final norm and lm_head only from
    the last export (the others carry a small stand-in vocabulary)."""
    if name.startswith("transformer.layers.0."):
        return name.replace("transformer.layers.0.", f"transformer.layers.{index}.", 1)
    return name if last else None


def assemble(exports: list[Path], ckpt: Path, tp: int) -> dict:
    """The whole checkpoint from the per-layer exports (see the module docstring, step 4)."""
    from pipeline import artifacts

    ckpt.mkdir(parents=True, exist_ok=True)
    last = exports[-1]
    n = len(exports)
    modules = [f"transformer.layers.{i}.{m}" for i in range(n) for m in LINEAR_MODULES]
    formats: dict = {}
    for i, folder in enumerate(exports):
        local = module_formats(folder, [f"transformer.layers.0.{m}" for m in LINEAR_MODULES])
        formats.update({k.replace("transformer.layers.0.", f"transformer.layers.{i}.", 1): v
                        for k, v in local.items()})
    head = safetensors_header(last / "rank0.safetensors")["header"]
    if "lm_head.weight" in head:
        modules.append("lm_head")
        formats.update(module_formats(last, ["lm_head"]))
    config = json.loads((last / "config.json").read_text())
    config["num_hidden_layers"] = n
    first = json.loads((exports[0] / "config.json").read_text()).get("quantization") or {}
    section, quant_cfg = quantization_section({m: formats[m] for m in modules}, first.get("kv_cache_quant_algo"),
                                              shared_embedding="lm_head.weight" not in head)
    config["quantization"] = section
    if quant_cfg is not None:
        (ckpt / artifacts.QUANT_CFG_FILE).write_text(json.dumps(quant_cfg, indent=4))
    tensors = 0
    for rank in range(tp):
        parts = [(folder / f"rank{rank}.safetensors", functools.partial(_layer_name, i, folder is last))
                 for i, folder in enumerate(exports)]
        tensors += concat_safetensors(parts, ckpt / f"rank{rank}.safetensors")
    (ckpt / "config.json").write_text(json.dumps(config, indent=4))
    return {"layers": n, "tensors": tensors}


def quantize_streamed(model_dir: Path, calib, *, evals, plan: Plan, quant, build, model_config: dict,
                      ckpt: Path, scratch: Path, device: str, dtype_name: str, table_layers: dict,
                      baseline: bool) -> dict:
    """Calibrate, gate and export layer by layer; returns {"accuracy", "calibrate_s", "assembled",
    "reference_final_hidden"} (the original model's final hidden states of the evaluation set, for the
    read-back's figures).

    ``scratch``: a folder for the per-layer exports (removed after). Raises StageFailed when the gate fails,
    before anything is written to ``ckpt``."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoConfig

    dtype = getattr(torch, dtype_name)
    export_dtype = torch.bfloat16 if build.dtype == "bfloat16" else torch.float16
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    if plan.quantized_formats().intersection(AWQ_FORMATS) and config.vocab_size % EXPORT_VOCAB:
        raise InputError(f"layer streaming cannot export INT4 AWQ layers of a model whose vocabulary "
                         f"({config.vocab_size}) is not a multiple of 64 (ModelOpt pads it when it exports the "
                         f"whole model); use compute.layer_streaming: never on a machine with more memory")
    store = WeightStore(model_dir)
    model = skeleton(config, dtype)
    # what ModelOpt registers when it is given the whole model (the HF attention class, for the KV-cache
    # quantizers): the holders are not HF models
    from modelopt.torch.quantization.plugins.custom import register_custom_model_plugins_on_the_fly

    register_custom_model_plugins_on_the_fly(model)
    cfg = None if baseline else recipe.modelopt_config(plan, quant)
    quantized = set(plan.layers) - set(plan.kept_high_precision())
    phases = [] if baseline else recipe.calibration_phases(plan, quant)
    decoder = families.FAMILIES[model_config["model_type"]].decoder_type
    tp = build.tensor_parallel_size
    t0 = time.perf_counter()
    return_freed_memory_to_the_os()

    with torch.no_grad():
        embed = store.get("model.embed_tokens.weight", dtype, device)
        rotary = type(model.model.rotary_emb)(config=config).to(device)
        # one calibration stream per phase: phase k of the whole-model calibration sees the model as phases
        # before it left it (an AWQ phase rescales weights: the same function, other roundings), quantizers
        # paused; a phase's stream is the layer's output in that state, taken before the phase changes it
        cal = [Streams(rotary, embed[calib.to(device)], gate.EVAL_BATCH) for _ in range(1 + len(phases))]
        ev = Streams(rotary, embed[evals.to(device)], gate.EVAL_BATCH)
        del embed  # read again for the last export: the vocabulary is the largest tensor of a small model
        quantized_hidden = ev.hidden
        exports: list[Path] = []
        last = model.model.layers[-1]  # the last decoder layer waits for lm_head: its export carries them
        for i, layer in enumerate(model.model.layers):
            store.load_module(layer, f"model.layers.{i}", dtype, device)
            nxt = [cal[0].through(layer)]
            next_ev = ev.through(layer)
            holder = _holder(**{f"model.layers.{i}": layer})
            prefix = f"model.layers.{i}."
            if cfg is not None:
                with _weights_may_all_stay(not any(n.startswith(prefix) for n in quantized)):
                    mtq.quantize(holder, cfg, lambda m, _i=i: cal[0].through(m.model.layers[str(_i)]))
                for k, (algorithm, names) in enumerate(phases, start=1):
                    with recipe.paused_quantizers(holder):
                        nxt.append(cal[k].through(holder.model.layers[str(i)]))
                    mine = [n for n in names if n.startswith(prefix)]
                    if mine:
                        recipe.calibrate_phase(holder, algorithm, mine,
                                           lambda m, _i=i, _k=k: cal[_k].through(m.model.layers[str(_i)]))
            layer = holder.model.layers[str(i)]
            quantized_hidden = ev.through(layer, quantized_hidden)
            for stream, hidden in zip(cal, nxt):
                stream.hidden = hidden
            ev.hidden = next_ev
            del nxt, next_ev
            if i < config.num_hidden_layers - 1:
                exports.append(export_layer(config, layer.cpu(), index=i, out_dir=scratch, decoder_type=decoder,
                                            dtype=export_dtype, tp=tp))
                model.model.layers[i] = layer.to("meta")
            else:
                last = layer
            trim_heap()
            log.info("layer %d/%d calibrated and exported (%.1f s, peak RSS %s)", i + 1, config.num_hidden_layers,
                     time.perf_counter() - t0, _peak())

        norm = model.model.norm
        store.load_module(norm, "model.norm", dtype, device)
        lm_head = model.lm_head
        original_head = store.get(store.head_name(), dtype, device)  # the embedding, when they are tied
        # a quantized lm_head may be smoothed in place: it gets a copy; a kept one shares the tensor
        lm_head.weight = torch.nn.Parameter(original_head.clone() if "lm_head" in quantized else original_head,
                                            requires_grad=False)
        final_cal = [norm(c.hidden) for c in cal]
        final_ev = norm(ev.hidden)
        head_holder = _holder(lm_head=lm_head)

        def head_loop(m, k=0):
            for a in range(0, final_cal[k].shape[0], gate.EVAL_BATCH):
                m.lm_head(final_cal[k][a:a + gate.EVAL_BATCH])

        if cfg is not None and "lm_head" in quantized:
            mtq.quantize(head_holder, cfg, head_loop)
            for k, (algorithm, names) in enumerate(phases, start=1):
                if "lm_head" in names:
                    recipe.calibrate_phase(head_holder, algorithm, ["lm_head"], lambda m, _k=k: head_loop(m, _k))
        final_cal.clear()  # the streams are done with
        cal.clear()
        quantized_head = head_holder.lm_head
        calibrate_s = time.perf_counter() - t0

        score = gate.Score()
        final_q = norm(quantized_hidden)
        for a in range(0, evals.shape[0], gate.EVAL_BATCH):
            lo = final_ev[a:a + gate.EVAL_BATCH] @ original_head.T
            score.add(evals[a:a + gate.EVAL_BATCH], lo, quantized_head(final_q[a:a + gate.EVAL_BATCH]))
        accuracy = score.result()
        log.info("accuracy (peak RSS %s): %s", _peak(), accuracy)
        if not baseline:
            gate.check_gate(accuracy, quant, plan, table_layers)

        tied = store.head_name() == "model.embed_tokens.weight"
        del final_q, quantized_hidden
        if "lm_head" in quantized:  # its export quantizes the full-precision weight
            embed = original_head if tied else store.get("model.embed_tokens.weight", dtype, device)
        else:  # ModelOpt casts unquantized tensors to the export dtype: done here, so fp32 copies are not held
            head16 = original_head.to(export_dtype)
            quantized_head.weight = torch.nn.Parameter(head16, requires_grad=False)
            del original_head
            # a bf16 or fp32 value rounds to the same fp16 value directly as through fp32
            embed = head16 if tied else store.get("model.embed_tokens.weight", export_dtype, device)
            trim_heap()
        head = {"embed": torch.nn.Parameter(embed.cpu(), requires_grad=False),
                "norm": torch.nn.Parameter(norm.weight.detach().cpu(), requires_grad=False),
                "lm_head": quantized_head.cpu()}
        exports.append(export_layer(config, last.cpu(), index=config.num_hidden_layers - 1, out_dir=scratch,
                                    decoder_type=decoder, dtype=export_dtype, tp=tp, head=head))
        del last, head, quantized_head, head_holder, embed
    log.info("last layer exported with the embedding and lm_head (peak RSS %s)", _peak())
    assembled = assemble(exports, ckpt, tp)
    shutil.rmtree(scratch, ignore_errors=True)
    trim_heap()
    return {"accuracy": accuracy, "calibrate_s": calibrate_s, "assembled": assembled,
            "reference_final_hidden": final_ev}


def _peak() -> str:
    from pipeline.child import own_peak_rss
    from pipeline.compute import gib

    return gib(own_peak_rss())


def streamed_original(model_dir: Path, config):
    """The original model in fp32 with its decoder layers read from its safetensors files when a forward
    reaches them (``checkpoint.StreamedLayers``): for the greedy generations of a streamed quantize."""
    import torch

    from pipeline.quant.checkpoint import StreamedLayers

    store = WeightStore(model_dir)
    model = skeleton(config, torch.float32)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its frequencies, for real
    store.load_module(model.model.embed_tokens, "model.embed_tokens", torch.float32)
    store.load_module(model.model.norm, "model.norm", torch.float32)
    if store.head_name() == "lm_head.weight":
        store.load_module(model.lm_head, "lm_head", torch.float32)
    else:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.streamed_layers = StreamedLayers(
        lambda i, layer: store.load_module(layer, f"model.layers.{i}", torch.float32), model.model.layers)
    return model


def read_back_streamed(ckpt: Path, model_dir: Path, *, kept: set[str], evals, reference_final_hidden,
                       device: str) -> tuple:
    """The accuracy figures of the checkpoint as written, read back one decoder layer at a time, against the
    original model (its final hidden states from the streamed pass, its head from the model's files); returns
    (figures, facts)."""
    import torch

    from pipeline.quant.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt, model_dir, kept)
    config = reader.hf_config
    config._attn_implementation = "sdpa"
    model = skeleton(config, torch.float32)
    with torch.no_grad():
        embed = reader.embedding().to(device)
        rotary = type(model.model.rotary_emb)(config=config).to(device)
        ev = Streams(rotary, embed[evals.to(device)], gate.EVAL_BATCH)
        del embed  # a tied lm_head reads it again at the end
        for i in range(config.num_hidden_layers):
            layer = reader.load_layer(i, model.model.layers[i]).to(device)
            ev.hidden = ev.through(layer)
            model.model.layers[i] = layer.to("meta")
            trim_heap()
        model.model.norm.weight = torch.nn.Parameter(reader.final_norm().to(device), requires_grad=False)
        final = model.model.norm(ev.hidden)
        head_w, transform = reader.lm_head()
        head_w = head_w.to(device)
        facts = reader.finish()
        store = WeightStore(model_dir)
        original_head = store.get(store.head_name(), torch.float32, device)
        score = gate.Score()
        for a in range(0, evals.shape[0], gate.EVAL_BATCH):
            x = final[a:a + gate.EVAL_BATCH]
            lq = (transform(x) if transform is not None else x) @ head_w.T
            # the reference comes in the streamed pass's dtype (bfloat16 on a GPU), the head in float32
            ref = reference_final_hidden[a:a + gate.EVAL_BATCH].to(original_head.dtype)
            score.add(evals[a:a + gate.EVAL_BATCH], ref @ original_head.T, lq)
    log.info("read back layer by layer (peak RSS %s)", _peak())
    return score.result(), facts
