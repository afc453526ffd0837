"""The open-loop load (pipeline/serving/bench/openloop.py): aiperf's command read back by aiperf's own parser,
the figures read from its exports, the sustainable-rate rule, and the cross-check of our client against aiperf's
closed loop. The load itself, against a real Triton server, is
tests/serving/bench/test_bench.py::test_open_loop_load_through_aiperf.

aiperf runs from its own environment (``.venv-aiperf``, scripts/setup-env; ``AIPERF`` overrides it); the tests
that need it skip, saying how to install it, where it is missing. CI's set-up installs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jinja2
import pytest
from conftest import REPO, run_invoke

from pipeline.config import BenchSection, load_config
from pipeline.errors import ConfigError, EnvironmentProblem
from pipeline.serving.bench import openloop

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start


@pytest.fixture(scope="module")
def aiperf_python() -> str:
    try:
        exe = Path(openloop.aiperf_executable())
    except EnvironmentProblem as e:
        return pytest.skip(f"aiperf is not installed here ({e})")
    return str(exe.with_name("python"))


def _resolved(aiperf_python: str, argv: list[str]) -> dict:
    """What aiperf's own parser makes of ``argv`` (without the executable and `profile`)."""
    out = subprocess.run([aiperf_python, str(REPO / "tests" / "bin" / "aiperf-parse-args"), json.dumps(argv)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["benchmark"]


def test_the_aiperf_command_is_what_aiperfs_own_parser_reads(aiperf_python, tmp_path):
    """aiperf 0.13's parser resolves our argv to Poisson arrivals at the rate, the request count, the prompt and
    output lengths, the SLA as its goodput bounds; for Triton, a template endpoint on generate_stream whose body
    renders to the ensemble's inputs; for vLLM, streamed completions that ignore EOS."""
    cfg = BenchSection(requests_per_level=12, prompt_tokens=48, output_tokens=20, request_timeout_s=90)
    sla = {"e2e_ms": 6000.0, "ttft_ms": 800.0, "itl_ms": 120.0}
    tok = tmp_path / "tokenizer"
    triton = openloop.aiperf_argv("aiperf", openai=False, http_url="127.0.0.1:8000", model="m_stream",
                                  tokenizer_dir=tok, rate=2.5, cfg=cfg, sla=sla, out_dir=tmp_path)
    assert triton[:2] == ["aiperf", "profile"]
    b = _resolved(aiperf_python, triton[2:])
    (phase,) = b["phases"]
    assert (phase["type"], phase["rate"], phase["requests"]) == ("poisson", 2.5, 12)
    (data,) = b["datasets"]
    assert data["prompts"]["isl"] == {"mean": 48.0, "stddev": 0.0}
    assert data["prompts"]["osl"] == {"mean": 20.0, "stddev": 0.0}
    assert data["random_seed"] == 0
    assert b["slos"] == {"request_latency": 6000.0, "time_to_first_token": 800.0, "inter_token_latency": 120.0}
    ep = b["endpoint"]
    assert (ep["type"], ep["path"], ep["streaming"], ep["urls"], ep["timeout"]) == (
        "template", "/v2/models/m_stream/generate_stream", True, ["http://127.0.0.1:8000"], 90.0)
    assert ep["template"]["response_field"] == "text_output"  # the field each of Triton's stream events carries
    body = jinja2.Environment(autoescape=True).from_string(ep["template"]["body"])
    assert json.loads(body.render(text='say "hi"', max_tokens=20)) == {"text_input": 'say "hi"', "max_tokens": 20,
                                                                       "end_id": -1}
    assert b["tokenizer"]["name"] == str(tok)
    assert not b["server_metrics"]["enabled"] and not b["gpu_telemetry"]["enabled"]

    vllm = openloop.aiperf_argv("aiperf", openai=True, http_url="127.0.0.1:8001", model="smollm2", tokenizer_dir=tok,
                                rate=0.5, cfg=cfg, sla={}, out_dir=tmp_path)
    b = _resolved(aiperf_python, vllm[2:])
    ep = b["endpoint"]
    assert (ep["type"], ep["streaming"], ep["extra"]) == ("completions", True, {"ignore_eos": True})
    assert b["models"]["items"] == [{"name": "smollm2"}] and b["phases"][0]["rate"] == 0.5
    assert not b.get("slos")


def test_the_closed_loop_command_differs_from_the_rate_command_only_in_its_load(aiperf_python, tmp_path):
    """The cross-check's command (bench.cross_check_concurrency): aiperf's parser resolves it to a concurrency
    phase of requests_per_level requests, the rest as the rate command has it."""
    cfg = BenchSection(requests_per_level=12, prompt_tokens=48, output_tokens=20)
    common = dict(openai=False, http_url="127.0.0.1:8000", model="m_stream", tokenizer_dir=tmp_path, cfg=cfg,
                  sla={}, out_dir=tmp_path)
    closed = openloop.aiperf_argv("aiperf", concurrency=3, **common)
    rate = openloop.aiperf_argv("aiperf", rate=2.5, **common)
    i = closed.index("--concurrency")
    assert closed[i:i + 2] == ["--concurrency", "3"]
    assert closed[:i] + closed[i + 2:] == rate[:i] + rate[i + 4:]  # --request-rate 2.5 --arrival-pattern poisson
    b = _resolved(aiperf_python, closed[2:])
    (phase,) = b["phases"]
    assert (phase["type"], phase["concurrency"], phase["requests"]) == ("concurrency", 3, 12)
    assert b["datasets"][0]["prompts"]["isl"] == {"mean": 48.0, "stddev": 0.0}
    assert b["endpoint"]["path"] == "/v2/models/m_stream/generate_stream" and b["endpoint"]["streaming"]
    with pytest.raises(ValueError, match="either rate or concurrency"):
        openloop.aiperf_argv("aiperf", rate=1.0, concurrency=3, **common)


def _level(rps: float, tps: float, ttft: float, itl: float, e2e: float) -> dict:
    return {"requests_per_s": rps, "output_tokens_per_s": tps, "output_tokens_mean": tps / rps,
            "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl}, "e2e_ms": {"p50": e2e}, "requests": 12, "errors": 0}


def test_the_cross_check_sets_aiperf_beside_our_client_and_judges_requests_per_second():
    ours = _level(2.0, 100.0, 50.0, 10.0, 700.0)
    c = openloop.cross_check(ours, _level(1.8, 110.0, 60.0, 9.0, 770.0), 4)
    assert c["concurrency"] == 4 and c["ours"]["e2e_p50_ms"] == 700 and c["aiperf"]["requests"] == 12
    assert c["aiperf_over_ours"] == pytest.approx({"requests_per_s": 0.9, "output_tokens_per_s": 1.1,
                                                   "output_tokens_mean": 1.1 / 0.9, "ttft_p50_ms": 1.2,
                                                   "itl_p50_ms": 0.9, "e2e_p50_ms": 1.1})
    assert c["agree"] and "aiperf / ours 0.90 in requests/s, within 15%" in c["sentence"]
    # aiperf counting more tokens per request than the server generated does not decide; requests/s 20 % short does
    slow = openloop.cross_check(ours, _level(1.6, 100.0, 60.0, 9.0, 770.0), 4)
    assert not slow["agree"] and "0.80 in requests/s, NOT within 15%" in slow["sentence"]


def _rate(rate: float, p99_e2e: float, errors: int = 0, sla: float = 5000.0) -> dict:
    return {"request_rate": rate, "errors": errors, "e2e_ms": {"p99": p99_e2e},
            "sla": {"met": p99_e2e <= sla, "p99_ms": {"e2e_ms": p99_e2e},
                    "violations": [] if p99_e2e <= sla else ["e2e_ms"], "goodput_rps": rate * 0.9}}


def test_the_sustainable_rate_is_the_last_that_keeps_the_sla():
    """Rates judged in ascending order; the first over the SLA (or with a failed request) ends the search."""
    sla = {"e2e_ms": 5000.0}
    r = openloop.sustainable_rate([_rate(0.5, 3000), _rate(1, 4000), _rate(2, 9000), _rate(4, 4500)], sla)
    assert r["request_rate"] == 1 and "at 2 requests/s P99 end-to-end 9000 ms over the SLA" in r["sentence"]
    r = openloop.sustainable_rate([_rate(0.5, 3000), _rate(1, 4000, errors=2)], sla)
    assert r["request_rate"] == 0.5 and "2 request(s) failed" in r["sentence"]
    r = openloop.sustainable_rate([_rate(0.5, 3000), _rate(1, 4000)], sla)
    assert r["request_rate"] == 1 and "the limit is beyond it" in r["sentence"]
    r = openloop.sustainable_rate([_rate(0.5, 6000), _rate(1, 4000)], sla)
    assert r["request_rate"] is None and "not even the lowest rate, 0.5 requests/s" in r["sentence"]
    r = openloop.sustainable_rate([_rate(0.5, 3000)], {})
    assert r["request_rate"] is None and "no SLA set" in r["sentence"]


def test_the_rate_requests_arrived_at_comes_from_their_start_times(tmp_path):
    records = tmp_path / openloop.RECORDS_FILE
    starts = [0, 0.4e9, 1.5e9, 2.0e9, 4.0e9]  # 4 gaps over 4 s
    records.write_text("".join(json.dumps({"metadata": {"request_start_ns": int(s) + 10**18}, "metrics": {}}) + "\n"
                               for s in starts))
    assert openloop.arrival_rate(records) == pytest.approx(1.0)
    records.write_text(records.read_text().splitlines()[0] + "\n")
    assert openloop.arrival_rate(records) is None


@pytest.mark.parametrize("override, says", [
    ("bench.request_rates=[2,1]", "positive, unique and ascending"),
    ("bench.request_rates=[0,1]", "positive, unique and ascending"),
])
def test_bad_request_rates_are_refused_naming_the_field(override, says):
    with pytest.raises(ConfigError, match=f"bench.request_rates.*{says}"):
        load_config(REPO / "engine_configs" / "smollm2-135m-cpu.yaml", [override])


@pytest.mark.parametrize("override", ["bench.request_rates=[1]", "bench.cross_check_concurrency=1"])
def test_aiperf_needs_a_server_bench_starts(override):
    with pytest.raises(ConfigError, match="drives the HTTP endpoint of a server bench starts"):
        load_config(REPO / "engine_configs" / "smollm2-135m-cpu.yaml", [override, "bench.grpc_url=127.0.0.1:8001"])


def test_without_aiperf_bench_stops_before_any_work_saying_how_to_install_it(tmp_path):
    proc = run_invoke("bench", "--work-root", str(tmp_path / "work"), "--set", "bench.request_rates=[1]",
                      env={openloop.ENV_VAR: str(tmp_path / "no-aiperf")}, timeout=300)
    assert proc.returncode == 3 and "scripts/setup-env` installs it into .venv-aiperf" in proc.stderr, \
        proc.stdout + proc.stderr
    assert not (tmp_path / "work" / "smollm2-135m-cpu" / "model").exists()
