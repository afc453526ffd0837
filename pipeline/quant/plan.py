"""plan stage: the mixed-precision plan, one line per linear layer, with the reason for its format.

Modes:
- threshold (default): a layer whose error in the decision format exceeds the threshold stays in high
  precision (FP16/BF16 in the checkpoint);
- budget: given a weight-memory budget (bytes, or average bits per weight over the linear layers), keep
  in high precision the set of layers that removes the most total error while fitting the budget (a 0/1
  knapsack, solved exactly on a 4 KiB grid with sizes rounded up, so the budget is never exceeded);
- rules (both modes, applied first): fnmatch patterns that keep layers in high precision or force a format.

Mixture-of-experts models (pipeline/families.py ``Family.moe``): each layer's router stays in high precision, and
all the experts of a layer get one format (the widest any of them needs in threshold mode, the base format in
budget mode). A rule addresses all the experts of layer 3 as ``model.layers.3.*.experts.*`` and one expert type
(w2) everywhere as ``*.experts.*.w2``; a rule naming experts on a dense model is a config error.

The plan is ``plan.yaml``: small and meant to be read and edited. The runner notices a hand edit; the
edited file is validated and then used as it is by the stages after it.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline import artifacts, families, records
from pipeline.config import PlanSection, QuantizationSection, SensitivitySection
from pipeline.errors import InputError
from pipeline.formats import (
    DECISION_COLUMN,
    HIGH_PRECISION,
    LAYER_FORMATS,
    bits,
    weight_bytes,
)
from pipeline.summaries import PlanFigures

PLAN_FORMAT_VERSION = records.PLAN_FORMAT_VERSION
BUDGET_GRID_BYTES = 4096



@dataclass
class LayerChoice:
    name: str
    format: str
    reason: str
    error: float | None
    params: int
    bytes: int


def decision_format(quant: QuantizationSection) -> str | None:
    return DECISION_COLUMN.get(quant.weight_format)


def layer_bytes(fmt: str, layer: dict, group_size: int) -> int:
    return weight_bytes(fmt, layer["out_features"], layer["in_features"], group_size)


def make_plan(table: dict, plan: PlanSection, sens: SensitivitySection, quant: QuantizationSection) -> dict:
    layers = table["layers"]
    base = quant.weight_format
    col = plan.decision_format or decision_format(quant)
    g = quant.awq_group_size
    choices: dict[str, LayerChoice] = {}

    def err(layer: dict, fmt: str) -> float | None:
        column = col if fmt == base else DECISION_COLUMN.get(fmt, fmt)
        e = layer["errors"].get(column)
        return e["error"] if e else None

    model_type = table.get("model", {}).get("model_type", "this model")
    fam = families.FAMILIES.get(model_type)
    moe = fam.moe if fam else None
    _check_expert_rules(plan, moe, model_type)
    # rules first: the last matching rule wins, as in ModelOpt's ordered configs
    free = []
    for layer in layers:
        if layer["module"] == "router":
            choices[layer["name"]] = _choice(layer, HIGH_PRECISION, ROUTER_REASON, err(layer, base), g)
            continue
        rule = None
        for r in plan.rules:
            if fnmatch.fnmatchcase(layer["name"], r.pattern):
                rule = r
        if base == "none":
            fmt, why = HIGH_PRECISION, "quantization.weight_format is none"
        elif rule is not None and rule.keep_high_precision:
            fmt, why = HIGH_PRECISION, f"rule '{rule.pattern}': keep high precision"
        elif rule is not None:
            if rule.format is None:  # PlanRule's validator: a rule sets keep_high_precision or a format
                raise InputError(f"plan rule '{rule.pattern}' sets neither keep_high_precision: true nor a format")
            fmt = rule.format if rule.format != "none" else HIGH_PRECISION
            why = f"rule '{rule.pattern}': format {rule.format}"
        else:
            free.append(layer)
            continue
        choices[layer["name"]] = LayerChoice(layer["name"], fmt, why,
                                             err(layer, fmt if fmt != HIGH_PRECISION else base),
                                             layer["in_features"] * layer["out_features"], layer_bytes(fmt, layer, g))

    binding = None
    if plan.mode == "threshold":
        for layer in free:
            e = err(layer, base)
            if e is not None and e > sens.threshold:
                choices[layer["name"]] = _choice(layer, HIGH_PRECISION, f"error {e:.3f} > threshold {sens.threshold}",
                                                 e, g)
            else:
                choices[layer["name"]] = _choice(layer, base, f"error {e:.3f} <= threshold {sens.threshold}", e, g)
    else:
        binding = _budget(free, choices, plan=plan, base=base, err=err, g=g)
    _align_fused(choices, table, base, g, widen=plan.mode == "threshold")
    if moe is not None:
        _align_experts(choices, table, moe=moe, base=base, g=g, widen=plan.mode == "threshold")
    if binding is not None:
        binding["used_bytes"] = sum(c.bytes for c in choices.values())
        binding["slack_bytes"] = binding["budget_bytes"] - binding["used_bytes"]

    ordered = [choices[l["name"]] for l in layers]
    return _summarise(ordered, table, plan=plan, sens=sens, quant=quant, col=col, binding=binding)


def _align_fused(choices: dict, table: dict, base: str, g: int, widen: bool) -> None:
    """Layers the target runs as one GEMM (q/k/v; gate/up as well for the HF unified checkpoint and for vLLM:
    the table's ``format_groups``) must share a format. Threshold mode widens the group to its widest member's
    format (the sensitive one wins); budget mode narrows it to the base format, which can only lower the
    bytes used."""
    groups = table.get("format_groups") or table.get("fusion_groups") or [["q_proj", "k_proj", "v_proj"]]
    by_block: dict[tuple, list[str]] = {}
    for name in choices:
        prefix, short = name.rsplit(".", 1) if "." in name else ("", name)
        for gi, group in enumerate(groups):
            if short in group:
                by_block.setdefault((prefix, gi), []).append(name)
    _one_format_each(choices, table, groups=by_block.values(), base=base, g=g, widen=widen,
                     rank=lambda m: bits(choices[m].format),
                     why=lambda leader, layer: f"fused with {layer['module']} into one GEMM: follows its format")


def _one_format_each(choices: dict, table: dict, *, groups, base: str, g: int, widen: bool, rank, why) -> None:
    """Give each group of layers one format: the format of its highest-``rank`` member when ``widen``, else the
    base format where a member has it; the others are rewritten with the reason ``why(leader, leader's layer)``."""
    layers = {l["name"]: l for l in table["layers"]}
    for members in groups:
        if len({choices[m].format for m in members}) < 2:
            continue
        if widen:
            leader = max(members, key=rank)
        else:
            leader = next((m for m in members if choices[m].format == base), members[0])
        fmt = choices[leader].format
        for m in members:
            if choices[m].format != fmt:
                choices[m] = _choice(layers[m], fmt, why(leader, layers[leader]), choices[m].error, g)


ROUTER_REASON = "MoE router: kept in high precision (ModelOpt exports it in fp32)"


def _check_expert_rules(plan: PlanSection, moe, model_type: str) -> None:
    """A rule naming experts on a dense model, or giving a router a format, cannot be carried out."""
    for r in plan.rules:
        if moe is None and "expert" in r.pattern:
            raise InputError(f"plan rule '{r.pattern}' names experts, but {model_type} is a dense model: it has no "
                             f"experts. Remove the rule, or point the config at a mixture-of-experts model.")
        if moe is not None and not r.keep_high_precision and fnmatch.fnmatchcase(f"model.layers.0.{moe.router}",
                                                                                 r.pattern):
            raise InputError(f"plan rule '{r.pattern}' gives the MoE routers ({moe.router}) format {r.format}; "
                             f"routers stay in high precision (ModelOpt exports them in fp32). Narrow the pattern.")


def _align_experts(choices: dict, table: dict, *, moe, base: str, g: int, widen: bool) -> None:
    """All the experts of a layer get one format: the checkpoint stacks them (one tensor per expert type) and
    TensorRT-LLM's fused MoE layer runs them with one quantization method. Threshold mode widens them to the
    widest any expert needs; budget mode narrows them to the base format."""
    by_block: dict[int, list[str]] = {}
    for layer in table["layers"]:
        if layer["module"].startswith("experts."):
            by_block.setdefault(layer["block"], []).append(layer["name"])
    _one_format_each(choices, table, groups=by_block.values(), base=base, g=g, widen=widen,
                     rank=lambda m: (bits(choices[m].format), choices[m].error or 0.0),
                     why=lambda leader, layer: f"the experts of layer {layer['block']} share one format in the "
                                               f"checkpoint: follows {layer['module']}")


def _choice(layer: dict, fmt: str, reason: str, error: float | None, g: int) -> LayerChoice:
    return LayerChoice(layer["name"], fmt, reason, error, layer["in_features"] * layer["out_features"],
                       layer_bytes(fmt, layer, g))


def _budget(free: list[dict], choices: dict, *, plan: PlanSection, base: str, err, g: int) -> dict:
    """Choose, per free layer, the base format, a wider format from budget.wider_formats, or high precision,
    to remove the most total error within the budget: a multiple-choice knapsack solved exactly on a 4 KiB
    grid with every option's extra bytes rounded up, so the result never exceeds the budget."""
    import numpy as np

    all_params = sum(c.params for c in choices.values()) + sum(l["in_features"] * l["out_features"] for l in free)
    spec = plan.budget
    if spec is not None and spec.weight_bytes is not None:
        budget = spec.weight_bytes
        what = f"weight_bytes {budget}"
    elif spec is not None and spec.avg_bits_per_weight is not None:
        budget = int(spec.avg_bits_per_weight * all_params // 8)
        what = f"avg_bits_per_weight {spec.avg_bits_per_weight} = {budget} bytes over {all_params} weights"
    else:  # PlanSection's and PlanBudget's validators give mode: budget exactly one of the two
        raise InputError("plan.mode: budget needs plan.budget: {weight_bytes: N} or {avg_bits_per_weight: X}")
    fixed = sum(c.bytes for c in choices.values())
    base_bytes = [layer_bytes(base, l, g) for l in free]
    floor = fixed + sum(base_bytes)
    if floor > budget:
        raise InputError(
            f"plan.budget ({what}) is below the smallest possible plan: {floor} bytes with every free layer in "
            f"{base} and the rules' choices. Raise the budget, or relax the rules that keep layers in high precision."
        )
    cap = (budget - floor) // BUDGET_GRID_BYTES
    base_err = [err(l, base) or 0.0 for l in free]
    # options per layer: (format, extra grid units over the base format, error removed)
    options: list[list[tuple[str, int, float]]] = []
    for layer, b, e in zip(free, base_bytes, base_err):
        opts = []
        for fmt in (*spec.wider_formats, HIGH_PRECISION):
            extra = layer_bytes(fmt, layer, g) - b
            fmt_err = 0.0 if fmt == HIGH_PRECISION else err(layer, fmt)
            if extra > 0 and fmt_err is not None and e - fmt_err > 0:
                opts.append((fmt, -(-extra // BUDGET_GRID_BYTES), e - fmt_err))
        options.append(opts)
    best = np.zeros(cap + 1)
    pick = np.full((len(free), cap + 1), -1, dtype=np.int8)  # option index chosen at each capacity
    for i, opts in enumerate(options):
        new = best.copy()
        for k, (_, u, gain) in enumerate(opts):
            if u > cap:
                continue
            cand = best[: cap + 1 - u] + gain
            better = cand > new[u:]
            new[u:] = np.where(better, cand, new[u:])
            pick[i, u:] = np.where(better, k, pick[i, u:])
        best = new
    c = int(np.argmax(best))
    chosen: dict[int, int] = {}
    for i in range(len(free) - 1, -1, -1):
        k = int(pick[i, c])
        if k >= 0:
            chosen[i] = k
            c -= options[i][k][1]
    for i, layer in enumerate(free):
        if i in chosen:
            fmt, _, gain = options[i][chosen[i]]
            why = f"budget: {fmt} removes error {gain:.3f} of {base_err[i]:.3f}"
            choices[layer["name"]] = _choice(layer, fmt, why,
                                             base_err[i] if fmt == HIGH_PRECISION else err(layer, fmt), g)
        else:
            choices[layer["name"]] = _choice(layer, base, f"budget: error {base_err[i]:.3f} left (no room)",
                                             base_err[i], g)
    used = sum(c.bytes for c in choices.values())
    slack = budget - used
    # the budget binds when some layer did not get its most accurate option; say how close it came
    upgrades = []
    for i, opts in enumerate(options):
        got_gain, got_units = (options[i][chosen[i]][2], options[i][chosen[i]][1]) if i in chosen else (0.0, 0)
        for _, u, gain in opts:
            if gain > got_gain:
                upgrades.append((u - got_units) * BUDGET_GRID_BYTES)
    if upgrades:
        binding = (f"the weight budget: {len(upgrades)} better option(s) left out; the cheapest needs "
                   f"{min(upgrades):,} more bytes, {slack:,} are left")
    else:
        binding = "none: every free layer got its most accurate allowed format"
    return {"budget_bytes": budget, "budget": what, "used_bytes": used, "slack_bytes": slack, "binding": binding}


def _summarise(ordered: list[LayerChoice], table: dict, *, plan: PlanSection, sens: SensitivitySection,
               quant: QuantizationSection, col: str | None, binding: dict | None) -> dict:
    fp16 = sum(layer_bytes(HIGH_PRECISION, l, quant.awq_group_size) for l in table["layers"])
    planned = sum(c.bytes for c in ordered)
    params = sum(c.params for c in ordered)
    kept = [c.name for c in ordered if c.format == HIGH_PRECISION]
    formats = sorted({c.format for c in ordered})
    figures: PlanFigures = {
        "layers": len(ordered),
        "kept_high_precision": len(kept),
        "kept_high_precision_layers": kept,
        "formats": formats,
        "mixed_precision": len([f for f in formats if f != HIGH_PRECISION]) > 1,
        "weight_bytes_fp16": fp16,
        "weight_bytes_planned": planned,
        "effective_bits_per_weight": round(planned * 8 / params, 3) if params else None,
        "total_error_left": round(sum(c.error or 0.0 for c in ordered if c.format != HIGH_PRECISION), 5),
    }
    return {
        "format_version": PLAN_FORMAT_VERSION,
        "base_format": quant.weight_format,
        "kv_cache": quant.kv_cache,
        "decision_column": col,
        "mode": plan.mode,
        "threshold": sens.threshold if plan.mode == "threshold" else None,
        "budget": binding,
        # error: the layer's measured error in the format it was judged by (also for kept layers)
        "layers": {c.name: {"format": c.format, "error": None if c.error is None else round(c.error, 5),
                            "reason": c.reason} for c in ordered},
        "summary": figures,
    }


def write_plan(plan: records.Plan, out_dir: Path, config_name: str) -> None:
    header = (
        f"# Mixed-precision plan for {config_name} (written by the plan stage).\n"
        f"# Each linear layer: its format (high_precision = kept in FP16/BF16) and why. You may edit `format`\n"
        f"# (one of: {', '.join(LAYER_FORMATS)}); the next stages use the edited file as it is.\n"
    )
    records.write_plan(out_dir / artifacts.PLAN_FILE, plan, header)


def over_threshold(table: dict, threshold: float) -> dict[str, int]:
    """Per measured format, how many of the sensitivity table's layers have an error over ``threshold``. The plan
    stage's figure: the sensitivity stage does not read the threshold, so one measurement serves every threshold."""
    fmts = list(table["layers"][0]["errors"]) if table["layers"] else []
    return {f: sum(1 for l in table["layers"] if l["errors"][f]["error"] > threshold) for f in fmts}


def plan_markdown(doc: dict, over: dict[str, int] | None = None) -> str:
    """plan.md; ``over``: over_threshold's counts (threshold mode)."""
    s = doc["summary"]
    lines = [f"# Plan: {doc['base_format']} weights, {doc['kv_cache']} KV cache ({doc['mode']} mode)", "",
             f"- layers: {s['layers']}, kept in high precision: {s['kept_high_precision']}",
             f"- weight bytes: {s['weight_bytes_planned']:,} planned vs {s['weight_bytes_fp16']:,} all-FP16 "
             f"({s['effective_bits_per_weight']} bits per weight)"]
    if doc.get("threshold") is not None:
        col = f" (decides on the `{doc['decision_column']}` column)" if doc.get("decision_column") else ""
        counts = ", ".join(f"{f} {n}" for f, n in (over or {}).items())
        lines.append(f"- threshold {doc['threshold']}{col}; layers over it per measured format: "
                     f"{counts or 'not counted'}")
    if doc.get("budget"):
        lines.append(f"- budget: {doc['budget']['budget']}; used {doc['budget']['used_bytes']:,} bytes; "
                     f"binding: {doc['budget']['binding']}")
    lines += ["", "| layer | format | error | reason |", "|---|---|---|---|"]
    for name, e in doc["layers"].items():
        if e["format"] == HIGH_PRECISION or "rule" in e["reason"]:
            lines.append(f"| {name} | {e['format']} | {e['error']} | {e['reason']} |")
    lines.append("")
    lines.append("(Only layers kept in high precision or set by a rule are listed; plan.yaml has every layer.)")
    return "\n".join(lines) + "\n"


def table_layers(table_path: Path) -> list[str]:
    return [l["name"] for l in json.loads(table_path.read_text())["layers"]]
