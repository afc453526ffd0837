"""Kubernetes manifests (issue #8): deploy/ and what `invoke deploy-manifests` renders from it, validated offline
against the Kubernetes schemas bundled in kubernetes-validate, checked for their wiring (selectors, ports,
probes, scaling thresholds) and, in the slow suite, scanned by checkov from its own environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import DEFAULT_CONFIG, REPO, run_invoke
from grafana import dashboard_exprs
from test_image import DEFAULT_NAME, PUSH_TO, make_published

from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError
from pipeline.release import deploy
from pipeline.release.image import content_tag, read_published

K8S_VERSION = "1.35.0"  # per-HPA tolerances need 1.33+ (beta, on by default, from 1.35)
CHECKOV_VERSION = "3.3.30"
CHECKOV_VENV = REPO / "build" / ".tools" / f"checkov-{CHECKOV_VERSION}"
# checkov findings that are decisions, not oversights:
CHECKOV_SKIPS = {
    "CKV_K8S_21": "the namespace is chosen when applying (kubectl -n, or a kustomize overlay's namespace:)",
    "CKV_K8S_43": "images are tagged by content (repository digest in the tag); the registry digest only exists "
                  "after the push",
    "CKV_K8S_15": "a content-derived tag never changes content, so IfNotPresent is right; Always would re-check "
                  "a multi-GB image on every pod start",
    "CKV_DOCKER_7": "FROM images come from ARGs whose defaults are pinned (tests/release/test_image.py checks them)",
}


def docs_in(folder: Path) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(folder.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


def validate_offline(docs: list[tuple[Path, dict]]) -> set[str]:
    """Strict schema validation of every built-in kind; returns the kinds without a bundled schema."""
    import kubernetes_validate

    no_schema = set()
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            no_schema.add(doc["kind"])
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path}: {doc['kind']} {doc['metadata'].get('name')}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
    return no_schema


def by_kind(docs) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for _, doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def check_serving_wiring(kinds: dict[str, list[dict]], gpus: int | None) -> None:
    (dep,) = kinds["Deployment"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["livenessProbe"]["failureThreshold"] == 3  # the seeds' "restart after 3 missed heartbeats"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    sec = c["securityContext"]
    assert (sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"]
            and sec["capabilities"]["drop"] == ["ALL"])
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][part])
        assert c["resources"][part].get(deploy.GPU_RESOURCE) == (str(gpus) if gpus else None)
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/shm"}

    (svc,) = kinds["Service"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {n: n for n in ports}
    (mon,) = kinds["PodMonitor"]
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [(e["port"], e["path"]) for e in mon["spec"]["podMetricsEndpoints"]] == [("metrics", "/metrics")]
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (netpol,) = kinds["NetworkPolicy"]
    assert netpol["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert {p["port"] for rule in netpol["spec"]["ingress"] for p in rule["ports"]} == set(ports.values())
    (sa,) = kinds["ServiceAccount"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and sa["automountServiceAccountToken"] is False

    (hpa,) = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"]["maxUnavailable"] == 1  # a drain keeps one replica
    behavior = hpa["spec"]["behavior"]
    up, down = float(behavior["scaleUp"]["tolerance"]), float(behavior["scaleDown"]["tolerance"])
    targets = {}
    for m in hpa["spec"]["metrics"]:
        if m["type"] == "Pods":
            targets[m["pods"]["metric"]["name"]] = float(m["pods"]["target"]["averageValue"])
        else:
            assert m["resource"]["name"] == "cpu"
            targets["cpu"] = float(m["resource"]["target"]["averageUtilization"])
    util = targets["cpu" if gpus is None else deploy.GPU_METRIC]
    # scale out above 85 % utilisation or 32 queued per replica; scale in under 50 % utilisation
    assert util * (1 + up) == 85 and targets[deploy.QUEUE_METRIC] * (1 + up) == 32
    assert abs(util * (1 - down) - 50) < 0.01
    assert abs(targets[deploy.QUEUE_METRIC] * (1 - down) - 32 * 50 / 85) < 0.01


def test_deploy_folder_validates_offline_and_is_wired():
    docs = docs_in(REPO / "deploy" / "base") + docs_in(REPO / "deploy" / "jobs")
    assert validate_offline(docs) == {"Kustomization", "PodMonitor"}
    kinds = by_kind(docs_in(REPO / "deploy" / "base"))
    check_serving_wiring(kinds, gpus=1)
    (kust,) = kinds["Kustomization"]
    assert sorted(kust["resources"]) == sorted(p.name for p in (REPO / "deploy" / "base").glob("*.yaml")
                                               if p.name != "kustomization.yaml")


def test_the_adapter_rules_serve_the_metrics_the_hpa_asks_for():
    rules = yaml.safe_load((REPO / "deploy" / "monitoring" / "prometheus-adapter-rules.yaml").read_text())
    served = {r["name"]["as"] for r in rules["rules"]["custom"]}
    (hpa,) = by_kind(docs_in(REPO / "deploy" / "base"))["HorizontalPodAutoscaler"]
    asked = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert asked == {deploy.GPU_METRIC, deploy.QUEUE_METRIC}
    assert served == asked | {deploy.VLLM_QUEUE_METRIC, deploy.VLLM_GPU_METRIC}  # the vllm target's two
    vllm_queue = next(r for r in rules["rules"]["custom"] if r["name"]["as"] == deploy.VLLM_QUEUE_METRIC)
    assert "vllm:num_requests_waiting" in vllm_queue["metricsQuery"]
    queue_rule = next(r for r in rules["rules"]["custom"] if r["name"]["as"] == deploy.QUEUE_METRIC)
    assert ("nv_trt_llm_request_metrics" in queue_rule["metricsQuery"]
            and 'request_type=~"|waiting"' in queue_rule["metricsQuery"])


@pytest.fixture
def rendered_gpu(tmp_path) -> tuple[Path, object]:
    make_published(tmp_path, target="tensorrt")
    done = run_invoke("deploy-manifests", "--work-root", str(tmp_path), "--set", "build.target=tensorrt",
                      "--set", f"image.repository={PUSH_TO}", "--gpu-type", "NVIDIA-H100-80GB-HBM3",
                      "--gpu-type", "NVIDIA-L40S")
    assert done.returncode == 0, done.stderr
    return (tmp_path / DEFAULT_NAME / deploy.RENDERED_DIR,
            read_published(tmp_path / DEFAULT_NAME / "publish" / "model_repository"))


def test_rendered_gpu_manifests(rendered_gpu):
    out, pub = rendered_gpu
    serving = [(p, d) for p, d in docs_in(out) if p.parent == out]
    assert validate_offline(docs_in(out)) == {"Kustomization", "PodMonitor", "PrometheusRule"}
    kinds = by_kind(serving)
    check_serving_wiring(kinds, gpus=1)
    (dep,) = kinds["Deployment"]
    assert dep["metadata"]["name"] == f"triton-{DEFAULT_NAME}"
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"{PUSH_TO}:{content_tag(pub)}"
    notes = dep["spec"]["template"]["metadata"]["annotations"]
    assert notes["trtllm-pipeline/repository-digest"] == f"sha256:{pub.repository_digest}"
    assert notes["trtllm-pipeline/trtllm-version"] == "1.2.1"
    assert {d["metadata"]["labels"]["app.kubernetes.io/instance"] for _, d in serving if d["kind"] != "Kustomization"} \
        == {f"triton-{DEFAULT_NAME}"}
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p, _ in serving if p.name != "kustomization.yaml")

    jobs = by_kind(docs_in(out / "jobs"))["Job"]
    assert sorted(j["spec"]["template"]["spec"]["nodeSelector"][deploy.GPU_PRODUCT_LABEL] for j in jobs) == \
        ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L40S"]
    roots = set()
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = c["args"]
        assert args[:3] == ["publish", "--config", "engine_configs/smollm2-135m-cpu.yaml"]
        assert args[args.index("--set") + 1] == "build.target=tensorrt"
        roots.add(args[args.index("--work-root") + 1])
        assert c["image"].startswith(f"{PUSH_TO}:builder-trtllm1.2.1-")
        assert c["resources"]["limits"][deploy.GPU_RESOURCE] == "1"
        assert c["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
        assert all("valueFrom" not in e for e in c["env"])  # the Hub token is a mounted Secret file
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {"engine-builds"}
    assert len(roots) == 2  # one work root per GPU type: engines are specific to a GPU


def test_rendered_cpu_manifests_have_no_gpu(tmp_path):
    make_published(tmp_path)
    done = run_invoke("deploy-manifests", "--work-root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    out = tmp_path / DEFAULT_NAME / deploy.RENDERED_DIR
    assert validate_offline(docs_in(out)) == {"Kustomization", "PodMonitor", "PrometheusRule"}
    assert not (out / "jobs").exists()
    (rule,) = by_kind(docs_in(out))["PrometheusRule"]
    plain = yaml.safe_load((out / deploy.ALERTS_RULE_FILE).read_text())
    assert rule["spec"] == plain and rule["metadata"]["name"] == f"triton-{DEFAULT_NAME}"
    assert all(f'pod=~"triton-{DEFAULT_NAME}-.*"' in r["expr"] for r in plain["groups"][0]["rules"]
               if r["alert"].startswith("Triton"))
    check_serving_wiring(by_kind(docs_in(out)), gpus=None)
    assert deploy.GPU_RESOURCE not in (out / "deployment.yaml").read_text()
    assert deploy.GPU_METRIC not in (out / "hpa.yaml").read_text()


def test_rendering_refusals(tmp_path):
    pub = read_published(make_published(tmp_path, target="tensorrt"))
    cfg = load_config(DEFAULT_CONFIG, ["build.target=tensorrt", "build.tensor_parallel_size=2"]).config
    serving = deploy.render_serving(cfg, pub, "img:tag")
    container = serving["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"][deploy.GPU_RESOURCE] == "2"
    with pytest.raises(ConfigError, match="engine-build Jobs are for the GPU targets"):
        deploy.render_jobs(load_config(DEFAULT_CONFIG).config, DEFAULT_CONFIG, [], ["NVIDIA-L40S"], "b:t")
    outside = tmp_path / "mine.yaml"
    outside.write_text(f"extends: {DEFAULT_CONFIG}\nbuild: {{target: tensorrt}}\n")
    with pytest.raises(InputError, match="engine_configs/"):
        deploy.render_jobs(cfg, outside, [], ["NVIDIA-L40S"], "b:t")
    with pytest.raises(ConfigError, match="not a node label value"):
        deploy.render_jobs(cfg, DEFAULT_CONFIG, [], ["H100 80GB"], "b:t")
    done = run_invoke("deploy-manifests", "--work-root", str(tmp_path / "empty"))
    assert done.returncode == 2 and "Run `invoke publish`" in done.stderr


def _checkov() -> Path:
    """checkov from its own venv: its pins (networkx 2.6, packaging 23.2, ...) would downgrade this project's."""
    exe = CHECKOV_VENV / "bin" / "checkov"
    if exe.is_file():
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True, timeout=300)
    done = subprocess.run([str(CHECKOV_VENV / "bin" / "pip"), "install", "-q", f"checkov=={CHECKOV_VERSION}"],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.skip(f"could not install checkov {CHECKOV_VERSION} into its own venv: {done.stderr[-500:]}")
    return exe


def test_the_dashboard_has_four_rows_and_promql_that_prometheus_parses(rendered_gpu, tmp_path):
    """The rendered ConfigMap (Grafana's sidecar label) holds the same dashboard as monitoring/dashboard.json:
    rows hardware, pipeline, quality of service, tenants; every panel's query parses (promtool checks each as a
    recording rule). That the serving model exports the series it reads is checked on a real server
    (test_verify.py, the watchdog test)."""

    from pipeline.release import dashboards

    out, _ = rendered_gpu
    (cm,) = by_kind(docs_in(out))["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    board = json.loads(text)
    assert board == json.loads((out / deploy.DASHBOARD_FILE).read_text())
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ["Hardware", "Inference pipeline",
                                                                           "Quality of service", "Tenants"]
    exprs = dashboard_exprs(board)
    assert len(exprs) >= 15 and all(f'pod=~"triton-{DEFAULT_NAME}-.*"' in e for e in exprs if "DCGM" not in e)
    assert any("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" in e for e in exprs) and dashboards.OURS in " ".join(exprs)
    _promtool_parses(exprs, tmp_path)


def test_checkov_finds_nothing_unjustified(rendered_gpu, tmp_path):
    out, _ = rendered_gpu
    exe = _checkov()
    for framework, target in (("kubernetes", ["-d", str(out)]), ("dockerfile", ["-f", str(REPO / "Dockerfile")])):
        done = subprocess.run([str(exe), *target, "--framework", framework, "--skip-download", "--compact",
                               "-o", "json", "--skip-check", ",".join(CHECKOV_SKIPS)],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        report = json.loads(done.stdout or "{}")
        reports = report if isinstance(report, list) else [report]
        failed = [f"{c['check_id']} {c['resource']} ({c['file_path']})"
                  for r in reports for c in r.get("results", {}).get("failed_checks", [])]
        assert not failed, f"checkov {framework}: " + "; ".join(failed)
        passed = sum(len(r.get("results", {}).get("passed_checks", [])) for r in reports)
        assert passed > 10, f"checkov {framework} checked almost nothing: {done.stdout[-500:]} {done.stderr[-500:]}"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rendered_vllm_manifests_serve_one_port_and_scale_on_vllms_queue(tmp_path, device):
    """The vllm target: vLLM's image on port 8000 (API, /health, /metrics), the HPA on vLLM's own queue gauge
    (32 waiting per replica) and on CPU (vllm.device cpu) or the DCGM GPU utilisation (cuda) at 85 %; alert
    rules on vLLM's own series (the GPU ones only on cuda); valid against the Kubernetes schemas."""
    name = "smollm2-135m-vllm"
    make_published(tmp_path, config_name=name, target="vllm")
    extra = ["--set", "build.cuda_graphs.enabled=true"] if device == "cuda" else []
    done = run_invoke("deploy-manifests", "--config", str(REPO / "engine_configs" / f"{name}.yaml"), "--work-root",
                      str(tmp_path), "--set", f"vllm.device={device}", *extra)
    assert done.returncode == 0, done.stderr
    out = tmp_path / name / deploy.RENDERED_DIR
    assert f"alert rules: {out / deploy.ALERTS_RESOURCE}" in done.stdout
    docs = docs_in(out)
    assert validate_offline(docs) == {"Kustomization", "PodMonitor", "PrometheusRule"}
    kinds = by_kind(docs)
    (dep,) = kinds["Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["name"] == "vllm" and [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000)]
    assert all(c[p]["httpGet"] == {"path": "/health", "port": "http"}
               for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert c["resources"]["limits"].get(deploy.GPU_RESOURCE) == ("1" if device == "cuda" else None)
    (svc,) = kinds["Service"]
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]
    (mon,) = kinds["PodMonitor"]
    assert [(e["port"], e["path"]) for e in mon["spec"]["podMetricsEndpoints"]] == [("http", "/metrics")]
    (netpol,) = kinds["NetworkPolicy"]
    assert {p["port"] for rule in netpol["spec"]["ingress"] for p in rule["ports"]} == {8000}
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    metrics = {m["pods"]["metric"]["name"] if m["type"] == "Pods" else "cpu": m for m in hpa["spec"]["metrics"]}
    assert metrics[deploy.VLLM_QUEUE_METRIC]["pods"]["target"]["averageValue"] == "32"
    util = deploy.VLLM_GPU_METRIC if device == "cuda" else "cpu"
    assert set(metrics) == {deploy.VLLM_QUEUE_METRIC, util}
    (rule,) = kinds["PrometheusRule"]
    plain = yaml.safe_load((out / deploy.ALERTS_RULE_FILE).read_text())
    names = [r["alert"] for r in plain["groups"][0]["rules"]]
    assert rule["spec"] == plain and "VllmQueueBacklog" in names and not any(n.startswith("Triton") for n in names)
    assert any(n.startswith("Gpu") for n in names) == (device == "cuda")
    # vLLM's own dashboard (its series: tests/test_alerts.py), as a ConfigMap and as JSON, its queries parsed
    (cm,) = kinds["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(next(iter(cm["data"].values())))
    assert board == json.loads((out / deploy.DASHBOARD_FILE).read_text()) and board["tags"][-1] == "vllm"
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == \
        ["Hardware"] * (device == "cuda") + ["Engine", "Quality of service", "Tenants"]
    assert f"dashboard: {out / deploy.DASHBOARD_RESOURCE}" in done.stdout
    _promtool_parses(dashboard_exprs(board), tmp_path)


def _promtool_parses(exprs: list[str], tmp_path: Path) -> None:
    """Each query parses as Prometheus reads it (promtool checks each as a recording rule)."""
    import shutil

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (Debian: apt-get install prometheus; scripts/setup-env does it as root)")
    rules = tmp_path / "dashboard-queries.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    checked = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in checked.stdout, \
        checked.stdout + checked.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_vllm_build_served_by_triton_keeps_the_triton_manifests(tmp_path, device):
    """triton first in vllm.frontends (the vllm-triton-cpu / vllm-triton-gpu images): the Triton manifests (HTTP,
    gRPC and metrics ports, /v2/health probes, Triton's queue metric, which the vLLM model feeds with vLLM's
    waiting requests) and the Triton alert rules; on cpu the cpu target's CPU resources and CPU metric and no GPU
    rules, on cuda the tensor-parallel GPU count, Triton's GPU metric and the GPU rules. Valid against the
    Kubernetes schemas."""
    name = "smollm2-135m-vllm"
    make_published(tmp_path, config_name=name, target="vllm")
    on_gpus = ["--set", "build.cuda_graphs.enabled=true", "--set", "build.tensor_parallel_size=2"]
    done = run_invoke("deploy-manifests", "--config", str(REPO / "engine_configs" / f"{name}.yaml"), "--work-root",
                      str(tmp_path), "--set", "vllm.frontends=[triton, openai]", "--set", f"vllm.device={device}",
                      *(on_gpus if device == "cuda" else []))
    assert done.returncode == 0, done.stderr
    out = tmp_path / name / deploy.RENDERED_DIR
    docs = docs_in(out)
    assert validate_offline(docs) == {"Kustomization", "PodMonitor", "PrometheusRule"}
    check_serving_wiring(by_kind(docs), gpus=2 if device == "cuda" else None)
    (dep,) = by_kind(docs)["Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["name"] != "vllm" and c["readinessProbe"]["httpGet"]["path"].startswith("/v2/health")
    assert (deploy.GPU_RESOURCE in (out / "deployment.yaml").read_text()) == (device == "cuda")
    (hpa,) = by_kind(docs)["HorizontalPodAutoscaler"]
    metrics = {m["pods"]["metric"]["name"] if m["type"] == "Pods" else m["resource"]["name"]
               for m in hpa["spec"]["metrics"]}
    assert metrics == {deploy.QUEUE_METRIC, deploy.GPU_METRIC if device == "cuda" else "cpu"}
    names = [r["alert"] for r in yaml.safe_load((out / deploy.ALERTS_RULE_FILE).read_text())["groups"][0]["rules"]]
    assert any(n.startswith("Triton") for n in names) and not any(n.startswith("Vllm") for n in names)
    assert any(n.startswith("Gpu") for n in names) == (device == "cuda")


def _gib(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])


def test_the_deepseek_vllm_pod_has_room_for_its_kv_offloading_in_dev_shm_and_memory(tmp_path):
    """vLLM 0.32 on CUDA holds --kv-offloading-size (the total over the tensor-parallel ranks) in one region under
    /dev/shm and refuses to start where /dev/shm lacks the room ("Insufficient space in /dev/shm"); /dev/shm is a
    memory emptyDir, counted against the pod's memory limit (tests/data/upstream/vllm_kv_offload.json). The
    rendered DeepSeek-V2-Lite pod holds its offload region on top of the base /dev/shm and memory, and `invoke
    explain` says so."""
    from upstream_facts import upstream

    facts = {f["path"]: f for f in upstream("vllm_kv_offload.json")["facts"]}
    assert facts["vllm/config/cache.py"]["total_over_tp_ranks"] is True
    assert "Insufficient space in /dev/shm" in facts["vllm/distributed/device_communicators/shm_broadcast.py"]["read"]
    profile = REPO / "engine_configs" / "deepseek-v2-lite-a100x2-vllm-int4awq.yaml"
    cfg = load_config(profile).config
    offload = cfg.vllm.kv_offloading_gib
    assert offload == 32 and cfg.build.tensor_parallel_size == 2  # the seeds' 16 GB per GPU, as vLLM's total
    pub = read_published(make_published(tmp_path, config_name="deepseek", target="vllm"))
    dep = deploy.render_serving(cfg, pub, "img:tag")["deployment.yaml"]
    spec = dep["spec"]["template"]["spec"]
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    (c,) = spec["containers"]
    base_shm = max(4, 2 * 2)  # the ranks' own shared memory (NCCL), as for any 2-GPU pod
    assert shm["emptyDir"]["medium"] == "Memory" and _gib(shm["emptyDir"]["sizeLimit"]) >= base_shm + offload
    limit = _gib(c["resources"]["limits"]["memory"])
    assert limit >= deploy.GPU_POD_MEMORY_GIB + offload and limit == _gib(c["resources"]["requests"]["memory"])
    done = run_invoke("explain", "--config", str(profile), "--work-root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (f"serving pod: memory {limit} GiB, /dev/shm {_gib(shm['emptyDir']['sizeLimit'])} GiB (vLLM's KV "
            f"offloading: 32 GiB in all, 16 GiB per rank of 2, in /dev/shm)") in done.stdout
    # a pod without offloading keeps the base sizes; vLLM's CPU build adds its KV cache to the memory
    plain = deploy.pod_host_memory(load_config(profile, ["vllm.kv_offloading_gib=null"]).config)
    assert plain == {"memory": deploy.GPU_POD_MEMORY_GIB, "shm": base_shm}
    cpu = load_config(REPO / "engine_configs" / "smollm2-135m-vllm.yaml", ["vllm.cpu_kv_cache_gib=3"]).config
    assert deploy.pod_host_memory(cpu) == {"memory": deploy.CPU_POD_MEMORY_GIB + 3, "shm": 4}
