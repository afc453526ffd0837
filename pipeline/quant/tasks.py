"""Task accuracy in the accuracy gate: lm-evaluation-harness tasks (quantization.accuracy.tasks) scored on the
original and the quantized model in this process (lm-eval's HFLM wrapping the model objects), and the recovery
(quantized / original) each keeps. lm-eval is imported only when tasks are configured.

A task is loaded from lm-eval's own task YAML: a local one from its folder (TaskManager include_path, lm-eval's
registered tasks left out, so nothing is read from the network), a registered one by name with its Hub dataset
pinned (dataset_kwargs.revision). Either is loaded through a small wrapper YAML that includes the task's own and
adds what the config pins: the local data files resolved against the task's folder (lm-eval passes them to
``datasets.load_dataset`` as written, relative to the working directory), or the dataset revision."""

from __future__ import annotations

import difflib
import logging
import math
import tempfile
from pathlib import Path
from typing import Any, Sequence

import yaml

from pipeline.config import AccuracyTask
from pipeline.errors import InputError

log = logging.getLogger(__name__)

BATCH_SIZE = 4  # requests per forward on the CPU: small, as the gate's own batches (gate.EVAL_BATCH)


def load_tasks(specs: Sequence[AccuracyTask]) -> list[tuple[Any, Any]]:
    """(lm-eval Task, the TaskManager that found it) for each configured task, its data read; an InputError
    naming the task and where it was looked for when one cannot be found or read."""
    registry = None  # lm-eval's whole index (about 15 s to build): only when a registered task is configured
    built = []
    for spec in specs:
        if spec.path is not None:
            manager = _manager(spec.path)
            built.append((_load_one(spec, manager, f"the folder {spec.path}"), manager))
        else:
            registry = registry or _manager(None)
            built.append((_load_one(spec, registry, "lm-eval's registered tasks"), registry))
    return built


def _manager(folder: Path | None):
    from lm_eval.tasks import TaskManager

    if folder is None:
        return TaskManager()
    return TaskManager(include_path=str(folder), include_defaults=False)


def _load_one(spec: AccuracyTask, manager, where: str):
    entry = manager.task_index.get(spec.name)
    if entry is None or entry.yaml_path is None:
        close = difflib.get_close_matches(spec.name, manager.all_subtasks, n=3)
        hint = f"; close names: {', '.join(close)}" if close else ""
        found = "" if spec.path is None else f" (tasks there: {', '.join(manager.all_subtasks) or 'none'})"
        raise InputError(f"quantization.accuracy.tasks: no lm-eval task named {spec.name!r} in {where}{found}"
                         f"{hint}. A local task's folder holds its YAML (task: {spec.name}) and its data file.")
    dataset_kwargs = dict(entry.cfg.get("dataset_kwargs") or {})
    if spec.path is not None:
        dataset_kwargs["data_files"] = _resolved(dataset_kwargs.get("data_files"), Path(entry.yaml_path).parent)
    else:
        dataset_kwargs["revision"] = spec.dataset_revision
    with tempfile.TemporaryDirectory(prefix="accuracy-task-") as tmp:
        wrapper = Path(tmp) / f"{spec.name}.yaml"
        wrapper.write_text(yaml.safe_dump({"include": str(Path(entry.yaml_path).resolve()), "task": spec.name,
                                           "dataset_kwargs": dataset_kwargs}))
        try:
            loaded = manager.load([str(wrapper)])["tasks"]
        except Exception as e:  # noqa: BLE001 - a task lm-eval cannot build: its YAML, its data, the Hub
            raise InputError(
                f"quantization.accuracy.tasks: lm-eval could not load task {spec.name!r} from {where} "
                f"({entry.yaml_path}): {type(e).__name__}: {e}. Check the task's YAML and its data file"
                + ("" if spec.path is not None else ", and that the Hub is reachable and has that dataset revision")
                + "."
            ) from None
    (task,) = loaded.values()
    return task


def _resolved(files: Any, folder: Path) -> Any:
    """A task's data_files (a name, a list, or a split -> name(s) mapping) against its folder."""
    if isinstance(files, str):
        path = Path(files)
        return str(path if path.is_absolute() else folder / path)
    if isinstance(files, list):
        return [_resolved(f, folder) for f in files]
    if isinstance(files, dict):
        return {k: _resolved(v, folder) for k, v in files.items()}
    raise InputError(f"the lm-eval task in {folder} names no data file: set dataset_kwargs.data_files in its YAML "
                     "(e.g. {test: questions.jsonl}, relative to the task's folder)")


def metric_key(spec: AccuracyTask) -> str:
    """The key lm-eval reports the metric under: metric,filter ("acc" -> "acc,none")."""
    return spec.metric if "," in spec.metric else f"{spec.metric},none"


def score(model, tokenizer, specs: Sequence[AccuracyTask], loaded: Sequence[tuple[Any, Any]]) -> dict[str, dict]:
    """Each task's figure on one model: {task: {"score", "higher_is_better", "samples"}}. ``model`` is a
    transformers model object (a ModelOpt fake-quantized one too), evaluated where it is."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH_SIZE)
    out = {}
    for spec, (task, manager) in zip(specs, loaded, strict=True):
        # its own TaskManager: without one simple_evaluate indexes every task lm-eval ships (about 15 s)
        res = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=spec.limit, bootstrap_iters=0,
                              log_samples=False)
        assert res is not None  # one process: rank 0
        figures = res["results"][spec.name]
        key = metric_key(spec)
        if key not in figures:
            reported = sorted(k for k in figures if k != "alias" and "_stderr" not in k)
            raise InputError(f"quantization.accuracy.tasks: task {spec.name!r} reports no metric {key!r}; it "
                             f"reports {', '.join(reported)}. Set the task's metric to one of them.")
        out[spec.name] = {"score": float(figures[key]),
                          "higher_is_better": bool(res["higher_is_better"][spec.name].get(key.split(",")[0], True)),
                          "samples": int(res["n-samples"][spec.name]["effective"])}
    return out


def task_figures(original, quantized, tokenizer, specs: Sequence[AccuracyTask]) -> list[dict]:
    """The gate's task rows: each task's score on both models and the recovery the quantized one keeps."""
    loaded = load_tasks(specs)  # once for both models: lm-eval rebuilds a task's requests on each evaluation
    o, q = score(original, tokenizer, specs, loaded), score(quantized, tokenizer, specs, loaded)
    return [{"task": s.name, "metric": metric_key(s), "samples": o[s.name]["samples"],
             "original": o[s.name]["score"], "quantized": q[s.name]["score"],
             "recovery": recovery(o[s.name]["score"], q[s.name]["score"], o[s.name]["higher_is_better"])}
            for s in specs]


def recovery(original: float, quantized: float, higher_is_better: bool = True) -> float:
    """quantized / original (original / quantized where lower is better), 6 significant digits; 1.0 where the
    original scores 0 on a higher-is-better metric (the quantized model cannot do worse)."""
    if higher_is_better:
        ratio = quantized / original if original > 0 else 1.0
    else:
        ratio = original / quantized if quantized > 0 else (1.0 if original == 0 else math.inf)
    return float(f"{ratio:.6g}")


def task_failures(rows: Sequence[dict], min_recovery: float) -> list[str]:
    return [f"{r['task']} {r['metric']} recovery {r['recovery']} < {min_recovery} "
            f"({r['original']} -> {r['quantized']})" for r in rows if r["recovery"] < min_recovery]
