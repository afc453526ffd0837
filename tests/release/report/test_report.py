"""report: every figure on the page and in summary.json is the one its stage's manifest recorded."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline import artifacts
from pipeline.release.report.document import Doc
from pipeline.release.report.stage import render
from pipeline.release.report.summary import five_lines
from pipeline.release.report.workdir import STAGES as REPORTED_STAGES


def _manifest(stage: str, summary: dict, upstream: dict | None = None, digest: str = "d" * 64) -> dict:
    """A manifest in the runner's layout (format 1), as the stages write them."""
    return {"format_version": 1, "stage": stage, "status": "ok", "config_name": "synthetic", "config_files": [],
            "overrides": [], "input_hash": "0" * 64,
            "inputs": {"stage": stage, "stage_version": 1, "pipeline_version": "0.1.0", "config": {},
                       "upstream": upstream or {}, "external": {}},
            "outputs": {"digest": digest, "total_bytes": 0, "files": {}}, "summary": summary,
            "tool_versions": {"python": "3.11", "torch": "2.13.0+cpu"}, "started_at": "2026-11-30T10:00:00+00:00",
            "finished_at": "2026-11-30T10:00:01+00:00", "duration_s": 1.0}


def test_stages_not_run_are_said_so(tmp_path):
    work = tmp_path / "synthetic"
    (work / "model").mkdir(parents=True)
    model_summary = {"model": {"architecture": "LlamaForCausalLM", "num_parameters": 1234567, "weight_bytes": 4938268},
                     "source": {"kind": "local"}}
    (work / "model" / "manifest.json").write_text(json.dumps(_manifest("model", model_summary)))
    (work / "text").mkdir()
    failed = _manifest("text", {}, {"model": "d" * 64})
    failed["status"] = "failed"  # a failed run is not a result
    (work / "text" / "manifest.json").write_text(json.dumps(failed))
    out = tmp_path / "report"
    out.mkdir()
    summary = render(work, out)
    assert summary["stages"] == {s: ("ok" if s == "model" else "not run") for s in REPORTED_STAGES}
    assert summary["model"] == model_summary["model"]
    assert summary["sizes"]["model_weight_bytes"] == 4938268
    assert summary["accuracy"] is None and summary["bench"] is None and summary["verify"] is None
    md = (out / "index.md").read_text()
    for stage, task in (("quantize", "quantize"), ("verify", "verify"), ("bench", "bench"), ("plan", "sensitivity"),
                        ("text", "download")):
        assert f"**not run**: the `{stage}` stage has no manifest in this work dir (`invoke {task}` runs it)." in md
    assert "4,938,268" in md  # the model's weight bytes, as recorded
    lines = five_lines(summary)
    assert len(lines) == 5 and lines[1] == "accuracy: not run" and lines[4] == "speed: bench not run"
    html = (out / "index.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<strong>not run</strong>" in html


@pytest.mark.parametrize("plan, said", [
    ({"mode": "threshold", "threshold": 0.2, "over_threshold": {"int8_sq": 3}},
     ["the `int8_sq` column with threshold 0.2.", "| over the plan's threshold | int8_sq: 3 |"]),
    ({"mode": "budget", "threshold": None, "over_threshold": None},
     ["the `int8_sq` column in budget mode (no threshold).", "| over the plan's threshold | — |"]),
    (None, ["the `int8_sq` column (its threshold is the plan stage's, which has not run)."]),
])
def test_the_sensitivity_section_says_the_plans_threshold(tmp_path, plan, said):
    """The sensitivity stage does not read the threshold (one measurement serves every threshold): the report's
    sensitivity section takes it, and the layers over it, from the plan's manifest."""
    work = tmp_path / "synthetic"
    sens = {"layers": 15, "decision_column": "int8_sq", "calibration_tokens": 256}
    for stage, summary in (("sensitivity", sens), ("plan", plan)):
        if summary is not None:
            (work / stage).mkdir(parents=True)
            (work / stage / "manifest.json").write_text(json.dumps(_manifest(stage, summary)))
    out = tmp_path / "report"
    out.mkdir()
    render(work, out)
    md = (out / "index.md").read_text()
    for line in said:
        assert line in md


@pytest.mark.parametrize("gate, build, served, measured_by", [
    ("int8", {"kv_cache_dtype": "fp8", "check": {"kv_cache": {"dtype": "fp8"}}}, "fp8", ["the build's vLLM check"]),
    ("fp8", {"kv_cache_dtype": "fp8_e4m3", "check": {"kv_cache": {"dtype": "fp8_e4m3"}}}, "fp8",
     ["the accuracy gate", "the build's vLLM check"]),
    ("none", {"kv_cache_dtype": "auto", "check": {"kv_cache": {"dtype": "auto"}}}, "none",
     ["the accuracy gate", "the build's vLLM check"]),
    ("int8", {"kv_cache_quant_algo": "INT8"}, "int8", ["the accuracy gate"]),
    ("fp8", {"kv_cache_quant_algo": "FP8"}, "fp8", ["the accuracy gate"]),
])
def test_the_kv_cache_served_and_what_measured_it(gate, build, served, measured_by):
    """vLLM picks its own KV dtype (an INT8 plan is served as FP8) and measures it in its build check; the
    TensorRT-LLM targets and the cpu runtime serve the checkpoint's, the format the gate simulated."""
    from pipeline.release.report.summary import kv_cache_receipt, kv_cache_sentence

    target = "vllm" if "kv_cache_dtype" in build else "cpu"
    kv = kv_cache_receipt(gate, build, target)
    assert kv == {"served": served, "target": target, "gate": gate, "measured_by": measured_by}
    text = kv_cache_sentence(kv)
    assert ("(the accuracy gate measured" in text) is ("the accuracy gate" not in measured_by)
    assert kv_cache_receipt(gate, None, target) is None and kv_cache_sentence(None) == "KV cache: build not run"


def test_unreadable_files_read_as_not_run(tmp_path):
    """The report reads leniently: a garbled provenance, build settings or result file is shown as absent."""
    work = tmp_path / "synthetic"
    (work / "publish").mkdir(parents=True)
    (work / "publish" / "manifest.json").write_text(json.dumps(_manifest("publish", {"models": ["m"]})))
    for path in (artifacts.published_repository(work) / artifacts.PROVENANCE_FILE,
                 work / "build" / artifacts.BUILD_SETTINGS_FILE, work / "verify" / artifacts.VERIFY_RESULTS_FILE,
                 artifacts.published_repository(work) / "m" / artifacts.MODEL_CONFIG_FILE):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{not json")
    out = tmp_path / "report"
    out.mkdir()
    summary = render(work, out)
    assert summary["repository"] is None and summary["verify"] is None and summary["target"] is None
    assert summary["stages"]["publish"] == "ok" and summary["hash_chain_ok"] is None
    assert "| `m` | — | — | — | — | — | 0 | 0.0 MiB |" in (out / "index.md").read_text()


def test_markdown_and_html_say_the_same():
    doc = Doc()
    doc.h(2, "A <section> & more")
    doc.p("value `a|b` and **bold** ✓")
    doc.table(["k", "v"], [["pipe|cell", 1.23456789], ["none", None], ["big", 123456]])
    md, html = doc.markdown(), doc.html("t")
    assert "## A <section> & more" in md and "pipe\\|cell" in md and "1.235" in md and "123,456" in md and "—" in md
    assert "A &lt;section&gt; &amp; more" in html and "<code>a|b</code>" in html and "<strong>bold</strong>" in html
    assert '<span class="ok">✓</span>' in html and "<td>1.235</td>" in html and "<td>123,456</td>" in html
    assert 'href="#a--section----more"' in html


# ---------------------------------------------------------------- a real (tiny) run, through the report


RUN_SETS = ["bench.concurrency=[1,2]", "bench.requests_per_level=4", "bench.warmup_requests=1",
            "bench.prompt_tokens=16", "bench.output_tokens=8", "triton.model_name=tiny"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    """The tiny model through every stage, the report included, with a small bench."""
    from conftest import tiny_config

    from pipeline.config import load_config
    from pipeline.runner import Runner
    from pipeline.stages import STAGES

    tmp = tmp_path_factory.mktemp("report_tiny")
    cfg = tiny_config(tmp, tiny_model_dir, "quantization: {kv_cache: int8, accuracy: {max_perplexity_increase_pct: "
                                           "100, min_top1_agreement: 0.3, max_kl_divergence: 2}}")
    loaded = load_config(cfg, RUN_SETS)
    runner = Runner(loaded, STAGES, tmp / "work")
    runner.run(["report"], echo=lambda s: None)
    return runner.work_dir


def _m(work: Path, stage: str) -> dict:
    return json.loads((work / stage / "manifest.json").read_text())


@pytest.mark.e2e
def test_report_figures_equal_the_manifests(tiny_run):
    work = tiny_run
    out = work / "report"
    s = json.loads((out / "summary.json").read_text())
    q, p, b, mo = (_m(work, x)["summary"] for x in ("quantize", "plan", "build", "model"))
    prov = json.loads((work / "publish" / "model_repository" / "provenance.json").read_text())
    verify = json.loads((work / "verify" / "verify_results.json").read_text())
    bench_summary = _m(work, "bench")["summary"]

    assert s["stages"] == {st: "ok" for st in REPORTED_STAGES}
    assert s["model"] == mo["model"]
    assert s["accuracy"] == q["accuracy"]
    assert s["accuracy_gate"] == _m(work, "quantize")["inputs"]["config"]["quantization"]["accuracy"]
    assert s["quantization"]["kept_high_precision"] == p["kept_high_precision"]
    assert s["quantization"]["effective_bits_per_weight"] == p["effective_bits_per_weight"]
    assert s["quantization"]["quant_algo"] == q["checkpoint"]["quant_algo"]
    assert s["sizes"]["checkpoint_bytes"] == q["checkpoint_bytes"]
    # the cpu target's runtime serves the checkpoint's INT8 KV cache: the format the gate simulated
    assert s["kv_cache"] == {"served": "int8", "target": "cpu", "gate": "int8", "measured_by": ["the accuracy gate"]}
    assert "KV cache int8 served (cpu target), measured by the accuracy gate" in five_lines(s)[2]
    assert s["sizes"]["weight_bytes_planned"] == p["weight_bytes_planned"]
    assert s["sizes"]["kv_cache_pool_bytes"] == b["smoke_test"]["kv_pool_bytes"]
    assert s["sizes"]["kv_cache_bytes_per_token"] == b["smoke_test"]["kv_pool_bytes"] / (b["kv_blocks"] *
                                                                                        b["tokens_per_block"])
    assert s["repository"]["repository_digest"] == prov["repository_digest"] == bench_summary["repository_digest"]
    assert s["verify"]["checks"] == len(verify["checks"]) and s["verify"]["ok"] is verify["ok"] is True
    assert s["bench"]["levels"] == bench_summary["levels"]
    assert s["bench"]["peak_output_tokens_per_s"] == bench_summary["peak_output_tokens_per_s"]
    assert s["hash_chain_ok"] is True
    links = {(l["stage"], l["upstream"]) for l in s["hash_chain"]}
    assert {("quantize", "model"), ("build", "quantize"), ("publish", "build"), ("bench", "publish"),
            ("publish", "build (checkpoint_sha256)"), ("bench", "publish (repository_digest)")} <= links

    md, html = (out / "index.md").read_text(), (out / "index.html").read_text()
    for text in (md, html):
        assert "not run" not in text.replace("Comparison with a baseline: not run", "")
        assert prov["repository_digest"] in text
        assert f"{q['checkpoint_bytes']:,}" in text
        assert mo["model"]["architecture"] in text
        assert f"{bench_summary['levels'][0]['ttft_p50_ms']}" in five_lines(s)[4]
    for line in five_lines(s):
        assert line in md
    assert f"+{q['accuracy']['perplexity_increase_pct']:.2f} %" in five_lines(s)[1]
    for img in ("sensitivity_heatmap.png", "plan_errors.png", "throughput_vs_concurrency.png",
                "latency_vs_concurrency.png"):
        assert (out / "img" / img).stat().st_size > 5_000
        assert f"img/{img}" in md and f'src="img/{img}"' in html
    # the stage's own summary carries the five lines `invoke all` prints
    assert _m(work, "report")["summary"]["five_lines"] == five_lines(s)


@pytest.mark.e2e
def test_a_broken_link_in_the_hash_chain_shows(tiny_run, tmp_path):
    work = tmp_path / "tiny"
    shutil.copytree(tiny_run, work, symlinks=True)
    m = _m(work, "build")
    m["inputs"]["upstream"]["quantize"] = "f" * 64  # as if the build had read another checkpoint
    (work / "build" / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "out"
    out.mkdir()
    s = render(work, out)
    assert s["hash_chain_ok"] is False
    bad = [l for l in s["hash_chain"] if l["ok"] is False]
    assert [(l["stage"], l["upstream"]) for l in bad] == [("build", "quantize")]
    assert "| build | quantize | `ffffffffffffffff…` |" in (out / "index.md").read_text()


def _chromium() -> str | None:
    return shutil.which("chromium-headless-shell") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.e2e
@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium (Debian: chromium-headless-shell)")
def test_the_page_renders_in_headless_chromium(tiny_run, tmp_path):
    """A person's view: Chromium lays the page out and paints it, plots included."""
    import numpy as np
    from PIL import Image

    shot = tmp_path / "page.png"
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={shot}", "--window-size=1280,2400",
                           (tiny_run / "report" / "index.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stdout + proc.stderr
    img = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1200
    rows_with_ink = (img < 200).any(axis=1).mean()
    assert rows_with_ink > 0.3  # text and tables down the page, not a blank or error page


def test_the_monitoring_section_links_the_dashboard_and_lists_the_levels_that_passed_an_alert_threshold(tmp_path):
    """A bench whose concurrency-8 level had a P99 six times its P50: the latency-tail rule's threshold (3) was
    passed there and nowhere else; with the thresholds raised, nothing is listed. The rendered dashboard and
    rules are linked relative to the page."""
    from pipeline.config import AlertsSection
    from pipeline.release.report import sections

    work = tmp_path / "synthetic"
    (work / "bench").mkdir(parents=True)
    levels = [{"concurrency": c, "e2e_ms": {"p50": 100.0, "p99": p99, "p99_over_p50": p99 / 100, "jitter": 0.2}}
              for c, p99 in ((1, 120.0), (8, 600.0))]
    (work / "bench" / artifacts.BENCH_RESULTS_FILE).write_text(json.dumps(
        {"targets": [{"label": "candidate", "levels": levels}]}))
    for rel in (sections.DEPLOY_DASHBOARD, sections.DEPLOY_RULES):
        work.joinpath(*rel).parent.mkdir(parents=True, exist_ok=True)
        work.joinpath(*rel).write_text("{}")
    out = tmp_path / "report"

    def section(alerts: AlertsSection) -> str:
        doc = Doc()
        sections._section_monitoring(doc, work, out, _manifest("bench", {}), alerts)
        return doc.markdown()

    md = section(AlertsSection())
    assert "[dashboard.json](../synthetic/deploy/monitoring/dashboard.json)" in md
    assert "| candidate | 8 | TritonLatencyTail | 6.00 | 3 |" in md and "| candidate | 1 |" not in md
    md = section(AlertsSection(latency_p99_over_p50=10))
    assert "none of the latency rules' thresholds was passed" in md and "over 10," in md


def test_report_and_clean_as_a_user_types_them(tiny_run):
    """Last in this module, as it deletes the built work dir: `invoke report` on it (up to date: it says so and
    prints where the page is), then `invoke clean`, which removes the config's work dir. No traceback."""
    from conftest import run_invoke

    work_root = tiny_run.parent
    common = ["--config", str(work_root.parent / "tiny.yaml"), "--work-root", str(work_root),
              *[a for s in RUN_SETS for a in ("--set", s)]]
    proc = run_invoke("report", *common, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert "report: up to date" in out and str(tiny_run / "report" / artifacts.REPORT_HTML) in out, out
    proc = run_invoke("clean", *common, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out and f"removed {tiny_run}" in out, out
    assert not tiny_run.exists()


def test_the_accuracy_table_shows_each_checkpoint_read_back(tmp_path):
    """With the HF unified checkpoint exported (pytorch target), its gated read-back is a column of its own."""
    from pipeline.release.report.sections import section_quantize

    def figures(ppl, kl):
        return {"perplexity_quantized": ppl, "perplexity_increase_pct": ppl - 20, "top1_agreement": 0.9,
                "kl_divergence": kl}

    accuracy = {"tokens": 126, "perplexity_original": 20.0, **figures(20.5, 0.05),
                "from_checkpoint": figures(20.4, 0.04), "from_hf_checkpoint": figures(20.9, 0.07)}
    m = _manifest("quantize", {"accuracy": accuracy, "checkpoint": {"exclude_modules": ["lm_head"]}})
    doc = Doc()
    section_quantize(doc, tmp_path, m)
    [(header, rows)] = [body for kind, body in doc.blocks if kind == "table" and body[0][0] == "figure"]
    assert header[2:4] == ["exported checkpoint (read back)", "HF unified checkpoint (read back, gated)"]
    assert {r[0]: r[1:4] for r in rows}["KL divergence"] == [0.05, 0.04, 0.07]
    assert all(len(r) == len(header) for r in rows)
    m["summary"]["accuracy"].pop("from_hf_checkpoint")
    doc = Doc()
    section_quantize(doc, tmp_path, m)
    [(header, _)] = [body for kind, body in doc.blocks if kind == "table" and body[0][0] == "figure"]
    assert len(header) == 4


def test_the_lm_eval_tasks_have_a_table_of_their_own(tmp_path):
    """quantization.accuracy.tasks: each task's scores and recovery, with the gate's bound from the config."""
    from pipeline.release.report.sections import section_quantize

    row = {"task": "tiny_facts", "metric": "acc,none", "samples": 20, "original": 0.5, "quantized": 0.45,
           "recovery": 0.9}
    m = _manifest("quantize", {"accuracy": {"tokens": 126, "perplexity_original": 20.0, "tasks": [row]},
                               "checkpoint": {}})
    m["inputs"]["config"] = {"quantization": {"accuracy": {"min_task_recovery": 0.85}}}
    doc = Doc()
    section_quantize(doc, tmp_path, m)
    [(header, rows)] = [body for kind, body in doc.blocks if kind == "table" and body[0][0] == "task"]
    assert rows == [["tiny_facts", "acc,none", 20, 0.5, 0.45, 0.9, "≥ 0.85"]] and len(header) == 7
    m["summary"]["accuracy"].pop("tasks")
    doc = Doc()
    section_quantize(doc, tmp_path, m)
    assert not [body for kind, body in doc.blocks if kind == "table" and body[0][0] == "task"]
