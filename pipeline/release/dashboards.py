"""A Grafana dashboard for a served build, in four rows: hardware, the inference pipeline, quality of service,
tenants.

`invoke deploy-manifests` writes it as a ConfigMap labelled ``grafana_dashboard: "1"`` (the label Grafana's
dashboard sidecar, as kube-prometheus-stack runs it, loads dashboards from) and as plain JSON to import by hand.
Every panel reads a series a real exporter writes (the same sources as pipeline/release/alerts.py):

- hardware: NVIDIA dcgm-exporter's default counters (etc/default-counters.csv at commit 00d6d344ea4a):
  ``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_MEM_COPY_UTIL`` (percent), ``DCGM_FI_DEV_FB_USED`` (MiB),
  ``DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL`` (shown as exported: the CSV declares a counter, but the field is
  reported to be DCGM's current rate, so no rate() and no alert on it until checked on a GPU); the serving model's
  resident memory and its KV pool's fragmentation (``trtllm_pipeline_model_metrics``,
  triton_repo/common/llm_serving.py);
- pipeline: Triton's per-model counters (``nv_inference_queue_duration_us``, ``nv_inference_compute_infer_duration_us``,
  ``nv_inference_request_success``, ``nv_inference_count``, ``nv_inference_exec_count``: the stage time split
  over preprocessing, the LLM and postprocessing, and requests per execution), the tensorrtllm backend's
  request, inflight-batcher (paused requests) and KV-cache families, and the padding factor;
- quality of service: end-to-end P50 / P99, P99 / P50, jitter and token-gap jitter over the last minute,
  failed requests, the scrape heartbeat (``up``), watchdog stops and pod restarts;
- tenants: the per-tenant series of ``pipeline.release.alerts.TENANT_SERIES`` (KV-cache share used, requests
  accepted and refused, P99 latency and time to first token), which the serving model exports only on a
  deployment whose config has a ``tenants:`` section (elsewhere the row's panels show no data).

The vllm target's OpenAI server exports vLLM's own series instead, and gets its own dashboard
(``dashboard(name, engine="vllm")``) on the series its alert rules read (pipeline/release/alerts.py, each in
``pipeline.engines.vllm.engine_args.METRIC_SERIES``, which verify's ``metrics`` check finds on the real server):
an engine row (requests waiting and running, KV cache used, preemptions), a quality-of-service row (API
answers by status, the 5xx share, the heartbeat, restarts) and, with ``vllm.device: cuda``, the DCGM row.
Each dashboard shows every series its alert rules read (tests/release/test_alerts.py holds them to it).
"""

from __future__ import annotations

import json

DASHBOARD_LABEL = {"grafana_dashboard": "1"}  # the Grafana sidecar's default label
SCHEMA_VERSION = 39
OURS = "trtllm_pipeline_model_metrics"


def _panel(title: str, exprs: dict[str, str], *, unit: str, x: int, y: int, description: str) -> dict:
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"x": x, "y": y, "w": 8, "h": 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                        for i, (legend, expr) in enumerate(exprs.items())]}


def _row(title: str, y: int) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "panels": []}


GPU_PANELS = [
    ("GPU utilisation", {"{{Hostname}} GPU {{gpu}}": "avg by (Hostname, gpu) (DCGM_FI_DEV_GPU_UTIL)"},
     "percent", "DCGM: the share of time a kernel ran (alert: GpuSaturated)"),
    ("GPU memory-copy load", {"{{Hostname}} GPU {{gpu}}": "avg by (Hostname, gpu) (DCGM_FI_DEV_MEM_COPY_UTIL)"},
     "percent", "DCGM: the share of time the memory was read or written (decode is memory-bound; alert: "
                "GpuMemoryCopyBusy)"),
    ("NVLink traffic", {"{{Hostname}} GPU {{gpu}}": "max by (Hostname, gpu) (DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL)"},
     "short", "DCGM field 449, all lanes (tensor-parallel traffic), as exported: the exporter's CSV "
              "declares it a counter, while DCGM reports it as a rate; shown raw, not rate()d"),
    ("GPU memory used", {"{{Hostname}} GPU {{gpu}}": "max by (Hostname, gpu) (DCGM_FI_DEV_FB_USED)"},
     "decmbytes", "DCGM: framebuffer used (MiB): weights, KV cache, activations"),
    ("GPU XID errors", {"{{Hostname}} GPU {{gpu}}": "max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS)"},
     "short", "DCGM: the last XID error's value, 0 when none (alert: GpuXidError)"),
]


def _pod_panels(pods: str) -> list:
    """Prometheus's scrape heartbeat and kube-state-metrics' restarts (alerts: TargetDown, PodRestarting)."""
    return [
        ("Heartbeat", {"{{pod}}": f"min by (pod) (up{{{pods}}})"}, "short",
         "1 while Prometheus scrapes the pod; 0 is a missed heartbeat (the TargetDown alert after 3)"),
        ("Restarts", {"restarts in 15m {{pod}}":
                      f"sum by (pod) (increase(kube_pod_container_status_restarts_total{{{pods}}}[15m]))"},
         "short", "The pod's container restarts (the PodRestarting alert)"),
    ]


def dashboard(name: str, engine: str = "triton", gpu: bool = True) -> dict:
    """The dashboard for release ``name`` (its pods are ``<name>-...``); panels by row, three to a line. ``engine``:
    whose series it reads ("triton", or "vllm": vLLM's OpenAI server; as pipeline.release.alerts.rules); ``gpu``:
    the vllm dashboard's DCGM row (the Triton one always has its hardware row)."""
    if engine == "vllm":
        return _board(name, _vllm_rows(name, gpu), "vllm")
    pods = f'pod=~"{name}-.*"'
    ours = OURS + '{{metric_type="{}",' + pods + "}}"
    per_model = "sum by (model) (rate({}{{" + pods + "}}[5m]))"
    rows = {
        "Hardware": [
            *GPU_PANELS,
            ("Model process memory", {"{{pod}}": f"max by (pod) ({ours.format('resident_memory_bytes')})",
                                      "{{pod}} growth / s": f"max by (pod) "
                                                            f"({ours.format('resident_memory_growth_bytes_per_s')})"},
             "bytes", "The serving model's resident memory and its growth over the watchdog's window (a leak)"),
            ("KV-pool fragmentation", {"{{pod}}": f"max by (pod) ({ours.format('kv_fragmentation')})"},
             "percentunit", "The share of the used KV blocks' token slots that hold no token"),
        ],
        "Inference pipeline": [
            ("Compute time per request, by stage",
             {"{{model}}": f"{per_model.format('nv_inference_compute_infer_duration_us')} / "
                           f"{per_model.format('nv_inference_request_success')} / 1000"},
             "ms", "Triton: each model's compute time per request (preprocessing, LLM, postprocessing)"),
            ("Queue time per request, by stage",
             {"{{model}}": f"{per_model.format('nv_inference_queue_duration_us')} / "
                           f"{per_model.format('nv_inference_request_success')} / 1000"},
             "ms", "Triton: time each model's requests waited in its scheduler queue"),
            ("Requests per execution", {"{{model}}": f"{per_model.format('nv_inference_count')} / "
                                                     f"{per_model.format('nv_inference_exec_count')}"},
             "short", "Triton: inferences per model execution (the effective batch size of each stage)"),
            ("LLM requests", {"{{request_type}}": f'sum by (request_type) (nv_trt_llm_request_metrics{{{pods},'
                                                 f'request_type=~"active|scheduled|waiting"}})',
                              "pending in Triton": f"sum (nv_inference_pending_request_count{{{pods}}})",
                              "paused": f'sum (nv_trt_llm_inflight_batcher_metrics{{{pods},'
                                        f'inflight_batcher_specific_metric="paused_requests"}})'},
             "short", "The batch manager's requests: active, scheduled (running), waiting, and paused (a running "
                      "sequence whose slot a more urgent request took; KV kept); Triton's pending requests "
                      "(waiting + pending: the TritonQueueBacklog alert)"),
            ("KV cache used", {"{{pod}}": f'sum by (pod) (nv_trt_llm_kv_cache_block_metrics{{{pods},'
                                          f'kv_cache_block_type="used"}}) / sum by (pod) '
                                          f'(nv_trt_llm_kv_cache_block_metrics{{{pods},kv_cache_block_type="max"}})'},
             "percentunit", "KV-cache blocks used out of the pool"),
            ("Padding factor", {"{{pod}}": f"max by (pod) ({ours.format('padding_factor')})"},
             "short", "Decode-step attention positions computed / real (1: no padding; 0: no decode step)"),
        ],
        "Quality of service": [
            ("End-to-end latency", {"P50 {{pod}}": f"max by (pod) ({ours.format('latency_p50_ms')})",
                                    "P99 {{pod}}": f"max by (pod) ({ours.format('latency_p99_ms')})"},
             "ms", "The LLM model's request latency over the last minute's requests"),
            ("Tail and jitter", {"P99 / P50 {{pod}}": f"max by (pod) ({ours.format('latency_p99_over_p50')})",
                                 "jitter {{pod}}": f"max by (pod) ({ours.format('latency_jitter')})",
                                 "token-gap jitter {{pod}}": f"max by (pod) ({ours.format('token_gap_jitter')})"},
             "short", "P99 / P50 and std / mean of latency, and of the gaps between tokens (alerts: "
                      "TritonLatencyTail, TritonLatencyJitter)"),
            ("Failed requests", {"{{pod}}": f"sum by (pod) (rate(nv_inference_request_failure{{{pods}}}[5m])) / "
                                            f"(sum by (pod) (rate(nv_inference_request_failure{{{pods}}}[5m])) + "
                                            f"sum by (pod) (rate(nv_inference_request_success{{{pods}}}[5m])))",
                                 "watchdog's last minute {{pod}}":
                                     f"max by (pod) ({ours.format('failed_requests_last_minute')})"},
             "short", "Triton's failed share of requests, and the failures the watchdog counts (its limit: "
                      "triton.watchdog.errors_per_minute)"),
            *_pod_panels(pods),
            ("Watchdog stops", {"watchdog tripped {{pod}}": f"max by (pod) ({ours.format('watchdog_tripped')})"},
             "short", "The model's watchdog stopping its server (a restart follows)"),
        ],
        "Tenants": _tenant_panels(pods),
    }
    return _board(name, rows, "triton")


def _tenant_panels(pods: str) -> list:
    """Per tenant (a deployment with a ``tenants:`` section; "default" is the pool's unassigned remainder): its
    KV-cache share used on its fullest pod, its requests accepted and refused, its P99 latency and time to first
    token on its slowest pod."""
    by = "sum by (pod, tenant)"
    used = f"{by} (tenant_quota_usage{{{pods}}}) / ({by} (tenant_quota_limit{{{pods}}}) > 0)"
    return [
        ("Tenant KV-cache share used", {"{{tenant}}": f"max by (tenant) ({used})"},
         "percentunit", "KV-cache blocks the tenant's admitted requests reserve (each at its full length) out of "
                        "its share, on its fullest pod (alert: TenantQuotaNearlyFull)"),
        ("Tenant requests", {"accepted {{tenant}}": f"sum by (tenant) (rate(tenant_requests_total{{{pods}}}[5m]))",
                             "refused {{tenant}}": f"sum by (tenant) (rate(tenant_rejections_total{{{pods}}}[5m]))"},
         "reqps", "Requests each tenant's queue accepted, and those refused at its limit (concurrency or token "
                  "rate)"),
        ("Tenant latency", {"P99 {{tenant}}": f"max by (tenant) (tenant_latency_p99_ms{{{pods}}})",
                            "P99 first token {{tenant}}": f"max by (tenant) (tenant_first_token_p99_ms{{{pods}}})"},
         "ms", "P99 end-to-end latency and time to first token over each tenant's requests answered in the last "
               "minute, on its slowest pod"),
    ]


def _vllm_rows(name: str, gpu: bool) -> dict:
    """vLLM's OpenAI server: its engine's gauges and counters and its API's requests (the series its alerts read)."""
    pods = f'pod=~"{name}-.*"'
    api = f'handler=~"/v1/.*",{pods}'
    rows = {"Hardware": GPU_PANELS} if gpu else {}
    rows["Engine"] = [
        ("Requests", {"waiting {{pod}}": f"sum by (pod) (vllm:num_requests_waiting{{{pods}}})",
                      "running {{pod}}": f"sum by (pod) (vllm:num_requests_running{{{pods}}})"},
         "short", "vLLM's scheduler: requests running in the batch and waiting for it (the VllmQueueBacklog alert)"),
        ("KV cache used", {"{{pod}}": f"max by (pod) (vllm:kv_cache_usage_perc{{{pods}}})"},
         "percentunit", "vLLM's KV-cache blocks in use (the VllmKVCacheNearlyFull alert)"),
        ("Preemptions", {"{{pod}}": f"sum by (pod) (rate(vllm:num_preemptions_total{{{pods}}}[5m]))"},
         "ops", "Sequences vLLM preempted (and will recompute) for want of KV cache (the VllmPreempting alert)"),
    ]
    failed = f'sum by (pod) (rate(http_requests_total{{status="5xx",{api}}}[5m]))'
    rows["Quality of service"] = [
        ("API answers", {"{{status}}": f"sum by (status) (rate(http_requests_total{{{api}}}[5m]))"},
         "reqps", "The OpenAI API's answers per second by status class (2xx, 4xx: bad client input, 5xx)"),
        ("Failed share", {"{{pod}}": f"{failed} / sum by (pod) (rate(http_requests_total{{{api}}}[5m]))"},
         "percentunit", "The share of API requests answered 5xx (the VllmErrorRate alert)"),
        *_pod_panels(pods),
    ]
    rows["Tenants"] = _tenant_panels(pods)  # the tenant middleware's series (a deployment with tenants)
    return rows


def _board(name: str, rows: dict, engine: str) -> dict:
    panels, y = [], 0
    for title, specs in rows.items():
        panels.append(_row(title, y))
        y += 1
        for i, (panel_title, exprs, unit, description) in enumerate(specs):
            panels.append(_panel(panel_title, exprs, unit=unit, x=8 * (i % 3), y=y + 8 * (i // 3),
                                 description=description))
        y += 8 * -(-len(specs) // 3)
    return {"title": f"{name}: LLM serving", "uid": f"trtllm-{name}"[:40], "schemaVersion": SCHEMA_VERSION,
            "tags": ["trtllm-pipeline", engine], "timezone": "browser", "refresh": "30s",
            "time": {"from": "now-3h", "to": "now"},
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus"}]},
            "panels": panels}


def config_map(name: str, labels: dict[str, str], engine: str = "triton", gpu: bool = True) -> dict:
    """The dashboard as a ConfigMap for Grafana's sidecar (one JSON file in it)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-dashboard", "labels": {**labels, **DASHBOARD_LABEL}},
            "data": {f"{name}.json": json.dumps(dashboard(name, engine, gpu), indent=1)}}
