"""Alert rules for a served build, from the ``alerts`` config section: a PrometheusRule for the Prometheus
Operator and the same groups as a plain rules file (for a Prometheus without the Operator, and for promtool).

Every expression reads a series a real exporter writes, named where it is defined:
- Triton's own metrics (``nv_inference_pending_request_count``, ``nv_inference_request_success`` /
  ``_failure``: Triton's metrics documentation), and the tensorrtllm backend's families the cpu target's
  models export too (``nv_trt_llm_request_metrics{request_type="waiting"}``,
  ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"|"max"}``: triton_repo/common/llm_serving.py);
- ``trtllm_pipeline_model_metrics{metric_type="latency_p99_over_p50"|"latency_jitter"}``: the Python-backend serving
  models' quality-of-service gauges over the last minute's requests (triton_repo/common/llm_serving.py; cpu and
  pytorch targets: the tensorrt target's C++ backend exports none, so those two rules stay silent there);
- the per-tenant series of ``TENANT_SERIES`` (``tenant_quota_usage`` / ``tenant_quota_limit``: KV-cache blocks
  reserved and the tenant's share, per pod), which the cpu and vllm targets' serving models (and on vLLM's OpenAI
  server its tenant middleware, triton_repo/tensorrt_llm_vllm/tenant_admission.py) export only on a deployment
  whose config has a ``tenants:`` section: elsewhere ``TenantQuotaNearlyFull`` reads nothing and stays silent;
- ``up`` (Prometheus itself: 0 when a scrape fails; the PodMonitor scrapes every ``SCRAPE_INTERVAL_S``);
- ``kube_pod_container_status_restarts_total`` (kube-state-metrics);
- NVIDIA dcgm-exporter's default counters (etc/default-counters.csv at commit 00d6d344ea4a):
  ``DCGM_FI_DEV_GPU_UTIL`` and ``DCGM_FI_DEV_MEM_COPY_UTIL`` (gauges, percent), ``DCGM_FI_DEV_XID_ERRORS``
  (gauge: the last XID error's value, 0 when none).

The vllm target's rules (``rules(..., engine="vllm")``) read vLLM's own series instead, as vLLM 0.32's server
exports them (each is in ``pipeline.engines.vllm.engine_args.METRIC_SERIES``, which verify's ``metrics`` check
finds on the real server's /metrics; tests/release/test_alerts.py holds the rules to that list):
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0-1), ``vllm:num_preemptions_total`` (v1/metrics/
loggers.py) and the API's ``http_requests_total{handler, status="2xx"|"4xx"|"5xx"}``
(prometheus-fastapi-instrumentator, attached in vllm/entrypoints/serve/instrumentator/metrics.py). The target,
restart and GPU rules are the same; the GPU ones only with ``vllm.device: cuda``.

The queue threshold defaults to the HorizontalPodAutoscaler's target (32 waiting per replica): the alert
says the autoscaler is not keeping up (at its maximum, or pods not starting), not that it has work to do.
Each alert carries a ``runbook`` annotation; docs/how-to/operate.md has a section per alert (its name the anchor).
"""

from __future__ import annotations

SCRAPE_INTERVAL_S = 15  # deploy/base/podmonitor.yaml
GROUP = "trtllm-pipeline.serving"
# The per-tenant series (labels tenant, model, version) triton_repo/common/llm_serving.py exports when the config
# has a `tenants:` section, and only then; tenant "default" is the pool's unassigned remainder. Gauges: KV-cache
# blocks reserved by the tenant's admitted requests (each at its full length), the tenant's share of the pool in
# blocks, and P99 latency and time to first token over its requests answered in the last minute (ms); counters:
# requests its queue accepted, and requests refused at its limit (concurrency or token rate).
TENANT_SERIES = ("tenant_quota_usage", "tenant_quota_limit", "tenant_requests_total", "tenant_rejections_total",
                 "tenant_latency_p99_ms", "tenant_first_token_p99_ms")


def _duration(seconds: int) -> str:
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def rules(section, name: str, engine: str = "triton", gpu: bool = True) -> list[dict]:
    """The alerting rules for the release ``name`` (its pods are ``<name>-...``), thresholds from ``section``
    (a config AlertsSection): on Triton's series, or with ``engine="vllm"`` on vLLM's; the GPU rules only with
    ``gpu``."""
    pods = f'pod=~"{name}-.*"'
    hold = _duration(section.for_minutes * 60)
    if engine == "vllm":  # the tenants' series: tenant_admission.py's, on the same /metrics
        return (_vllm_rules(section, name) + [_tenant_rule(section, pods, hold)] + _pod_rules(section, name, "Vllm")
                + (_gpu_rules(section) if gpu else []))
    waiting = (f'sum by (namespace, pod) ({{__name__=~"nv_inference_pending_request_count|nv_trt_llm_request_metrics",'
               f'request_type=~"|waiting",{pods}}})')
    kv = 'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="{}",' + pods + '}}'
    failed = f"sum by (namespace, pod) (rate(nv_inference_request_failure{{{pods}}}[5m]))"
    # a tenant's request refused at its limit is an error answer, which the ensemble counts as a failure
    # (measured on the nvidia-pytriton server, reason="OTHER"); it is throttling, not a fault, so it is taken out
    rejected = f"sum by (namespace, pod) (rate(tenant_rejections_total{{{pods}}}[5m]))"
    faults = f"clamp_min({failed} - ({rejected} or {failed} * 0), 0)"
    qos = 'max by (namespace, pod) (trtllm_pipeline_model_metrics{{metric_type="{}",' + pods + '}})'
    answered = f"sum by (namespace, pod) (rate(nv_inference_request_success{{{pods}}}[5m]))"
    out = [
        _rule("TritonQueueBacklog", f"{waiting} > {section.queue_waiting}", hold=hold, severity="warning",
              summary=f"More than {section.queue_waiting} requests have waited in {{{{ $labels.pod }}}} for {hold}.",
              runbook="The autoscaler is not keeping up: check the HPA (at maxReplicas?), pending pods and GPU "
                      "capacity; lower build.max_batch_size only if P99 latency is the problem."),
        _rule("TritonKVCacheNearlyFull",
              f"sum by (namespace, pod) ({kv.format('used')}) / sum by (namespace, pod) ({kv.format('max')}) "
              f"> {section.kv_cache_used_fraction}", hold=hold, severity="warning",
              summary=f"{{{{ $labels.pod }}}} has used over {section.kv_cache_used_fraction:.0%} of its KV-cache "
                      f"blocks for {hold}.",
              runbook="New requests wait for blocks: raise build.kv_cache.free_gpu_memory_fraction, quantize the "
                      "KV cache (quantization.kv_cache: fp8), or add replicas."),
        _rule("TritonErrorRate", f"{faults} / ({failed} + {answered}) > {section.error_ratio}", hold=hold,
              severity="critical",
              summary=f"Over {section.error_ratio:.0%} of requests to {{{{ $labels.pod }}}} failed for {hold}.",
              runbook="Read the pod's log (the ensemble counts its 4xx answers too; a tenant's refusals are left out); "
                      "a model that fails every "
                      "request is restarted by its watchdog / liveness probe."),
        _rule("TritonLatencyTail", f"{qos.format('latency_p99_over_p50')} > {section.latency_p99_over_p50}", hold=hold,
              severity="warning",
              summary=f"End-to-end P99 over P50 in {{{{ $labels.pod }}}} has been above "
                      f"{section.latency_p99_over_p50:g} for {hold} (now {{{{ $value }}}}).",
              runbook="A few requests wait far longer than most: long prompts prefilled whole (set "
                      "triton.prefill_chunk_tokens), a batch limit too high for the SLA (`invoke tune`), or one class "
                      "starving another (priority_levels)."),
        _rule("TritonLatencyJitter", f"{qos.format('latency_jitter')} > {section.latency_jitter}", hold=hold,
              severity="warning",
              summary=f"End-to-end latency jitter (std / mean) in {{{{ $labels.pod }}}} has been above "
                      f"{section.latency_jitter:g} for {hold} (now {{{{ $value }}}}).",
              runbook="Latency is unpredictable: mixed prompt and output lengths under load; see "
                      "TritonLatencyTail's runbook, and compare the token-gap jitter on the dashboard (high: decode "
                      "steps stall)."),
        _tenant_rule(section, pods, hold),
    ]
    return out + _pod_rules(section, name, "Triton") + (_gpu_rules(section) if gpu else [])


def _tenant_rule(section, pods: str, hold: str) -> dict:
    """A tenant whose admitted requests hold most of its KV-cache share, per pod; a tenant with no share (limit 0)
    is left out rather than divided by zero."""
    by = "sum by (namespace, pod, tenant)"
    used = f"{by} (tenant_quota_usage{{{pods}}})"
    share = f"({by} (tenant_quota_limit{{{pods}}}) > 0)"
    return _rule("TenantQuotaNearlyFull", f"{used} / {share} > {section.tenant_quota_fraction}", hold=hold,
                 severity="warning",
                 summary=f"Tenant {{{{ $labels.tenant }}}} has reserved over {section.tenant_quota_fraction:.0%} of "
                         f"its KV-cache share in {{{{ $labels.pod }}}} for {hold}.",
                 runbook="The tenant's admitted requests hold nearly all of its KV-cache share, so its next ones may "
                         "not fit: raise its kv share in the `tenants:` section, lower its concurrency there, or "
                         "add replicas.")


def _vllm_rules(section, name: str) -> list[dict]:
    """Queue, KV cache, preemptions and errors, on vLLM's own series."""
    pods = f'pod=~"{name}-.*"'
    hold = _duration(section.for_minutes * 60)
    api = f'handler=~"/v1/.*",{pods}'
    failed = f'sum by (namespace, pod) (rate(http_requests_total{{status="5xx",{api}}}[5m]))'
    answered = f"sum by (namespace, pod) (rate(http_requests_total{{{api}}}[5m]))"
    return [
        _rule("VllmQueueBacklog", f"sum by (namespace, pod) (vllm:num_requests_waiting{{{pods}}}) > "
                                  f"{section.queue_waiting}", hold=hold, severity="warning",
              summary=f"More than {section.queue_waiting} requests have waited in {{{{ $labels.pod }}}} for {hold}.",
              runbook="The autoscaler is not keeping up: check the HPA (at maxReplicas?), pending pods and GPU "
                      "capacity; lower build.max_batch_size (max_num_seqs) only if P99 latency is the problem."),
        _rule("VllmKVCacheNearlyFull", f"max by (namespace, pod) (vllm:kv_cache_usage_perc{{{pods}}}) > "
                                       f"{section.kv_cache_used_fraction}", hold=hold, severity="warning",
              summary=f"{{{{ $labels.pod }}}} has used over {section.kv_cache_used_fraction:.0%} of its KV cache "
                      f"for {hold}.",
              runbook="vLLM preempts sequences when it runs out: raise vllm.gpu_memory_utilization "
                      "(vllm.cpu_kv_cache_gib on CPUs), keep the KV cache in FP8, add vllm.kv_offloading_gib, or add "
                      "replicas."),
        _rule("VllmPreempting", f"sum by (namespace, pod) (rate(vllm:num_preemptions_total{{{pods}}}[5m])) > 0",
              hold=hold, severity="warning",
              summary=f"vLLM in {{{{ $labels.pod }}}} has been preempting sequences for {hold}.",
              runbook="Preempted sequences are recomputed (time to first token and latency suffer): the KV cache "
                      "is too small for the batch; see VllmKVCacheNearlyFull's runbook."),
        _rule("VllmErrorRate", f"{failed} / {answered} > {section.error_ratio}", hold=hold, severity="critical",
              summary=f"Over {section.error_ratio:.0%} of API requests to {{{{ $labels.pod }}}} answered 5xx for "
                      f"{hold}.",
              runbook="Read the pod's log (bad client input is a 4xx, not a failure here); an engine that died makes "
                      "/health fail and the liveness probe restart the pod."),
    ]


def _pod_rules(section, name: str, prefix: str) -> list[dict]:
    """A target that stopped answering scrapes, a pod that keeps restarting."""
    pods = f'pod=~"{name}-.*"'
    return [
        _rule(f"{prefix}TargetDown", f'up{{{pods}}} == 0', hold=_duration(section.missed_scrapes * SCRAPE_INTERVAL_S),
              severity="critical",
              summary=f"{{{{ $labels.pod }}}} missed {section.missed_scrapes} scrapes in a row (no metrics for "
                      f"{section.missed_scrapes * SCRAPE_INTERVAL_S} s).",
              runbook="The server is down or hung: its liveness probe restarts it; if it keeps happening, see "
                      f"{prefix}PodRestarting."),
        _rule(f"{prefix}PodRestarting",
              f"increase(kube_pod_container_status_restarts_total{{{pods}}}[15m]) > {section.restarts_in_15m}",
              hold="0s", severity="critical",
              summary=f"{{{{ $labels.pod }}}} restarted more than {section.restarts_in_15m} times in 15 minutes.",
              runbook="kubectl describe pod / logs --previous: OOM kill (raise the memory limit), engine load failure "
                      "(image and engine built for another GPU?), or a watchdog stop."),
    ]


def _gpu_rules(section) -> list[dict]:
    """The DCGM exporter's GPU figures."""
    return [
        _rule("GpuSaturated", f"avg by (Hostname, gpu) (DCGM_FI_DEV_GPU_UTIL) > {section.gpu_util_percent}", hold="15m",
              severity="warning",
              summary=f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.Hostname }}}} has been over "
                      f"{section.gpu_util_percent}% busy for 15 minutes.",
              runbook="Expected under load; with a queue backlog too, add GPUs (raise the HPA's maxReplicas)."),
        _rule("GpuMemoryCopyBusy", f"avg by (Hostname, gpu) (DCGM_FI_DEV_MEM_COPY_UTIL) > "
                                   f"{section.mem_copy_util_percent}", hold="15m", severity="warning",
              summary=f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.Hostname }}}} spent over "
                      f"{section.mem_copy_util_percent}% of its time on memory copies for 15 minutes.",
              runbook="Decode is memory-bound: a quantized KV cache and weights (INT8/FP8/INT4) move fewer bytes."),
        _rule("GpuXidError", "max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS) > 0", hold="0s", severity="critical",
              summary="GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported XID error {{ $value }}.",
              runbook="Look the XID up in NVIDIA's XID catalogue; drain the node if it repeats."),
    ]


def _rule(alert: str, expr: str, *, hold: str, severity: str, summary: str, runbook: str) -> dict:
    return {"alert": alert, "expr": expr, "for": hold, "labels": {"severity": severity},
            "annotations": {"summary": summary, "runbook": runbook}}


def rule_file(section, name: str, engine: str = "triton", gpu: bool = True) -> dict:
    """A plain Prometheus rules file (``rule_files:``; what promtool checks)."""
    return {"groups": [{"name": GROUP, "rules": rules(section, name, engine, gpu)}]}


def prometheus_rule(section, name: str, labels: dict[str, str], engine: str = "triton", gpu: bool = True) -> dict:
    """The same groups as a Prometheus Operator PrometheusRule resource."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": name, "labels": dict(labels)}, "spec": rule_file(section, name, engine, gpu)}
