"""Triton's own counters, from its Prometheus metrics endpoint, read before and after each level.

A level's server-side figures are the difference: queue and compute time per request, per model, and the
server's first-response time of the streaming model.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

log = logging.getLogger(__name__)

# Triton's per-model counters (cumulative since the server started; a level's figure is the difference)
TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                   "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us", "nv_inference_first_response_histogram_ms_sum",
                   "nv_inference_first_response_histogram_ms_count")
# the server's own time to first response of decoupled models, where the server reports it (the Triton
# images do; nvidia-pytriton's 2.51 reports none for Python-backend models, and the figure is then absent)
METRICS_ARGS = ("--metrics-config=histogram_latencies=true",)

_METRIC_LINE = re.compile(r"^([a-z_]+)\{([^}]*)\}\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """{(metric, model): value} for Triton's per-model counters (summed over versions)."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line.strip())
        if not m or m.group(1) not in TRITON_COUNTERS:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if "model" not in labels:
            continue
        key = (m.group(1), labels["model"])
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def scrape_metrics(url: Optional[str]) -> Optional[dict[tuple[str, str], float]]:
    """The counters at ``url`` now; None (and a warning) when there is no URL or it cannot be read."""
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return parse_metrics(r.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError) as e:
        log.warning("could not read Triton's metrics at %s: %s", url, e)
        return None


def answered(counters: Optional[dict[tuple[str, str], float]], model: str) -> float:
    """The requests ``model`` has finished (succeeded or failed) by ``counters``."""
    if counters is None:
        return 0.0
    return (counters.get(("nv_inference_request_success", model), 0.0)
            + counters.get(("nv_inference_request_failure", model), 0.0))


def scrape_settled(url: Optional[str], model: str, at_least: float, timeout_s: float = 10.0,
                   ) -> Optional[dict[tuple[str, str], float]]:
    """The counters at ``url`` once ``model`` has finished ``at_least`` requests, or as they stand after
    ``timeout_s`` (a warning). Triton counts a decoupled request when it releases it, which can come after the
    client has read its final response: a scrape at once may miss the level's last requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        counters = scrape_metrics(url)
        if counters is None or answered(counters, model) >= at_least:
            return counters
        if time.monotonic() >= deadline:
            log.warning("Triton's metrics at %s count %d finished request(s) of %s after %.0f s, not %d: the "
                        "level's server-side figures are short", url, answered(counters, model), model, timeout_s,
                        at_least)
            return counters
        time.sleep(0.05)


def metrics_delta(before: Optional[dict], after: Optional[dict], models: Sequence[str]) -> Optional[dict]:
    """Per model, what the level added: requests, executions, average batch, queue/compute ms per request."""
    if before is None or after is None:
        return None
    out = {}
    for model in models:
        fig = _model_figures({k: after.get((k, model), 0.0) - before.get((k, model), 0.0) for k in TRITON_COUNTERS})
        if fig is not None:
            out[model] = fig
    return out


def _model_figures(d: dict[str, float]) -> Optional[dict]:
    """One model's figures from what its counters added; None where it answered no request."""
    n = d["nv_inference_request_success"]
    if n <= 0:
        return None

    def per(k: str) -> float:  # microseconds per request -> ms
        return d[k] / n / 1e3

    fig = {
        "requests": int(n),
        "failures": int(d["nv_inference_request_failure"]),
        "executions": int(d["nv_inference_exec_count"]),
        "avg_batch_size": d["nv_inference_count"] / d["nv_inference_exec_count"]
        if d["nv_inference_exec_count"] else None,
        "request_ms": per("nv_inference_request_duration_us"),
        "queue_ms": per("nv_inference_queue_duration_us"),
        "compute_input_ms": per("nv_inference_compute_input_duration_us"),
        "compute_infer_ms": per("nv_inference_compute_infer_duration_us"),
        "compute_output_ms": per("nv_inference_compute_output_duration_us"),
    }
    if d["nv_inference_first_response_histogram_ms_count"] > 0:
        fig["first_response_ms"] = (d["nv_inference_first_response_histogram_ms_sum"]
                                    / d["nv_inference_first_response_histogram_ms_count"])
    return fig
