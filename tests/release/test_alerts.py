"""The alert rules `invoke deploy-manifests` renders (Triton's series, or vLLM's for the vllm target), checked
and unit-tested by Prometheus's own promtool: each alert fires on the series its exporter writes once its
condition has held long enough, not before, and not for a healthy pod beside it. That vLLM's real server
exports every series its rules read is verify's ``metrics`` check (tests/engines/vllm/test_vllm.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from pipeline.config import AlertsSection
from pipeline.release import alerts, deploy

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="needs promtool (Debian: apt-get install prometheus; scripts/setup-env does it as root)")
NAME = "triton-demo"
BAD, GOOD = f"{NAME}-7d9f-a", f"{NAME}-7d9f-b"
THROTTLED = f"{NAME}-7d9f-c"  # a pod whose only errors are a tenant's refusals


def _summary(rule: dict, labels: dict, value: str = "") -> str:
    text = rule["annotations"]["summary"].replace("{{ $value }}", value)
    for k, v in labels.items():
        text = text.replace(f"{{{{ $labels.{k} }}}}", v)
    return text


# alert -> (input series, sample interval, a time it must not fire yet, a time it must be firing, the firing
# alert's labels, its $value as text). Times by hand from the rule: the condition's start plus its `for`.
CASES = {
    "TritonQueueBacklog": (  # 20 pending + 20 waiting in the batch manager = 40 > 32 from t=0, for 5m
        [(f'nv_inference_pending_request_count{{namespace="ns",pod="{BAD}"}}', "20x200"),
         (f'nv_trt_llm_request_metrics{{namespace="ns",pod="{BAD}",request_type="waiting"}}', "20x200"),
         # the batch manager's active requests are not waiting: 10 + 100 active stays healthy
         (f'nv_inference_pending_request_count{{namespace="ns",pod="{GOOD}"}}', "10x200"),
         (f'nv_trt_llm_request_metrics{{namespace="ns",pod="{GOOD}",request_type="active"}}', "100x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD}, ""),
    "TritonKVCacheNearlyFull": (  # 95 of 100 blocks used from t=0, for 5m
        [(f'nv_trt_llm_kv_cache_block_metrics{{namespace="ns",pod="{BAD}",kv_cache_block_type="used"}}', "95x200"),
         (f'nv_trt_llm_kv_cache_block_metrics{{namespace="ns",pod="{BAD}",kv_cache_block_type="max"}}', "100x200"),
         (f'nv_trt_llm_kv_cache_block_metrics{{namespace="ns",pod="{GOOD}",kv_cache_block_type="used"}}', "50x200"),
         (f'nv_trt_llm_kv_cache_block_metrics{{namespace="ns",pod="{GOOD}",kv_cache_block_type="max"}}', "100x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD}, ""),
    "TritonErrorRate": (  # half the requests fail; a rate needs two samples (t=15s), then 5m
        [(f'nv_inference_request_failure{{namespace="ns",pod="{BAD}",model="m",version="1"}}', "0+10x200"),
         (f'nv_inference_request_success{{namespace="ns",pod="{BAD}",model="m",version="1"}}', "0+10x200"),
         (f'nv_inference_request_failure{{namespace="ns",pod="{GOOD}",model="m",version="1"}}', "0+0x200"),
         (f'nv_inference_request_success{{namespace="ns",pod="{GOOD}",model="m",version="1"}}', "0+10x200"),
         # half the answers are a tenant's refusals (the ensemble counts them as failures): no alert
         (f'nv_inference_request_failure{{namespace="ns",pod="{THROTTLED}",model="m",version="1"}}', "0+10x200"),
         (f'tenant_rejections_total{{namespace="ns",pod="{THROTTLED}",model="m_tensorrt_llm",version="1",'
          f'tenant="A"}}', "0+10x200"),
         (f'nv_inference_request_success{{namespace="ns",pod="{THROTTLED}",model="m",version="1"}}', "0+10x200")],
        "15s", "5m", "7m", {"namespace": "ns", "pod": BAD}, ""),
    "TritonLatencyTail": (  # P99 / P50 of 5 from t=0 (3 is the limit), for 5m; 2 stays healthy
        [(f'trtllm_pipeline_model_metrics{{namespace="ns",pod="{BAD}",model="llm",version="1",'
          f'metric_type="latency_p99_over_p50"}}', "5x200"),
         (f'trtllm_pipeline_model_metrics{{namespace="ns",pod="{GOOD}",model="llm",version="1",'
          f'metric_type="latency_p99_over_p50"}}', "2x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD}, "5"),
    "TritonLatencyJitter": (  # jitter 0.8 (limit 0.5) from t=0, for 5m; 0.2 stays healthy
        [(f'trtllm_pipeline_model_metrics{{namespace="ns",pod="{BAD}",model="llm",version="1",'
          f'metric_type="latency_jitter"}}', "0.8x200"),
         (f'trtllm_pipeline_model_metrics{{namespace="ns",pod="{GOOD}",model="llm",version="1",'
          f'metric_type="latency_jitter"}}', "0.2x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD}, "0.8"),
    "TenantQuotaNearlyFull": (  # one pod: tenant A holds 90 of its 100 blocks from t=0, for 5m; B's 30 of 100 and
        # the default tenant's 4 blocks with no share left (limit 0: left out, not divided by zero) stay quiet
        [(f'tenant_quota_usage{{namespace="ns",pod="{BAD}",model="llm",version="1",tenant="A"}}', "90x200"),
         (f'tenant_quota_limit{{namespace="ns",pod="{BAD}",model="llm",version="1",tenant="A"}}', "100x200"),
         (f'tenant_quota_usage{{namespace="ns",pod="{BAD}",model="llm",version="1",tenant="B"}}', "30x200"),
         (f'tenant_quota_limit{{namespace="ns",pod="{BAD}",model="llm",version="1",tenant="B"}}', "100x200"),
         (f'tenant_quota_usage{{namespace="ns",pod="{BAD}",model="llm",version="1",tenant="default"}}', "4x200"),
         (f'tenant_quota_limit{{namespace="ns",pod="{BAD}",model="llm",version="1",tenant="default"}}', "0x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD, "tenant": "A"}, ""),
    "TritonTargetDown": (  # scrapes fail from t=15s: three missed scrapes (45 s) later it fires
        [(f'up{{job="ns/triton",namespace="ns",pod="{BAD}"}}', "1 0x200"),
         (f'up{{job="ns/triton",namespace="ns",pod="{GOOD}"}}', "1x200")],
        "15s", "45s", "2m", {"job": "ns/triton", "namespace": "ns", "pod": BAD}, ""),
    "TritonPodRestarting": (  # three restarts at t=10m; a steady count of one is no restart
        [(f'kube_pod_container_status_restarts_total{{namespace="ns",pod="{BAD}",container="triton"}}', "0x9 3x20"),
         (f'kube_pod_container_status_restarts_total{{namespace="ns",pod="{GOOD}",container="triton"}}', "1x30")],
        "1m", "9m", "11m", {"namespace": "ns", "pod": BAD, "container": "triton"}, ""),
    "GpuSaturated": (
        [('DCGM_FI_DEV_GPU_UTIL{Hostname="node-1",gpu="0"}', "99x200"),
         ('DCGM_FI_DEV_GPU_UTIL{Hostname="node-1",gpu="1"}', "60x200")],
        "15s", "14m", "16m", {"Hostname": "node-1", "gpu": "0"}, ""),
    "GpuMemoryCopyBusy": (
        [('DCGM_FI_DEV_MEM_COPY_UTIL{Hostname="node-1",gpu="0"}', "97x200"),
         ('DCGM_FI_DEV_MEM_COPY_UTIL{Hostname="node-1",gpu="1"}', "40x200")],
        "15s", "14m", "16m", {"Hostname": "node-1", "gpu": "0"}, ""),
    "GpuXidError": (  # XID 79 (fallen off the bus) from t=2m
        [('DCGM_FI_DEV_XID_ERRORS{Hostname="node-1",gpu="0"}', "0 0 79x20"),
         ('DCGM_FI_DEV_XID_ERRORS{Hostname="node-1",gpu="1"}', "0x22")],
        "1m", "1m", "3m", {"Hostname": "node-1", "gpu": "0"}, "79"),
}


# the vllm target: vLLM 0.32's series as its OpenAI server exports them (labels engine, model_name; the API's
# http_requests_total by handler and status class); the target and restart rules read the same series as Triton's
VLLM = 'namespace="ns",engine="0",model_name="m"'
VLLM_CASES = {
    "VllmQueueBacklog": (  # 40 waiting > 32 from t=0, for 5m; 10 waiting stays healthy
        [(f'vllm:num_requests_waiting{{{VLLM},pod="{BAD}"}}', "40x200"),
         (f'vllm:num_requests_waiting{{{VLLM},pod="{GOOD}"}}', "10x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD}, ""),
    "VllmKVCacheNearlyFull": (  # 95 % of the KV cache in use from t=0, for 5m
        [(f'vllm:kv_cache_usage_perc{{{VLLM},pod="{BAD}"}}', "0.95x200"),
         (f'vllm:kv_cache_usage_perc{{{VLLM},pod="{GOOD}"}}', "0.5x200")],
        "15s", "4m", "6m", {"namespace": "ns", "pod": BAD}, ""),
    "VllmPreempting": (  # preemptions keep coming; a count that stopped growing is no alert
        [(f'vllm:num_preemptions_total{{{VLLM},pod="{BAD}"}}', "0+3x200"),
         (f'vllm:num_preemptions_total{{{VLLM},pod="{GOOD}"}}', "7x200")],
        "15s", "5m", "7m", {"namespace": "ns", "pod": BAD}, ""),
    "VllmErrorRate": (  # half the API's answers are 5xx; 4xx (bad input) and /metrics scrapes do not count
        [(f'http_requests_total{{namespace="ns",pod="{BAD}",handler="/v1/completions",method="POST",status="5xx"}}',
          "0+10x200"),
         (f'http_requests_total{{namespace="ns",pod="{BAD}",handler="/v1/completions",method="POST",status="2xx"}}',
          "0+10x200"),
         (f'http_requests_total{{namespace="ns",pod="{GOOD}",handler="/v1/chat/completions",method="POST",'
          f'status="4xx"}}', "0+10x200"),
         (f'http_requests_total{{namespace="ns",pod="{GOOD}",handler="/v1/completions",method="POST",status="2xx"}}',
          "0+10x200")],
        "15s", "5m", "7m", {"namespace": "ns", "pod": BAD}, ""),
    "TenantQuotaNearlyFull": CASES["TenantQuotaNearlyFull"],  # the OpenAI server's tenant middleware's series
    "VllmTargetDown": CASES["TritonTargetDown"],
    "VllmPodRestarting": CASES["TritonPodRestarting"],
}
ENGINES = {"triton": (True, CASES), "vllm-cpu": (False, VLLM_CASES),
           "vllm-cuda": (True, {**VLLM_CASES, **{k: v for k, v in CASES.items() if k.startswith("Gpu")}})}


def _rules(engine: str) -> list[dict]:
    gpu, _ = ENGINES[engine]
    return alerts.rules(AlertsSection(), NAME, engine.split("-")[0], gpu)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_alert_has_a_case_a_runbook_and_the_hpa_queue_threshold(engine):
    rules = _rules(engine)
    assert sorted(r["alert"] for r in rules) == sorted(ENGINES[engine][1])
    assert all(r["annotations"]["runbook"] for r in rules)
    assert AlertsSection().queue_waiting == deploy.SCALE_OUT_QUEUED_PER_REPLICA
    doc = alerts.prometheus_rule(AlertsSection(), NAME, {"app": "x"}, engine.split("-")[0], ENGINES[engine][0])
    assert doc["kind"] == "PrometheusRule" and doc["spec"]["groups"][0]["rules"] == rules


@needs_promtool
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_promtool_checks_the_rules_and_each_alert_fires_when_and_only_where_it_should(tmp_path, engine):
    gpu, cases = ENGINES[engine]
    by_name = {r["alert"]: r for r in _rules(engine)}
    rule_path = tmp_path / "alert-rules.yml"
    rule_path.write_text(yaml.safe_dump(alerts.rule_file(AlertsSection(), NAME, engine.split("-")[0], gpu),
                                        sort_keys=False))
    checked = subprocess.run([PROMTOOL, "check", "rules", str(rule_path)], capture_output=True, text=True)
    assert checked.returncode == 0 and f"SUCCESS: {len(cases)} rules found" in checked.stdout, checked.stdout

    tests = []
    for alert, (series, interval, not_yet, fires, labels, value) in cases.items():
        rule = by_name[alert]
        firing = {"exp_labels": {**labels, "severity": rule["labels"]["severity"]},
                  "exp_annotations": {"summary": _summary(rule, labels, value),
                                      "runbook": rule["annotations"]["runbook"]}}
        tests.append({"name": alert, "interval": interval,
                      "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [{"eval_time": not_yet, "alertname": alert, "exp_alerts": []},
                                          {"eval_time": fires, "alertname": alert, "exp_alerts": [firing]}]})
    test_path = tmp_path / "alert-tests.yml"
    test_path.write_text(yaml.safe_dump({"rule_files": [str(rule_path)], "evaluation_interval": "15s",
                                         "tests": tests}, sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", str(test_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_the_vllm_rules_read_only_series_verify_finds_on_vllms_real_server():
    """Every series name in the vllm rules (bar the target and restart ones, Prometheus's and kube-state-metrics')
    is one verify's metrics check requires on the running vLLM server (engine_args.METRIC_SERIES)."""
    import re

    from pipeline.engines.vllm.engine_args import METRIC_SERIES

    exprs = [r["expr"] for r in alerts.rules(AlertsSection(), NAME, "vllm", gpu=False) if r["alert"] in VLLM_CASES
             and r["alert"] not in ("VllmTargetDown", "VllmPodRestarting")]
    read = {m for e in exprs for m in re.findall(r"([a-z_:]+)\{", e)}
    tenant = {m for m in read if m.startswith("tenant_")}  # a tenanted deployment's only: alerts.TENANT_SERIES
    assert tenant == {"tenant_quota_usage", "tenant_quota_limit"} and tenant <= set(alerts.TENANT_SERIES)
    assert read - tenant and read - tenant <= set(METRIC_SERIES), read - tenant - set(METRIC_SERIES)


def test_the_triton_rules_read_only_series_verify_finds_on_a_real_triton_server():
    """Every series name in the Triton rules (bar the target and restart ones, Prometheus's and
    kube-state-metrics', and the GPU ones, dcgm-exporter's) is one verify's Triton metrics check requires of a
    build served by the project's own models (cpu, pytorch, vllm); the tensorrt target's C++ backend is held to
    all of them but the pipeline's latency family. The per-tenant series exist only on a deployment with a
    ``tenants:`` section, so verify cannot require them of every build: the rules may read them only from the
    declared list (alerts.TENANT_SERIES); the tenanted real-server check is in tests/serving."""
    import re

    from pipeline.serving.verify import PIPELINE_SERIES, metric_series

    exprs = [r["expr"] for r in alerts.rules(AlertsSection(), NAME, "triton", gpu=False)
             if r["alert"] not in ("TritonTargetDown", "TritonPodRestarting")]
    read = {m for e in exprs for m in re.findall(r"([a-z_:]+)\{", e)}
    read |= {m for e in exprs for names in re.findall(r'__name__=~"([^"]+)"', e) for m in names.split("|")}
    tenant = {m for m in read if m.startswith("tenant_")}
    assert tenant == {"tenant_quota_usage", "tenant_quota_limit", "tenant_rejections_total"}
    assert tenant <= set(alerts.TENANT_SERIES)
    required = {family for family, _, _ in metric_series("cpu")}
    assert read - tenant and read - tenant <= required, read - tenant - required
    assert set(metric_series("tensorrt")) == set(metric_series("cpu")) - set(PIPELINE_SERIES)


def _series(exprs: list[str]) -> set[str]:
    """The series names a set of PromQL expressions read (``name{...}`` and ``__name__=~"a|b"``)."""
    import re

    read = {m for e in exprs for m in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", e)}
    read |= {m for e in exprs for m in re.findall(r"\bDCGM_FI_[A-Z_]+", e)}  # read bare, without labels
    return read | {m for e in exprs for names in re.findall(r'__name__=~"([^"]+)"', e) for m in names.split("|")}


# series from Prometheus itself, kube-state-metrics and dcgm-exporter: no serving endpoint exports them
EXTERNAL = {"up", "kube_pod_container_status_restarts_total"}


def test_the_tenant_series_are_the_six_the_tenanted_model_exports():
    """The declared per-tenant list: quota used and limit (gauges, KV-cache blocks), requests accepted and
    refused (counters), P99 latency and time to first token (gauges, ms)."""
    assert sorted(alerts.TENANT_SERIES) == sorted(["tenant_quota_usage", "tenant_quota_limit",
                                                   "tenant_requests_total", "tenant_rejections_total",
                                                   "tenant_latency_p99_ms", "tenant_first_token_p99_ms"])


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_frontends_dashboard_shows_every_series_its_alerts_read_and_only_what_verify_finds(engine):
    """Triton's and vLLM's OpenAI server's dashboards: every series an alert rule reads is on a panel. vLLM's: every
    series a panel reads from the server is one verify's metrics check requires on the real server
    (engine_args.METRIC_SERIES), so the dashboard is held to the alerts and both to the exporter. Triton's reads
    more of Triton's own families than verify requires: the watchdog test (tests/test_verify.py) finds each on
    a real server's endpoint. Both have a tenants row on every series of alerts.TENANT_SERIES, which only
    a deployment with a ``tenants:`` section exports (so verify cannot require them of every build; the tenanted
    real-server check is in tests/serving): every tenant series a panel or rule reads is on that list."""
    from pipeline.engines.vllm.engine_args import METRIC_SERIES
    from pipeline.release import dashboards
    from pipeline.serving.verify import metric_series

    gpu, _ = ENGINES[engine]
    kind = engine.split("-")[0]
    board = dashboards.dashboard(NAME, kind, gpu)
    shown = _series([t["expr"] for p in board["panels"] for t in p.get("targets", [])])
    assert _series([r["expr"] for r in _rules(engine)]) <= shown
    served = set(METRIC_SERIES) if kind == "vllm" else {family for family, _, _ in metric_series("cpu")}
    tenant = {s for s in shown | _series([r["expr"] for r in _rules(engine)]) if s.startswith("tenant_")}
    assert tenant == set(alerts.TENANT_SERIES), tenant
    from_server = {s for s in shown - EXTERNAL - tenant if not s.startswith("DCGM_")}
    assert from_server and (kind != "vllm" or from_server <= served), from_server - served
    assert _series([r["expr"] for r in _rules(engine)]) - EXTERNAL - tenant - \
        {s for s in shown if s.startswith("DCGM_")} <= served
    assert any(s.startswith("DCGM_") for s in shown) == gpu
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == (["Hardware"] if gpu else []) + (["Engine"] if kind == "vllm" else ["Inference pipeline"]) + [
        "Quality of service", "Tenants"]
    assert board["tags"] == ["trtllm-pipeline", kind]
