"""quantize stage: the plan -> a ModelOpt-quantized model -> a TensorRT-LLM checkpoint, behind an accuracy gate.

Runs in a child process (pipeline.child) with its log beside the checkpoint. In order:
1. the rules users trip on are checked before any work (AWQ group size must divide every INT4 layer's
   input width, and its per-rank width for row-parallel layers under tensor parallelism; tensor parallelism
   must divide the attention and KV heads; layers fused into one GEMM share one format: q/k/v, and
   gate/up for the HF unified checkpoint); formats that need a GPU (NVFP4, MX) are refused by the config;
2. the ModelOpt config is built from the plan: the base format's preset, then one entry per layer whose
   format differs (later entries win, as in ModelOpt), the plan's high-precision layers disabled,
   INT8/FP8 KV-cache quantizers;
3. calibration on the calibration tokens (``mtq.quantize``). A plan that mixes formats is calibrated with
   ``max`` first, then each calibration algorithm on its own layers with every other quantizer paused
   (SmoothQuant for the int8_sq layers, AWQ-lite for the INT4 ones), as each format would be alone;
4. the accuracy gate on the evaluation tokens (disjoint from calibration): perplexity of the original and of
   the quantized (simulated) model, teacher-forced top-1 agreement and mean KL(original || quantized), plus
   a few greedy generations side by side for a person to read (not gated: near-ties flip argmaxes);
5. a deep copy of the calibrated model when the config asks for the HF unified checkpoint (ModelOpt's HF
   export modifies the model in place, so it never sees a model already exported);
6. the TensorRT-LLM checkpoint export (one rank file per tensor-parallel rank), and a check of what it wrote:
   quant_algo (MIXED_PRECISION with a quant_cfg.json listing exactly the plan's quantized layers and their
   formats, when formats are mixed), kv_cache_quant_algo, exclusions = the plan's high-precision layers,
   rope fields, weight dtypes;
7. the HF unified checkpoint (``hf_checkpoint/``) from the copy, checked: hf_quant_config.json names the
   format, the KV-cache format and the plan's kept layers, and its config.json parses under transformers;
8. the checkpoint read back by pipeline.checkpoint, and the same accuracy figures for that rebuilt model
   (without KV-cache quantization, which the CPU runtime adds);
9. the HF unified checkpoint read back too (pipeline.quant.hf_checkpoint) and held to the gate itself: its
   fused groups are resmoothed and requantized by the export, so it is not the model step 4 measured.

Steps 3-8 hold the model whole. A model that does not fit the memory bound so goes through the same steps
one decoder layer at a time (``quantize_streams`` decides; pipeline.quant.streaming does it, and
``run_stage`` reads its checkpoint back in a second child process), with a bit-equal checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Optional

from pipeline import artifacts, families, targets
from pipeline.config import BuildSection, ComputeSection, QuantizationSection
from pipeline.errors import InputError, StageFailed
from pipeline.formats import (
    AWQ_FORMATS,
    FORMATS,
    HIGH_PRECISION,
    KV_CACHE_ALGOS,
    MOE_EXPORT_FORMATS,
    TRTLLM_QUANT_ALGO,
)

log = logging.getLogger(__name__)

EVAL_BATCH = 4
GREEDY_PROMPTS = ("The capital of France is", "A function in Python is defined with", "Once upon a time,")
GREEDY_NEW_TOKENS = 16

# our format -> ModelOpt preset, and the quant_algo its TensorRT-LLM export writes
# TensorRT-LLM splits these on their input dim under tensor parallelism (row-parallel)
ROW_PARALLEL = ("o_proj", "down_proj")
# tokenizer files copied into the HF unified checkpoint, so the LLM API can serve it on its own
# HF module -> TensorRT-LLM checkpoint module (llama family); q/k/v become one fused qkv GEMM
TRTLLM_MODULE = {"q_proj": "attention.qkv", "k_proj": "attention.qkv", "v_proj": "attention.qkv",
                 "o_proj": "attention.dense", "gate_proj": "mlp.fc", "up_proj": "mlp.gate", "down_proj": "mlp.proj"}


def trtllm_name(hf_name: str, moe=None) -> str:
    """model.layers.3.mlp.down_proj -> transformer.layers.3.mlp.proj; lm_head stays lm_head. With ``moe`` (the
    family's, pipeline/families.py): its router -> mlp.router, an expert's fused pair (w1, w3) -> mlp.fc and its
    other linear (w2) -> mlp.proj, each stacked over the experts."""
    if hf_name == "lm_head":
        return "lm_head"
    parts = hf_name.split(".")
    layer = f"transformer.layers.{parts[2]}"
    rel = ".".join(parts[3:])
    if moe is not None and rel == moe.router:
        return f"{layer}.mlp.router"
    if moe is not None and rel.startswith(moe.experts + "."):
        return f"{layer}.mlp.fc" if parts[-1] in moe.fused else f"{layer}.mlp.proj"
    return f"{layer}.{TRTLLM_MODULE[parts[-1]]}"


def kept_layers(plan_doc: dict) -> set[str]:
    """The layers the plan keeps in high precision (HF names)."""
    return {n for n, e in plan_doc["layers"].items() if e["format"] == HIGH_PRECISION}


def quantized_formats(plan_doc: dict) -> set[str]:
    return {e["format"] for e in plan_doc["layers"].values()} - {HIGH_PRECISION}


def check_rules(plan_doc: dict, quant: QuantizationSection, build: BuildSection, model_config: dict,
                table_layers: dict) -> None:
    """Refuse, before any work, what ModelOpt or TensorRT-LLM would reject later (each message says the fix)."""
    problems = []
    tp = build.tensor_parallel_size
    fam = families.FAMILIES.get(model_config.get("model_type"))
    row_parallel = ROW_PARALLEL
    if fam is not None and fam.moe is not None:
        problems += _moe_problems(plan_doc, fam, model_config, tp)
        row_parallel = (*ROW_PARALLEL, fam.moe.down)  # an expert's down linear is split on its input too
    g = quant.awq_group_size
    for name, entry in plan_doc["layers"].items():
        if entry["format"] in AWQ_FORMATS:
            width = table_layers[name]["in_features"]
            # a row-parallel layer's input is split across the ranks: each rank's slice needs whole groups
            per_rank = width // tp if name.rsplit(".", 1)[-1] in row_parallel and tp > 1 else width
            if width % tp == 0 and per_rank % g == 0:
                continue
            ok = [c for c in (128, 64, 32) if width % tp == 0 and per_rank % c == 0]
            where = f"its input width {width}"
            if per_rank != width:
                where += f" split over {tp} ranks ({per_rank} per rank)"
            problems.append(f"{name}: quantization.awq_group_size {g} does not divide {where}; use "
                            f"{' or '.join(map(str, ok)) if ok else 'another format for this layer'}")
            break
    heads, kv = model_config.get("num_attention_heads"), model_config.get("num_key_value_heads")
    if heads and (heads % tp or (kv or heads) % tp):
        problems.append(f"build.tensor_parallel_size {tp} must divide the attention heads ({heads}) and KV heads "
                        f"({kv}); valid: {[t for t in range(1, heads + 1) if heads % t == 0 and (kv or heads) % t == 0]}")
    # one GEMM in the checkpoint -> one format: q/k/v always; gate/up in the HF unified checkpoint, and in
    # the TensorRT-LLM one when either is FP8 (TensorRT-LLM fuses them for FP8; ModelOpt's export insists)
    for group, fused in ((("q_proj", "k_proj", "v_proj"), lambda f: True),
                         (("gate_proj", "up_proj"), lambda f: quant.export_hf_checkpoint or "fp8" in f)):
        blocks: dict[str, set] = {}
        for name, entry in plan_doc["layers"].items():
            if name.rsplit(".", 1)[-1] in group:
                blocks.setdefault(name.rsplit(".", 1)[0], set()).add(entry["format"])
        split = sorted(b for b, f in blocks.items() if len(f) > 1 and fused(f))
        if split:
            members = "/".join(m.removesuffix("_proj") for m in group)
            problems.append(f"{members} of {split[0]} have different formats in the plan ({sorted(blocks[split[0]])}), "
                            f"but they are one fused GEMM in the exported checkpoint: give them the same format "
                            f"(a plan rule such as '{split[0]}.{group[0]}' with the other's format)")
    if quant.export_hf_checkpoint and quant.kv_cache == "int8":
        problems.append("an INT8 KV cache cannot be exported as an HF unified checkpoint; use kv_cache fp8 or none")
    if fam is not None and fam.fused_formats is not None and targets.get(build.target).serves_hf_checkpoint:
        fused, loadable = fam.fused_formats
        wrong = sorted(n for n, e in plan_doc["layers"].items() if n.rsplit(".", 1)[-1] in fused
                       and e["format"] not in (HIGH_PRECISION, *loadable))
        if wrong:
            problems.append(f"{wrong[0]} ({plan_doc['layers'][wrong[0]]['format']}, and {len(wrong) - 1} more): "
                            f"TensorRT-LLM's pytorch backend splits {fam.model_type}'s {' and '.join(fused)} itself "
                            f"when loading and carries only per-tensor scales to the halves, so they must be "
                            f"{' or '.join(loadable)} or high precision: add plan rules such as "
                            + ", ".join(f"{{pattern: '*.{f}', format: {loadable[0]}}}" for f in fused))
    if fam is not None and not fam.trtllm_checkpoint and not quant.export_hf_checkpoint:
        problems.append(f"{fam.model_type} is exported as the HF unified checkpoint only (no TensorRT-LLM checkpoint "
                        f"of it can be written here): set quantization.export_hf_checkpoint: true")
    if model_config.get("model_type") not in families.FAMILIES:
        problems.append(f"model type {model_config.get('model_type')!r} has no TensorRT-LLM export mapping here "
                        f"(supported: {', '.join(families.FAMILIES)})")
    if problems:
        raise InputError("quantize: " + "; ".join(problems) + ".")


def _moe_problems(plan_doc: dict, fam, model_config: dict, tp: int) -> list[str]:
    """What the export cannot write, or the ranks cannot split, for a mixture-of-experts model."""
    problems = []
    bad = sorted({e["format"] for n, e in plan_doc["layers"].items()
                  if f".{fam.moe.experts}." in n and e["format"] not in (*MOE_EXPORT_FORMATS, HIGH_PRECISION)})
    if bad and fam.trtllm_checkpoint:  # the HF unified export writes each expert as its own linears, in any format
        problems.append(f"the plan gives experts {', '.join(bad)}, which ModelOpt's TensorRT-LLM export cannot write "
                        f"for stacked experts; give them {' or '.join(MOE_EXPORT_FORMATS)} with a plan rule such as "
                        f"{{pattern: '*.experts.*', format: fp8}}, or keep them in high precision")
    # each rank holds a slice of every expert's intermediate dim (ModelOpt's _split_model_config_for_tp)
    inter = model_config.get("moe_intermediate_size") or model_config.get("intermediate_size")
    if inter and inter % tp:
        problems.append(f"build.tensor_parallel_size {tp} does not divide the experts' intermediate size {inter}")
    return problems


def _algorithm(fmt: str, quant: QuantizationSection):
    """The calibration algorithm a format gets on its own (its ModelOpt preset's; SmoothQuant with our alpha)."""
    import modelopt.torch.quantization as mtq

    if fmt == "int8_sq":
        return {"method": "smoothquant", "alpha": quant.smoothquant_alpha}
    return copy.deepcopy(getattr(mtq, FORMATS[fmt].modelopt_preset).get("algorithm", "max"))


def _layer_entries(name: str, fmt: str, group: int) -> list[dict]:
    """ModelOpt entries giving one layer the weight and input quantizers of format ``fmt``."""
    import modelopt.torch.quantization as mtq

    entries = []
    for e in copy.deepcopy(getattr(mtq, FORMATS[fmt].modelopt_preset))["quant_cfg"]:
        qn = e.get("quantizer_name")
        if qn in ("*weight_quantizer", "*input_quantizer") and not e.get("parent_class"):
            item = {"quantizer_name": f"{name}.{qn[1:]}"}
            if "cfg" in e:
                item["cfg"] = e["cfg"]
                _set_block_size(item["cfg"], group)
            if "enable" in e:
                item["enable"] = e["enable"]
            entries.append(item)
    return entries


def modelopt_config(plan_doc: dict, quant: QuantizationSection) -> dict:
    """The ordered ModelOpt quantization config for the plan (later entries win, as in ModelOpt).

    The base format's preset first; then, per layer, entries for a format other than the base (and for
    lm_head, which every preset leaves off), or a disable for a layer kept in high precision."""
    import modelopt.torch.quantization as mtq

    base = quant.weight_format
    cfg = copy.deepcopy(getattr(mtq, FORMATS[base].modelopt_preset))
    entries = cfg["quant_cfg"]
    if base == "int8_sq":
        cfg["algorithm"] = {"method": "smoothquant", "alpha": quant.smoothquant_alpha}
    if base in AWQ_FORMATS:
        for e in entries:
            _set_block_size(e.get("cfg"), quant.awq_group_size)
    for name, entry in plan_doc["layers"].items():
        fmt = entry["format"]
        if fmt == HIGH_PRECISION:
            entries.append({"quantizer_name": f"{name}.*", "enable": False})
        elif fmt != base or name == "lm_head":
            entries += _layer_entries(name, fmt, quant.awq_group_size)
    formats = quantized_formats(plan_doc)
    if len(formats) > 1:  # mixed: max for all first, then each algorithm on its own layers (calibration_phases)
        cfg["algorithm"] = "max"
    elif formats and formats != {base}:  # every layer moved off the base format: calibrate as that format
        cfg["algorithm"] = _algorithm(next(iter(formats)), quant)
    if quant.kv_cache != "none":
        bits = 8 if quant.kv_cache == "int8" else (4, 3)
        entries.append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": bits, "axis": None},
                        "enable": True})
    return cfg


def calibration_phases(plan_doc: dict, quant: QuantizationSection) -> list[tuple[object, list[str]]]:
    """For a plan that mixes formats: (algorithm, layers) to run after the first ``max`` calibration, one per
    algorithm other than max (SmoothQuant, AWQ-lite), each on the layers whose format uses it."""
    if len(quantized_formats(plan_doc)) < 2:
        return []
    phases: dict[str, tuple[object, list[str]]] = {}
    for name, entry in plan_doc["layers"].items():
        if entry["format"] == HIGH_PRECISION:
            continue
        algorithm = _algorithm(entry["format"], quant)
        if algorithm in ("max", None) or (isinstance(algorithm, dict) and algorithm.get("method") == "max"):
            continue
        key = json.dumps(algorithm, sort_keys=True)
        phases.setdefault(key, (algorithm, []))[1].append(name)
    def method(algorithm) -> str:
        return algorithm if isinstance(algorithm, str) else algorithm.get("method", "")

    return sorted(phases.values(), key=lambda p: (method(p[0]), json.dumps(p[0], sort_keys=True)))


@contextlib.contextmanager
def paused_quantizers(model, keep: tuple[str, ...] = ()):
    """Every enabled quantizer of ``model`` disabled meanwhile (its layer computes in full precision, its scales
    stay), except those under the module prefixes ``keep``; yields the kept ones."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    enabled = [(n, m) for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    paused = [m for n, m in enabled if not n.startswith(keep)] if keep else [m for _, m in enabled]
    for m in paused:
        m.disable()
    try:
        yield [m for n, m in enabled if keep and n.startswith(keep)]
    finally:
        for m in paused:
            m.enable()


def _calibrate_phase(model, algorithm, layers: list[str], forward_loop) -> None:
    """One calibration algorithm on some layers only: every other enabled quantizer is paused meanwhile, so
    its scales stay as they are and its layers compute in full precision (as in a single-format calibration)."""
    import modelopt.torch.quantization as mtq

    with paused_quantizers(model, keep=tuple(f"{n}." for n in layers)) as mine:
        for m in mine:  # forget the first max pass: the algorithm collects its own statistics
            m.reset_amax()
            if m._calibrator is not None:
                m._calibrator.reset()
        mtq.calibrate(model, algorithm, forward_loop)


def _set_block_size(cfg, group: int) -> None:
    for c in cfg if isinstance(cfg, list) else [cfg]:
        if isinstance(c, dict) and isinstance(c.get("block_sizes"), dict) and -1 in c["block_sizes"]:
            c["block_sizes"][-1] = group


class Score:
    """The accuracy gate's figures, accumulated batch by batch from the two models' logits: perplexity of
    both, teacher-forced top-1 agreement and mean KL(original || quantized) per token."""

    def __init__(self) -> None:
        self.nll_o = self.nll_q = self.kl = 0.0
        self.agree = self.count = 0

    def add(self, ids, lo, lq) -> None:
        """ids [B, T]; lo / lq: the logits of the original and the quantized model for them, [B, T, vocab].
        One sequence at a time: the log-softmax temporaries of a whole batch over a large vocabulary would
        outweigh a decoder layer."""
        import torch.nn.functional as F

        for r in range(ids.shape[0]):
            o, q = lo[r, :-1].float(), lq[r, :-1].float().to(lo.device)
            target = ids[r, 1:].to(lo.device)
            logp_o = F.log_softmax(o, dim=-1)
            logp_q = F.log_softmax(q, dim=-1)
            self.nll_o += float(-logp_o.gather(-1, target[..., None]).sum())
            self.nll_q += float(-logp_q.gather(-1, target[..., None]).sum())
            self.kl += float((logp_o.exp() * (logp_o - logp_q)).sum())
            self.agree += int((o.argmax(-1) == q.argmax(-1)).sum())
            self.count += target.numel()

    def result(self) -> dict:
        ppl_o, ppl_q = math.exp(self.nll_o / self.count), math.exp(self.nll_q / self.count)

        def sig(x: float) -> float:  # 6 significant digits: readable, and never rounded to 0 before the gate
            return float(f"{x:.6g}")

        return {"tokens": self.count, "perplexity_original": sig(ppl_o), "perplexity_quantized": sig(ppl_q),
                "perplexity_increase_pct": sig((ppl_q / ppl_o - 1) * 100),
                "top1_agreement": sig(self.agree / self.count), "kl_divergence": sig(self.kl / self.count)}


def _accuracy(original, quantized, eval_ids) -> dict:
    """The gate's figures for two whole models, over the evaluation tokens in batches of EVAL_BATCH."""
    import torch

    score = Score()
    with torch.no_grad():
        for b in range(0, eval_ids.shape[0], EVAL_BATCH):
            ids = eval_ids[b:b + EVAL_BATCH]
            score.add(ids, original(ids.to(_input_device(original))).logits,
                      quantized(ids.to(_input_device(quantized))).logits)
    return score.result()


def _input_device(model):
    """Where a model's input ids go: its embedding's device (the first GPU of a device map)."""
    return model.get_input_embeddings().weight.device


def _generations(original, quantized, tokenizer) -> list[dict]:
    import torch

    rows = []
    with torch.no_grad():
        for prompt in GREEDY_PROMPTS:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            pad = tokenizer.pad_token_id or tokenizer.eos_token_id
            outs = []
            for m in (original, quantized):
                x = ids.to(_input_device(m))
                outs.append(m.generate(x, max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False,
                                       attention_mask=torch.ones_like(x), pad_token_id=pad)[0, ids.shape[1]:])
            o, q = outs
            rows.append({"prompt": prompt, "original": tokenizer.decode(o), "quantized": tokenizer.decode(q)})
    return rows


def _expected_algo(fmt: str, quant: QuantizationSection) -> dict:
    """What ModelOpt's exporter writes for one layer of format ``fmt`` (quant_utils.process_layer_quant_config)."""
    want = {"quant_algo": TRTLLM_QUANT_ALGO[fmt]}
    if fmt in AWQ_FORMATS:
        want.update(group_size=quant.awq_group_size, has_zero_point=False, pre_quant_scale=True)
    return want


def _check_layer_formats(listed: dict, expected: dict, what: str) -> list[str]:
    """listed: {module: {quant_algo, ...}} as exported; expected: {module: wanted entry} from the plan."""
    problems = []
    extra, absent = sorted(set(listed) - set(expected)), sorted(set(expected) - set(listed))
    if extra:
        problems.append(f"{what} lists {len(extra)} layer(s) the plan keeps in high precision: {extra[:3]}")
    if absent:
        problems.append(f"{what} lacks {len(absent)} layer(s) the plan quantizes: {absent[:3]}")
    for module in sorted(set(listed) & set(expected)):
        got = {k: listed[module].get(k) for k in expected[module]}
        if got != expected[module]:
            problems.append(f"{what}: {module} is {got}, the plan says {expected[module]}")
    return problems


def _check_export(ckpt: Path, plan_doc: dict, quant: QuantizationSection, model_config: dict, tp: int = 1) -> dict:
    """What TensorRT-LLM will read must say what the plan says."""
    from safetensors import safe_open

    cfg = json.loads((ckpt / "config.json").read_text())
    q = cfg.get("quantization", {})
    problems = []
    moe = families.FAMILIES[model_config["model_type"]].moe
    kept = {trtllm_name(n, moe) for n in kept_layers(plan_doc)}
    formats = quantized_formats(plan_doc)
    if q.get("kv_cache_quant_algo") != KV_CACHE_ALGOS[quant.kv_cache]:
        problems.append(f"kv_cache_quant_algo {q.get('kv_cache_quant_algo')} (expected {KV_CACHE_ALGOS[quant.kv_cache]})")
    if model_config.get("rope_theta") is not None and cfg.get("rotary_base") != model_config["rope_theta"]:
        problems.append(f"rotary_base {cfg.get('rotary_base')} != the model's rope_theta {model_config['rope_theta']}")
    if model_config.get("rope_scaling") and not cfg.get("rotary_scaling"):
        problems.append("rotary_scaling missing although the model has rope_scaling")
    ranks = sorted(ckpt.glob("rank*.safetensors"))
    mapping = cfg.get("mapping", {})
    if not len(ranks) == mapping.get("world_size") == mapping.get("tp_size") == tp:
        problems.append(f"{len(ranks)} rank files for world_size {mapping.get('world_size')} / tp_size "
                        f"{mapping.get('tp_size')} (expected {tp})")
    dtypes: dict[str, str] = {}
    with safe_open(str(ranks[0]), framework="pt") as f:
        for k in f.keys():
            if k.endswith(".weight"):
                dtypes[k[: -len(".weight")]] = f.get_slice(k).get_dtype()
    quantized_layers = None
    if len(formats) <= 1:
        want = TRTLLM_QUANT_ALGO[next(iter(formats))] if formats else None
        if q.get("quant_algo") != want:
            problems.append(f"quant_algo {q.get('quant_algo')} (expected {want})")
        # exclude_modules may hold fnmatch patterns (ModelOpt writes 'transformer.layers.28.mlp*' for a whole MLP)
        excluded = {m for pat in (q.get("exclude_modules") or []) for m in [*dtypes, "lm_head"]
                    if fnmatch.fnmatchcase(m, pat)}
        linear_excluded = {m for m in excluded if not m.endswith("layernorm")}
        if formats and linear_excluded != kept:  # an unquantized checkpoint needs no exclusions
            problems.append(f"exclude_modules differ from the plan's high-precision layers: "
                            f"{sorted(linear_excluded ^ kept)[:4]}")
    else:
        path = ckpt / artifacts.QUANT_CFG_FILE
        if q.get("quant_algo") != "MIXED_PRECISION" or not path.is_file():
            problems.append(f"a mixed plan must export quant_algo MIXED_PRECISION with {artifacts.QUANT_CFG_FILE} "
                            f"(found quant_algo {q.get('quant_algo')})")
        else:
            listed = json.loads(path.read_text()).get("quantized_layers") or {}
            quantized_layers = len(listed)
            # fused q/k/v are one module in the checkpoint; check_rules made their formats agree
            expected = {trtllm_name(n, moe): _expected_algo(e["format"], quant) for n, e in plan_doc["layers"].items()
                        if e["format"] != HIGH_PRECISION}
            problems += _check_layer_formats(listed, expected, artifacts.QUANT_CFG_FILE)
    for module, dtype in dtypes.items():
        if module in kept and dtype not in ("F16", "BF16", "F32"):
            problems.append(f"{module} is kept in high precision by the plan but stored as {dtype}")
        if ".layers." in module and module not in kept and not module.endswith("layernorm") and \
                dtype in ("F16", "BF16", "F32") and formats:
            problems.append(f"{module} should be quantized but is stored as {dtype}")
    if problems:
        raise StageFailed("the exported TensorRT-LLM checkpoint does not match the plan: " + "; ".join(problems[:6]))
    return {"quant_algo": q.get("quant_algo"), "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
            "exclude_modules": sorted(q.get("exclude_modules") or []), "rotary_base": cfg.get("rotary_base"),
            "weight_dtypes": sorted(set(dtypes.values())), "ranks": len(ranks),
            "formats": sorted(TRTLLM_QUANT_ALGO[f] for f in formats), "quant_cfg_layers": quantized_layers}


def _check_hf_export(hf_dir: Path, plan_doc: dict, quant: QuantizationSection, model_config: dict,
                     target: str) -> dict:
    """The HF unified checkpoint must say what the plan says, in a config.json transformers can read; its FP8 KV
    scales must fit the target's KV cache (_kv_range_check)."""
    from transformers import AutoConfig

    problems = []
    path = hf_dir / artifacts.HF_QUANT_CONFIG_FILE
    if not path.is_file():
        raise StageFailed(f"the HF unified checkpoint in {hf_dir} has no {artifacts.HF_QUANT_CONFIG_FILE}")
    q = json.loads(path.read_text()).get("quantization", {})
    formats = quantized_formats(plan_doc)
    layers = list(plan_doc["layers"])
    kept = kept_layers(plan_doc)
    if q.get("kv_cache_quant_algo") != KV_CACHE_ALGOS[quant.kv_cache]:
        problems.append(f"kv_cache_quant_algo {q.get('kv_cache_quant_algo')} (expected {KV_CACHE_ALGOS[quant.kv_cache]})")
    if len(formats) <= 1:
        want = TRTLLM_QUANT_ALGO[next(iter(formats))] if formats else None
        if q.get("quant_algo") != want:
            problems.append(f"quant_algo {q.get('quant_algo')} (expected {want})")
        excluded = {n for pat in (q.get("exclude_modules") or []) for n in layers if fnmatch.fnmatchcase(n, pat)}
        if excluded != kept:
            problems.append(f"exclude_modules differ from the plan's high-precision layers: "
                            f"{sorted(excluded ^ kept)[:4]}")
    elif q.get("quant_algo") != "MIXED_PRECISION":
        problems.append(f"a mixed plan must export quant_algo MIXED_PRECISION (found {q.get('quant_algo')})")
    else:
        expected = {n: _expected_algo(e["format"], quant) for n, e in plan_doc["layers"].items()
                    if e["format"] != HIGH_PRECISION}
        problems += _check_layer_formats(q.get("quantized_layers") or {}, expected, artifacts.HF_QUANT_CONFIG_FILE)
    try:
        parsed = AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"config.json does not parse under transformers: {e}")
    else:
        qc = getattr(parsed, "quantization_config", None) or {}
        if qc.get("quant_method") != "modelopt":
            problems.append(f"config.json quantization_config.quant_method is {qc.get('quant_method')!r}, not modelopt")
        theta = model_config.get("rope_theta")
        if theta is not None and getattr(parsed, "rope_theta", None) != theta:
            problems.append(f"config.json rope_theta {getattr(parsed, 'rope_theta', None)} != the model's "
                            f"{model_config['rope_theta']}")
    if problems:
        raise StageFailed("the exported HF unified checkpoint does not match the plan: " + "; ".join(problems[:6]))
    kv = None
    if quant.kv_cache == "fp8":
        fam = families.FAMILIES.get(model_config.get("model_type"))
        kv = _kv_range_check(hf_dir, model_config["num_hidden_layers"], target,
                             engine_serves_it=fam is None or any(targets.get(t).engine_per_rank for t in fam.targets))
    return {"quant_algo": q.get("quant_algo"), "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
            "exclude_modules": sorted(q.get("exclude_modules") or []),
            "quantized_layers": len(q.get("quantized_layers") or {}) or None, "kv_scales_max": kv,
            "bytes": sum(p.stat().st_size for p in hf_dir.iterdir() if p.is_file())}


# On the CPU this stage holds the model whole, in fp32, several times at once: the original (the accuracy
# gate's reference), the copy ModelOpt quantizes, the model rebuilt from the checkpoint for the read-back
# check, and a copy for the HF export when one is asked for; besides, the libraries, and the gate's logits
# over the vocabulary for a batch of evaluation sequences (both models', and copies). Fitted to SmolLM2's
# default config: 3 x 0.50 GiB + 0.59 GiB + 4 x 256 x 49152 x 4 B x 6 = 3.2 GiB estimated, 3.29 GiB measured
# (scripts/bench_streaming.py). A model that does not fit so is quantized one decoder layer at a time
# (quantize_streams, pipeline.quant.streaming).
IN_MEMORY_COPIES = 3
LIBRARIES_BYTES = 600 * 2**20  # torch, transformers and ModelOpt imported: 555 MB of RSS (CPU wheels)
LOGIT_COPIES = 6


def check_host_memory(model_dir: Path, quant: QuantizationSection, bound, eval_seq_len: int = 0) -> int:
    """Refuse, before any work, a model whose in-memory quantization cannot fit ``bound`` (a compute.Bound);
    returns the bytes it needs (an estimate: see IN_MEMORY_COPIES)."""
    from pipeline import compute as comp

    fp32 = comp.model_bytes(model_dir, "float32")
    copies = IN_MEMORY_COPIES + int(quant.export_hf_checkpoint)
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size") or 0
    logits = EVAL_BATCH * eval_seq_len * vocab * 4 * LOGIT_COPIES
    need = fp32 * copies + LIBRARIES_BYTES + logits
    if need > bound.bytes:
        raise InputError(
            f"quantize in memory on the CPU would hold about {comp.gib(need)}: the model {copies} times in fp32 "
            f"({comp.gib(fp32)} each), the libraries ({comp.gib(LIBRARIES_BYTES)}) and the accuracy gate's "
            f"logits ({comp.gib(logits)}); more than the memory bound {bound.text()}, and "
            f"compute.layer_streaming is never. Set it to auto to quantize one decoder layer at a time, run it on "
            f"a GPU (compute.device: cuda), or on a machine with more memory (compute.max_host_memory).")
    return need


# On GPUs the model is loaded twice in the reference dtype (the accuracy gate's original and the copy ModelOpt
# quantizes), three times where the HF export gets its own copy (families with both exports): the least it can
# hold. The peak is higher: at Llama-3.1-8B's shape on an H200 (scripts/gpu_check.py, no HF export) 55.6 GiB for
# 13.75 GiB of bf16 weights, 4.0 times, for FP8 and INT8 SmoothQuant alike.
GPU_MEASURED_PEAK = 4.0


def check_gpu_memory(model_dir: Path, quant: QuantizationSection, dtype: str, bounds: list) -> int:
    """Refuse, before the model is loaded, GPUs whose bounds (compute.Bound, one per GPU) together cannot hold
    the in-memory path's copies of the model; warn where they are under the measured peak. Returns the least
    bytes it needs."""
    from pipeline import compute as comp

    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    fam = families.FAMILIES.get(model_type)
    copies = 2 + int(bool(quant.export_hf_checkpoint and (fam is None or fam.trtllm_checkpoint)))
    weights = comp.model_bytes(model_dir, dtype)
    need, room = copies * weights, sum(b.bytes for b in bounds)
    held = f"the model {copies} times in {dtype} ({comp.gib(weights)} each)"
    if need > room:
        raise InputError(
            f"quantize in memory on {len(bounds)} GPU(s) holds at least {comp.gib(need)}, {held}; their bound is "
            f"{comp.gib(room)} together ({bounds[0].source}). Give it more GPUs (CUDA_VISIBLE_DEVICES), or set "
            f"compute.layer_streaming: always to quantize one decoder layer at a time"
            + (" (not with quantization.export_hf_checkpoint)" if quant.export_hf_checkpoint else "") + ".")
    if GPU_MEASURED_PEAK * weights > room:
        log.warning("quantize: the GPUs' bound %s is under the %.1f times the weights (%s) this stage peaked at "
                    "where measured; it may run out of GPU memory", comp.gib(room), GPU_MEASURED_PEAK,
                    comp.gib(int(GPU_MEASURED_PEAK * weights)))
    return need


def gpu_streams(model_dir: Path, quant: QuantizationSection, mode: str, dtype: str, bounds: list) -> bool:
    """On GPUs (in the child, which knows their free memory): whether quantize streams the model layer by layer.
    ``mode`` auto streams where the GPUs' bounds together are under the measured peak (GPU_MEASURED_PEAK times
    the weights) and no HF export is asked for (it is not streamed); else check_gpu_memory refuses what cannot
    fit and warns under the peak."""
    from pipeline import compute as comp

    if mode == "auto" and not quant.export_hf_checkpoint:
        weights, room = comp.model_bytes(model_dir, dtype), sum(b.bytes for b in bounds)
        if GPU_MEASURED_PEAK * weights > room:
            log.info("layer streaming on %d GPU(s): %.1f times the weights (%s) is more than their bound %s (%s)",
                     len(bounds), GPU_MEASURED_PEAK, comp.gib(int(GPU_MEASURED_PEAK * weights)), comp.gib(room),
                     bounds[0].source)
            return True
    check_gpu_memory(model_dir, quant, dtype, bounds)
    return False


def quantize_streams(model_dir: Path, cfg, bound) -> bool:
    """Whether quantize streams the model layer by layer (compute.layer_streaming; auto: on the CPU, when the
    in-memory path would not fit ``bound``; on GPUs the child decides, gpu_streams). Refuses, before any work,
    what neither way can do."""
    from pipeline import compute as comp

    mode = cfg.compute.layer_streaming
    on_cpu = cfg.compute.device == "cpu" or comp.nvidia_gpu_count() == 0
    stream = mode == "always"
    if not stream and on_cpu:
        try:
            check_host_memory(model_dir, cfg.quantization, bound, cfg.text.evaluation.seq_len)
        except InputError:
            if mode == "never":
                raise
            stream = True
    if not stream:
        return False
    if cfg.quantization.export_hf_checkpoint:
        raise InputError(
            "quantize: this model is quantized one decoder layer at a time (it does not fit the memory bound "
            f"{bound.text()} whole, or compute.layer_streaming is always), and the HF unified checkpoint "
            "(quantization.export_hf_checkpoint: the pytorch target's, and the only export of "
            f"{', '.join(f.model_type for f in families.FAMILIES.values() if not f.trtllm_checkpoint)}) is not "
            "exported that way yet. Run it on a GPU or a machine with more memory "
            "(compute.max_host_memory), or, for the other families, use the tensorrt or cpu target without it.")
    if on_cpu:
        comp.check_layer_fits(model_dir, "float32", bound, "quantize")
    return True


def _gpu_bounds(compute: ComputeSection) -> list:
    """One compute.Bound per visible GPU, for what is still free on it: read again before each load, so that
    the second copy of the model is mapped around the first (compute.max_gpu_memory less what this process holds
    there; else the free memory less the margin)."""
    import torch

    from pipeline import compute as comp

    bounds = []
    for i in range(torch.cuda.device_count()):
        bound = comp.gpu_memory_bound(compute, torch.cuda.mem_get_info(i)[0])
        if compute.max_gpu_memory is not None:
            bound = comp.Bound(max(0, bound.bytes - torch.cuda.memory_allocated(i)), bound.source)
        bounds.append(bound)
    return bounds


def _load_model(model_dir: Path, device: str, dtype_name: str, compute: ComputeSection):
    """The HF model for calibration: on the CPU as it is; on CUDA spread over the visible GPUs by a device map
    (accelerate), each GPU held to what its bound leaves (_gpu_bounds)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    attention = families.attn_implementation(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type"))
    if device == "cpu":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention).eval()
    max_memory = {i: b.bytes for i, b in enumerate(_gpu_bounds(compute))}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention,
                                                device_map="auto", max_memory=max_memory).eval()


def run_quantize(model_dir: Path, calibration_file: Path, evaluation_file: Path, plan_file: Path, table_file: Path,
                 quant: QuantizationSection, build: BuildSection, out_dir: Path,
                 compute: Optional[ComputeSection] = None, stream: bool = False, memory_bound=None) -> dict:
    """The stage's work, in a child process; returns the summary for the manifest.

    ``stream``: calibrate, gate, export and read back one decoder layer at a time (pipeline.quant.streaming).
    ``memory_bound``: the compute.Bound the parent set (recorded; default: computed here)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from pipeline import compute as comp
    from pipeline.quant.plan import read_plan

    compute = compute or ComputeSection()
    bound = memory_bound or comp.host_memory_bound(compute)
    device = comp.resolve_device(compute)
    ref_dtype = comp.reference_dtype(device, "float32")
    log.info("quantize on %s in %s", device, ref_dtype)

    t0 = time.perf_counter()
    table = json.loads(table_file.read_text())
    table_layers = {l["name"]: l for l in table["layers"]}
    plan_doc = read_plan(plan_file, list(table_layers))
    model_config = json.loads((model_dir / "config.json").read_text())
    baseline = quant.weight_format == "none"  # the unquantized baseline: exported as it is, nothing to gate
    check_rules(plan_doc, quant, build, model_config, table_layers)

    calib = torch.as_tensor(load_file(str(calibration_file))[artifacts.TOKENS_KEY])
    evals = torch.as_tensor(load_file(str(evaluation_file))[artifacts.TOKENS_KEY])
    ckpt = out_dir / artifacts.TRTLLM_CHECKPOINT_DIR
    kept = kept_layers(plan_doc)
    if device == "cuda" and not stream:
        stream = gpu_streams(model_dir, quant, compute.layer_streaming, ref_dtype, _gpu_bounds(compute))
    if stream:
        from pipeline.quant import streaming

        log.info("layer streaming: one decoder layer at a time")
        res = streaming.quantize_streamed(model_dir, calib, evals, plan_doc, quant, build, model_config, ckpt,
                                          out_dir / "layer_exports", device, ref_dtype, table_layers, baseline)
        exported = _check_export(ckpt, plan_doc, quant, model_config, build.tensor_parallel_size)
        from safetensors.torch import save_file

        save_file({"hidden": res["reference_final_hidden"].cpu().contiguous()}, str(out_dir / READ_BACK_REFERENCE))
        return {"read_back_pending": True, "accuracy": res["accuracy"], "exported": exported,
                "calibrate_s": res["calibrate_s"], "elapsed_s": time.perf_counter() - t0, "device": device,
                "calibration_tokens": int(calib.numel()), "greedy_generations": quant.greedy_generations,
                "compute": comp.compute_record(device, ref_dtype, bound)}
    original = _load_model(model_dir, device, ref_dtype, compute)
    # the model ModelOpt quantizes in place; on GPUs a second load (a deep copy of a dispatched model would
    # share accelerate's hooks)
    model = copy.deepcopy(original) if device == "cpu" else _load_model(model_dir, device, ref_dtype, compute)
    calib = calib.to(_input_device(model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    import modelopt.torch.quantization as mtq

    cfg = None if baseline else modelopt_config(plan_doc, quant)

    def forward_loop(m):
        for b in range(0, calib.shape[0], EVAL_BATCH):
            m(calib[b:b + EVAL_BATCH])

    if not baseline:
        with torch.no_grad():
            mtq.quantize(model, cfg, forward_loop)
            for algorithm, layers in calibration_phases(plan_doc, quant):
                log.info("calibrating %d layer(s) with %s", len(layers), algorithm)
                _calibrate_phase(model, algorithm, layers, forward_loop)
    t_quant = time.perf_counter() - t0
    log.info("calibrated in %.1f s", t_quant)

    accuracy = _accuracy(original, model, evals)
    generations = _generations(original, model, tokenizer) if quant.greedy_generations else []
    log.info("accuracy: %s", accuracy)
    if not baseline:
        _gate(accuracy, quant, plan_doc, table_layers)

    from modelopt.torch.export import (
        export_hf_checkpoint,
        export_tensorrt_llm_checkpoint,
    )

    fam = families.FAMILIES[model_config["model_type"]]
    # ModelOpt's HF export modifies the model in place (resmoothing, requantizing): it gets its own copy,
    # taken before the TensorRT-LLM export touches the model (none where the family has no such export)
    hf_source = None
    if quant.export_hf_checkpoint:
        hf_source = copy.deepcopy(model) if fam.trtllm_checkpoint else model
    dtype = torch.bfloat16 if build.dtype == "bfloat16" else torch.float16
    exported = None
    if fam.trtllm_checkpoint:
        with torch.no_grad():
            export_tensorrt_llm_checkpoint(model, fam.decoder_type, dtype, export_dir=ckpt,
                                           inference_tensor_parallel=build.tensor_parallel_size)
        exported = _check_export(ckpt, plan_doc, quant, model_config, build.tensor_parallel_size)
    hf_exported = None
    if hf_source is not None:
        hf_dir = out_dir / artifacts.HF_CHECKPOINT_DIR
        if build.dtype != "float32":  # ModelOpt writes unquantized weights in the model's own dtype
            hf_source = hf_source.to(dtype)
        with torch.no_grad():
            export_hf_checkpoint(hf_source, dtype, export_dir=hf_dir)
        del hf_source
        for name in artifacts.TOKENIZER_FILES:  # the LLM API serves the folder on its own
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, hf_dir / name)
        hf_exported = _check_hf_export(hf_dir, plan_doc, quant, model_config, build.target)
    from_ckpt = read_facts = None
    if exported is not None:
        # the model as the checkpoint says, read back by our own reader: the figure closest to the engine's
        from pipeline.quant.checkpoint import rebuild

        rebuilt, read_facts = rebuild(ckpt, model_dir, kept)
        if device == "cuda":  # fp32, as read; on the GPU the evaluation pass takes seconds, not hours
            rebuilt = rebuilt.to(_input_device(original))
        from_ckpt = _accuracy(original, rebuilt, evals)
        del rebuilt
    if hf_exported is not None:
        hf_exported["read_back"], hf_exported["accuracy"] = _read_back_hf(out_dir / artifacts.HF_CHECKPOINT_DIR,
                                                                           original, evals, kept, quant)
    if exported is None:  # the HF unified checkpoint is the only one: its read-back is the checkpoint's figure
        assert hf_exported is not None  # check_rules refuses such a family without export_hf_checkpoint
        exported, read_facts, from_ckpt = hf_exported, hf_exported.pop("read_back"), hf_exported.pop("accuracy")
        hf_exported = None
    return _finish(out_dir, accuracy, from_ckpt, read_facts, exported, hf_exported, generations, plan_doc,
                   int(calib.numel()), int(evals.numel()), comp.compute_record(device, ref_dtype, bound), t_quant, t0)


# The FP8 KV-cache scale TensorRT-LLM 1.2's PyTorch backend serves with, whatever the checkpoint holds: its
# attention keeps kv_cache_scaling_factor = 1.0 and loads the checkpoint's k_scale / v_scale for an NVFP4 KV
# cache only (cited: tests/data/upstream/pytorch_kv_cache_scales.json).
PYTORCH_FP8_KV_SCALE = 1.0


def _kv_range_check(hf_dir: Path, num_layers: int, target: str, engine_serves_it: bool) -> dict:
    """The HF unified checkpoint's largest FP8 KV scales (k_scale, v_scale: calibrated amax / 448). For the
    pytorch target, whose KV cache runs at PYTORCH_FP8_KV_SCALE, a layer whose K or V amax is beyond what that
    scale can hold (scale > 1) is a StageFailed: the served cache would not hold what calibration saw.
    ``engine_serves_it``: the model's family has the tensorrt target, which the message then offers."""
    from pipeline.quant.hf_checkpoint import kv_scales
    from pipeline.quant.quant_math import FP8_MAX

    scales = kv_scales(hf_dir, num_layers)
    over = [(i, k, v) for i, (k, v) in enumerate(scales) if max(k, v) > PYTORCH_FP8_KV_SCALE]
    if over and targets.get(target).serves_hf_checkpoint:  # TensorRT-LLM's LLM API: one FP8 KV scale
        shown = ", ".join(f"layer {i}: K amax {k * FP8_MAX:.0f}, V amax {v * FP8_MAX:.0f}" for i, k, v in over[:4])
        engine = (", or with build.target: tensorrt, whose engine takes the checkpoint's scale" if engine_serves_it
                  else "")
        raise StageFailed(
            f"build.target pytorch: TensorRT-LLM 1.2's PyTorch backend keeps an FP8 KV cache at scale "
            f"{PYTORCH_FP8_KV_SCALE} (it does not load the checkpoint's k_scale / v_scale for FP8), where FP8 holds "
            f"values up to +-{FP8_MAX:.0f}; calibration found larger keys or values in {len(over)} layer(s) "
            f"({shown}). Serve this model with quantization.kv_cache: none{engine}.")
    return {"k_scale": max(k for k, _ in scales), "v_scale": max(v for _, v in scales), "layers_over_unit_scale": len(over)}


def _read_back_hf(hf_dir: Path, original, evals, kept: set[str], quant: QuantizationSection) -> tuple[dict, dict]:
    """The HF unified checkpoint (what the pytorch target serves) read back by pipeline.quant.hf_checkpoint and
    held to the accuracy gate: ModelOpt's HF export gives each of q/k/v and gate/up one pre-quant scale and one
    input scale and requantizes their weights, so it computes something other than the model the gate measured
    (on a tiny Llama with INT4 AWQ the change was 70 % of quantization's own: tests/test_hf_checkpoint.py).
    Returns (reader facts, the gate's figures); a StageFailed when they fail the gate."""
    from pipeline.quant.hf_checkpoint import rebuild_hf

    model, facts = rebuild_hf(hf_dir, kept)
    model = model.to(_input_device(original))
    acc = _accuracy(original, model, evals)
    log.info("HF unified checkpoint read back: %s", acc)
    failed = _gate_failures(acc, quant)
    if failed:
        raise StageFailed(
            f"the HF unified checkpoint (quantization.export_hf_checkpoint, what the pytorch target serves), read "
            f"back, fails the accuracy gate: {'; '.join(failed)} (perplexity {acc['perplexity_original']} -> "
            f"{acc['perplexity_quantized']}), although the calibrated model passed it. ModelOpt's HF export gives "
            f"q/k/v and gate/up one pre-quant scale and one input scale per group; keep such a group in high "
            f"precision with plan rules, or serve the TensorRT-LLM checkpoint (build.target tensorrt) where the "
            f"model's family has one.")
    return facts, {k: acc[k] for k in ("perplexity_quantized", "perplexity_increase_pct", "top1_agreement",
                                       "kl_divergence")}


READ_BACK_REFERENCE = "read_back_reference.safetensors"  # the streamed pass's original final hidden states


def finish_streamed(model_dir: Path, evaluation_file: Path, plan_file: Path, table_file: Path, out_dir: Path,
                    partial: dict) -> dict:
    """The read-back of a streamed quantize, in a second child process (a fresh interpreter: the streamed
    pass's heap and libraries do not add to its peak); returns the stage's summary."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    from pipeline import compute as comp
    from pipeline.quant import streaming
    from pipeline.quant.plan import read_plan

    t0 = time.perf_counter() - partial["elapsed_s"]
    comp.return_freed_memory_to_the_os()
    table_layers = {l["name"]: l for l in json.loads(table_file.read_text())["layers"]}
    plan_doc = read_plan(plan_file, list(table_layers))
    kept = kept_layers(plan_doc)
    evals = torch.as_tensor(load_file(str(evaluation_file))[artifacts.TOKENS_KEY])
    reference = out_dir / READ_BACK_REFERENCE
    hidden = load_torch(str(reference))["hidden"].to(partial["device"])
    reference.unlink()
    ckpt = out_dir / artifacts.TRTLLM_CHECKPOINT_DIR
    from_ckpt, read_facts = streaming.read_back_streamed(ckpt, model_dir, kept, evals, hidden, partial["device"])
    evaluation_tokens = int(evals.numel())
    del hidden, evals
    comp.trim_heap()
    generations = _streamed_generations(model_dir, ckpt, kept) if partial["greedy_generations"] else []
    return _finish(out_dir, partial["accuracy"], from_ckpt, read_facts, partial["exported"], None, generations, plan_doc,
                   partial["calibration_tokens"], evaluation_tokens, partial["compute"], partial["calibrate_s"], t0,
                   streamed=True)


def _streamed_generations(model_dir: Path, ckpt: Path, kept: set[str]) -> list[dict]:
    """The greedy generations of a streamed quantize: the original model and the written checkpoint, both
    with their decoder layers streamed (one layer in memory at a time; every token reads both models again:
    GREEDY_PROMPTS x GREEDY_NEW_TOKENS forwards each)."""
    from transformers import AutoTokenizer

    from pipeline.quant import streaming
    from pipeline.quant.checkpoint import rebuild

    quantized, _ = rebuild(ckpt, model_dir, kept, streamed=True)
    original = streaming.streamed_original(model_dir, quantized.config)
    rows = _generations(original, quantized, AutoTokenizer.from_pretrained(model_dir))
    log.info("greedy generations, both models streamed (peak RSS %s)", streaming._peak())
    return rows


def run_stage(model_dir: Path, calibration_file: Path, evaluation_file: Path, plan_file: Path, table_file: Path,
              quant: QuantizationSection, build: BuildSection, out_dir: Path, compute: ComputeSection, stream: bool,
              bound, log_path: Path) -> tuple[dict, int]:
    """The stage in child processes: (summary, peak RSS of the largest). A streamed quantize reads its
    checkpoint back in a second child."""
    from pipeline.child import run_in_child

    summary, peak = run_in_child(run_quantize, model_dir, calibration_file, evaluation_file, plan_file, table_file,
                                 quant, build, out_dir, compute, stream, bound, log_path=log_path, what="quantize",
                                 bound=bound)
    if summary.get("read_back_pending"):
        summary, second = run_in_child(finish_streamed, model_dir, evaluation_file, plan_file, table_file, out_dir,
                                       summary, log_path=log_path, what="quantize (read-back)", bound=bound)
        peak = max(peak, second)
    return summary, peak


def _finish(out_dir: Path, accuracy: dict, from_ckpt: dict, read_facts: dict, exported: dict, hf_exported,
            generations: list[dict], plan_doc: dict, calibration_tokens: int, evaluation_tokens: int,
            compute_record: dict, t_quant: float, t0: float,
            streamed: bool = False) -> dict:
    """The accuracy files, and the stage's summary."""
    ckpt = out_dir / artifacts.TRTLLM_CHECKPOINT_DIR
    if not ckpt.is_dir():  # a family exported as the HF unified checkpoint only
        ckpt = out_dir / artifacts.HF_CHECKPOINT_DIR
    accuracy["from_checkpoint"] = {k: from_ckpt[k] for k in ("perplexity_quantized", "perplexity_increase_pct",
                                                             "top1_agreement", "kl_divergence")}
    accuracy["from_checkpoint"]["kv_cache_quantized"] = False  # the CPU runtime (build stage) adds it
    if hf_exported and hf_exported.get("accuracy"):
        accuracy["from_hf_checkpoint"] = {**hf_exported["accuracy"], "kv_cache_quantized": False}
    (out_dir / artifacts.ACCURACY_FILE).write_text(json.dumps({"accuracy": accuracy, "generations": generations}, indent=2))
    (out_dir / artifacts.GENERATIONS_FILE).write_text(_generations_markdown(generations, accuracy, streamed))
    return {"accuracy": accuracy, "checkpoint": {**exported, "read_back": read_facts},
            "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.iterdir()),
            "hf_checkpoint": hf_exported, "layer_streaming": streamed,
            "kept_high_precision": sum(e["format"] == HIGH_PRECISION for e in plan_doc["layers"].values()),
            "calibration_tokens": calibration_tokens, "evaluation_tokens": evaluation_tokens,
            "compute": compute_record,
            "timing_s": {"calibrate": round(t_quant, 1), "total": round(time.perf_counter() - t0, 1)}}


def _gate_failures(acc: dict, quant: QuantizationSection) -> list[str]:
    tol = quant.accuracy
    failed = []
    if acc["perplexity_increase_pct"] > tol.max_perplexity_increase_pct:
        failed.append(f"perplexity +{acc['perplexity_increase_pct']}% > {tol.max_perplexity_increase_pct}%")
    if acc["top1_agreement"] < tol.min_top1_agreement:
        failed.append(f"top-1 agreement {acc['top1_agreement']} < {tol.min_top1_agreement}")
    if acc["kl_divergence"] > tol.max_kl_divergence:
        failed.append(f"KL {acc['kl_divergence']} > {tol.max_kl_divergence}")
    return failed


def _gate(acc: dict, quant: QuantizationSection, plan_doc: dict, table_layers: dict) -> None:
    failed = _gate_failures(acc, quant)
    if not failed:
        return
    col = plan_doc.get("decision_column")
    quantized = [(l["errors"].get(col, {}).get("error", 0.0), n) for n, l in table_layers.items()
                 if plan_doc["layers"][n]["format"] != HIGH_PRECISION]
    worst = [n for _, n in sorted(quantized, reverse=True)[:5]]
    raise StageFailed(
        f"accuracy gate failed: {'; '.join(failed)} (perplexity {acc['perplexity_original']} -> "
        f"{acc['perplexity_quantized']}, top-1 {acc['top1_agreement']}, KL {acc['kl_divergence']} over "
        f"{acc['tokens']} evaluation tokens). Nothing was exported. Try keeping more layers in high precision "
        f"(lower sensitivity.threshold, or plan rules); the most sensitive layers still quantized: {', '.join(worst)}."
    )


def _generations_markdown(rows: list[dict], acc: dict, streamed: bool = False) -> str:
    lines = ["# Greedy generations, original vs quantized (for reading; not gated)", "",
             f"Perplexity {acc['perplexity_original']} -> {acc['perplexity_quantized']} "
             f"(+{acc['perplexity_increase_pct']}%), top-1 agreement {acc['top1_agreement']}, "
             f"KL {acc['kl_divergence']}.", ""]
    if not rows:
        lines += ["Not run (quantization.greedy_generations: false).", ""]
    elif streamed:
        lines += ["Quantized with layer streaming: the quantized side is the written checkpoint read back (as the "
                  "engine gets it), both models streamed a decoder layer at a time.", ""]
    for r in rows:
        lines += [f"**{r['prompt']}**", "", f"- original: {r['original']!r}", f"- quantized: {r['quantized']!r}", ""]
    return "\n".join(lines)
