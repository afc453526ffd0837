"""The serving settings `invoke tune` chose, as a file that publish applies: ``<work dir>/tune/tuned_settings.yaml``.

The file (written by ``pipeline.serving.tune``)::

    format_version: 1
    triton: {max_running: 4}          # the chosen settings: keys of the config's triton section
    sla: {itl_ms: 150}                # the P99 bounds (ms) they were chosen for
    build_digest: <sha256>            # the build they were measured on (its stage's output digest)

publish applies each setting the config leaves unset: a value the config sets itself (in its YAML or with
--set) wins, and publish's summary names the tuned value it did not apply. The file applies only to the
build and the SLA it was measured for; otherwise publish says why it is not applied (`invoke tune` again).
``tune.apply: false`` ignores it. Its content is one of publish's inputs, so a new tune result republishes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import yaml
from pydantic import ValidationError

from pipeline import artifacts
from pipeline.config import PipelineConfig
from pipeline.errors import InputError
from pipeline.fsutil import sha256_file

log = logging.getLogger(__name__)

TUNE_DIR = "tune"  # <work dir>/tune: what the last successful `invoke tune` wrote
FAILED_DIR = "tune.failed"  # <work dir>/tune.failed: the evidence of a tune that found no setting to apply
TUNED_FILE = "tuned_settings.yaml"
RESULTS_FILE = "tune_results.json"  # every measured point, the choice, the A/B
TABLE_FILE = "tune.md"
PLOT_FILE = "throughput_vs_p99.png"
PLAN_FILE = "tune_plan.yaml"  # <work dir>/tune_plan.yaml: the GPU targets' points to measure where the GPU is
# the triton keys a tuned file may set (pipeline/config/serving.py TritonSection says which target reads which)
TUNABLE = ("max_running", "adaptive_batch", "prefill_chunk_tokens", "scheduler_policy",
           "kv_cache_free_gpu_memory_fraction")
FORMAT_VERSION = 1


def tuned_path(work_dir: Path) -> Path:
    return work_dir / TUNE_DIR / TUNED_FILE


def build_digest(work_dir: Path) -> Optional[str]:
    """The build stage's output digest (what a tune result was measured on); None before a build."""
    try:
        manifest = json.loads((artifacts.stage_dir(work_dir, "build") / artifacts.MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("outputs", {}).get("digest")


def read_tuned(path: Path) -> Optional[dict]:
    """The tuned settings file, checked; None where there is none."""
    if not path.is_file():
        return None
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"{path} is not readable YAML ({e}); run `invoke tune` again or delete it") from None
    unknown = sorted(set(doc.get("triton", {})) - set(TUNABLE)) if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION
            or not isinstance(doc.get("triton"), dict) or unknown or not isinstance(doc.get("sla"), dict)):
        raise InputError(f"{path} is not a tuned settings file of format {FORMAT_VERSION} (triton: only "
                         f"{', '.join(TUNABLE)}; sla: the bounds it was tuned for"
                         f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}); run `invoke tune` again or "
                         f"delete it")
    return doc


def tuned_fingerprint(config: PipelineConfig, work_dir: Path) -> dict:
    """publish's outside input: the tuned settings file's content and whether it applies (the SLA's bounds are
    not publish's input otherwise), where there is one and tune.apply holds."""
    path = tuned_path(work_dir)
    if not config.tune.apply or not path.is_file():
        return {}
    doc = read_tuned(path)
    applies = doc is not None and _why_not(doc, config, work_dir) is None
    return {"tuned_settings_sha256": sha256_file(path), "tuned_settings_apply": applies}


def _why_not(doc: dict, config: PipelineConfig, work_dir: Path) -> Optional[str]:
    """Why a tuned settings file does not apply to this config and build; None where it does."""
    if doc["sla"] != config.sla.bounds():
        return f"it was tuned for the SLA {doc['sla']}, and the config's is {config.sla.bounds()}"
    if doc.get("build_digest") != build_digest(work_dir):
        return "it was measured on another build than the current one"
    return None


def with_triton(config: PipelineConfig, settings: dict) -> PipelineConfig:
    """``config`` with these triton keys set, validated again as a whole (raises pydantic's ValidationError)."""
    data = config.model_dump()
    data["triton"].update(settings)
    return PipelineConfig.model_validate(data)


def apply_tuned(config: PipelineConfig, work_dir: Path) -> tuple[PipelineConfig, dict]:
    """(the config with the tuned settings applied, what was applied and what was not, for the summary)."""
    path = tuned_path(work_dir)
    doc = read_tuned(path) if config.tune.apply else None
    if doc is None:
        return config, {}
    where = f"{TUNE_DIR}/{TUNED_FILE}"
    why_not = _why_not(doc, config, work_dir)
    if why_not:
        log.warning("publish: %s is not applied: %s; run `invoke tune` again", where, why_not)
        return config, {"file": where, "applied": {}, "not_applied": why_not}
    explicit = config.triton.model_fields_set
    applied = {k: v for k, v in doc["triton"].items() if k not in explicit}
    config_wins = {k: getattr(config.triton, k) for k in doc["triton"] if k in explicit}
    try:
        tuned = with_triton(config, applied)
    except ValidationError as e:
        raise InputError(f"{path}: its settings do not validate with this config ({e.errors()[0]['msg']}); run "
                         f"`invoke tune` again, or set tune.apply: false") from None
    if config_wins:
        log.warning("publish: the config sets %s itself; the tuned value(s) %s in %s are not applied",
                    ", ".join(f"triton.{k}" for k in config_wins), {k: doc["triton"][k] for k in config_wins}, where)
    log.info("publish: tuned settings applied from %s: %s", where, applied or (
        "none (the config sets them itself)" if config_wins else "none: tune kept the defaults"))
    return tuned, {"file": where, "applied": applied, "config_wins": config_wins}


def servers_said(rounds: dict) -> str:
    """How rotated_rounds' servers shared the host, from its results (``servers``; results without it are
    from before one-at-a-time rounds, when every server was up)."""
    return ("one server up at a time" if rounds.get("servers") == "alone" else "every server up")
