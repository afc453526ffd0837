"""The staged runner: content-hash cache, atomic outputs, manifests, a work-dir lock.

A stage is up to date when the hash of its inputs (its config sections, its upstream stages' output
digests, the content of any files the config points at, the pipeline and stage versions) equals the one
recorded in its manifest, and its recorded outputs are still there unchanged. Inputs are hashed *before*
the stage runs and checked again after it, so an input edited mid-run is caught, not recorded as done.

Layout of a work dir (``build/<config name>/`` by default)::

    <stage>/manifest.json   what ran, on what, producing which files (hashes, sizes), how long it took
    <stage>/stage.log       the stage's log
    <stage>/...             its artifacts
    .staging/               a stage writes here, then its folder is renamed into place when complete
    .lock                   held by the running process; a second run on the same work dir is refused
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import platform
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from pipeline import __version__, artifacts, console
from pipeline.child import StageLogHandler
from pipeline.config import LoadedConfig
from pipeline.errors import (
    EnvironmentProblem,
    InputError,
    PipelineError,
    StageFailed,
    WorkDirBusy,
)
from pipeline.fsutil import (
    HashCache,
    atomic_write_json,
    digest_of_files,
    fsync_dir,
    fsync_tree,
    hash_json,
    list_files,
    remove_tree,
    sha256_file,
)
from pipeline.summaries import StageSummary

log = logging.getLogger("pipeline")

TOOL_PACKAGES = ("torch", "transformers", "huggingface_hub", "safetensors", "gguf", "tokenizers", "numpy",
                 "nvidia-modelopt", "tensorrt_llm", "tritonclient", "nvidia-pytriton")


@dataclass
class StageContext:
    """What a stage's adapter gets: the config, a folder to write into, its upstream stages' folders."""

    loaded: LoadedConfig
    work_dir: Path  # <work_root>/<config name>: the stages' folders, the live Triton repository, logs
    out_dir: Path  # the staging folder; becomes <work_dir>/<stage> when the stage completes
    upstream_dirs: dict[str, Path]
    hash_cache: HashCache

    @property
    def config(self):
        return self.loaded.config

    def upstream(self, name: str) -> Path:
        return self.upstream_dirs[name]


@dataclass(frozen=True)
class StageDef:
    name: str
    description: str
    run: Callable[[StageContext], StageSummary]  # does the work into ctx.out_dir; returns the manifest's summary
    needs: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()  # config sections (dotted) that are this stage's inputs
    # content fingerprints of outside inputs (files the config points at, a resolved Hub revision)
    # (called with the loaded config, the hash cache and the work dir)
    external_inputs: Optional[Callable[[LoadedConfig, HashCache, Path], dict]] = None
    version: int = 1  # bump when the stage's logic changes in a way that changes its outputs
    # outputs a person may edit by hand (the plan): an edit is validated by accept_edit(stage_dir), which
    # returns summary figures to record, and then used as it is instead of being overwritten
    editable: tuple[str, ...] = ()
    accept_edit: Optional[Callable[[Path], Mapping[str, Any]]] = None
    # checks that this machine can run the stage (a GPU, TensorRT-LLM, ...), raising EnvironmentProblem or
    # ConfigError; called for every stage a run selects, upstream ones included, before the first one starts,
    # so a GPU profile on a CPU machine fails in seconds instead of after the download and calibration
    preflight: Optional[Callable[[LoadedConfig], None]] = None


@dataclass
class StageStatus:
    name: str
    up_to_date: bool
    reasons: list[str] = field(default_factory=list)
    manifest: Optional[dict] = None
    inputs_changed: bool = False
    output_problems: list[str] = field(default_factory=list)
    edited: list[str] = field(default_factory=list)  # editable outputs changed by hand

    def recorded_manifest(self) -> dict:
        """The manifest this status was judged from (there is one whenever it is up to date or edited)."""
        if self.manifest is None:
            raise PipelineError(f"internal: stage {self.name} has no manifest to reuse")
        return self.manifest


def tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "pipeline": __version__}
    for pkg in TOOL_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


class WorkDirLock:
    """An exclusive flock on <work_dir>/.lock, released when the process ends (even on kill -9)."""

    def __init__(self, work_dir: Path):
        self.path = work_dir / artifacts.LOCK_FILE
        self._fd: Optional[int] = None

    def __enter__(self) -> "WorkDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkDirBusy(
                f"Work dir {self.path.parent} is in use by another run (pid {holder}). Wait for it to "
                f"finish, or use another --work-root."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Runner:
    def __init__(self, loaded: LoadedConfig, stages: list[StageDef], work_root: Path):
        self.loaded = loaded
        self.stages = {s.name: s for s in stages}
        self.order = [s.name for s in stages]  # stages are listed in dependency order
        self.work_dir = Path(work_root) / loaded.name
        self.hash_cache = HashCache(self.work_dir / artifacts.HASH_CACHE_FILE)

    # ------------------------------------------------------------ inspection

    def closure(self, targets: list[str]) -> list[str]:
        """The targets and everything they depend on, in run order."""
        want: set[str] = set()

        def visit(name: str) -> None:
            if name not in self.stages:
                raise PipelineError(f"internal: unknown stage {name!r}")
            if name not in want:
                want.add(name)
                for dep in self.stages[name].needs:
                    visit(dep)

        for t in targets:
            visit(t)
        return [n for n in self.order if n in want]

    def stage_dir(self, name: str) -> Path:
        return self.work_dir / name

    def read_manifest(self, name: str) -> Optional[dict]:
        path = self.stage_dir(name) / artifacts.MANIFEST_FILE
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def compute_inputs(self, stage: StageDef) -> dict:
        cfg = self.loaded.config.model_dump(mode="json")
        sections = {}
        for dotted in stage.sections:
            node: Any = cfg
            for key in dotted.split("."):
                node = node[key]
            sections[dotted] = node
        upstream = {}
        for dep in stage.needs:
            m = self.read_manifest(dep)
            upstream[dep] = m["outputs"]["digest"] if m and m.get("status") == "ok" else None
        external = stage.external_inputs(self.loaded, self.hash_cache, self.work_dir) if stage.external_inputs else {}
        return {
            "stage": stage.name,
            "stage_version": stage.version,
            "pipeline_version": __version__,
            "config": sections,
            "upstream": upstream,
            "external": external,
        }

    def status(self, name: str, inputs: Optional[dict] = None) -> StageStatus:
        stage = self.stages[name]
        manifest = self.read_manifest(name)
        if manifest is None:
            return StageStatus(name, False, ["never run (no manifest)"])
        if manifest.get("format_version") != artifacts.MANIFEST_FORMAT_VERSION:
            return StageStatus(name, False, ["manifest from another pipeline format version"], manifest)
        if manifest.get("status") != "ok":
            return StageStatus(name, False, [f"last run ended with status {manifest.get('status')}"], manifest)
        if inputs is None:
            inputs = self.compute_inputs(stage)
        reasons = []
        changed = hash_json(inputs) != manifest.get("input_hash")
        if changed:
            reasons = _describe_changes(manifest.get("inputs", {}), inputs) or ["inputs changed"]
        problems, edited = self._check_outputs(name, manifest, stage.editable)
        reasons += problems
        reasons += [f"{name}/{rel} was edited by hand: it will be checked and used as it is" for rel in edited]
        return StageStatus(name, not reasons, reasons, manifest, changed, problems, edited)

    def _check_outputs(self, name: str, manifest: dict, editable: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
        root = self.stage_dir(name)
        problems, edited = [], []
        for rel, rec in manifest["outputs"]["files"].items():
            p = root / rel
            try:
                st = p.stat()
            except OSError:
                problems.append(f"output {name}/{rel} is missing")
                continue
            modified = st.st_size != rec["size_bytes"] or (
                st.st_mtime_ns != rec["mtime_ns"] and sha256_file(p) != rec["sha256"])
            if modified and rel in editable:
                edited.append(rel)
            elif st.st_size != rec["size_bytes"]:
                problems.append(f"output {name}/{rel} changed size")
            elif modified:
                problems.append(f"output {name}/{rel} was modified")
        return problems, edited

    def explain(self, targets: list[str]) -> list[StageStatus]:
        """What `run` would do, without doing it: used by `invoke explain`."""
        out: list[StageStatus] = []
        rerun: set[str] = set()
        for name in self.closure(targets):
            stage = self.stages[name]
            st = self.status(name)
            stale_deps = [d for d in stage.needs if d in rerun]
            if stale_deps and st.up_to_date:
                st = StageStatus(name, False, [f"upstream {', '.join(stale_deps)} will rerun "
                                               "(skipped after all if its outputs come out identical)"],
                                 st.manifest)
            if not st.up_to_date:
                rerun.add(name)
            out.append(st)
        if self.work_dir.is_dir():
            self.hash_cache.save()
        return out

    # ------------------------------------------------------------ running

    def preflight(self, targets: list[str]) -> None:
        """What this machine lacks for the targets and the stages they need (StageDef.preflight), before any work."""
        for name in self.closure(targets):
            check = self.stages[name].preflight
            if check is not None:
                check(self.loaded)

    def run(self, targets: list[str], force: bool | list[str] = False,
            echo: Optional[Callable[[str], None]] = None) -> list[dict]:
        """Run the targets and what they need, in order. Each stage's lines go to ``echo``; without one, to the
        console (pipeline.console), where a running stage's line is live on a terminal until its outcome."""
        names = self.closure(targets)
        self.preflight(targets)
        forced = set(names) if force is True else set(force or [])
        results = []
        with WorkDirLock(self.work_dir):
            self._clear_leftovers()
            for name in names:
                results.append(self._run_one(self.stages[name], name in forced, echo or console.echo,
                                             echo or console.status))
            self.hash_cache.save()
        return results

    def _clear_leftovers(self) -> None:
        """Staging folders left by an interrupted run (Ctrl-C, kill -9) never reached a final path."""
        for sub in (artifacts.STAGING_DIR, artifacts.TRASH_DIR):
            d = self.work_dir / sub
            if d.is_dir():
                for child in d.iterdir():
                    log.info("removing leftover %s from an interrupted run", child.relative_to(self.work_dir))
                    remove_tree(child)

    def _run_one(self, stage: StageDef, force: bool, echo: Callable[[str], None],
                 status: Callable[[str], None]) -> dict:
        t0 = time.monotonic()
        inputs = self.compute_inputs(stage)  # hashed before the stage runs
        input_hash = hash_json(inputs)
        st = self.status(stage.name, inputs)
        if st.up_to_date and not force:
            echo(f"{stage.name}: up to date (inputs unchanged, outputs intact) [{time.monotonic() - t0:.1f} s]")
            return st.recorded_manifest()
        if st.edited and not force:
            return self._accept_edit(stage, st, echo)
        why = "forced (--force)" if force else "; ".join(st.reasons)
        status(f"{stage.name}: running ({why})")

        staging = self.work_dir / artifacts.STAGING_DIR / f"{stage.name}-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir(parents=True)
            handler = StageLogHandler(staging / artifacts.STAGE_LOG_FILE, encoding="utf-8")
        except OSError as e:
            remove_tree(staging)
            if _disk_full(e):
                raise EnvironmentProblem(self._disk_full_message(stage.name)) from e
            raise
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.setLevel(logging.INFO)
        root_logger = logging.getLogger()
        root_logger.addHandler(handler)
        saved_level = log.level
        if log.getEffectiveLevel() > logging.INFO:
            log.setLevel(logging.INFO)  # the stage log keeps the pipeline's INFO lines whatever the console shows
        started = datetime.now(timezone.utc)
        try:
            # quiet console: what the stage and its libraries print goes to its log, beside the records
            with console.stage_output(staging / artifacts.STAGE_LOG_FILE):
                ctx = StageContext(self.loaded, self.work_dir, staging,
                                   {d: self.stage_dir(d) for d in stage.needs}, self.hash_cache)
                summary = stage.run(ctx) or {}
            after = self.compute_inputs(stage)
            if hash_json(after) != input_hash:
                changed = "; ".join(_describe_changes(inputs, after)) or "inputs changed"
                raise InputError(f"{stage.name}: an input changed while the stage ran ({changed}). Run again.")
        except BaseException as e:
            if isinstance(e, PipelineError):  # the message is the story: into the stage log, not the console
                handler.emit(log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s failed: %s",
                                            (stage.name, e), None))
            elif not isinstance(e, KeyboardInterrupt):
                log.error("%s failed", stage.name, exc_info=True)
            root_logger.removeHandler(handler)
            _close_log(handler)
            log.setLevel(saved_level)
            kept = self._keep_failed_log(stage.name, staging)
            remove_tree(staging)
            if _disk_full(e):
                raise EnvironmentProblem(self._disk_full_message(stage.name)) from e
            if isinstance(e, KeyboardInterrupt):
                echo(f"{stage.name}: interrupted; nothing was written to {self.stage_dir(stage.name)}")
                raise
            if isinstance(e, PipelineError):
                raise
            raise StageFailed(
                f"{stage.name} failed: {type(e).__name__}: {e}. Log: {kept}. Previous outputs, if any, "
                f"are untouched."
            ) from e
        root_logger.removeHandler(handler)
        _close_log(handler)
        log.setLevel(saved_level)

        files: dict[str, dict[str, Any]] = {}  # rel -> sha256, size_bytes, mtime_ns
        # the log is kept beside the artifacts but is not one: its timestamps differ on every run
        for rel in list_files(staging, exclude=[artifacts.MANIFEST_FILE, artifacts.STAGE_LOG_FILE]):
            p = staging / rel
            st_ = p.stat()
            files[rel] = {"sha256": sha256_file(p), "size_bytes": st_.st_size, "mtime_ns": st_.st_mtime_ns}
        finished = datetime.now(timezone.utc)
        manifest = {
            "format_version": artifacts.MANIFEST_FORMAT_VERSION,
            "stage": stage.name,
            "status": "ok",
            "config_name": self.loaded.name,
            "config_files": [p.name for p in self.loaded.files],
            "overrides": list(self.loaded.overrides),
            "input_hash": input_hash,
            "inputs": inputs,
            "outputs": {
                "digest": digest_of_files({k: v["sha256"] for k, v in files.items()}),
                "total_bytes": sum(v["size_bytes"] for v in files.values()),
                "files": files,
            },
            "summary": summary,
            "tool_versions": tool_versions(),
            "started_at": started.isoformat(timespec="seconds"),
            "finished_at": finished.isoformat(timespec="seconds"),
            "duration_s": round((finished - started).total_seconds(), 3),
        }
        try:
            atomic_write_json(staging / artifacts.MANIFEST_FILE, manifest)
            fsync_tree(staging)
        except OSError as e:
            remove_tree(staging)
            if _disk_full(e):
                raise EnvironmentProblem(self._disk_full_message(stage.name)) from e
            raise StageFailed(f"{stage.name}: could not write its manifest ({e}). Previous outputs, if any, are "
                              f"untouched.") from e
        self._swap_into_place(stage.name, staging)
        echo(f"{stage.name}: done in {manifest['duration_s']:.1f} s -> {self.stage_dir(stage.name)}")
        return manifest

    def _accept_edit(self, stage: StageDef, st: StageStatus, echo: Callable[[str], None]) -> dict:
        """A person edited an editable output: check it and record it, never overwrite it silently."""
        files = ", ".join(st.edited)
        if st.inputs_changed or st.output_problems:
            other = "; ".join(r for r in st.reasons if "edited by hand" not in r)
            raise InputError(
                f"{stage.name}: {files} was edited by hand, and {other}. Rerunning the stage would overwrite "
                f"your edit: copy it somewhere safe, then rerun with --force (or undo the other change)."
            )
        root = self.stage_dir(stage.name)
        figures = stage.accept_edit(root) if stage.accept_edit else {}
        manifest = dict(st.recorded_manifest())
        files_rec = dict(manifest["outputs"]["files"])
        for rel in st.edited:
            p = root / rel
            stat = p.stat()
            files_rec[rel] = {"sha256": sha256_file(p), "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        manifest["outputs"] = {
            "digest": digest_of_files({k: v["sha256"] for k, v in files_rec.items()}),
            "total_bytes": sum(v["size_bytes"] for v in files_rec.values()),
            "files": files_rec,
        }
        manifest["hand_edited"] = sorted(set(manifest.get("hand_edited", [])) | set(st.edited))
        manifest["summary"] = {**manifest.get("summary", {}), **figures, "hand_edited": True}
        atomic_write_json(root / artifacts.MANIFEST_FILE, manifest)
        echo(f"{stage.name}: using the hand-edited {files} (checked; stages after it will rerun)")
        return manifest

    def _swap_into_place(self, name: str, staging: Path) -> None:
        final = self.stage_dir(name)
        if final.exists():
            trash = self.work_dir / artifacts.TRASH_DIR / f"{name}-{uuid.uuid4().hex[:8]}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.replace(final, trash)
            os.replace(staging, final)
            fsync_dir(self.work_dir)
            remove_tree(trash)
        else:
            os.replace(staging, final)
            fsync_dir(self.work_dir)

    def _keep_failed_log(self, name: str, staging: Path) -> Path:
        """A failed stage's log to ``logs/<stage>.failed.log``, and the other logs at the top of its output (a
        server's) to ``logs/<stage>.failed.<file name>``, before the output goes; returns the stage log's path."""
        dst = self.work_dir / "logs" / f"{name}.failed.log"
        others = [p for p in staging.glob("*.log") if p.name != artifacts.STAGE_LOG_FILE] if staging.is_dir() else []
        moves = [(staging / artifacts.STAGE_LOG_FILE, dst)] + [(p, dst.parent / f"{name}.failed.{p.name}")
                                                               for p in sorted(others)]
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            for src, to in moves:
                if src.is_file():
                    os.replace(src, to)
        except OSError as e:  # a full disk may not take even the folder
            log.warning("could not keep the failed stage's logs in %s: %s", dst.parent, e)
        return dst

    def _disk_full_message(self, name: str) -> str:
        free = shutil.disk_usage(self.work_dir).free
        return (f"{name}: the file system holding {self.work_dir} is full (no space left on device; "
                f"{free / 2**20:.0f} MiB free now that the stage's partial output is removed). Free space there "
                f"or give another --work-root. Previous outputs, if any, are untouched.")


def _close_log(handler: logging.Handler) -> None:
    """Close a stage's log handler; a log that cannot be flushed (a full disk) must not hide the stage's outcome."""
    try:
        handler.close()
    except OSError as e:
        log.warning("could not finish writing the stage log: %s", e)


def _disk_full(e: Optional[BaseException]) -> bool:
    """Whether a failure (or what caused it; a child's error arrives as text) is a full file system."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "[Errno 28]" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _describe_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two recorded input dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b:
            continue
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(a, dict) and isinstance(b, dict):
            out += _describe_changes(a, b, path)
        elif path.startswith("upstream."):
            out.append(f"upstream stage '{key}' produced new outputs")
        else:
            out.append(f"{_label(path)} changed: {_brief(a)} -> {_brief(b)}")
    return out


def _label(path: str) -> str:
    if path.startswith("config."):
        return "config " + path[len("config."):]
    if path.startswith("external."):
        return "input " + path[len("external."):]
    return path


def _brief(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:28] + "..." + text[-28:]
