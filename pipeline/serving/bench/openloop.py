"""Open-loop load: requests arriving at a set rate (Poisson arrivals), driven by NVIDIA's aiperf.

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
from pipeline.procs import foreign_python_env, stop_process_group
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


def aiperf_executable() -> str:
    """aiperf's executable (``AIPERF``, else ``.venv-aiperf``'s); EnvironmentProblem says how to install it."""
    exe = os.environ.get(ENV_VAR) or str(REPO_ROOT / VENV_DIR / "bin" / "aiperf")
    if not Path(exe).is_file() and shutil.which(exe) is None:
        raise EnvironmentProblem(
            f"bench.request_rates is driven by aiperf, and {exe} does not exist. `bash scripts/setup-env` installs "
            f"it into {VENV_DIR} (its own environment: it needs numpy 2 and transformers 5); or point {ENV_VAR} at "
            f"an aiperf executable; or leave bench.request_rates empty (the closed-loop sweep needs no aiperf).")
    return exe


def aiperf_argv(exe: str, *, openai: bool, http_url: str, model: str, tokenizer_dir: Path, rate: float,
                cfg: BenchSection, sla: dict[str, float], out_dir: Path) -> list[str]:
    """aiperf's command for one rate. ``http_url``: the server's host:port; ``model``: the served model's name
    (vLLM's) or the streaming model's (Triton's)."""
    argv = [exe, "profile", "--model", model, "--url", f"http://{http_url}", "--streaming",
            "--request-rate", f"{rate:g}", "--arrival-pattern", "poisson",
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


def read_export(folder: Path, rate: float, sla: dict[str, float]) -> dict:
    """One rate's figures from aiperf's exports in ``folder``: throughput, latency percentiles (ms), goodput,
    and whether the SLA held."""
    d = json.loads((folder / EXPORT_FILE).read_text())

    def stat(tag: str, key: str) -> Optional[float]:
        v = d.get(tag) or {}
        return v.get(key)

    def pcts(tag: str) -> dict:
        return {k: stat(tag, k) for k in ("p50", "p90", "p99", "avg")}

    completed = int(stat("request_count", "avg") or 0)
    errors = sum(int(e.get("count", 0)) for e in d.get("error_summary") or [])
    latency = {m: pcts(AIPERF_METRICS[m]) for m in AIPERF_METRICS}
    out: dict = {
        "request_rate": rate,
        "requests": completed,
        "errors": errors,
        "requests_per_s": stat("request_throughput", "avg") or 0.0,
        "output_tokens_per_s": stat("output_token_throughput", "avg"),
        "duration_s": stat("benchmark_duration", "avg"),
        **latency,
        "arrived_rps": arrival_rate(folder / RECORDS_FILE),
    }
    if sla:
        p99 = {m: latency[m]["p99"] for m in sla}
        violations = [m for m, b in sla.items() if p99[m] is None or p99[m] > b]
        out["sla"] = {"met": not violations and completed > 0, "p99_ms": p99, "violations": violations,
                      "goodput_rps": stat("goodput", "avg") or 0.0}
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
    """aiperf at one rate, in its own process group (ended with it, whatever happens); its figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = aiperf_argv(exe, openai=openai, http_url=http_url, model=model, tokenizer_dir=tokenizer_dir, rate=rate,
                       cfg=cfg, sla=sla, out_dir=out_dir)
    log_path = out_dir / "aiperf.log"
    # the run's own length (requests / rate) plus aiperf's start-up and the slowest request
    timeout_s = cfg.requests_per_level / rate + cfg.request_timeout_s + 300
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=foreign_python_env(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_process_group(proc, "aiperf")  # its services are processes of their own: none outlives it
    export = out_dir / EXPORT_FILE
    if code != 0 or not export.is_file():
        what = "ran past its time limit" if code is None else f"exited with {code}"
        raise StageFailed(f"bench ({label}, request rate {rate:g}/s): aiperf {what}. The last lines of its "
                          f"log:\n{_tail(log_path)}")
    fig = read_export(out_dir, rate, sla)
    log.info("%s at %g req/s (Poisson): %.2f req/s completed, TTFT p99 %.0f ms, e2e p50/p99 %.0f/%.0f ms%s", label,
             rate, fig["requests_per_s"], fig["ttft_ms"]["p99"] or 0, fig["e2e_ms"]["p50"] or 0,
             fig["e2e_ms"]["p99"] or 0, "" if fig.get("sla", {"met": True})["met"] else " (over the SLA)")
    return fig


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])
