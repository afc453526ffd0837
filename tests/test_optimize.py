"""`invoke optimize`: the candidates, the search's rules, and a whole run on the tiny model with real builds, the
real accuracy gate and real Triton servers."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO, tiny_config

from pipeline import artifacts, commands, constants
from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError, StageFailed
from pipeline.optimize import (
    candidate_plans,
    check_optimizable,
    choose,
    confirm,
    halving_schedule,
    override_args,
    pareto_front,
    side_key,
)
from pipeline.release.report.stage import write_report


def _point(candidate, goodput, *, met=True, ppl=1.0, weights=100, settings=None):
    settings = settings or {}
    return {"candidate": candidate, "label": ", ".join(f"{k}={v}" for k, v in settings.items()) or "default",
            "settings": settings, "sla_met": met, "goodput_rps": goodput, "perplexity_increase_pct": ppl,
            "weight_bytes": weights}


def test_without_candidates_the_seed_its_threshold_halved_and_doubled_and_every_layer_quantized_are_tried():
    cfg = load_config(constants.CPU_DEFAULT_CONFIG).config
    plans = candidate_plans(cfg)
    assert [p.name for p in plans] == ["seed", "threshold-0.05", "threshold-0.2", "all-int8_sq"]
    assert plans[0].set == {} and plans[1].set == {"sensitivity.threshold": 0.05}
    # rules first, the last matching wins: the config's own lm_head rule still keeps lm_head
    assert plans[3].set == {"plan.rules": [{"pattern": "*", "format": "int8_sq"},
                                           {"pattern": "lm_head", "keep_high_precision": True}]}
    # each candidate loads as the config with its fields set, in a work dir named after it
    loaded = load_config(constants.CPU_DEFAULT_CONFIG, override_args(plans[3]))
    assert loaded.name == "all-int8_sq" and [r.pattern for r in loaded.config.plan.rules] == ["*", "lm_head"]


def test_a_candidate_may_set_only_the_plan_and_the_quantization_and_seed_is_the_configs_own():
    with pytest.raises(ConfigError, match="quantization.accuracy, the floor"):
        load_config(constants.CPU_DEFAULT_CONFIG,
                    ["optimize.candidates=[{name: a, set: {quantization.accuracy.max_kl_divergence: 1}}]"])
    with pytest.raises(ConfigError, match="not build.max_batch_size"):
        load_config(constants.CPU_DEFAULT_CONFIG, ["optimize.candidates=[{name: a, set: {build.max_batch_size: 2}}]"])
    with pytest.raises(ConfigError, match="named more than once: a"):
        load_config(constants.CPU_DEFAULT_CONFIG, ["optimize.candidates=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match="goal: memory needs min_goodput_rps"):
        load_config(constants.CPU_DEFAULT_CONFIG, ["optimize.goal=memory"])
    seeded = load_config(constants.CPU_DEFAULT_CONFIG, ["optimize.candidates=[{name: seed}]"]).config
    with pytest.raises(InputError, match="'seed' is the config's own plan"):
        candidate_plans(seeded)
    cfg = load_config(constants.CPU_DEFAULT_CONFIG, ["sla.p99_e2e_ms=1000", "optimize.compare_with=[nope]"]).config
    with pytest.raises(InputError, match="compare_with names nope, not a candidate"):
        check_optimizable(cfg)
    gpu = load_config(constants.CPU_DEFAULT_CONFIG, ["sla.p99_e2e_ms=1000", "build.target=tensorrt",
                                                     "build.dtype=float16"]).config
    with pytest.raises(InputError, match="every tensorrt candidate on the image's tritonserver, which is not on PATH"):
        check_optimizable(gpu)  # (this machine has none: the GPU targets are measured where the engine runs)
    with pytest.raises(InputError, match="invoke optimize chooses against the SLA"):
        check_optimizable(load_config(constants.CPU_DEFAULT_CONFIG).config)


def test_an_unreadable_lm_eval_task_stops_optimize_before_any_work(tmp_path, tiny_model_dir):
    cfg = tiny_config(tmp_path, tiny_model_dir)
    task = {"name": "tiny_fact", "path": str(REPO / "tests" / "data" / "lm_eval_tiny")}  # the folder has tiny_facts
    with pytest.raises(InputError, match="no lm-eval task named 'tiny_fact' in the folder"):
        commands.optimize(str(cfg), ["sla.p99_e2e_ms=1000", f"quantization.accuracy.tasks=[{json.dumps(task)}]"],
                          tmp_path / "work")
    assert not (tmp_path / "work" / "tiny").exists()  # not one candidate, not the shared download


def test_halving_rounds_double_the_requests_up_to_the_last_which_has_them_all():
    assert halving_schedule(4, 1, 32, 16) == [16, 32]  # 4 -> 2 -> 1: two rounds
    assert halving_schedule(8, 1, 64, 4) == [16, 32, 64]
    assert halving_schedule(8, 1, 32, 16) == [16, 16, 32]  # at least one request per client
    assert halving_schedule(5, 2, 32, 4) == [16, 32]
    assert halving_schedule(1, 1, 32, 4) == [32] and halving_schedule(2, 2, 32, 4) == [32]


def test_the_front_is_the_points_nothing_beats_on_every_axis():
    a = _point("a", 10, ppl=3, weights=100)
    b = _point("b", 8, ppl=1, weights=100)  # less goodput, better accuracy: on the front
    c = _point("c", 7, ppl=2, weights=100)  # b beats it on both
    d = _point("d", 5, ppl=3, weights=50)  # the smallest: on the front
    assert pareto_front([a, b, c, d]) == [a, b, d]


def test_the_choice_keeps_seed_within_noise_and_the_memory_goal_takes_the_smallest_fast_enough():
    seed, other = _point("seed", 10.0), _point("t", 10.3)
    chosen, why = choose([seed, other], goal="goodput", min_goodput=None, min_gain=0.05)
    assert chosen is seed and "does not beat it by tune.min_gain 5%" in why
    chosen, why = choose([seed, _point("t", 12.0, settings={"max_running": 4})], goal="goodput", min_goodput=None,
                         min_gain=0.05)
    assert chosen["candidate"] == "t" and "1.20x seed's best" in why
    missed = _point("fast", 50.0, met=False)
    chosen, _ = choose([seed, missed], goal="goodput", min_goodput=None, min_gain=0.05)
    assert chosen is seed  # a point missing the SLA is never chosen
    small, big = _point("small", 6.0, weights=50), _point("big", 9.0, weights=100)
    chosen, why = choose([small, big], goal="memory", min_goodput=5.0, min_gain=0.05)
    assert chosen is small and "fewest weight bytes" in why
    chosen, why = choose([small, big], goal="memory", min_goodput=7.0, min_gain=0.05)
    assert chosen is big
    assert choose([missed], goal="goodput", min_goodput=None, min_gain=0.05)[0] is None


def test_the_side_by_side_rounds_confirm_the_choice_or_seed_stays():
    seed, other = _point("seed", 10.0), _point("t", 12.0)
    side = {"rounds": 3, "medians": {"t": {"goodput_rps": 11.0, "sla_kept": True},
                                     "seed": {"goodput_rps": 10.0, "sla_kept": True}}}
    chosen, why = confirm(other, side, [seed, other])
    assert chosen is other and "confirmed side by side" in why
    side["medians"]["seed"]["goodput_rps"] = 11.5
    chosen, why = confirm(other, side, [seed, other])
    assert chosen is seed and "did not confirm" in why
    side["medians"]["seed"]["sla_kept"] = False  # seed faster but outside the SLA: the choice holds
    assert confirm(other, side, [seed, other])[0] is other


@pytest.mark.e2e
def test_invoke_optimize_gates_measures_chooses_and_publishes_and_a_rerun_builds_nothing(tmp_path, monkeypatch,
                                                                                        outlier_model_dir):
    """Four candidates on the tiny outlier model: seed; keep-more (only the threshold differs: it shares seed's
    sensitivity measurement); int4 (INT4 AWQ weights: about 16x the weight error of INT8, past the gate's KL
    bound, which INT8 keeps); broken (a budget no plan fits: its plan stage fails). Then a rerun against an SLA nothing
    keeps: every candidate is up to date, nothing is published, the error names the closest. Last, engines that fail
    every request (the serving model's test-only fault switch): each recorded as failed with its server's log."""
    cfg = tiny_config(tmp_path, outlier_model_dir, "quantization: {kv_cache: int8, accuracy: "
                                                   "{max_perplexity_increase_pct: 100, min_top1_agreement: 0.3, "
                                                   "max_kl_divergence: 0.00001}}")
    overrides = [
        "bench.concurrency=[1,2]", "bench.warmup_requests=1", "bench.prompt_tokens=16", "bench.output_tokens=8",
        "triton.model_name=tiny", "sla.p99_e2e_ms=600000", "tune.requests=4", "tune.concurrency=2",
        "tune.ab_rounds=1",
        "optimize.candidates=[{name: keep-more, set: {sensitivity.threshold: 0.02}}, "
        "{name: int4, set: {quantization.weight_format: int4_awq, quantization.awq_group_size: 32, "
        "plan.decision_format: int8_w8a8}}, "
        "{name: broken, set: {plan.mode: budget, plan.budget: {weight_bytes: 1}}}]",
    ]
    work = tmp_path / "work" / "tiny"
    out = commands.optimize(str(cfg), overrides, tmp_path / "work")
    by = {c["name"]: c for c in out["candidates"]}
    assert [c["name"] for c in out["candidates"]] == ["seed", "keep-more", "int4", "broken"]
    assert by["int4"]["status"] == "gate" and "accuracy gate failed: KL" in by["int4"]["why"]
    assert by["broken"]["status"] == "failed" and "plan.budget (weight_bytes 1)" in by["broken"]["why"]
    assert by["broken"]["log"].endswith("plan.failed.log") and os.path.isfile(by["broken"]["log"])
    for name in ("seed", "keep-more"):
        assert by[name]["status"] == "measured" and by[name]["rounds"][-1]["requests"] == 4
        assert by[name]["accuracy"]["kl_divergence"] <= 0.00001
    # one sensitivity measurement: the candidates' manifests are the config's (a threshold does not change it),
    # the model's weights hard links of the config's
    base = (work / "sensitivity" / "manifest.json").read_text()
    cands = work / "optimize" / "candidates"
    assert (cands / "seed" / "sensitivity" / "manifest.json").read_text() == base
    assert (cands / "keep-more" / "sensitivity" / "manifest.json").read_text() == base
    assert (cands / "int4" / "sensitivity" / "manifest.json").read_text() != base  # the format is measured
    manifest = (cands / "keep-more" / "sensitivity" / "manifest.json").stat().st_ino
    assert manifest != (work / "sensitivity" / "manifest.json").stat().st_ino  # a copy: small files are not linked
    weights = next((work / "model").rglob("*.safetensors"))
    assert (cands / "keep-more" / weights.relative_to(work)).stat().st_ino == weights.stat().st_ino
    # the choice: a measured point keeping the SLA, published from the candidate's own work dir
    chosen = out["chosen"]
    assert chosen["candidate"] in ("seed", "keep-more")
    assert any(p["candidate"] == chosen["candidate"] and p["settings"] == chosen["settings"] and p["sla_met"]
               for p in out["points"])
    published = cands / chosen["candidate"] / "publish" / "manifest.json"
    assert published.is_file()
    tuned = cands / chosen["candidate"] / "tune" / "tuned_settings.yaml"
    assert tuned.is_file() == bool(chosen["settings"])
    applied = json.loads(published.read_text())["summary"].get("tuned_settings") or {}
    assert applied.get("applied", {}) == chosen["settings"]
    results = work / "optimize" / "results"
    table = (results / "optimize.md").read_text()
    for name in ("seed", "keep-more", "int4", "broken"):
        assert f"| {name} |" in table
    assert (results / "pareto.png").stat().st_size > 0 and "Chosen: " in table and "Cost: 4 candidates" in table
    assert out["front"] and out["cost"]["measured"] == 2
    # stages run, read from the manifests: plan, quantize, build; int4's sensitivity and plan (its gate refused it)
    assert [c["stages_run"] for c in out["candidates"]] == [3, 3, 2, 0] and out["cost"]["built"] == 3
    if out["side_by_side"]:  # the search's choice beside seed, one server up at a time; seed stays unless confirmed
        assert out["side_by_side"]["servers"] == "alone" and "one server up at a time, the order rotated" in table
        # a side is a candidate at settings: the search's choice may be seed itself at other serving settings
        first, other = (s["key"] for s in out["side_by_side"]["sides"])
        picked = side_key(chosen["candidate"], chosen["settings"])
        assert other == "seed" and picked in (first, "seed")
        assert ("confirmed side by side" in out["why"]) == (picked == first)

    # the config's report carries the choice, the front and its plot
    report = tmp_path / "report"
    report.mkdir()
    write_report(work, report, load_config(cfg, overrides))
    md = (report / artifacts.REPORT_MD).read_text()
    assert "## Plan and settings chosen together (invoke optimize)" in md and f"**Chosen**: {out['why']}." in md
    assert (report / "img" / "pareto.png").is_file()

    before = published.read_text()
    with pytest.raises(StageFailed, match="no candidate meets the objective.*the closest: (seed|keep-more): P99 "
                                          "end-to-end"):
        commands.optimize(str(cfg), [*overrides, "sla.p99_e2e_ms=1", "optimize.serving_search=false"],
                          tmp_path / "work")
    failed = json.loads((work / "optimize" / "results.failed" / "optimize_results.json").read_text())
    assert failed["chosen"] is None and failed["cost"]["built"] == 0  # every candidate up to date
    int4 = next(c for c in failed["candidates"] if c["name"] == "int4")  # the refusal, not quantized again
    assert int4["status"] == "gate" and "the same inputs as the last run's refusal" in int4["why"]
    assert published.read_text() == before  # nothing published
    assert (results / "optimize_results.json").is_file()  # the last choice's evidence is kept

    # engines failing under measurement: each candidate recorded as failed with its server's log, none chosen
    sys.path.insert(0, str(REPO / "triton_repo" / "common"))
    from llm_watchdog import FAULT_ENV

    fault = tmp_path / "fault"
    fault.write_text("raise")
    monkeypatch.setenv(FAULT_ENV, str(fault))
    with pytest.raises(StageFailed, match="the closest: (seed|keep-more): failed: under measurement"):
        commands.optimize(str(cfg), [*overrides, "optimize.serving_search=false"], tmp_path / "work")
    evidence = work / "optimize" / "results.failed"
    crashed = {c["name"]: c for c in json.loads((evidence / "optimize_results.json").read_text())["candidates"]}
    for name in ("seed", "keep-more"):
        assert crashed[name]["status"] == "failed" and "injected fault" in crashed[name]["why"]
        assert (evidence / crashed[name]["log"]).stat().st_size > 0  # the server's log, kept with the evidence
