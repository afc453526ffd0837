"""The plan: threshold mode, rules, and budget mode (exact budget, better than keeping the N worst)."""

from __future__ import annotations

import pytest

from pipeline.config import (
    PlanBudget,
    PlanRule,
    PlanSection,
    QuantizationSection,
    SensitivitySection,
)
from pipeline.errors import InputError
from pipeline.formats import HIGH_PRECISION
from pipeline.quant.plan import layer_bytes, make_plan

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

Q = QuantizationSection(weight_format="int8_sq")
S = SensitivitySection(formats=("int8_sq",), threshold=0.1)


def layer(name, error, out_f, in_f, module="down_proj", block=0):
    return {"name": name, "block": block, "module": module, "in_features": in_f, "out_features": out_f,
            "errors": {"int8_sq": {"error": error, "mean": error, "max": error}}}


def table(*layers):
    return {"layers": list(layers), "calibration": {"samples": 1, "seq_len": 1, "tokens": 1}}


def kept(doc):
    return {n for n, e in doc["layers"].items() if e["format"] == HIGH_PRECISION}


def test_threshold_mode_keeps_exactly_the_layers_over_threshold():
    t = table(layer("a", 0.05, 64, 64), layer("b", 0.2, 64, 64), layer("c", 0.1, 64, 64), layer("d", 0.11, 64, 64))
    doc = make_plan(t, PlanSection(), S, Q)
    assert kept(doc) == {"b", "d"}  # 0.1 is not over 0.1
    assert doc["layers"]["b"]["reason"] == "error 0.200 > threshold 0.1"
    assert doc["summary"]["kept_high_precision"] == 2


def test_rules_pin_and_force_formats_last_rule_wins():
    t = table(layer("lm_head", 0.01, 512, 64, "lm_head", -1), layer("x.down_proj", 0.5, 64, 64),
              layer("x.up_proj", 0.01, 64, 64, "up_proj"))
    rules = (PlanRule(pattern="lm_head", keep_high_precision=True),
             PlanRule(pattern="*.down_proj", keep_high_precision=True),
             PlanRule(pattern="x.down_proj", format="int8_wo"))
    doc = make_plan(t, PlanSection(rules=rules), S, Q)
    assert doc["layers"]["lm_head"]["format"] == HIGH_PRECISION
    assert doc["layers"]["x.down_proj"]["format"] == "int8_wo"  # the later rule wins
    assert doc["summary"]["mixed_precision"] is True


# Sizes differ: one big sensitive layer, several small ones that together matter more.
BIG = layer("big", 0.5, 4096, 2048)  # keeping it costs ~8 MiB extra
SMALL = [layer(f"s{i}", 0.3, 1024, 1024) for i in range(3)]  # ~1 MiB extra each
REST = [layer(f"r{i}", 0.01, 1024, 1024) for i in range(4)]


def extra(l):
    return layer_bytes(HIGH_PRECISION, l, 64) - layer_bytes("int8_sq", l, 64)


def floor_bytes(layers):
    return sum(layer_bytes("int8_sq", l, 64) for l in layers)


def naive_keep_worst(layers, budget):
    """Keep the N worst layers, N as large as fits."""
    order = sorted(layers, key=lambda l: -l["errors"]["int8_sq"]["error"])
    used, chosen = floor_bytes(layers), set()
    for l in order:
        if used + extra(l) > budget:
            break
        used += extra(l)
        chosen.add(l["name"])
    return chosen


def error_left(layers, chosen):
    return sum(l["errors"]["int8_sq"]["error"] for l in layers if l["name"] not in chosen)


def test_budget_beats_keeping_the_n_worst_and_respects_the_budget():
    layers = [BIG, *SMALL, *REST]
    budget = floor_bytes(layers) + 3 * extra(SMALL[0]) + 8192  # room for the three small ones, not the big one
    doc = make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(weight_bytes=budget)), S, Q)
    assert doc["summary"]["weight_bytes_planned"] <= budget
    assert doc["budget"]["used_bytes"] == doc["summary"]["weight_bytes_planned"]
    ours = kept(doc)
    assert ours == {"s0", "s1", "s2"}
    naive = naive_keep_worst(layers, budget)
    assert naive == set()  # the worst layer does not fit, so the naive choice keeps nothing
    assert error_left(layers, ours) < error_left(layers, naive)
    assert doc["summary"]["total_error_left"] == pytest.approx(error_left(layers, ours), abs=1e-4)
    assert "weight budget" in doc["budget"]["binding"]


def test_budget_exactly_at_a_plan_size_is_used_and_never_exceeded():
    layers = [BIG, *SMALL, *REST]
    all_fp16 = sum(layer_bytes(HIGH_PRECISION, l, 64) for l in layers)
    doc = make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(weight_bytes=all_fp16)), S, Q)
    assert kept(doc) == {l["name"] for l in layers}  # everything fits: keep every layer with error > 0
    assert doc["summary"]["weight_bytes_planned"] == all_fp16
    assert doc["budget"]["binding"].startswith("none")
    for budget in (floor_bytes(layers) + extra(SMALL[0]) - 1, floor_bytes(layers) + extra(SMALL[0]) + 4096):
        d = make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(weight_bytes=budget)), S, Q)
        assert d["summary"]["weight_bytes_planned"] <= budget


def test_average_bits_budget():
    layers = [BIG, *SMALL, *REST]
    params = sum(l["in_features"] * l["out_features"] for l in layers)
    doc = make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(avg_bits_per_weight=9.0)), S, Q)
    assert doc["summary"]["weight_bytes_planned"] * 8 <= 9.0 * params
    assert doc["summary"]["effective_bits_per_weight"] <= 9.0


def test_budget_below_the_smallest_plan_says_so():
    layers = [BIG, *SMALL]
    with pytest.raises(InputError, match="below the smallest possible plan"):
        make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(weight_bytes=1000)), S, Q)


def test_budget_can_move_layers_to_a_wider_format_instead_of_high_precision():
    q4 = QuantizationSection(weight_format="int4_awq", awq_group_size=64)
    s4 = SensitivitySection(formats=("int4_awq", "int8_wo"))

    def l4(name, e4, e8):
        return {"name": name, "block": 0, "module": "down_proj", "in_features": 1024, "out_features": 1024,
                "errors": {"int4_awq": {"error": e4, "mean": e4, "max": e4},
                           "int8_wo": {"error": e8, "mean": e8, "max": e8}}}

    layers = [l4(f"l{i}", 0.2, 0.01) for i in range(4)]
    base = sum(layer_bytes("int4_awq", l, 64) for l in layers)
    to_int8 = layer_bytes("int8_wo", layers[0], 64) - layer_bytes("int4_awq", layers[0], 64)
    budget = base + 4 * to_int8 + 8192  # room for all four in int8, not for one in FP16 on top
    hp_only = make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(weight_bytes=budget)), s4, q4)
    wider = make_plan(table(*layers), PlanSection(mode="budget", budget=PlanBudget(
        weight_bytes=budget, wider_formats=("int8_wo",))), s4, q4)
    assert {e["format"] for e in wider["layers"].values()} == {"int8_wo"}
    assert wider["summary"]["weight_bytes_planned"] <= budget and hp_only["summary"]["weight_bytes_planned"] <= budget
    assert wider["summary"]["total_error_left"] < hp_only["summary"]["total_error_left"]
    assert wider["summary"]["mixed_precision"] is False


def test_fused_qkv_share_a_format():
    t = table(layer("m.layers.0.self_attn.q_proj", 0.01, 256, 64, "q_proj"),  # the biggest, not sensitive
              layer("m.layers.0.self_attn.k_proj", 0.01, 64, 64, "k_proj"),
              layer("m.layers.0.self_attn.v_proj", 0.3, 64, 64, "v_proj"),
              layer("m.layers.0.self_attn.o_proj", 0.01, 64, 64, "o_proj"))
    doc = make_plan(t, PlanSection(), S, Q)
    assert kept(doc) == {f"m.layers.0.self_attn.{m}_proj" for m in "qkv"}  # v is sensitive: the fused GEMM stays
    assert "fused with v_proj" in doc["layers"]["m.layers.0.self_attn.q_proj"]["reason"]
    qkv = [l for l in t["layers"] if l["module"] != "o_proj"]
    budget = floor_bytes(t["layers"]) + extra(qkv[2]) + 4096  # room for v alone, not the group
    doc = make_plan(t, PlanSection(mode="budget", budget=PlanBudget(weight_bytes=budget)), S, Q)
    assert kept(doc) == set() and doc["summary"]["weight_bytes_planned"] <= budget


def test_the_vllm_target_gives_gate_and_up_one_format():
    """vLLM runs gate/up as one GEMM (TensorRT-LLM keeps them apart): a table made for the vllm target lists
    them as a format group, and the plan keeps the pair together where one of them is sensitive."""
    from pipeline.quant.sensitivity import TRTLLM_FUSION_GROUPS, format_groups

    groups = [list(g) for g in TRTLLM_FUSION_GROUPS]
    assert format_groups("tensorrt", groups) == groups == [["q_proj", "k_proj", "v_proj"]]
    assert format_groups("vllm", groups) == [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]
    t = table(layer("m.layers.0.mlp.gate_proj", 0.3, 128, 64, "gate_proj"),
              layer("m.layers.0.mlp.up_proj", 0.01, 128, 64, "up_proj"),
              layer("m.layers.0.mlp.down_proj", 0.01, 64, 128, "down_proj"))
    apart = make_plan({**t, "fusion_groups": groups, "format_groups": format_groups("tensorrt", groups)},
                      PlanSection(), S, Q)
    assert kept(apart) == {"m.layers.0.mlp.gate_proj"}
    together = make_plan({**t, "fusion_groups": groups, "format_groups": format_groups("vllm", groups)},
                         PlanSection(), S, Q)
    assert kept(together) == {"m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"}
    assert "fused with gate_proj into one GEMM" in together["layers"]["m.layers.0.mlp.up_proj"]["reason"]
