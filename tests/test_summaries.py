"""The stage summaries' types (pipeline.summaries) hold every key their readers read, and the adapters return them."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from pipeline import stages, summaries
from pipeline.config import PlanSection, QuantizationSection, SensitivitySection
from pipeline.quant.plan import make_plan

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

PACKAGE = Path(summaries.__file__).parent  # the pipeline package
READERS = [PACKAGE / "release" / "report" / "sections.py", PACKAGE / "release" / "report" / "summary.py",
           PACKAGE / "commands.py"]

# the top-level keys of m["summary"] the readers read, per stage (READERS: the report's sections and summary.json,
# `invoke all`'s last lines); test_every_key_read_is_listed_here keeps this list in step with the code
READS: dict[str, set[str]] = {
    "model": {"source", "model"},  # sections._section_source; summary.build_summary (model, sizes)
    "text": {"calibration", "evaluation", "source_documents"},  # sections._section_text
    "sensitivity": {"decision_column", "calibration_tokens", "layers",
                    "embedding_int8_error", "analysis_s", "compute", "peak_rss_bytes"},  # _section_sensitivity, ran_on
    "plan": {"mode", "formats", "layers", "kept_high_precision", "mixed_precision", "effective_bits_per_weight",
             "weight_bytes_planned", "weight_bytes_fp16", "total_error_left", "budget", "hand_edited",
             "threshold", "over_threshold"},  # _section_plan; _judged_by (the sensitivity section's threshold)
    "quantize": {"checkpoint", "calibration_tokens", "evaluation_tokens", "timing_s", "compute", "peak_rss_bytes",
                 "accuracy", "checkpoint_bytes"},  # section_quantize; summary.build_summary
    "build": {"kv_cache_dtype", "kv_cache_quant_algo", "kv_blocks", "tokens_per_block", "check", "smoke_test",
              "export", "greedy_tokens", "vllm"},  # _section_sizes, _section_build, _vllm_check, kv_cache_receipt
    "publish": {"models", "repository_dir", "versions_kept"},  # sections._section_repository
    "verify": set(),  # the report reads verify_results.json, not the summary
    "bench": {"peak_output_tokens_per_s", "peak_at_concurrency", "knee_concurrency", "knee", "levels",
              "comparison", "sla", "repository_digest"},  # summary.build_summary, hash_chain
    "report": {"five_lines"},  # commands.print_summary
}


def keys(td: type) -> set[str]:
    return set(td.__required_keys__) | set(td.__optional_keys__)


def test_every_stage_has_its_summary_type():
    assert list(summaries.BY_STAGE) == [s.name for s in stages.STAGES]
    assert set(typing.get_args(summaries.StageSummary)) == set(summaries.BY_STAGE.values())


@pytest.mark.parametrize("stage", stages.STAGES, ids=lambda s: s.name)
def test_each_adapter_returns_its_stages_summary(stage):
    assert typing.get_type_hints(stage.run)["return"] is summaries.BY_STAGE[stage.name]


@pytest.mark.parametrize("stage", list(READS))
def test_every_key_the_readers_read_is_in_the_stages_summary(stage):
    missing = READS[stage] - keys(summaries.BY_STAGE[stage])
    assert not missing, f"{summaries.BY_STAGE[stage].__name__} lacks {sorted(missing)}, which the report reads"


def _summary_expr(node: ast.AST, aliases: set[str]) -> bool:
    """m["summary"], m.get("summary"), or a name bound to one (s = m["summary"], or SUMMARY_PARAMS)."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "summary"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "summary")


# functions handed a stage's summary as a parameter, and its name
SUMMARY_PARAMS = {"ran_on": "summary", "_vllm_check": "b", "kv_cache_receipt": "build"}


def _reads(fn: ast.FunctionDef) -> set[str]:
    """The keys read off a summary: x.get("k"), x["k"], "k" in x, dig(x, "k", ...), where x is a summary."""
    aliases = {SUMMARY_PARAMS[fn.name]} if fn.name in SUMMARY_PARAMS else set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if _summary_expr(node.value, set()):
                aliases.add(node.targets[0].id)
    found = set()
    for node in ast.walk(fn):
        key, on = None, None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            key, on = node.args[0].value, node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dig" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            key, on = node.args[1].value, node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key, on = node.slice.value, node.value
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and len(node.comparators) == 1:
            key, on = node.left.value, node.comparators[0]
        if isinstance(key, str) and key != "summary" and on is not None and _summary_expr(on, aliases):
            found.add(key)
    return found


def test_every_key_read_is_listed_here():
    """Keys read off a summary in READERS (found in their syntax) are in READS, so a new read is checked too."""
    listed = set().union(*READS.values())
    for path in READERS:
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and fn.name != "build_summary":  # its s maps stage -> summary
                unlisted = _reads(fn) - listed
                assert not unlisted, f"{path.name}: {fn.name} reads {sorted(unlisted)} off a summary: add to READS"


def test_build_summary_reads_are_in_each_stages_summary():
    """summary.build_summary: s[stage] is that stage's summary; dig(s["stage"], "key", ...) and s["stage"].get."""
    tree = ast.parse((PACKAGE / "release" / "report" / "summary.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "build_summary")
    seen = 0
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dig" \
                and isinstance(node.args[0], ast.Subscript) and isinstance(node.args[0].value, ast.Name) \
                and node.args[0].value.id == "s":
            stage, key = node.args[0].slice.value, node.args[1].value
            assert key in READS[stage] and key in keys(summaries.BY_STAGE[stage]), (stage, key)
            seen += 1
    assert seen >= 10  # the pattern still matches the code


def test_the_plan_summary_is_the_plans_figures_its_budget_mode_and_threshold():
    layer = {"name": "a", "block": 0, "module": "down_proj", "in_features": 64, "out_features": 64,
             "errors": {"int8_sq": {"error": 0.2, "mean": 0.2, "max": 0.2}}}
    doc = make_plan({"layers": [layer], "calibration": {"samples": 1, "seq_len": 1, "tokens": 1}}, PlanSection(),
                    SensitivitySection(formats=("int8_sq",), threshold=0.1),
                    QuantizationSection(weight_format="int8_sq"))
    assert set(doc["summary"]) == keys(summaries.PlanFigures)
    assert set(summaries.PlanSummary.__required_keys__) == keys(summaries.PlanFigures) | {
        "budget", "mode", "threshold", "over_threshold"}
    # the threshold is the plan's to judge: the sensitivity measurement neither reads nor reports it
    assert not {"threshold", "over_threshold"} & keys(summaries.SensitivitySummary)
    # a hand-edited plan: accept_edit's figures over the summary, and the runner's mark
    assert keys(summaries.PlanEditFigures) | {"hand_edited"} <= keys(summaries.PlanSummary)
    plan = next(s for s in stages.STAGES if s.name == "plan")
    assert typing.get_type_hints(plan.accept_edit)["return"] is summaries.PlanEditFigures
