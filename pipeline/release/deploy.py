"""Kubernetes manifests for a published build, rendered from the plain YAML in ``deploy/``.

The manifests under ``deploy/base`` (serving) and ``deploy/jobs`` (engine builds) are valid on their own (the
tests validate them against the Kubernetes schemas); rendering loads them as data, sets what depends on the
published build (names, image, GPU count, provenance annotations; the cpu target's CPU resources and CPU metric)
and writes plain YAML plus a kustomization.yaml into ``<work dir>/deploy/``. Nothing is string-templated.

Scaling rules (HorizontalPodAutoscaler, per-pod averages): scale out when GPU utilisation > 85 % or more than
32 requests wait per replica; scale in when GPU utilisation < 50 % and the queue < 32 x 50/85 (one scale-down
tolerance serves every metric of an HPA). The cpu target scales on CPU utilisation the same way.

The vllm target runs vLLM's image (``launch.py vllm``): one port (8000) for the OpenAI API, ``/health`` (the
probes) and ``/metrics`` (the PodMonitor); the queue is vLLM's ``vllm:num_requests_waiting``, utilisation the
DCGM exporter's on GPUs and the CPU's with ``vllm.device: cpu``. Its alert rules read vLLM's own series
(pipeline/release/alerts.py; the GPU rules only with ``vllm.device: cuda``). A vllm build whose image is Triton
(``triton`` first in ``vllm.frontends``: the ``vllm-triton-cpu`` / ``vllm-triton-gpu`` images) keeps the Triton
manifests, metrics and alert rules: the cpu target's CPU resources and metric with ``vllm.device: cpu``, the GPUs
and Triton's GPU metric with ``cuda``. Its queue is vLLM's own: the vLLM Python-backend model reports vLLM's
waiting requests in the tensorrtllm backend's request family, which ``triton_queued_requests`` reads.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Callable, Sequence

import yaml

from pipeline import constants, targets
from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError, InputError
from pipeline.fsutil import atomic_write_text, remove_tree, replace_dir
from pipeline.release import alerts, dashboards
from pipeline.runner import Runner, WorkDirLock

DEPLOY_DIR = constants.REPO_ROOT / "deploy"
BASE_DIR = DEPLOY_DIR / "base"
JOBS_DIR = DEPLOY_DIR / "jobs"
JOB_TEMPLATE = "engine-build-job.yaml"
JOBS_SHARED = ("engine-builds-pvc.yaml", "networkpolicy.yaml")  # rendered once, beside the Jobs
RENDERED_DIR = "deploy"  # inside the config's work dir
ALERTS_RESOURCE = "prometheusrule.yaml"  # the Prometheus Operator's resource, among the serving manifests
ALERTS_RULE_FILE = "monitoring/alert-rules.yml"  # the same rules as a plain rules file (not a resource)
DASHBOARD_RESOURCE = "grafana-dashboard.yaml"  # a ConfigMap for Grafana's dashboard sidecar (every frontend)
DASHBOARD_FILE = "monitoring/dashboard.json"  # the same dashboard, to import by hand
BASE_NAME = "triton-llm"  # the name every base resource carries; rendering replaces it
INSTANCE_LABEL = "app.kubernetes.io/instance"
ANNOTATION_PREFIX = "trtllm-pipeline/"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

SCALE_OUT_UTILIZATION_PCT = 85  # GPU (cpu target: CPU) utilisation, average over replicas
SCALE_OUT_QUEUED_PER_REPLICA = 32
SCALE_IN_UTILIZATION_PCT = 50
GPU_METRIC = "triton_gpu_utilization_percent"
QUEUE_METRIC = "triton_queued_requests"
# the vllm target: vLLM's own gauge vllm:num_requests_waiting, and the GPU's utilisation from the DCGM exporter
# (vLLM exports none), each turned into a per-pod custom metric by deploy/monitoring/prometheus-adapter-rules.yaml
VLLM_QUEUE_METRIC = "vllm_queued_requests"
VLLM_GPU_METRIC = "dcgm_gpu_utilization_percent"
VLLM_PORT = 8000  # vLLM's server: the OpenAI API, /health and /metrics on one port


def scale_down_tolerance() -> str:
    """HPA scale-down tolerance that puts the scale-in point at SCALE_IN_UTILIZATION_PCT."""
    return f"{1 - SCALE_IN_UTILIZATION_PCT / SCALE_OUT_UTILIZATION_PCT:.4f}"


def dns_name(text: str, limit: int = 63) -> str:
    """A DNS-1123 label: lowercase letters, digits and '-', at most 63 characters."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:limit].rstrip("-") or "x"


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def base_documents() -> list[tuple[str, dict]]:
    """(file name, resource) of the serving base, in its kustomization's order."""
    kustomization = load_yaml_docs(BASE_DIR / "kustomization.yaml")[0]
    out = []
    for name in kustomization["resources"]:
        for doc in load_yaml_docs(BASE_DIR / name):
            out.append((name, doc))
    return out


def _relabel(node, name: str) -> None:
    """Every app.kubernetes.io/instance label (and selector) becomes the rendered instance name."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == INSTANCE_LABEL and isinstance(value, str):
                node[key] = name
            else:
                _relabel(value, name)
    elif isinstance(node, list):
        for item in node:
            _relabel(item, name)


GPU_POD_MEMORY_GIB = 32  # a GPU pod's host memory besides its KV tiers: the server, its Python, the tokenizer
CPU_POD_MEMORY_GIB = 8  # a CPU pod's: the model's weights and the server besides its KV cache


def pod_host_memory(cfg: PipelineConfig) -> dict[str, int]:
    """The serving pod's host memory in GiB: ``memory`` (its limit and request) and ``shm`` (the /dev/shm
    emptyDir's sizeLimit, which counts against that limit). vLLM 0.32 (tests/data/upstream/vllm_kv_offload.json):
    ``--kv-offloading-size`` is the total over the tensor-parallel ranks, held on CUDA in one shared region under
    /dev/shm (it refuses to start, "Insufficient space in /dev/shm", where the room is missing) and on a CPU in
    each rank's own memory; the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE) is process memory."""
    gpus = cfg.build.tensor_parallel_size * cfg.build.pipeline_parallel_size
    target = targets.get(cfg.build.target)
    on_cpu = target.on_cpu(cfg)
    offload = math.ceil(target.kv_offloading_gib(cfg) or 0)
    # one tritonserver per GPU rank (serving/launch.py) has its own Python-backend shared memory region, and
    # NCCL moves tensors between the ranks through /dev/shm too
    shm = 4 if on_cpu else max(4, 2 * gpus)
    if on_cpu:
        kv = target.host_kv_cache_gib(cfg)
        return {"memory": CPU_POD_MEMORY_GIB + kv + offload, "shm": shm}
    return {"memory": GPU_POD_MEMORY_GIB + offload, "shm": shm + offload}


def _containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def render_serving(cfg: PipelineConfig, pub, image_ref: str) -> dict[str, dict]:
    """{file name: resource} for serving the published build ``pub`` (a pipeline.release.image.PublishedBuild)."""
    name = dns_name(f"triton-{pub.config_name}")
    gpus = cfg.build.tensor_parallel_size * cfg.build.pipeline_parallel_size
    from pipeline.release.image import model_identity, quant_label

    _, model_revision = model_identity(pub.provenance)
    annotations = {
        f"{ANNOTATION_PREFIX}config": pub.config_name,
        f"{ANNOTATION_PREFIX}model-name": pub.model_name,
        f"{ANNOTATION_PREFIX}model-revision": model_revision,
        f"{ANNOTATION_PREFIX}quantization": quant_label(pub),
        f"{ANNOTATION_PREFIX}build-target": pub.target,
        f"{ANNOTATION_PREFIX}trtllm-version": pub.trtllm_version or "none",
        f"{ANNOTATION_PREFIX}repository-digest": f"sha256:{pub.repository_digest}",
    }
    out: dict[str, dict] = {}
    on_cpu = targets.get(pub.target).on_cpu(cfg)
    for file_name, base in base_documents():
        doc = copy.deepcopy(base)
        doc["metadata"]["name"] = name
        _relabel(doc, name)
        kind = doc["kind"]
        if serves_vllm_openai(cfg, pub.target):
            _to_vllm(doc, cfg.vllm.device)
        if kind == "Deployment":
            doc["metadata"]["annotations"] = dict(annotations)
            pod = doc["spec"]["template"]
            pod.setdefault("metadata", {})["annotations"] = dict(annotations)
            pod["spec"]["serviceAccountName"] = name
            container = _containers(doc)[0]
            container["image"] = image_ref
            res = container["resources"]
            host = pod_host_memory(cfg)
            if on_cpu:
                for part in ("requests", "limits"):
                    res[part].pop(GPU_RESOURCE, None)
                res["requests"].update({"cpu": "2"})
                res["limits"].update({"cpu": "4"})
                pod["spec"].pop("tolerations", None)
                # the CPU runtime loads in seconds, not minutes
                container["startupProbe"]["failureThreshold"] = 30
            else:
                for part in ("requests", "limits"):
                    res[part][GPU_RESOURCE] = str(gpus)
            for part in ("requests", "limits"):
                res[part]["memory"] = f"{host['memory']}Gi"
            for vol in pod["spec"]["volumes"]:
                if vol["name"] == "dshm":
                    vol["emptyDir"]["sizeLimit"] = f"{host['shm']}Gi"
        elif kind == "HorizontalPodAutoscaler":
            doc["spec"]["scaleTargetRef"]["name"] = name
            metrics = doc["spec"]["metrics"]
            for m in metrics:
                if m["type"] == "Pods" and m["pods"]["metric"]["name"] == GPU_METRIC:
                    m["pods"]["target"]["averageValue"] = str(SCALE_OUT_UTILIZATION_PCT)
                    if on_cpu:  # no GPU: CPU
                        m.clear()
                        m.update({"type": "Resource", "resource": {"name": "cpu", "target": {
                            "type": "Utilization", "averageUtilization": SCALE_OUT_UTILIZATION_PCT}}})
                elif m["type"] == "Pods" and m["pods"]["metric"]["name"] == QUEUE_METRIC:
                    m["pods"]["target"]["averageValue"] = str(SCALE_OUT_QUEUED_PER_REPLICA)
            doc["spec"]["behavior"]["scaleUp"]["tolerance"] = "0"
            doc["spec"]["behavior"]["scaleDown"]["tolerance"] = scale_down_tolerance()
        out[file_name] = doc
    labels = out["deployment.yaml"]["metadata"].get("labels") or {}
    out[ALERTS_RESOURCE] = alerts.prometheus_rule(cfg.alerts, name, labels, *alert_engine(cfg, pub.target))
    out[DASHBOARD_RESOURCE] = dashboards.config_map(name, labels, *alert_engine(cfg, pub.target))
    return out


def serves_vllm_openai(cfg: PipelineConfig, target: str) -> bool:
    """Whether the image runs vLLM's OpenAI server (the vllm target with openai first in vllm.frontends), not
    Triton (pipeline.release.image.docker_target)."""
    return targets.get(target).server(targets.get(target).frontends(cfg)[0]) == targets.SERVER_VLLM_OPENAI


def alert_engine(cfg: PipelineConfig, target: str) -> tuple[str, bool]:
    """(whose series the alert rules read, whether the GPU rules apply) for a build of ``target``."""
    return targets.get(target).alert_engine(cfg)


def _to_vllm(doc: dict, device: str) -> None:
    """A base resource turned to serve vLLM: one port, /health, vLLM's queue and the DCGM GPU metric."""
    kind = doc["kind"]
    if kind == "Deployment":
        (c,) = _containers(doc)
        c["name"] = "vllm"
        c["ports"] = [p for p in c["ports"] if p["name"] == "http"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            c[probe]["httpGet"]["path"] = "/health"
        doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 60
    elif kind == "Service":
        doc["spec"]["ports"] = [p for p in doc["spec"]["ports"] if p["name"] == "http"]
    elif kind == "PodMonitor":
        for endpoint in doc["spec"]["podMetricsEndpoints"]:
            endpoint["port"] = "http"
    elif kind == "NetworkPolicy":
        for rule in doc["spec"]["ingress"]:
            rule["ports"] = [p for p in rule["ports"] if p["port"] == VLLM_PORT]
    elif kind == "HorizontalPodAutoscaler":
        for m in doc["spec"]["metrics"]:
            metric = m.get("pods", {}).get("metric", {})
            if metric.get("name") == QUEUE_METRIC:
                metric["name"] = VLLM_QUEUE_METRIC
            elif metric.get("name") == GPU_METRIC and device == "cuda":
                metric["name"] = VLLM_GPU_METRIC


def render_jobs(cfg: PipelineConfig, config_path: Path, overrides: Sequence[str], gpu_types: Sequence[str],
                builder_ref: str) -> dict[str, dict]:
    """{file name: resource}: the shared volume and network policy, then one engine-build Job per GPU type."""
    if not targets.get(cfg.build.target).gpu_only:
        raise ConfigError(f"build.target is {cfg.build.target}: engine-build Jobs are for the GPU targets. Render "
                          f"them for a tensorrt or pytorch config (or --set build.target=tensorrt).")
    try:
        rel_config = config_path.resolve().relative_to(constants.REPO_ROOT).as_posix()
    except ValueError:
        rel_config = None
    if rel_config is None or not rel_config.startswith("engine_configs/"):
        raise InputError(f"Engine-build Jobs run the configs baked into the builder image (engine_configs/); "
                         f"{config_path} is not there. Add it to engine_configs/ and rebuild the builder image "
                         f"(`invoke image --builder`).")
    template = load_yaml_docs(JOBS_DIR / JOB_TEMPLATE)[0]
    out = {name: load_yaml_docs(JOBS_DIR / name)[0] for name in JOBS_SHARED}
    gpus = cfg.build.tensor_parallel_size * cfg.build.pipeline_parallel_size
    seen = set()
    for gpu_type in gpu_types:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?", gpu_type):
            raise ConfigError(f"--gpu-type {gpu_type!r} is not a node label value (letters, digits, '-', '_', '.'; "
                              f"e.g. NVIDIA-H100-80GB-HBM3, the value of the {GPU_PRODUCT_LABEL} node label).")
        slug = dns_name(gpu_type, 30)
        if slug in seen:
            raise ConfigError(f"--gpu-type {gpu_type!r} given twice")
        seen.add(slug)
        job = copy.deepcopy(template)
        job_name = dns_name(f"engine-build-{cfg.name[:24]}-{slug}")
        job["metadata"]["name"] = job_name
        for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
            meta["labels"][INSTANCE_LABEL] = job_name
            meta["annotations"] = {f"{ANNOTATION_PREFIX}config": cfg.name, f"{ANNOTATION_PREFIX}gpu-type": gpu_type,
                                   f"{ANNOTATION_PREFIX}trtllm-version": cfg.build.trtllm_version}
        pod = job["spec"]["template"]["spec"]
        pod["nodeSelector"] = {GPU_PRODUCT_LABEL: gpu_type}
        container = pod["containers"][0]
        container["image"] = builder_ref
        container["args"] = ["publish", "--config", rel_config,
                             *[a for o in overrides for a in ("--set", o)],
                             "--work-root", f"/workspace/builds/{slug}"]
        for part in ("requests", "limits"):
            container["resources"][part][GPU_RESOURCE] = str(gpus)
        out[f"{job_name}.yaml"] = job
    return out


def _kustomization(files: Sequence[str], comment: str) -> str:
    body = yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                           "resources": list(files)}, sort_keys=False)
    return f"# {comment}\n{body}"


def write_rendered(out_dir: Path, serving: dict[str, dict], jobs: dict[str, dict], header: str,
                   plain: dict[str, dict] | None = None) -> Path:
    """Write the rendered manifests into out_dir (replaced whole: written beside it, then renamed); ``plain``:
    files that are not Kubernetes resources (kept out of the kustomization), by relative path."""
    staging = out_dir.with_name(out_dir.name + ".staging")
    remove_tree(staging)
    staging.mkdir(parents=True)

    def dump(path: Path, doc: dict) -> None:
        atomic_write_text(path, f"# {header}\n" + yaml.safe_dump(doc, sort_keys=False))

    for file_name, doc in serving.items():
        dump(staging / file_name, doc)
    atomic_write_text(staging / "kustomization.yaml",
                      _kustomization(list(serving), f"{header}. Apply: kubectl apply -k <this folder>"))
    if jobs:
        (staging / "jobs").mkdir()
        for file_name, doc in jobs.items():
            dump(staging / "jobs" / file_name, doc)
        atomic_write_text(staging / "jobs" / "kustomization.yaml",
                          _kustomization(list(jobs), f"{header}. Engine builds: kubectl apply -k <this folder>"))
    for rel, doc in (plain or {}).items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".json"):
            atomic_write_text(staging / rel, json.dumps(doc, indent=1) + "\n")
        else:
            dump(staging / rel, doc)
    replace_dir(staging, out_dir)
    return out_dir


def render_manifests(runner: Runner, overrides: Sequence[str], gpu_types: Sequence[str] = (),
                     echo: Callable[[str], None] = print) -> Path:
    """`invoke deploy-manifests`: deploy/ rendered for the published build into <work dir>/deploy/."""
    from pipeline.release.image import (
        _published,
        builder_tag,
        content_tag,
        image_repository,
        source_revision,
    )

    cfg = runner.loaded.config
    with WorkDirLock(runner.work_dir):
        pub = _published(runner, echo)
        image_ref = f"{image_repository(cfg.image)}:{cfg.image.tag or content_tag(pub)}"
        serving = render_serving(cfg, pub, image_ref)
        jobs = {}
        if gpu_types:
            builder_ref = f"{image_repository(cfg.image)}:{builder_tag(cfg.build.trtllm_version, source_revision())}"
            jobs = render_jobs(cfg, runner.loaded.path, overrides, gpu_types, builder_ref)
        header = (f"Rendered by `invoke deploy-manifests` from deploy/ for {pub.config_name} "
                  f"(repository sha256:{pub.short_digest}...); edit deploy/, not this file")
        plain = {}
        if ALERTS_RESOURCE in serving:
            plain[ALERTS_RULE_FILE] = alerts.rule_file(cfg.alerts, serving[ALERTS_RESOURCE]["metadata"]["name"],
                                                       *alert_engine(cfg, pub.target))
        if DASHBOARD_RESOURCE in serving:
            plain[DASHBOARD_FILE] = dashboards.dashboard(serving[ALERTS_RESOURCE]["metadata"]["name"],
                                                         *alert_engine(cfg, pub.target))
        out = write_rendered(runner.work_dir / RENDERED_DIR, serving, jobs, header, plain)
    echo(f"image: {image_ref}")
    echo(f"manifests: {out} (kubectl apply -k {out})")
    if ALERTS_RESOURCE in serving:
        echo(f"alert rules: {out / ALERTS_RESOURCE} (PrometheusRule), {out / ALERTS_RULE_FILE} (plain rules file)")
    if DASHBOARD_RESOURCE in serving:
        echo(f"dashboard: {out / DASHBOARD_RESOURCE} (ConfigMap for Grafana's sidecar), {out / DASHBOARD_FILE}")
    if jobs:
        echo(f"engine-build Jobs: {out / 'jobs'} ({len(jobs) - len(JOBS_SHARED)} job(s); "
             f"kubectl apply -k {out / 'jobs'})")
    elif targets.get(cfg.build.target).gpu_only:
        echo("engine-build Jobs: pass --gpu-type <node label value> (repeatable) to render them")
    if cfg.image.repository is None:
        echo("note: image.repository is not set: the image name is local; a cluster cannot pull it")
    return out
