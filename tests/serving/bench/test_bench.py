"""bench: the statistics on known samples, the knee, Triton's metrics, and the load generator on a real server."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import RUN_TOKEN_ENV, run_processes

from pipeline import artifacts
from pipeline.records import BuildSettings
from pipeline.serving.bench.load import RequestRecord, drive, level_figures, make_prompts
from pipeline.serving.bench.metrics import metrics_delta, parse_metrics, scrape_settled
from pipeline.serving.bench.plots import LATENCY_PNG, THROUGHPUT_PNG
from pipeline.serving.bench.stats import (
    find_knee,
    goodput,
    knee_sentence,
    median_figures,
    median_rounds,
    padding_factor,
    percentile,
    sla_choice,
    summarize,
)

# ---------------------------------------------------------------- statistics on known samples


def test_percentiles_on_a_known_sample():
    # 1..100: order statistics x_k = k; the q-th percentile interpolates at rank 1 + 99 q / 100
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    # four values, worked by hand: rank 3 * q / 100 between 10, 20, 30, 40
    s = summarize([40, 10, 30, 20])
    assert (s["p50"], s["p90"], s["p99"]) == pytest.approx((25.0, 37.0, 39.7))
    assert s["mean"] == 25 and s["min"] == 10 and s["max"] == 40 and s["n"] == 4
    assert s["std"] == pytest.approx(125 ** 0.5)  # population std: sqrt(((15^2 + 5^2) * 2) / 4)
    assert s["jitter"] == pytest.approx(125 ** 0.5 / 25)
    assert s["p99_over_p50"] == pytest.approx(39.7 / 25)


def test_summary_of_constant_and_empty_samples():
    s = summarize([7.0] * 5)
    assert s["jitter"] == 0 and s["p99_over_p50"] == 1
    assert summarize([]) == {"n": 0}
    with pytest.raises(ValueError):
        percentile([], 50)


def test_request_record_ttft_itl_and_gaps():
    # sent at 0; responses at 100 ms (1 token), 150 ms (2 tokens: a held-back multi-byte character), 200 ms
    r = RequestRecord(prompt_tokens=64, sent=0.0, arrivals=[(0.100, 1), (0.150, 2), (0.200, 1)])
    assert r.output_tokens == 4
    assert r.ttft_ms == pytest.approx(100)
    assert r.e2e_ms == pytest.approx(200)
    assert r.itl_ms == pytest.approx(100 / 3)  # (e2e - ttft) / (tokens - 1)
    assert r.token_gaps_ms() == pytest.approx([25, 25, 50])
    assert RequestRecord(8, 0.0, [(0.05, 1)]).itl_ms is None


def test_level_figures_throughput_and_errors():
    recs = [RequestRecord(10, 0.0, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)]),
            RequestRecord(12, 0.0, [(0.2, 1), (0.4, 1), (0.6, 1), (0.8, 1)]),
            RequestRecord(11, 0.0, error="boom")]
    f = level_figures(recs, wall_s=2.0, concurrency=2)
    assert f["errors"] == 1 and f["requests"] == 3
    assert f["output_tokens"] == 8 and f["output_tokens_per_s"] == pytest.approx(4.0)
    assert f["requests_per_s"] == pytest.approx(1.0)  # successful requests only
    assert f["ttft_ms"]["p50"] == pytest.approx(150)
    assert f["e2e_ms"]["p50"] == pytest.approx(600)
    assert f["itl_ms"]["mean"] == pytest.approx((100 + 200) / 2)
    assert f["prompt_tokens_mean"] == 11


def test_goodput_counts_the_requests_within_every_bound_and_the_level_keeps_the_sla_on_p99():
    # four requests over 2 s: ttft / itl / e2e; the third is late to its first token, the fourth has one token
    recs = [RequestRecord(8, 0.0, [(0.100, 1), (0.200, 1), (0.300, 1)]),  # ttft 100, itl 100, e2e 300
            RequestRecord(8, 0.0, [(0.050, 1), (0.450, 1), (0.850, 1)]),  # ttft 50, itl 400, e2e 850
            RequestRecord(8, 0.0, [(0.400, 1), (0.500, 1), (0.600, 1)]),  # ttft 400, itl 100, e2e 600
            RequestRecord(8, 0.0, [(0.120, 1)])]  # ttft 120, no itl, e2e 120
    f = level_figures(recs, wall_s=2.0, concurrency=4, sla={"ttft_ms": 150, "itl_ms": 200})
    g = f["sla"]
    assert g["good_requests"] == 2 and g["goodput_rps"] == pytest.approx(1.0)  # the first and the fourth
    assert g["p99_ms"]["ttft_ms"] == pytest.approx(percentile([100, 50, 400, 120], 99))
    assert g["violations"] == ["ttft_ms", "itl_ms"] and not g["met"]
    loose = goodput([{"e2e_ms": r.e2e_ms, "ttft_ms": r.ttft_ms, "itl_ms": r.itl_ms} for r in recs], 2.0,
                    {"e2e_ms": 900})
    assert loose["met"] and loose["good_requests"] == 4 and loose["goodput_rps"] == pytest.approx(2.0)
    assert level_figures(recs, wall_s=2.0, concurrency=4)["sla"] is None  # no SLA configured


def _round(wall_s: float, *requests: tuple[float, float]) -> dict:
    """One round of a concurrency-2 level: requests of 4 tokens each, (TTFT ms, end-to-end ms), over ``wall_s``."""
    recs = [RequestRecord(16, 0.0, [(ttft / 1e3, 1), (e2e / 1e3, 3)]) for ttft, e2e in requests]
    return level_figures(recs, wall_s, concurrency=2, sla={"e2e_ms": 450})


def test_a_level_over_three_rounds_is_their_medians_with_the_spread():
    """Each figure is the median over the rounds; the SLA is judged again on the median P99 (the first round, over
    its bound, does not decide); spread: min, max, (max - min) / median of throughput and P99 end-to-end."""
    # 8 tokens per round: 8 / 1.0, 8 / 2.0, 8 / 1.6 tokens/s; P99 end-to-end of two requests a < b: a + 0.99 (b - a)
    b, a, c = (_round(1.0, (100, 500), (200, 600)), _round(2.0, (100, 300), (100, 400)),
               _round(1.6, (50, 200), (50, 300)))
    assert [r["e2e_ms"]["p99"] for r in (b, a, c)] == pytest.approx([599, 399, 299])
    assert [r["sla"]["met"] for r in (b, a, c)] == [False, True, True]
    level = median_rounds([b, a, c], {"e2e_ms": 450})
    assert level["output_tokens_per_s"] == pytest.approx(5.0) and level["requests_per_s"] == pytest.approx(1.25)
    assert level["wall_s"] == pytest.approx(1.6) and level["ttft_ms"]["p50"] == pytest.approx(100)
    assert level["e2e_ms"]["p99"] == pytest.approx(399) and level["e2e_ms"]["p50"] == pytest.approx(350)
    assert level["concurrency"] == 2 and isinstance(level["concurrency"], int) and level["requests"] == 2
    assert level["sla"]["p99_ms"]["e2e_ms"] == pytest.approx(399)
    assert (level["sla"]["met"] and level["sla"]["violations"] == []
            and level["sla"]["goodput_rps"] == pytest.approx(1.0))
    s = level["spread"]
    assert s["rounds"] == 3
    assert (s["output_tokens_per_s"]["min"], s["output_tokens_per_s"]["max"]) == pytest.approx((4.0, 8.0))
    assert s["output_tokens_per_s"]["relative"] == pytest.approx((8 - 4) / 5)
    assert (s["e2e_p99_ms"]["min"], s["e2e_p99_ms"]["max"]) == pytest.approx((299, 599))
    assert s["e2e_p99_ms"]["relative"] == pytest.approx(300 / 399)
    assert [r["output_tokens_per_s"] for r in s["per_round"]] == pytest.approx([8.0, 4.0, 5.0])
    assert [r["ttft_p50_ms"] for r in s["per_round"]] == pytest.approx([150, 100, 50])
    # the medians over rounds keeping the SLA at the P99 bound only when the median P99 does
    assert not median_rounds([a, b, b], {"e2e_ms": 450})["sla"]["met"]
    assert median_rounds([a], {"e2e_ms": 450}) is a  # one round: the level as it was measured, no spread


def test_median_figures_walk_dicts_and_skip_missing_numbers():
    rounds = [{"c": 4, "x": 1, "p": None, "basis": "cpu"}, {"c": 4, "x": 3, "p": 2.0, "basis": "cpu"},
              {"c": 4, "x": 2, "p": 4.0, "basis": "cpu"}]
    assert median_figures(rounds) == {"c": 4, "x": 2, "p": 3.0, "basis": "cpu"}


def test_sla_choice_is_the_fastest_level_that_keeps_it_or_says_what_the_lowest_missed():
    def level(c, tps, p99, met):
        return {"concurrency": c, "output_tokens_per_s": tps,
                "sla": {"met": met, "goodput_rps": tps / 10, "p99_ms": {"e2e_ms": p99},
                        "violations": [] if met else ["e2e_ms"]}}

    levels = [level(1, 10, 400, True), level(2, 19, 700, True), level(4, 30, 1200, False), level(8, 31, 2500, False)]
    choice = sla_choice(levels, {"e2e_ms": 1000})
    assert choice["met"] and choice["concurrency"] == 2 and choice["goodput_rps"] == pytest.approx(1.9)
    assert "kept up to concurrency 2" in choice["sentence"] and "P99 end-to-end <= 1000 ms" in choice["sentence"]
    none = sla_choice([level(1, 10, 1500, False), level(2, 19, 2500, False)], {"e2e_ms": 1000})
    assert not none["met"] and none["concurrency"] is None
    assert "at the lowest, concurrency 1, P99 end-to-end 1500 ms > 1000 ms" in none["sentence"]


def test_knee_where_throughput_stops_paying():
    knee = find_knee([1, 2, 4, 8, 16], [10, 19, 34, 36, 36.5], 0.10)
    assert knee["found"] and knee["concurrency"] == 4
    assert knee["next_gain_per_doubling"] == pytest.approx(36 / 34 - 1)
    assert [round(g["gain_per_doubling"], 3) for g in knee["gains"]] == [0.9, 0.789, 0.059, 0.014]
    # uneven steps are judged per doubling: 1 -> 4 with +20 % is +9.5 % per doubling
    assert find_knee([1, 4], [10, 12], 0.10)["concurrency"] == 1
    assert not find_knee([1, 4], [10, 12.5], 0.10)["found"]
    # one noisy level does not move it: measured on a fresh clone, 1 -> 2 gained 9.9 %, then 2 -> 4 and 4 -> 8
    # about 50 % each, 8 -> 16 nothing; comparing each level with the next only put the knee at 1
    noisy = find_knee([1, 2, 4, 8, 16], [6.1, 6.7, 10.0, 15.0, 14.9], 0.10)
    assert noisy["found"] and noisy["concurrency"] == 8
    assert noisy["gains"][0]["gain_per_doubling"] == pytest.approx(0.098, abs=1e-3)
    # and a level that dips then recovers is not a plateau either
    assert find_knee([1, 2, 4, 8], [10, 20, 19, 40], 0.10)["found"] is False
    still_rising = find_knee([1, 2, 4], [10, 20, 40], 0.10)
    assert not still_rising["found"] and still_rising["concurrency"] == 4
    levels = [{"concurrency": c, "output_tokens_per_s": t, "e2e_ms": {"p50": 100.0 * c}} for c, t in
              zip([1, 2, 4, 8, 16], [10, 19, 34, 36, 36.5], strict=True)]
    assert "the knee is at concurrency 4" in knee_sentence(knee, levels)
    assert "beyond this sweep" in knee_sentence(still_rising, levels[:3])


def build_settings(target: str = "cpu", **changed) -> BuildSettings:
    """build_settings.json as the build writes it (a cpu build of batch 8), with ``changed`` fields."""
    return BuildSettings.model_validate({
        "target": target, "artifact_dir": "cpu_bundle", "max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512,
        "kv_cache": {"quant_algo": None, "tokens_per_block": 32, "free_gpu_memory_fraction": 0.9,
                     "enable_block_reuse": False},
        "cuda_graphs": {"enabled": False, "batch_sizes": [], "enable_padding": False, "cuda_graph_mode": False,
                        "cuda_graph_cache_size": 0},
        "trtllm_version": None, "provenance": {}, "checkpoint_sha256": "ab" * 32, **changed})


def test_padding_factor_from_build_settings():
    cpu = build_settings()
    assert padding_factor(cpu, 4)["value"] == 1.0
    gpu = build_settings("tensorrt", cuda_graphs={"enabled": True, "enable_padding": True, "batch_sizes": [1, 2, 4, 8],
                                                  "cuda_graph_mode": True, "cuda_graph_cache_size": 0})
    assert padding_factor(gpu, 3)["value"] == pytest.approx(3 / 4)
    assert padding_factor(gpu, 16)["value"] == 1.0  # 8 live sequences fill the largest graph
    assert padding_factor(None, 2)["value"] is None


METRICS_BEFORE = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m_stream",version="1"} 2
nv_inference_request_success{model="m_preprocessing",version="1"} 2
nv_inference_queue_duration_us{model="m_preprocessing",version="1"} 100
nv_inference_compute_infer_duration_us{model="m_preprocessing",version="1"} 1000
nv_inference_exec_count{model="m_preprocessing",version="1"} 2
nv_inference_count{model="m_preprocessing",version="1"} 2
nv_inference_first_response_histogram_ms_bucket{model="m_stream",version="1",le="100"} 1
nv_inference_first_response_histogram_ms_sum{model="m_stream",version="1"} 150
nv_inference_first_response_histogram_ms_count{model="m_stream",version="1"} 2
nv_cpu_utilization 0.5
"""
METRICS_AFTER = """nv_inference_request_success{model="m_stream",version="1"} 6
nv_inference_request_success{model="m_preprocessing",version="1"} 6
nv_inference_queue_duration_us{model="m_preprocessing",version="1"} 900
nv_inference_compute_infer_duration_us{model="m_preprocessing",version="1"} 9000
nv_inference_exec_count{model="m_preprocessing",version="1"} 4
nv_inference_count{model="m_preprocessing",version="1"} 6
nv_inference_first_response_histogram_ms_sum{model="m_stream",version="1"} 550
nv_inference_first_response_histogram_ms_count{model="m_stream",version="1"} 6
"""


def test_triton_metrics_parsed_and_differenced():
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    assert before[("nv_inference_request_success", "m_stream")] == 2
    assert ("nv_cpu_utilization", "") not in before  # not a per-model counter
    d = metrics_delta(before, after, ["m_stream", "m_preprocessing", "m_absent"])
    assert set(d) == {"m_stream", "m_preprocessing"}
    pre = d["m_preprocessing"]
    assert pre["requests"] == 4
    assert pre["queue_ms"] == pytest.approx(800 / 4 / 1000)
    assert pre["compute_infer_ms"] == pytest.approx(8000 / 4 / 1000)
    assert pre["avg_batch_size"] == pytest.approx(4 / 2)
    assert d["m_stream"]["first_response_ms"] == pytest.approx(400 / 4)
    assert metrics_delta(None, after, ["m_stream"]) is None


def test_a_level_reads_the_counters_once_the_server_has_counted_its_requests():
    """Triton counts a decoupled request when it releases it, after the client's final response: the scrape
    after a level waits for the count. (A local endpoint stands in for Triton's here: it makes the lag certain,
    where the real server shows it now and then.)"""
    import http.server
    import threading

    scrapes = []

    class Lagging(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            scrapes.append(1)
            body = (METRICS_BEFORE if len(scrapes) < 4 else METRICS_AFTER).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lagging)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        counters = scrape_settled(url, "m_stream", at_least=6)
        assert counters[("nv_inference_request_success", "m_stream")] == 6 and len(scrapes) == 4
        counters = scrape_settled(url, "m_stream", at_least=7, timeout_s=0.3)  # never reached: what there is
        assert counters[("nv_inference_request_success", "m_stream")] == 6
    finally:
        server.shutdown()
        server.server_close()


def test_prompts_are_windows_of_the_evaluation_text(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    samples = tmp_path / "evaluation_samples.jsonl"
    samples.write_text("\n".join(json.dumps({"index": i, "text": f"The statement number {i} is about loops and "
                                                                 f"classes.</s>Another document starts here."})
                                 for i in range(3)) + "\n")
    prompts = make_prompts(samples, tok, 8, 40)
    assert len(prompts) == 40
    assert all("</s>" not in p.text for p in prompts)
    assert all(6 <= p.tokens <= 10 for p in prompts)  # re-tokenized windows of 8 tokens
    distinct = {p.text for p in prompts}
    assert 1 < len(distinct) < 40  # windows repeat once the text is used up
    with pytest.raises(Exception, match="fewer than bench.prompt_tokens"):
        make_prompts(samples, tok, 10_000, 1)


# ---------------------------------------------------------------- a real server on the tiny published model


@pytest.fixture(scope="module")
def published_tiny(tmp_path_factory, tiny_model_dir):
    """The tiny model through publish (a real Triton repository), with a small bench section."""
    from conftest import tiny_config

    from pipeline.config import load_config
    from pipeline.runner import Runner
    from pipeline.stages import STAGES

    tmp = tmp_path_factory.mktemp("bench_tiny")
    cfg = tiny_config(tmp, tiny_model_dir, "quantization: {kv_cache: int8, accuracy: {max_perplexity_increase_pct: "
                                           "100, min_top1_agreement: 0.3, max_kl_divergence: 2}}")
    overrides = ["bench.concurrency=[1,2,4]", "bench.requests_per_level=6", "bench.warmup_requests=1",
                 "bench.prompt_tokens=16", "bench.output_tokens=8", "triton.model_name=tiny",
                 "sla.p99_e2e_ms=600000", "bench.request_timeout_s=120"]  # a stuck request fails in 2 min
    loaded = load_config(cfg, overrides)
    runner = Runner(loaded, STAGES, tmp / "work")
    runner.run(["publish"], echo=lambda s: None)
    return loaded, runner, cfg, overrides


def _run_bench(runner, echo) -> None:
    """The bench stage; where it fails, the kept server log's end (the models' stacks) goes in the failure."""
    from pipeline.errors import StageFailed

    try:
        runner.run(["bench"], echo=echo)
    except StageFailed as e:
        kept = runner.work_dir / "logs" / f"bench.failed.{artifacts.SERVER_LOG_FILE}"
        tail = "\n".join(kept.read_text(errors="replace").splitlines()[-300:]) if kept.is_file() else "(no log)"
        pytest.fail(f"{e}\n--- the end of {kept.name}:\n{tail}")


@pytest.mark.e2e
def test_bench_stage_on_a_real_server(published_tiny):
    loaded, runner, _, _ = published_tiny
    said = []
    _run_bench(runner, said.append)
    out = runner.work_dir / "bench"
    results = json.loads((out / artifacts.BENCH_RESULTS_FILE).read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    (t,) = results["targets"]
    assert [l["concurrency"] for l in t["levels"]] == [1, 2, 4]
    for level in t["levels"]:
        assert level["requests"] == 6 and level["errors"] == 0
        assert level["output_tokens"] == 6 * 8  # end_id -1: every request generates exactly output_tokens
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
        assert level["ttft_ms"]["p50"] <= level["ttft_ms"]["p90"] <= level["ttft_ms"]["p99"]
        assert level["padding_factor"]["value"] == 1.0
        tri = level["triton"]
        assert tri["tiny_stream"]["requests"] == 6  # Triton counted exactly this level's requests
        assert tri["tiny_tensorrt_llm"]["requests"] == 6 and tri["tiny_stream"]["queue_ms"] >= 0
        # the streaming model tokenizes itself: no request of the sweep goes through preprocessing
        assert tri.get("tiny_preprocessing", {}).get("requests", 0) == 0
        assert level["sla"]["met"] and level["sla"]["goodput_rps"] == pytest.approx(level["requests_per_s"])
        cpu = level["cpu_ms_per_token"]  # the server's processes: the engine model's stub apart from the rest
        # the frontend is tritonserver alone (the streaming model is an ensemble of the engine model): C++ work that
        # can stay under one clock tick in a level of this tiny model
        assert cpu["engine_ms"] > 0 and cpu["frontend_ms"] >= 0
        assert cpu["total_ms"] == pytest.approx(cpu["engine_ms"] + cpu["frontend_ms"])
    assert t["knee"]["concurrency"] in (1, 2, 4)
    fastest = max(t["levels"], key=lambda l: l["output_tokens_per_s"])
    assert results["sla"] == {"e2e_ms": 600000} and t["sla_choice"]["concurrency"] == fastest["concurrency"]
    assert (out / THROUGHPUT_PNG).stat().st_size > 10_000 and (out / LATENCY_PNG).stat().st_size > 10_000
    s = manifest["summary"]
    assert s["levels"][0]["output_tokens_per_s"] == round(t["levels"][0]["output_tokens_per_s"], 2)
    prov = json.loads((runner.work_dir / "publish" / "model_repository" / "provenance.json").read_text())
    assert s["repository_digest"] == prov["repository_digest"]


@pytest.mark.e2e
def test_requests_that_time_out_keep_the_server_log_with_where_its_models_threads_stood(published_tiny, monkeypatch):
    """Requests failing on a live server (here: a deadline no request meets) fail the stage, and the server's log
    is kept under logs/ ending with every Python thread of its models (they dump their stacks on SIGUSR1): the
    engine model's scheduler thread among them. The server is stopped, its stubs with it."""
    from pipeline.config import load_config
    from pipeline.errors import StageFailed
    from pipeline.runner import Runner
    from pipeline.stages import STAGES

    _, runner, cfg, overrides = published_tiny
    loaded = load_config(cfg, overrides + ["bench.request_timeout_s=0.001"])
    token = uuid.uuid4().hex  # every process this bench starts inherits it: the leftover check below sees only ours
    monkeypatch.setenv(RUN_TOKEN_ENV, token)
    with pytest.raises(StageFailed, match="request\\(s\\) failed") as failed:
        Runner(loaded, STAGES, runner.work_dir.parent).run(["bench"], echo=lambda s: None)
    kept = runner.work_dir / "logs" / f"bench.failed.{artifacts.SERVER_LOG_FILE}"
    assert f"logs/{kept.name}" in str(failed.value) and "SIGUSR1" in str(failed.value)
    log_text = kept.read_text(errors="replace")
    dumps = dict(part.split(" (stub pid", 1) for part in log_text.split("--- the Python threads of model ")[1:])
    # every Python model's stub (the streaming model is an ensemble: no stub of its own)
    assert set(dumps) == {"tiny_preprocessing", "tiny_postprocessing", "tiny_tensorrt_llm", "tiny_tensorrt_llm_unary"}
    assert all("thread 0x" in d.lower() for d in dumps.values())  # faulthandler's dump under each header
    engine = dumps["tiny_tensorrt_llm"]  # its scheduler thread, waiting for work, and the metrics thread
    assert "cpu_runtime.py" in engine and "in _loop" in engine and "in refresh" in engine
    deadline = time.monotonic() + 30  # the server, its stubs, their reapers: all end
    while (left := run_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left


@pytest.mark.e2e
def test_open_loop_load_through_aiperf(published_tiny, monkeypatch):
    """bench.request_rates: after the sweep, aiperf sends Poisson arrivals at each rate to the server bench
    started (Triton's generate_stream of the streaming model); every request answered, the figures, aiperf's
    artifacts and the sustainable rate under the SLA in the results; no aiperf process outlives the stage.
    In the same run, bench.repeats: each level the medians of two rounds, with their spread; and
    bench.cross_check_concurrency: aiperf's closed loop at level 2 beside our client's figures there."""
    from pipeline.config import load_config
    from pipeline.runner import Runner
    from pipeline.serving.bench.openloop import EXPORT_FILE, aiperf_executable
    from pipeline.stages import STAGES

    try:
        aiperf_executable()
    except Exception as e:  # EnvironmentProblem: scripts/setup-env installs it (CI has it)
        pytest.skip(f"aiperf is not installed here ({e})")
    _, runner, cfg, overrides = published_tiny
    loaded = load_config(cfg, overrides + ["bench.concurrency=[1,2]", "bench.requests_per_level=6",
                                           "bench.request_rates=[1,4]", "bench.repeats=2",
                                           "bench.cross_check_concurrency=2"])
    token = uuid.uuid4().hex  # every process this bench starts inherits it: the leftover check below sees only ours
    monkeypatch.setenv(RUN_TOKEN_ENV, token)
    Runner(loaded, STAGES, runner.work_dir.parent).run(["bench"], echo=lambda s: None)
    out = runner.work_dir / "bench"
    results = json.loads((out / artifacts.BENCH_RESULTS_FILE).read_text())
    (t,) = results["targets"]
    for level in t["levels"]:
        s = level["spread"]
        assert s["rounds"] == 2 and len(s["per_round"]) == 2
        assert level["output_tokens_per_s"] == statistics.median(r["output_tokens_per_s"] for r in s["per_round"])
        assert level["e2e_ms"]["p99"] == statistics.median(r["e2e_p99_ms"] for r in s["per_round"])
        assert s["output_tokens_per_s"]["min"] <= level["output_tokens_per_s"] <= s["output_tokens_per_s"]["max"]
    knee = t["knee"]  # found on the medians
    assert knee["throughput"] == next(l["output_tokens_per_s"] for l in t["levels"]
                                      if l["concurrency"] == knee["concurrency"])
    check = results["cross_check"]["this build"]
    assert check["concurrency"] == 2 and check["ours"]["output_tokens_per_s"] == t["levels"][1]["output_tokens_per_s"]
    assert check["aiperf"]["requests"] == 6 and check["aiperf"]["errors"] == 0  # every aiperf request answered
    # every figure measured; aiperf's ITL is the gap between the chunks it reads, and on a busy machine the
    # tokens of a stream can arrive back to back (a P50 of 0 was seen once), so that one may be 0
    assert all(v > 0 for k, v in check["aiperf"].items() if k not in ("errors", "itl_p50_ms")), check["aiperf"]
    assert check["aiperf"]["itl_p50_ms"] >= 0, check["aiperf"]
    assert check["aiperf_over_ours"]["output_tokens_per_s"] == pytest.approx(
        check["aiperf"]["output_tokens_per_s"] / check["ours"]["output_tokens_per_s"])
    assert isinstance(check["agree"], bool) and "in requests/s" in check["sentence"]  # evidence, not a failure
    assert ("same token counts" in results["definitions"]["cross_check"]
            and "median" in results["definitions"]["repeats"])
    assert [r["request_rate"] for r in t["rates"]] == [1, 4]
    for r in t["rates"]:
        assert r["requests"] == 6 and r["errors"] == 0 and r["arrived_rps"] > 0
        assert r["ttft_ms"]["p50"] > 0 and r["e2e_ms"]["p99"] >= r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
        assert r["sla"]["met"] and r["sla"]["goodput_rps"] > 0  # the fixture's SLA: 600 s end-to-end
    assert t["sustainable_rate"]["request_rate"] == 4 and "the limit is beyond it" in t["sustainable_rate"]["sentence"]
    assert (out / "aiperf" / "this_build_4" / EXPORT_FILE).is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["sustainable_rate"]["request_rate"] == 4
    deadline = time.monotonic() + 30  # aiperf's controller and services, Triton, its stubs, their reapers: all end
    while (left := run_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in left]


@pytest.mark.e2e
def test_bench_drives_an_existing_server(published_tiny):
    """bench.grpc_url: no server of its own; a server without this build's models is refused before any load."""
    from pipeline.config import load_config
    from pipeline.errors import InputError
    from pipeline.runner import Runner
    from pipeline.serving.server import TritonServer
    from pipeline.stages import STAGES

    _, runner, cfg, overrides = published_tiny
    repo = runner.work_dir / "publish" / "model_repository"
    small = overrides + ["bench.concurrency=[1,2]", "bench.requests_per_level=2"]
    with TritonServer(repo) as server:
        loaded = load_config(cfg, small + [f"bench.grpc_url={server.grpc_url}",
                                           f"bench.metrics_url={server.metrics_url}"])
        Runner(loaded, STAGES, runner.work_dir.parent).run(["bench"], echo=lambda s: None)
    (t,) = json.loads((runner.work_dir / "bench" / artifacts.BENCH_RESULTS_FILE).read_text())["targets"]
    assert t["server"] == f"existing server at {server.grpc_url}"
    assert [l["errors"] for l in t["levels"]] == [0, 0]
    assert all(l["triton"]["tiny_stream"]["requests"] == 2 for l in t["levels"])
    with TritonServer(repo, load_models=["tiny_preprocessing"]) as server:
        loaded = load_config(cfg, small + [f"bench.grpc_url={server.grpc_url}"])
        with pytest.raises(InputError, match="does not serve version 1"):
            Runner(loaded, STAGES, runner.work_dir.parent).run(["bench"], echo=lambda s: None)


class _ServersUp:
    """Counts, every 50 ms while the block runs, the servers this test process started (its descendants: other
    workers' servers are not counted), one per repository (a tritonserver's forked children carry its name and
    command line); ``most``: the most seen up at once."""

    def __init__(self):
        self.most, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        import psutil

        me = psutil.Process()
        while not self._stop.wait(0.05):
            up = set()
            for child in me.children(recursive=True):
                try:
                    if child.name() == "tritonserver" and child.status() != psutil.STATUS_ZOMBIE:
                        up |= {a for a in child.cmdline() if a.startswith("--model-repository=")}
                except psutil.Error:
                    continue
            self.most = max(self.most, len(up))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.e2e
@pytest.mark.parametrize("servers,repeats,most_up", [("alone", 2, 1), ("together", 1, 2)])
def test_comparison_mode_sweeps_two_servers_one_at_a_time_or_together(published_tiny, tmp_path, servers, repeats,
                                                                        most_up):
    """A second build (unquantized KV cache: another repository digest) as the baseline, in the same run:
    ``alone`` (the default) never has both servers up, each round starting each in turn; ``together`` has."""
    from pipeline.config import load_config
    from pipeline.runner import Runner
    from pipeline.stages import STAGES

    loaded, runner, cfg, overrides = published_tiny
    base_root = tmp_path / "baseline"
    base = Runner(load_config(cfg, overrides + ["quantization.kv_cache=none"]), STAGES, base_root)
    base.run(["publish"], echo=lambda s: None)
    repo = base.work_dir / "publish" / "model_repository"
    mode = [] if servers == "alone" else [f"bench.servers={servers}"]  # alone: the default
    cmp = Runner(load_config(cfg, overrides + ["bench.concurrency=[1,2]", "bench.requests_per_level=3",
                                               f"bench.repeats={repeats}", *mode,
                                               f"bench.compare_repository={base.work_dir}"]), STAGES,
                 runner.work_dir.parent)
    with _ServersUp() as up:
        cmp.run(["bench"], echo=lambda s: None)
    assert up.most == most_up
    results = json.loads((cmp.work_dir / "bench" / artifacts.BENCH_RESULTS_FILE).read_text())
    assert results["settings"]["servers"] == servers
    this, baseline = results["targets"]
    for t in (this, baseline):  # every round of every level measured, each on a server of its own round
        assert all(len(l.get("spread", {}).get("per_round", [None])) == repeats for l in t["levels"])
        assert all(l["errors"] == 0 and l["requests"] == 3 for l in t["levels"])
    assert baseline["repository"] == str(repo) and baseline["label"] == "baseline"
    assert this["repository_digest"] != baseline["repository_digest"]
    ratios = results["comparison"]["levels"]
    assert [r["concurrency"] for r in ratios] == [1, 2]
    for r, a, b in zip(ratios, this["levels"], baseline["levels"], strict=True):
        assert r["output_tokens_per_s"] == pytest.approx(a["output_tokens_per_s"] / b["output_tokens_per_s"])
        assert r["e2e_p50"] == pytest.approx(a["e2e_ms"]["p50"] / b["e2e_ms"]["p50"])
    # the baseline is an input: republishing it would make bench stale, and so would dropping it
    manifest = json.loads((cmp.work_dir / "bench" / "manifest.json").read_text())
    assert manifest["inputs"]["external"]["compare_repository_digest"] == baseline["repository_digest"]


def _perf_analyzer() -> str | None:
    """A perf_analyzer that runs here (tritonclient 2.51's wheel carries one; it needs libb64 and libcudart)."""
    exe = os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer")
    if not exe:
        return None
    try:
        ok = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).returncode == 0
    except OSError:
        return None
    return exe if ok else None


@pytest.mark.e2e
@pytest.mark.skipif(_perf_analyzer() is None, reason="perf_analyzer not available (set PERF_ANALYZER)")
def test_client_agrees_with_perf_analyzer(published_tiny):
    """The same server, the same prompts: our client's request latency and throughput vs perf_analyzer's."""
    from transformers import AutoTokenizer

    from pipeline.serving.server import TritonServer

    loaded, runner, _, _ = published_tiny
    repo = runner.work_dir / "publish" / "model_repository"
    prov = json.loads((repo / "provenance.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(repo / f"tiny_preprocessing/{prov['version']}/tokenizer"))
    prompts = make_prompts(runner.work_dir / "text" / "evaluation_samples.jsonl", tok, 16, 8)
    with TritonServer(repo) as server, tempfile.TemporaryDirectory() as tmp:
        drive(server.grpc_url, "tiny_stream", prompts=prompts[:2], concurrency=1, max_tokens=8)  # warm-up
        records, wall = drive(server.grpc_url, "tiny_stream", prompts=prompts, concurrency=2, max_tokens=8)
        ours = level_figures(records, wall, 2)
        data = {"data": [{"text_input": [p.text], "max_tokens": [8], "end_id": [-1]} for p in prompts]}
        Path(tmp, "input.json").write_text(json.dumps(data))
        export = Path(tmp, "profile.json")
        proc = subprocess.run([_perf_analyzer(), "-m", "tiny_stream", "-i", "grpc", "-u", server.grpc_url,
                               "--streaming", "--input-data", str(Path(tmp, "input.json")), "--concurrency-range",
                               "2", "--measurement-mode", "count_windows", "--measurement-request-count", "8",
                               "--profile-export-file", str(export), "--stability-percentage", "999",
                               "--max-trials", "3"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        doc = json.loads(export.read_text())
    reqs = [r for exp in doc["experiments"] for r in exp["requests"]]
    # perf_analyzer asks for the empty final response: the last timestamp is that flag, right after the last token
    e2e = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in reqs]
    ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in reqs]
    # the two clients measure the same server within a loose band (2 shared cores: noise is large)
    assert np.median(e2e) == pytest.approx(ours["e2e_ms"]["p50"], rel=0.6)
    assert np.median(ttft) == pytest.approx(ours["ttft_ms"]["p50"], rel=0.6, abs=20)


@pytest.mark.e2e
def test_invoke_tune_measures_settings_on_real_servers_and_republishes_with_the_choice(published_tiny):
    """An SLA no setting can meet: every limit is measured (4, 2, 1), nothing is applied, the evidence is in
    tune.failed/. Then a loose SLA: the chosen setting is written with its evidence, publish applies it
    (the model's max_running parameter) and records it; no server outlives the command."""
    import psutil
    import yaml

    from pipeline import commands
    from pipeline.errors import StageFailed
    from pipeline.serving.tuned import RESULTS_FILE

    _, runner, cfg, overrides = published_tiny
    work = runner.work_dir
    load = ["tune.requests=4", "tune.concurrency=4", "tune.ab_rounds=1"]
    me = psutil.Process()
    with pytest.raises(StageFailed, match=r"no measured setting keeps the SLA: the best, .* is bound by P99 "
                                          r"end-to-end"):
        commands.tune(str(cfg), [o for o in overrides if not o.startswith("sla.")] + ["sla.p99_e2e_ms=1"] + load,
                      work.parent)
    failed = json.loads((work / "tune.failed" / RESULTS_FILE).read_text())
    assert [p["label"] for p in failed["points"]] == ["default", "max_running=2", "max_running=1"]
    assert failed["chosen"] is None and not (work / "tune" / "tuned_settings.yaml").exists()
    assert not [c for c in me.children(recursive=True) if "tritonserver" in c.name()]

    results = commands.tune(str(cfg), overrides + load, work.parent)  # the fixture's SLA: 600 s end-to-end
    assert results["points"][0]["label"] == "default" and all(p["sla_met"] for p in results["points"])
    assert [p["label"] for p in results["points"]][:2] == ["default", "max_running=2"] and len(results["points"]) <= 3
    tuned = yaml.safe_load((work / "tune" / "tuned_settings.yaml").read_text())
    assert tuned["triton"] == results["chosen"]["settings"] and tuned["sla"] == {"e2e_ms": 600000}
    assert (work / "tune" / "throughput_vs_p99.png").stat().st_size > 10_000 and not (work / "tune.failed").exists()
    pbtxt = (work / "publish" / "model_repository" / "tiny_tensorrt_llm" / "config.pbtxt").read_text()
    want = results["chosen"]["settings"].get("max_running", 0)
    assert f'key: "max_running"\n  value {{\n    string_value: "{want}"' in pbtxt
    publish = json.loads((work / "publish" / "manifest.json").read_text())["summary"]
    assert publish["tuned_settings"]["applied"] == results["chosen"]["settings"]
    assert not [c for c in me.children(recursive=True) if "tritonserver" in c.name()]

    from pipeline.release.report.stage import write_report

    (work / "report_check").mkdir()
    write_report(work, work / "report_check", runner.loaded)  # the report's Serving settings section
    page = (work / "report_check" / "index.md").read_text()
    section = page[page.index("## Serving settings"):page.index("## Chain of content hashes")]
    assert f"**Chosen**: {results['why']}." in section and "| default |" in section
    assert ("img/throughput_vs_p99.png" in section
            and (work / "report_check" / "img" / "throughput_vs_p99.png").is_file())


def test_prompt_and_output_lengths_must_fit_the_build():
    """bench and tune refuse a request mix the build cannot hold, naming what to lower."""
    from pipeline.config import BenchSection
    from pipeline.errors import InputError
    from pipeline.serving.bench.target import check_lengths

    settings = build_settings(max_input_len=64, max_seq_len=128)
    check_lengths(BenchSection(prompt_tokens=64, output_tokens=64), settings, "this build")
    check_lengths(BenchSection(prompt_tokens=4096), None, "a repository without build settings")
    with pytest.raises(InputError, match=r"prompt_tokens 64 \+ output_tokens 65 do not fit the build's limits "
                                         r"\(max_input_len 64, max_seq_len 128\)"):
        check_lengths(BenchSection(prompt_tokens=64, output_tokens=65), settings, "the build")
    with pytest.raises(InputError, match="do not fit this build's limits"):
        check_lengths(BenchSection(prompt_tokens=65, output_tokens=1), settings, "this build")
