"""A pydantic validation failure as a ConfigError's text: one line per error, each naming the file that set the
value, its YAML path, the bad value and what would be valid (for an unknown key: the keys valid there and the
closest one)."""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import BaseModel, ValidationError

from pipeline.config.schema import PipelineConfig


def format_validation_error(e: ValidationError, raw: dict, origins: dict[str, str], path: Path) -> str:
    lines = [f"Invalid config {path}:"]
    for err in e.errors():
        yaml_path, value, present = _yaml_path(err["loc"], raw)
        where = origin_for(yaml_path, origins) or str(path)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent_model = _model_at(yaml_path.rsplit(".", 1)[0] if "." in yaml_path else "", raw)
            key = yaml_path.rsplit(".", 1)[-1]
            valid = sorted(parent_model.model_fields) if parent_model else []
            guess = difflib.get_close_matches(key, valid, n=1)
            msg = f": unknown key '{key}'"
            msg += f" (did you mean '{guess[0]}'?)" if guess else ""
            msg += f"; valid keys here: {', '.join(valid)}" if valid else ""
        elif kind == "missing":
            msg = ": is required but missing"
        else:
            text = err["msg"].removeprefix("Value error, ")
            msg = f" = {_short(value)}: {text}" if present and not isinstance(value, dict) else f": {text}"
        lines.append(f"  {where}: {yaml_path or '<top level>'}{msg}")
    lines.append("Fix the value(s) above; `invoke explain --config FILE` re-checks a config without running anything.")
    return "\n".join(lines)


def _yaml_path(loc: tuple, raw: dict) -> tuple[str, Any, bool]:
    """Map a pydantic error location onto the YAML document, dropping union tags pydantic inserts."""
    parts: list[str] = []
    node: Any = raw
    present = True
    for item in loc:
        if isinstance(node, dict) and item in node:
            node = node[item]
            parts.append(str(item))
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            node = node[item]
            parts.append(f"[{item}]")
        elif isinstance(node, dict) and "kind" in node and item == node.get("kind"):
            continue  # discriminated-union tag
        elif isinstance(item, str) and item.startswith(("function-", "tagged-union", "union")):
            continue
        else:
            parts.append(str(item))
            present = False
    path = ".".join(parts).replace(".[", "[")
    return path, node, present


def _model_at(dotted: str, raw: dict) -> type[BaseModel] | None:
    """The pydantic model describing the YAML mapping at ``dotted`` (for listing its valid keys)."""
    model: Any = PipelineConfig
    node: Any = raw
    for part in [k for k in dotted.split(".") if k]:
        match = re.fullmatch(r"(.*?)(?:\[(\d+)\])?", part)
        if match is None:  # a key with a line break in it (`.` stops there): no model describes it
            return None
        key, index = match.groups()
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or key not in model.model_fields:
            return None
        node = node.get(key) if isinstance(node, dict) else None
        annotation = model.model_fields[key].annotation
        if index is not None:
            node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
            args = typing.get_args(annotation)
            annotation = args[0] if args else None
        model = _model_for(annotation, node)
    return model


def _model_for(annotation: Any, node: Any) -> type[BaseModel] | None:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model_for(typing.get_args(annotation)[0], node)
    if origin is Union:
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(node, dict) and "kind" in node:
            for m in models:
                if "kind" in m.model_fields and node["kind"] in typing.get_args(m.model_fields["kind"].annotation):
                    return m
        return models[0] if len(models) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def origin_for(yaml_path: str, origins: dict[str, str]) -> str | None:
    probe = yaml_path
    while probe:
        if probe in origins:
            return origins[probe]
        hits = [f for k, f in origins.items() if k.startswith(probe + ".")]
        if hits:
            return hits[0]
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
