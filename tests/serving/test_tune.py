"""`invoke tune`: the search rule, the choice, the tuned settings file and how publish applies it.

The real-server run (`invoke tune` on the published default) is in test_bench.py (e2e)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import DEFAULT_CONFIG as DEFAULT_CPU_CONFIG
from conftest import REPO

from pipeline import commands
from pipeline.config import load_config
from pipeline.engines.trtllm.targets import serving_llm_api_options
from pipeline.errors import ConfigError, InputError, StageFailed
from pipeline.serving.tune import (
    RESULTS_FILE,
    ab_summary,
    apply_results,
    check_tunable,
    choose,
    confirm,
    gpu_plan,
    plot_points,
    rotated_rounds,
    search,
    table_markdown,
)
from pipeline.serving.tuned import PLAN_FILE, TUNE_DIR, TUNED_FILE, apply_tuned, tuned_fingerprint, with_triton

VLLM_CONFIG = REPO / "engine_configs" / "smollm2-135m-vllm.yaml"

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

ITL = {"itl_ms": 250.0}


def level(goodput: float, met: bool, tok_s: float = 10.0, itl_p99: float = 200.0) -> dict:
    """One measured level as bench.target.run_level gives it, the figures the search reads."""
    return {"sla": {"goodput_rps": goodput, "met": met, "violations": [] if met else ["itl_ms"],
                    "p99_ms": {"itl_ms": itl_p99}},
            "output_tokens_per_s": tok_s, "requests_per_s": goodput, "e2e_ms": {"p99": 9000.0},
            "ttft_ms": {"p99": 2000.0}, "itl_ms": {"p99": itl_p99}}


def curve(table: dict) -> tuple[list[str], object]:
    """A measure function over a table {label: level}, and the labels in the order they were asked for."""
    asked: list[str] = []

    def measure(settings: dict) -> dict:
        key = ", ".join(f"{k}={v}" for k, v in settings.items()) or "default"
        asked.append(key)
        return table[key]
    return asked, measure


def test_search_halves_until_the_sla_holds_then_stops_where_halving_stops_paying():
    asked, measure = curve({"default": level(0.0, False), "max_running=4": level(0.1, False),
                            "max_running=2": level(0.5, True), "max_running=1": level(0.3, True),
                            "adaptive_batch=True": level(0.2, False)})
    points = search(measure, 8, adaptive=True, min_gain=0.05)
    assert asked == ["default", "max_running=4", "max_running=2", "max_running=1", "adaptive_batch=True"]
    chosen, why = choose(points, 0.05)
    assert chosen["settings"] == {"max_running": 2} and "the default does not keep the SLA" in why


def test_with_an_itl_bound_the_search_tries_chunked_prefill_alone_and_with_the_adaptive_limit():
    table = {"default": level(0.0, False), "max_running=4": level(0.1, False), "max_running=2": level(0.2, False),
             "max_running=1": level(0.1, True), "adaptive_batch=True": level(0.2, False),
             "prefill_chunk_tokens=8": level(0.4, True),
             "adaptive_batch=True, prefill_chunk_tokens=8": level(0.5, True)}
    asked, measure = curve(table)
    points = search(measure, 8, adaptive=True, min_gain=0.05, chunk=8)
    assert asked[-3:] == ["adaptive_batch=True", "prefill_chunk_tokens=8",
                          "adaptive_batch=True, prefill_chunk_tokens=8"]
    chosen, _ = choose(points, 0.05)
    assert chosen["settings"] == {"adaptive_batch": True, "prefill_chunk_tokens": 8}
    asked, measure = curve(table)
    search(measure, 8, adaptive=False, min_gain=0.05, chunk=8)  # no ITL bound: what chunking buys is not asked for
    assert not any("prefill_chunk" in a for a in asked)


def test_search_stops_after_one_halving_when_the_default_keeps_the_sla_and_wins():
    asked, measure = curve({"default": level(1.0, True), "max_running=4": level(0.9, True)})
    points = search(measure, 8, adaptive=False, min_gain=0.05)
    assert asked == ["default", "max_running=4"]  # two points: smaller limits only lose throughput
    chosen, why = choose(points, 0.05)
    assert chosen["settings"] == {} and why.startswith("the default is already the optimum")


def test_a_gain_within_noise_keeps_the_default_and_a_real_gain_replaces_it():
    _, measure = curve({"default": level(1.0, True), "max_running=4": level(1.03, True),
                        "max_running=2": level(0.7, True)})
    assert choose(search(measure, 8, adaptive=False, min_gain=0.05), 0.05)[0]["settings"] == {}
    _, measure = curve({"default": level(1.0, True), "max_running=4": level(1.3, True),
                        "max_running=2": level(1.2, True)})
    chosen, why = choose(search(measure, 8, adaptive=False, min_gain=0.05), 0.05)
    assert chosen["settings"] == {"max_running": 4} and "1.30x the default's goodput" in why


def test_no_setting_keeping_the_sla_chooses_nothing_and_names_what_bounds_the_best():
    _, measure = curve({"default": level(0.0, False, itl_p99=900), "max_running=2": level(0.2, False, itl_p99=300),
                        "max_running=1": level(0.1, False, itl_p99=280)})
    chosen, why = choose(search(measure, 4, adaptive=False, min_gain=0.05), 0.05)
    assert chosen is None
    assert "no measured setting keeps the SLA" in why and "max_running=2" in why and "P99 inter-token 300 ms" in why


def test_the_evidence_table_and_plot(tmp_path):
    results = {"sla": ITL, "load": {"requests": 8, "prompt_tokens": 64, "output_tokens": 24, "concurrency": 8},
               "points": [{"label": "default", "settings": {}, "goodput_rps": 0.0, "sla_met": False,
                           "violations": ["itl_ms"], "p99_ms": {"itl_ms": 400.0}, "output_tokens_per_s": 12.0,
                           "ttft_p99_ms": 900.0, "itl_p99_ms": 400.0, "e2e_p99_ms": 9000.0},
                          {"label": "max_running=2", "settings": {"max_running": 2}, "goodput_rps": 0.4,
                           "sla_met": True, "violations": [], "p99_ms": {"itl_ms": 200.0},
                           "output_tokens_per_s": 8.0, "ttft_p99_ms": 3000.0, "itl_p99_ms": 200.0,
                           "e2e_p99_ms": 12000.0}],
               "why": "max_running=2 keeps the SLA",
               "ab": ab_summary([{"default": level(0.0, False, 12.0), "tuned": level(0.4, True, 8.0)},
                                 {"default": level(0.1, False, 11.0), "tuned": level(0.5, True, 9.0)}], ITL)}
    md = table_markdown(results)
    assert "| max_running=2 | 0.40 | 8.0 | 3000 | 200 | 12000 | kept |" in md
    assert "| default | 0.00 | 12.0 | 900 | 400 | 9000 | missed: itl_ms |" in md
    assert "goodput default 0.05, tuned 0.45 req/s (9.00x)" in md
    plot_points(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_the_ab_confirms_a_choice_only_when_its_medians_keep_the_sla():
    chosen = {"settings": {"max_running": 2}, "label": "max_running=2"}

    def ab(tuned_itl: list[float], default_itl: list[float], tuned_good=0.5, default_good=0.2) -> dict:
        return ab_summary([{"tuned": level(tuned_good, i <= 250, itl_p99=i), "default": level(default_good, d <= 250,
                                                                                                itl_p99=d)}
                           for i, d in zip(tuned_itl, default_itl, strict=True)], ITL)

    assert confirm(chosen, ab([200, 240, 900], [400, 500, 450]), ITL) == (chosen, None)  # one noisy round of three
    none, why = confirm(chosen, ab([200, 300, 900], [400, 500, 450]), ITL)
    assert none is None and "median P99 inter-token 300 ms > 250 ms" in why and "tune.ab_rounds" in why
    default, why = confirm(chosen, ab([200, 200, 200], [240, 240, 240], default_good=0.6), ITL)
    assert default["settings"] == {} and why.startswith("the default stays")


@pytest.mark.parametrize("together", [False, True])
def test_rotated_rounds_keep_one_server_up_at_a_time_or_all_and_stop_every_one(together):
    """tune's A/B and optimize's side by side: the order rotated from round to round; "alone" starts each side's
    server for its turn and stops it after (never two up), "together" starts each once; none left up, even when
    a measurement fails. (The sides here are counters, not servers: what is checked is the order of starts,
    measurements and stops; tests/serving/bench/test_bench.py runs tune on real servers.)"""
    up: list[str] = []
    events: list[tuple[str, str, int]] = []

    def side(name):
        def start():
            up.append(name)
            events.append(("start", name, len(up)))
            return name
        return start, (lambda t: (up.remove(t), events.append(("stop", t, len(up)))))

    sides = {k: side(k) for k in ("a", "b", "c")}
    rows = rotated_rounds(sides, 3, lambda t: {"measured": t, "up": len(up)}, together=together)
    assert [list(r) for r in rows] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {r[k]["up"] for r in rows for k in r} == ({3} if together else {1})
    assert sum(e[0] == "start" for e in events) == (3 if together else 9) and up == []

    def fails(t):
        if t == "b":
            raise RuntimeError("the engine died")
        return {}
    with pytest.raises(RuntimeError):
        rotated_rounds(sides, 2, fails, together=together)
    assert up == []


def test_tune_refuses_the_edge_target_and_a_missing_sla_and_takes_the_vllm_target():
    with pytest.raises(InputError, match="set at least one of sla.p99_e2e_ms"):
        check_tunable(load_config(DEFAULT_CPU_CONFIG).config)
    edge = load_config(REPO / "engine_configs" / "smollm2-135m-edge.yaml", ["sla.p99_itl_ms=200"]).config
    with pytest.raises(InputError, match="the edge target's .*are not tuned by it"):
        check_tunable(edge)
    check_tunable(load_config(VLLM_CONFIG, ["sla.p99_itl_ms=200"]).config)  # its max_running: vLLM's max_num_seqs


def test_max_running_is_checked_against_the_build_and_the_target():
    with pytest.raises(ConfigError, match=r"triton.max_running 16: .*at most build.max_batch_size \(8\)"):
        load_config(DEFAULT_CPU_CONFIG, ["triton.max_running=16"])
    with pytest.raises(ConfigError, match=r"triton.max_running 32: .*at most build.max_batch_size \(16\)"):
        load_config(VLLM_CONFIG, ["triton.max_running=32"])
    assert load_config(VLLM_CONFIG, ["triton.max_running=2"]).config.triton.max_running == 2
    with pytest.raises(ConfigError, match="the tensorrt target's limit is build.max_batch_size itself"):
        load_config(REPO / "engine_configs" / "llama-3.1-8b-h100-fp8.yaml", ["triton.max_running=2"])
    with pytest.raises(ConfigError, match="adaptive_batch.*vLLM's scheduler fills its batch"):
        load_config(VLLM_CONFIG, ["triton.adaptive_batch=true", "sla.p99_itl_ms=200"])
    with pytest.raises(ConfigError, match="tune.min_gain"):
        load_config(DEFAULT_CPU_CONFIG, ["tune.min_gain=2"])


# ---------------------------------------------------------------- the tuned settings file, as publish applies it


def work_dir_with(tmp_path, tuned: dict | str, digest: str = "abc") -> object:
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "manifest.json").write_text(json.dumps({"outputs": {"digest": digest}}))
    (tmp_path / TUNE_DIR).mkdir()
    text = tuned if isinstance(tuned, str) else yaml.safe_dump(tuned)
    (tmp_path / TUNE_DIR / TUNED_FILE).write_text(text)
    return tmp_path


TUNED = {"format_version": 1, "triton": {"max_running": 2}, "sla": ITL, "build_digest": "abc"}


def test_publish_applies_the_tuned_settings_the_config_leaves_unset(tmp_path):
    work = work_dir_with(tmp_path, TUNED)
    cfg = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250"]).config
    tuned, summary = apply_tuned(cfg, work)
    assert tuned.triton.max_running == 2 and cfg.triton.max_running is None
    assert summary == {"file": "tune/tuned_settings.yaml", "applied": {"max_running": 2}, "config_wins": {}}
    # a value the config sets itself wins, and the summary says so
    own = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250", "triton.max_running=4"]).config
    tuned, summary = apply_tuned(own, work)
    assert tuned.triton.max_running == 4 and summary["config_wins"] == {"max_running": 4}
    # the file's content is one of publish's inputs; tune.apply: false ignores it
    fingerprint = tuned_fingerprint(cfg, work)
    assert fingerprint["tuned_settings_sha256"] and fingerprint["tuned_settings_apply"]
    off = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250", "tune.apply=false"]).config
    assert apply_tuned(off, work) == (off, {}) and tuned_fingerprint(off, work) == {}


def test_tuned_settings_that_shrink_the_pool_under_the_tenants_block_counts_are_a_clear_error(tmp_path):
    """Tenants given as block counts fit the pool of build.max_batch_size sequences; tune's max_running 2 holds
    fewer blocks, so applying it names the tenants' shares instead of serving a model that cannot load."""
    work = work_dir_with(tmp_path, TUNED)
    base = load_config(DEFAULT_CPU_CONFIG).config
    per_seq = -(-base.build.max_seq_len // base.build.kv_cache.tokens_per_block)
    blocks = per_seq * base.build.max_batch_size // 2 + 1  # fits the whole pool, not two sequences' worth
    assert base.build.max_batch_size > 2 and blocks > 2 * per_seq
    cfg = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250", f"tenants=[{{name: a, kv_blocks: {blocks}}}]"]).config
    with pytest.raises(InputError, match=rf"do not validate with this config \(.*tenants: the KV shares sum to "
                                         rf"{blocks} blocks, past the pool's {2 * per_seq}"):
        apply_tuned(cfg, work)


def test_tuned_settings_for_another_sla_or_build_are_not_applied(tmp_path):
    work = work_dir_with(tmp_path, TUNED)
    other_sla = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=100"]).config
    tuned, summary = apply_tuned(other_sla, work)
    assert tuned.triton.max_running is None and "tuned for the SLA" in summary["not_applied"]
    assert tuned_fingerprint(other_sla, work)["tuned_settings_apply"] is False  # publish reruns when that changes
    (tmp_path / "build" / "manifest.json").write_text(json.dumps({"outputs": {"digest": "rebuilt"}}))
    cfg = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250"]).config
    assert "another build" in apply_tuned(cfg, work)[1]["not_applied"]


@pytest.mark.parametrize("text", ["triton: [", yaml.safe_dump({**TUNED, "triton": {"instance_count": 4}}),
                                  yaml.safe_dump({**TUNED, "format_version": 9})])
def test_a_malformed_tuned_file_is_a_clear_error(tmp_path, text):
    work = work_dir_with(tmp_path, text)
    with pytest.raises(InputError, match="run `invoke tune` again or delete it"):
        apply_tuned(load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250"]).config, work)


# ---------------------------------------------------------------- the GPU targets: a plan here, results from the GPU

H100 = REPO / "engine_configs" / "llama-3.1-8b-h100-fp8.yaml"
PYTORCH = ["build.target=pytorch", "quantization.export_hf_checkpoint=true"]


def test_the_gpu_plan_tunes_what_each_targets_runtime_reads_and_leaves_the_configs_own_keys():
    pytorch = load_config(H100, PYTORCH + ["sla.p99_itl_ms=50"]).config
    assert gpu_plan(pytorch) == [{}, {"scheduler_policy": "max_utilization"},
                                 {"kv_cache_free_gpu_memory_fraction": 0.95}, {"max_running": 64},
                                 {"max_running": 32}, {"adaptive_batch": True}]
    for settings in gpu_plan(pytorch):
        with_triton(pytorch, settings)  # every point is a config this target accepts
    # the tensorrt engine's batch limit is a build setting and its backend reads no dynamic-batch parameter
    tensorrt = load_config(H100, ["sla.p99_itl_ms=50"]).config
    assert gpu_plan(tensorrt) == [{}, {"scheduler_policy": "max_utilization"},
                                  {"kv_cache_free_gpu_memory_fraction": 0.95}]
    own = load_config(H100, ["sla.p99_itl_ms=50", "triton.scheduler_policy=guaranteed_no_evict"]).config
    assert {"scheduler_policy": "max_utilization"} not in gpu_plan(own)  # the config's value wins at publish


def test_the_serving_keys_are_refused_where_the_targets_runtime_has_no_such_setting():
    with pytest.raises(ConfigError, match="the tensorrtllm backend reads no dynamic-batch parameter"):
        load_config(H100, ["triton.adaptive_batch=true"])
    with pytest.raises(ConfigError, match="the tensorrt target's limit is build.max_batch_size itself"):
        load_config(H100, ["triton.max_running=8"])
    with pytest.raises(ConfigError, match="triton.scheduler_policy sets TensorRT-LLM's executor"):
        load_config(DEFAULT_CPU_CONFIG, ["triton.scheduler_policy=max_utilization"])
    with pytest.raises(ConfigError, match="triton.prefill_chunk_tokens is the cpu runtime's chunked prefill"):
        load_config(H100, ["triton.prefill_chunk_tokens=64"])
    with pytest.raises(ConfigError, match="triton.kv_cache_free_gpu_memory_fraction"):
        load_config(DEFAULT_CPU_CONFIG, ["triton.kv_cache_free_gpu_memory_fraction=0.5"])
    assert load_config(H100, PYTORCH + ["triton.adaptive_batch=true"]).config.triton.adaptive_batch  # no SLA needed


def test_invoke_tune_on_a_gpu_target_without_tritonserver_writes_the_plan(tmp_path, capsys):
    out = commands.tune(str(H100), PYTORCH + ["sla.p99_itl_ms=50"], tmp_path)
    plan = yaml.safe_load((tmp_path / "llama-3.1-8b-h100-fp8" / PLAN_FILE).read_text())
    assert [p["settings"] for p in plan["points"]] == [p["settings"] for p in out["points"]]
    assert plan["target"] == "pytorch" and plan["sla"] == {"itl_ms": 50.0} and plan["build_digest"] is None
    assert plan["load"]["loop"] == "closed" and "invoke tune --results FILE" in plan["how"]
    # the H100 profile's bench goes to 128 in flight: each of the 256 clients sends at least one request
    assert plan["load"]["concurrency"] == 256 and plan["load"]["requests"] == 256
    printed = capsys.readouterr().out
    assert "no tritonserver here" in printed and "- max_running=64" in printed


def gpu_results(*measured: tuple[dict, float, float]) -> dict:
    """A tune_results.json as the GPU machine's `invoke tune` writes it (the fields apply_results reads), from
    (settings, goodput, ITL P99) per point; every point claims to keep the SLA."""
    points = []
    for settings, goodput, itl in measured:
        points.append({"label": ", ".join(f"{k}={v}" for k, v in settings.items()) or "default",
                       "settings": settings, "goodput_rps": goodput, "sla_met": True,
                       "violations": [], "p99_ms": {"itl_ms": itl}, "output_tokens_per_s": 100 * goodput,
                       "requests_per_s": goodput, "ttft_p99_ms": 80.0, "itl_p99_ms": itl, "e2e_p99_ms": 900.0})
    return {"format_version": 1, "target": "pytorch", "sla": {"itl_ms": 50.0}, "build_digest": "gpu-build",
            "load": {"concurrency": 64, "requests": 32, "prompt_tokens": 128, "output_tokens": 64, "loop": "closed"},
            "points": points}


def test_results_measured_on_the_gpu_are_chosen_from_here_and_applied_to_that_build(tmp_path):
    cfg = load_config(H100, PYTORCH + ["sla.p99_itl_ms=50"]).config
    # max_running=64 claims the SLA but its P99 is over the bound: judged again here, it is not eligible
    doc = gpu_results(({}, 4.0, 45.0), ({"max_running": 64}, 9.0, 60.0),
                      ({"scheduler_policy": "max_utilization"}, 5.0, 48.0))
    path = tmp_path / RESULTS_FILE
    path.write_text(json.dumps(doc))
    work = tmp_path / "work"
    results = apply_results(cfg, work, path)
    assert results["chosen"]["settings"] == {"scheduler_policy": "max_utilization"}
    assert results["points"][1]["sla_met"] is False and results["points"][1]["violations"] == ["itl_ms"]
    tuned = yaml.safe_load((work / TUNE_DIR / TUNED_FILE).read_text())
    assert tuned["triton"] == {"scheduler_policy": "max_utilization"} and tuned["build_digest"] == "gpu-build"
    assert "measured elsewhere" in (work / TUNE_DIR / "tune.md").read_text()
    # where that build is, publish applies it: the LLM-API options the server loads carry the policy
    (work / "build").mkdir()
    (work / "build" / "manifest.json").write_text(json.dumps({"outputs": {"digest": "gpu-build"}}))
    applied, summary = apply_tuned(cfg, work)
    assert summary["applied"] == {"scheduler_policy": "max_utilization"}
    opts = serving_llm_api_options({"max_batch_size": 128, "kv_cache_config": {"free_gpu_memory_fraction": 0.9}},
                                   applied.triton)
    assert opts["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}


def test_a_choice_the_measuring_runs_ab_did_not_confirm_is_not_applied(tmp_path):
    cfg = load_config(H100, PYTORCH + ["sla.p99_itl_ms=50"]).config
    doc = gpu_results(({}, 4.0, 45.0), ({"max_running": 64}, 6.0, 40.0))
    side = {"goodput_rps": 5.0, "output_tokens_per_s": 500.0, "sla_met_rounds": 1}
    doc["chosen"] = {"label": "max_running=64", "settings": {"max_running": 64}}
    doc["ab"] = {"rounds": 3, "goodput_ratio": 1.0, "output_tokens_per_s_ratio": 1.0,
                 "default": {**side, "p99_ms": {"itl_ms": 45.0}, "sla_kept": True},
                 "tuned": {**side, "p99_ms": {"itl_ms": 70.0}, "sla_kept": False}}  # its medians missed the bound
    path = tmp_path / RESULTS_FILE
    path.write_text(json.dumps(doc))
    with pytest.raises(StageFailed, match="the A/B did not confirm max_running=64"):
        apply_results(cfg, tmp_path / "work", path)
    assert not (tmp_path / "work" / TUNE_DIR / TUNED_FILE).exists()
    doc["ab"]["tuned"].update(p99_ms={"itl_ms": 40.0}, sla_kept=True, goodput_rps=6.0)  # confirmed
    path.write_text(json.dumps(doc))
    results = apply_results(cfg, tmp_path / "work", path)
    assert results["chosen"]["settings"] == {"max_running": 64} and "confirmed by the measuring run's A/B" in \
        results["why"]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(sla={"itl_ms": 80.0}), "measured against the SLA"),
    (lambda d: d["points"][1].update(settings={"instance_count": 2}), r"points\[1\]: settings must be a mapping of"),
    (lambda d: d["points"][1].update(settings={"max_running": 500}), r"points\[1\]: settings .* do not validate"),
    (lambda d: d["points"][1].pop("goodput_rps"), "missing or not a number: goodput_rps"),
    (lambda d: d["points"].pop(0), "the first point must be the default"),
    (lambda d: d.pop("build_digest"), "missing: build_digest"),
])
def test_a_results_file_that_does_not_fit_the_config_is_refused_before_anything_is_written(tmp_path, change,
                                                                                              message):
    cfg = load_config(H100, PYTORCH + ["sla.p99_itl_ms=50"]).config
    doc = gpu_results(({}, 4.0, 45.0), ({"max_running": 64}, 5.0, 40.0))
    change(doc)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=message):
        apply_results(cfg, tmp_path / "work", path)
    assert not (tmp_path / "work" / TUNE_DIR).exists()
