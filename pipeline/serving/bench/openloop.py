"""Open-loop load: requests arriving at a set rate (Poisson arrivals), driven by NVIDIA's aiperf; and aiperf's
closed loop at one sweep level, a cross-check of our own client.

The concurrency sweep is closed-loop: a new request leaves only when one finishes, so the server is never asked
for more than it gives, and queueing never shows. Production traffic arrives on its own clock. At each rate of
``bench.request_rates`` aiperf sends ``bench.requests_per_level`` requests with exponential gaps between
arrivals (``--arrival-pattern poisson``), whether or not the earlier ones have finished, each of
``bench.prompt_tokens`` synthetic prompt tokens and ``bench.output_tokens`` output tokens (EOS ignored, as in the
sweep). It streams from Triton's ``generate_stream`` endpoint of the streaming model (a payload template with
the ensemble's inputs) or from vLLM's OpenAI ``/v1/completions``.

aiperf (https://github.com/ai-dynamo/aiperf, the maintained successor of genai-perf) pins numpy 2 and
transformers 5, which the build environment's ModelOpt pins do not allow: it runs from ``.venv-aiperf``
(``scripts/setup-env``; ``AIPERF`` names another executable). Its JSON export gives each rate's figures;
goodput is aiperf's own, against the same SLA bounds (``--goodput``).

The sustainable rate (``sustainable_rate``): the highest rate at which no request failed and every P99 the SLA
bounds stayed within its bound. Past the server's capacity requests queue and latency grows for as long as the
run lasts, which the SLA catches once a level's run is long against one request's latency (requests_per_level
well above rate x latency). Without an SLA no rate is judged.

The cross-check (``bench.cross_check_concurrency``): aiperf drives the same closed loop as the sweep (``--concurrency``,
``requests_per_level`` requests, the same prompt and output lengths, the same endpoint) at one level; its
figures are set beside our client's (``cross_check``). aiperf's synthetic prompts are other text of the same
token count. It counts output tokens by tokenizing the streamed text, which need not give back the tokens the
server generated (the tiny test model's 8 tokens came back as 6 to 15), so its output tokens/s and inter-token
latency follow its count; the two clients are judged on requests/s, each request being exactly
``bench.output_tokens`` tokens on the server (EOS ignored).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from pipeline.config import BenchSection
from pipeline.errors import EnvironmentProblem, StageFailed
from pipeline.procs import foreign_python_env, start_group, stop_process_group
from pipeline.serving.bench.stats import SLA_NAMES

log = logging.getLogger(__name__)

ENV_VAR = "AIPERF"
VENV_DIR = ".venv-aiperf"
REPO_ROOT = Path(__file__).resolve().parents[3]
EXPORT_FILE = "profile_export_aiperf.json"  # aiperf's summary, in its artifact folder
RECORDS_FILE = "profile_export.jsonl"  # and its per-request records
TEMPLATE_FILE = "triton_generate_stream.json.j2"
# our SLA metric -> aiperf's metric tag (its --goodput keys and JSON export keys)
AIPERF_METRICS = {"e2e_ms": "request_latency", "ttft_ms": "time_to_first_token", "itl_ms": "inter_token_latency"}
# Triton's generate_stream body for the streaming model (the ensemble's inputs; end_id -1 generates exactly
# max_tokens). aiperf renders it with Jinja2 per request: ``text`` is the prompt, ``max_tokens`` the output length.
TRITON_TEMPLATE = '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}%s}\n'
# the cross-check: our client and aiperf agree when aiperf's requests/s is within this fraction of ours
CROSS_CHECK_TOLERANCE = 0.15


def aiperf_executable() -> str:
    """aiperf's executable (``AIPERF``, else ``.venv-aiperf``'s); EnvironmentProblem says how to install it."""
    exe = os.environ.get(ENV_VAR) or str(REPO_ROOT / VENV_DIR / "bin" / "aiperf")
    if not Path(exe).is_file() and shutil.which(exe) is None:
        raise EnvironmentProblem(
            f"bench.request_rates and bench.cross_check_concurrency are driven by aiperf, and {exe} does not exist. "
            f"`bash scripts/setup-env` installs it into {VENV_DIR} (its own environment: it needs numpy 2 and "
            f"transformers 5); or point {ENV_VAR} at "
            f"an aiperf executable; or leave bench.request_rates empty and bench.cross_check_concurrency unset (the "
            f"closed-loop sweep needs no aiperf).")
    return exe


def aiperf_argv(exe: str, *, openai: bool, http_url: str, model: str, tokenizer_dir: Path, cfg: BenchSection,
                sla: dict[str, float], out_dir: Path, rate: Optional[float] = None,
                concurrency: Optional[int] = None) -> list[str]:
    """aiperf's command for one load, ``requests_per_level`` requests: Poisson arrivals at ``rate`` requests/s, or
    a closed loop of ``concurrency`` requests in flight (give one). ``http_url``: the server's host:port;
    ``model``: the served model's name (vLLM's) or the streaming model's (Triton's)."""
    if (rate is None) == (concurrency is None):
        raise ValueError("aiperf_argv: give either rate or concurrency")
    load = (["--request-rate", f"{rate:g}", "--arrival-pattern", "poisson"] if rate is not None
            else ["--concurrency", str(concurrency)])
    argv = [exe, "profile", "--model", model, "--url", f"http://{http_url}", "--streaming", *load,
            "--request-count", str(cfg.requests_per_level),
            "--synthetic-input-tokens-mean", str(cfg.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(cfg.output_tokens), "--output-tokens-stddev", "0",
            "--tokenizer", str(tokenizer_dir), "--random-seed", "0",
            "--request-timeout-seconds", f"{cfg.request_timeout_s:g}",
            "--artifact-dir", str(out_dir), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"]
    if openai:
        argv += ["--endpoint-type", "completions"]
        if cfg.ignore_eos:
            argv += ["--extra-inputs", "ignore_eos:true"]
    else:
        template = out_dir / TEMPLATE_FILE
        template.write_text(TRITON_TEMPLATE % (', "end_id": -1' if cfg.ignore_eos else ""))
        argv += ["--endpoint-type", "template", "--custom-endpoint", f"/v2/models/{model}/generate_stream",
                 "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output"]
    if sla:
        argv += ["--goodput", " ".join(f"{AIPERF_METRICS[m]}:{b:g}" for m, b in sla.items())]
    return argv


def read_figures(folder: Path) -> dict:
    """One run's figures from aiperf's summary in ``folder``: requests, errors, throughput, latency percentiles (ms),
    and its goodput where it was given SLA bounds (``goodput_rps``)."""
    d = json.loads((folder / EXPORT_FILE).read_text())

    def stat(tag: str, key: str) -> Optional[float]:
        v = d.get(tag) or {}
        return v.get(key)

    def pcts(tag: str) -> dict:
        return {k: stat(tag, k) for k in ("p50", "p90", "p99", "avg")}

    return {
        "requests": int(stat("request_count", "avg") or 0),
        "errors": sum(int(e.get("count", 0)) for e in d.get("error_summary") or []),
        "requests_per_s": stat("request_throughput", "avg") or 0.0,
        "output_tokens_per_s": stat("output_token_throughput", "avg"),
        "output_tokens_mean": stat("output_sequence_length", "avg"),  # as aiperf counts them: see the docstring
        "duration_s": stat("benchmark_duration", "avg"),
        **{m: pcts(AIPERF_METRICS[m]) for m in AIPERF_METRICS},
        **({"goodput_rps": stat("goodput", "avg") or 0.0} if "goodput" in d else {}),
    }


def read_export(folder: Path, rate: float, sla: dict[str, float]) -> dict:
    """One rate's figures from aiperf's exports in ``folder``: throughput, latency percentiles (ms), the rate
    requests arrived at, goodput, and whether the SLA held."""
    fig = read_figures(folder)
    goodput_rps = fig.pop("goodput_rps", 0.0)
    out: dict = {"request_rate": rate, **fig, "arrived_rps": arrival_rate(folder / RECORDS_FILE)}
    if sla:
        p99 = {m: fig[m]["p99"] for m in sla}
        violations = [m for m, b in sla.items() if p99[m] is None or p99[m] > b]
        out["sla"] = {"met": not violations and fig["requests"] > 0, "p99_ms": p99, "violations": violations,
                      "goodput_rps": goodput_rps}
    return out


def arrival_rate(records: Path) -> Optional[float]:
    """The rate requests actually arrived at, from aiperf's per-request records: (n - 1) over the span of their
    n start times (a Poisson draw of a few requests strays from the nominal rate); None below three requests."""
    starts = [json.loads(line).get("metadata", {}).get("request_start_ns") for line in records.read_text().splitlines()]
    starts = [t for t in starts if t is not None]
    if len(starts) < 3:
        return None
    return (len(starts) - 1) / ((max(starts) - min(starts)) / 1e9)


def sustainable_rate(rates: Sequence[dict], sla: dict[str, float]) -> dict:
    """The highest rate whose requests all succeeded and whose P99s kept the SLA, with a sentence; rates are
    judged in ascending order and the first that fails ends the search. Without an SLA there is no bound to
    judge by (past the server's capacity the queue, and with it latency, grows for as long as the run lasts):
    the sentence says so."""
    if not sla:
        return {"request_rate": None, "sentence": "no SLA set (sla: in the config), so no rate is judged sustainable "
                                                  "or not; the figures per rate are in the results"}
    best = None
    for r in rates:
        if r["errors"] or not r["sla"]["met"]:
            break
        best = r
    if best is None:
        low = rates[0]
        return {"request_rate": None, "sentence": f"not even the lowest rate, {low['request_rate']:g} requests/s, "
                                                  f"kept the SLA: {_why_not(low)}. Lower bench.request_rates."}
    sentence = (f"the SLA holds up to {best['request_rate']:g} requests/s (Poisson arrivals): "
                f"P99 end-to-end {best['e2e_ms']['p99']:.0f} ms, goodput {best['sla']['goodput_rps']:.2f} "
                f"requests/s")
    following = [r for r in rates if r["request_rate"] > best["request_rate"]]
    if following:
        sentence += f"; at {following[0]['request_rate']:g} requests/s {_why_not(following[0])}"
    else:
        sentence += "; the highest rate swept: the limit is beyond it"
    return {"request_rate": best["request_rate"], "goodput_rps": best["sla"]["goodput_rps"], "sentence": sentence}


def _why_not(r: dict) -> str:
    if r["errors"]:
        return f"{r['errors']} request(s) failed"
    return "; ".join(f"P99 {SLA_NAMES[m]} {r['sla']['p99_ms'][m]:.0f} ms over the SLA" for m in r["sla"]["violations"])


def run_rate(exe: str, *, openai: bool, http_url: str, model: str, tokenizer_dir: Path, rate: float,
             cfg: BenchSection, sla: dict[str, float], out_dir: Path, label: str) -> dict:
    """aiperf at one rate; its figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = aiperf_argv(exe, openai=openai, http_url=http_url, model=model, tokenizer_dir=tokenizer_dir, rate=rate,
                       cfg=cfg, sla=sla, out_dir=out_dir)
    # the run's own length (requests / rate) plus aiperf's start-up and the slowest request
    _run(argv, out_dir, cfg.requests_per_level / rate + cfg.request_timeout_s + 300,
         f"{label}, request rate {rate:g}/s")
    fig = read_export(out_dir, rate, sla)
    log.info("%s at %g req/s (Poisson): %.2f req/s completed, TTFT p99 %.0f ms, e2e p50/p99 %.0f/%.0f ms%s", label,
             rate, fig["requests_per_s"], fig["ttft_ms"]["p99"] or 0, fig["e2e_ms"]["p50"] or 0,
             fig["e2e_ms"]["p99"] or 0, "" if fig.get("sla", {"met": True})["met"] else " (over the SLA)")
    return fig


def run_concurrency(exe: str, *, openai: bool, http_url: str, model: str, tokenizer_dir: Path, concurrency: int,
                    cfg: BenchSection, out_dir: Path, label: str) -> dict:
    """aiperf's closed loop of ``concurrency`` requests in flight (the cross-check); its figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = aiperf_argv(exe, openai=openai, http_url=http_url, model=model, tokenizer_dir=tokenizer_dir,
                       concurrency=concurrency, cfg=cfg, sla={}, out_dir=out_dir)
    # each client's share of the requests one after another, each within the request timeout, plus start-up
    per_client = -(-cfg.requests_per_level // concurrency)
    _run(argv, out_dir, per_client * cfg.request_timeout_s + 300, f"{label}, concurrency {concurrency}")
    return read_figures(out_dir)


def _run(argv: list[str], out_dir: Path, timeout_s: float, what: str) -> None:
    """aiperf in its own process group (ended with it, whatever happens); StageFailed with its log's last lines
    when it fails or writes no summary."""
    log_path = out_dir / "aiperf.log"
    with log_path.open("w") as log_file:
        proc = start_group(argv, "aiperf", stdout=log_file, stderr=subprocess.STDOUT, env=foreign_python_env())
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_process_group(proc, "aiperf")  # its services are processes of their own: none outlives it
    if code != 0 or not (out_dir / EXPORT_FILE).is_file():
        how = "ran past its time limit" if code is None else f"exited with {code}"
        raise StageFailed(f"bench ({what}): aiperf {how}. The last lines of its log:\n{_tail(log_path)}")


def cross_check(ours: dict, theirs: dict, concurrency: int) -> dict:
    """Our client's level (its medians) beside aiperf's closed loop at the same concurrency: the headline figures
    of each, aiperf / ours, and whether the throughputs agree (requests/s within ``CROSS_CHECK_TOLERANCE``), in a
    sentence."""
    a, o = _headline(theirs), _headline(ours)
    ratio = {k: a[k] / o[k] if a[k] is not None and o[k] else None for k in o}
    r = ratio["requests_per_s"]
    agree = r is not None and abs(r - 1) <= CROSS_CHECK_TOLERANCE
    latency = [ratio["ttft_p50_ms"], ratio["itl_p50_ms"], ratio["e2e_p50_ms"]]
    sentence = (f"at concurrency {concurrency} aiperf measured {a['requests_per_s']:.2f} requests/s and "
                f"{a['output_tokens_per_s'] or 0:.1f} output tokens/s ({a['output_tokens_mean'] or 0:.1f} per request "
                f"as it counts them), our client {o['requests_per_s']:.2f} and {o['output_tokens_per_s']:.1f} "
                f"({o['output_tokens_mean']:.1f}): aiperf / ours {_ratio(r)} in requests/s, "
                f"{'within' if agree else 'NOT within'} {CROSS_CHECK_TOLERANCE:.0%}; median TTFT, ITL and end-to-end "
                f"latency aiperf / ours {', '.join(map(_ratio, latency))}")
    return {"concurrency": concurrency, "ours": o,
            "aiperf": {**a, "requests": theirs["requests"], "errors": theirs["errors"]},
            "aiperf_over_ours": ratio, "agree_within": CROSS_CHECK_TOLERANCE, "agree": agree, "sentence": sentence}


def _headline(fig: dict) -> dict:
    """The figures the cross-check compares, from a level of ours or an aiperf run (the same shape)."""
    return {"requests_per_s": fig["requests_per_s"], "output_tokens_per_s": fig["output_tokens_per_s"],
            "output_tokens_mean": fig["output_tokens_mean"], "ttft_p50_ms": fig["ttft_ms"].get("p50"),
            "itl_p50_ms": fig["itl_ms"].get("p50"), "e2e_p50_ms": fig["e2e_ms"].get("p50")}


def _ratio(r: Optional[float]) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])
