"""What quantize checks of a plan before any work (the rules users trip on) and of the checkpoints it exported
(the TensorRT-LLM one's quant_algo, layer formats and exclusions; the HF unified one's hf_quant_config.json)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from pipeline import artifacts, families, targets
from pipeline.config import BuildSection, QuantizationSection
from pipeline.errors import InputError, StageFailed
from pipeline.formats import AWQ_FORMATS, HIGH_PRECISION, KV_CACHE_ALGOS, MOE_EXPORT_FORMATS, TRTLLM_QUANT_ALGO
from pipeline.quant.recipe import ROW_PARALLEL, trtllm_name
from pipeline.records import Plan


def check_rules(plan: Plan, quant: QuantizationSection, build: BuildSection, model_config: dict,
                table_layers: dict) -> None:
    """Refuse, before any work, what ModelOpt or TensorRT-LLM would reject later (each message says the fix)."""
    problems = []
    tp = build.tensor_parallel_size
    fam = families.FAMILIES.get(str(model_config.get("model_type")))
    row_parallel: tuple[str, ...] = ROW_PARALLEL
    if fam is not None and fam.moe is not None:
        problems += _moe_problems(plan, fam, model_config, tp)
        row_parallel = (*ROW_PARALLEL, fam.moe.down)  # an expert's down linear is split on its input too
    g = quant.awq_group_size
    for name, layer in plan.layers.items():
        if layer.format in AWQ_FORMATS:
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
        valid = [t for t in range(1, heads + 1) if heads % t == 0 and (kv or heads) % t == 0]
        problems.append(f"build.tensor_parallel_size {tp} must divide the attention heads ({heads}) and KV heads "
                        f"({kv}); valid: {valid}")
    # one GEMM in the checkpoint -> one format: q/k/v always; gate/up in the HF unified checkpoint, and in
    # the TensorRT-LLM one when either is FP8 (TensorRT-LLM fuses them for FP8; ModelOpt's export insists)
    for group, fused in ((("q_proj", "k_proj", "v_proj"), lambda f: True),
                         (("gate_proj", "up_proj"), lambda f: quant.export_hf_checkpoint or "fp8" in f)):
        blocks: dict[str, set] = {}
        for name, layer in plan.layers.items():
            if name.rsplit(".", 1)[-1] in group:
                blocks.setdefault(name.rsplit(".", 1)[0], set()).add(layer.format)
        split = sorted(b for b, f in blocks.items() if len(f) > 1 and fused(f))
        if split:
            members = "/".join(m.removesuffix("_proj") for m in group)
            problems.append(f"{members} of {split[0]} have different formats in the plan ({sorted(blocks[split[0]])}), "
                            f"but they are one fused GEMM in the exported checkpoint: give them the same format "
                            f"(a plan rule such as '{split[0]}.{group[0]}' with the other's format)")
    if quant.export_hf_checkpoint and quant.kv_cache == "int8":
        problems.append("an INT8 KV cache cannot be exported as an HF unified checkpoint; use kv_cache fp8 or none")
    if fam is not None and fam.fused_formats is not None and targets.get(build.target).serves_hf_checkpoint:
        fused_linears, loadable = fam.fused_formats
        wrong = sorted(n for n, layer in plan.layers.items() if n.rsplit(".", 1)[-1] in fused_linears
                       and layer.format not in (HIGH_PRECISION, *loadable))
        if wrong:
            problems.append(f"{wrong[0]} ({plan.layers[wrong[0]].format}, and {len(wrong) - 1} more): "
                            f"TensorRT-LLM's pytorch backend splits {fam.model_type}'s "
                            f"{' and '.join(fused_linears)} itself "
                            f"when loading and carries only per-tensor scales to the halves, so they must be "
                            f"{' or '.join(loadable)} or high precision: add plan rules such as "
                            + ", ".join(f"{{pattern: '*.{f}', format: {loadable[0]}}}" for f in fused_linears))
    if fam is not None and not fam.trtllm_checkpoint and not quant.export_hf_checkpoint:
        problems.append(f"{fam.model_type} is exported as the HF unified checkpoint only (no TensorRT-LLM checkpoint "
                        f"of it can be written here): set quantization.export_hf_checkpoint: true")
    if model_config.get("model_type") not in families.FAMILIES:
        problems.append(f"model type {model_config.get('model_type')!r} has no TensorRT-LLM export mapping here "
                        f"(supported: {', '.join(families.FAMILIES)})")
    if problems:
        raise InputError("quantize: " + "; ".join(problems) + ".")


def _moe_problems(plan: Plan, fam, model_config: dict, tp: int) -> list[str]:
    """What the export cannot write, or the ranks cannot split, for a mixture-of-experts model."""
    problems = []
    bad = sorted({layer.format for n, layer in plan.layers.items()
                  if f".{fam.moe.experts}." in n and layer.format not in (*MOE_EXPORT_FORMATS, HIGH_PRECISION)})
    if bad and fam.trtllm_checkpoint:  # the HF unified export writes each expert as its own linears, in any format
        problems.append(f"the plan gives experts {', '.join(bad)}, which ModelOpt's TensorRT-LLM export cannot write "
                        f"for stacked experts; give them {' or '.join(MOE_EXPORT_FORMATS)} with a plan rule such as "
                        f"{{pattern: '*.experts.*', format: fp8}}, or keep them in high precision")
    # each rank holds a slice of every expert's intermediate dim (ModelOpt's _split_model_config_for_tp)
    inter = model_config.get("moe_intermediate_size") or model_config.get("intermediate_size")
    if inter and inter % tp:
        problems.append(f"build.tensor_parallel_size {tp} does not divide the experts' intermediate size {inter}")
    return problems


def _expected_algo(fmt: str, quant: QuantizationSection) -> dict:
    """What ModelOpt's exporter writes for one layer of format ``fmt`` (quant_utils.process_layer_quant_config)."""
    want: dict[str, object] = {"quant_algo": TRTLLM_QUANT_ALGO[fmt]}
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


def check_export(ckpt: Path, plan: Plan, quant: QuantizationSection, model_config: dict, tp: int = 1) -> dict:
    """What TensorRT-LLM will read must say what the plan says."""
    from safetensors import safe_open

    cfg = json.loads((ckpt / "config.json").read_text())
    q = cfg.get("quantization", {})
    problems = []
    moe = families.FAMILIES[model_config["model_type"]].moe
    kept = {trtllm_name(n, moe) for n in plan.kept_high_precision()}
    formats = plan.quantized_formats()
    if q.get("kv_cache_quant_algo") != KV_CACHE_ALGOS[quant.kv_cache]:
        problems.append(f"kv_cache_quant_algo {q.get('kv_cache_quant_algo')} "
                        f"(expected {KV_CACHE_ALGOS[quant.kv_cache]})")
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
            expected = {trtllm_name(n, moe): _expected_algo(layer.format, quant) for n, layer in plan.layers.items()
                        if layer.format != HIGH_PRECISION}
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


def check_hf_export(hf_dir: Path, plan: Plan, quant: QuantizationSection, model_config: dict,
                     target: str) -> dict:
    """The HF unified checkpoint must say what the plan says, in a config.json transformers can read; its FP8 KV
    scales must fit the target's KV cache (kv_range_check)."""
    from transformers import AutoConfig

    problems = []
    path = hf_dir / artifacts.HF_QUANT_CONFIG_FILE
    if not path.is_file():
        raise StageFailed(f"the HF unified checkpoint in {hf_dir} has no {artifacts.HF_QUANT_CONFIG_FILE}")
    q = json.loads(path.read_text()).get("quantization", {})
    formats = plan.quantized_formats()
    layers = list(plan.layers)
    kept = set(plan.kept_high_precision())
    if q.get("kv_cache_quant_algo") != KV_CACHE_ALGOS[quant.kv_cache]:
        problems.append(f"kv_cache_quant_algo {q.get('kv_cache_quant_algo')} "
                        f"(expected {KV_CACHE_ALGOS[quant.kv_cache]})")
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
        expected = {n: _expected_algo(layer.format, quant) for n, layer in plan.layers.items()
                    if layer.format != HIGH_PRECISION}
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
        fam = families.FAMILIES.get(str(model_config.get("model_type")))
        kv = kv_range_check(hf_dir, model_config["num_hidden_layers"], target,
                             engine_serves_it=fam is None or any(targets.get(t).engine_per_rank for t in fam.targets))
    return {"quant_algo": q.get("quant_algo"), "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
            "exclude_modules": sorted(q.get("exclude_modules") or []),
            "quantized_layers": len(q.get("quantized_layers") or {}) or None, "kv_scales_max": kv,
            "bytes": sum(p.stat().st_size for p in hf_dir.iterdir() if p.is_file())}
# The FP8 KV-cache scale TensorRT-LLM 1.2's PyTorch backend serves with, whatever the checkpoint holds: its
# attention keeps kv_cache_scaling_factor = 1.0 and loads the checkpoint's k_scale / v_scale for an NVFP4 KV
# cache only (cited: tests/data/upstream/pytorch_kv_cache_scales.json).
PYTORCH_FP8_KV_SCALE = 1.0


def kv_range_check(hf_dir: Path, num_layers: int, target: str, engine_serves_it: bool) -> dict:
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
    return {"k_scale": max(k for k, _ in scales), "v_scale": max(v for _, v in scales),
            "layers_over_unit_scale": len(over)}
