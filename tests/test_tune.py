"""`invoke tune`: the search rule, the choice, the tuned settings file and how publish applies it.

The real-server run (`invoke tune` on the published default) is in test_bench.py (e2e)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import DEFAULT_CONFIG as DEFAULT_CPU_CONFIG
from conftest import REPO

from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError
from pipeline.serving.tune import ab_summary, check_tunable, choose, confirm, plot_points, search, table_markdown
from pipeline.serving.tuned import TUNE_DIR, TUNED_FILE, apply_tuned, tuned_fingerprint

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


def test_tune_refuses_a_gpu_target_and_a_missing_sla():
    with pytest.raises(InputError, match="set at least one of sla.p99_e2e_ms"):
        check_tunable(load_config(DEFAULT_CPU_CONFIG).config)
    vllm = load_config(REPO / "engine_configs" / "smollm2-135m-vllm.yaml", ["sla.p99_itl_ms=200"]).config
    with pytest.raises(InputError, match="the cpu target only; the vllm target's settings"):
        check_tunable(vllm)


def test_max_running_is_checked_against_the_build_and_the_target():
    with pytest.raises(ConfigError, match=r"triton.max_running 16: .*at most build.max_batch_size \(8\)"):
        load_config(DEFAULT_CPU_CONFIG, ["triton.max_running=16"])
    with pytest.raises(ConfigError, match="the vllm target's limit is build.max_batch_size itself"):
        load_config(REPO / "engine_configs" / "smollm2-135m-vllm.yaml", ["triton.max_running=2"])
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
    assert tuned_fingerprint(cfg, work)["tuned_settings_sha256"] and tuned_fingerprint(cfg, work)["tuned_settings_apply"]
    off = load_config(DEFAULT_CPU_CONFIG, ["sla.p99_itl_ms=250", "tune.apply=false"]).config
    assert apply_tuned(off, work) == (off, {}) and tuned_fingerprint(off, work) == {}


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
