"""What the report reads from the work dir, leniently: a missing or unreadable file is None ("not run").

The report shows whatever is there and never fails on what is not, so it does not use the strict typed
readers of ``pipeline.artifacts`` (which raise); the file names are the artifact contract's all the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import yaml

from pipeline import artifacts
from pipeline.serving.publish import read_config

STAGES = tuple(s for s in artifacts.STAGE_TASK if s != "report")  # the stages the report covers


def read_manifests(work_dir: Path) -> dict[str, Optional[dict]]:
    """Each stage's manifest (None: not run, or its last run did not finish ok)."""
    out = {}
    for stage in STAGES:
        try:
            m = json.loads((work_dir / stage / artifacts.MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            m = None
        out[stage] = m if m and m.get("status") == "ok" else None
    return out


def read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def dig(d: Optional[dict], *keys, default=None):
    """d[k1][k2]...; default where a level is missing or not a dict."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


# ---------------------------------------------------------------- each stage's files the report reads


def maybe_provenance(work_dir: Path) -> Optional[Any]:
    """publish's provenance.json of the version it just published."""
    return read_json(artifacts.published_repository(work_dir) / artifacts.PROVENANCE_FILE)


def maybe_build_settings(work_dir: Path) -> Optional[Any]:
    return read_json(artifacts.stage_dir(work_dir, "build") / artifacts.BUILD_SETTINGS_FILE)


def maybe_verify_results(work_dir: Path) -> Optional[Any]:
    return read_json(artifacts.stage_dir(work_dir, "verify") / artifacts.VERIFY_RESULTS_FILE)


def maybe_bench_results(work_dir: Path) -> Optional[Any]:
    return read_json(artifacts.stage_dir(work_dir, "bench") / artifacts.BENCH_RESULTS_FILE)


def maybe_accuracy(work_dir: Path) -> Optional[Any]:
    return read_json(artifacts.stage_dir(work_dir, "quantize") / artifacts.ACCURACY_FILE)


def maybe_sensitivity_table(work_dir: Path) -> Optional[Any]:
    return read_json(artifacts.stage_dir(work_dir, "sensitivity") / artifacts.SENSITIVITY_TABLE_JSON)


def maybe_plan(work_dir: Path) -> Optional[dict]:
    """plan.yaml as written or hand-edited (not checked: the plan stage did that)."""
    try:
        return yaml.safe_load((artifacts.stage_dir(work_dir, "plan") / artifacts.PLAN_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return None


def published_model_config(work_dir: Path, model: str) -> dict:
    """What a reader wants from a published config.pbtxt (parsed as the ModelConfig protobuf it was written from)."""
    try:
        msg = read_config(artifacts.published_repository(work_dir) / model / artifacts.MODEL_CONFIG_FILE)
    except Exception:  # noqa: BLE001 - an unreadable config is shown as unknown, the report still renders
        return {}
    return {"kind": msg.backend or msg.platform, "max_batch_size": msg.max_batch_size,
            "decoupled": msg.model_transaction_policy.decoupled,
            "inputs": ", ".join(i.name + ("?" if i.optional else "") for i in msg.input),
            "outputs": ", ".join(o.name for o in msg.output)}
