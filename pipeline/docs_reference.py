"""The configuration reference page (docs/reference/config.md), generated from the config schema.

Every field of ``PipelineConfig`` and the models under it, with its type, default, constraints and description.
A field's description is its ``Field(description=...)`` where it has one, else the comments written beside it in
the schema's source (the lines just above it and the one on its line), so the page says what the code says.
``invoke docs --write`` rewrites the page; tests/test_docs.py fails when the committed page differs.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pipeline.config import PipelineConfig
from pipeline.errors import EnvironmentProblem

PAGE = Path("docs") / "reference" / "config.md"
FIX = ".venv/bin/invoke docs --write"

_HEADER = """\
# Configuration reference

<!-- generated from the config schema (pipeline.config) by pipeline/docs_reference.py: do not edit by hand;
     run `invoke docs --write` after changing the schema -->

An engine config is one YAML file (`engine_configs/*.yaml`) read into one strict schema: an unknown key, a wrong
type or an impossible combination is an error naming the file, the YAML path, the bad value and what is valid.
`extends: other.yaml` starts from another file; `--set section.key=value` overrides one field on the command line.
Unset fields take the default below, or the value the model's family and the build target choose
(`invoke explain` prints those choices and why).

Each section lists its fields: the YAML path, the type, the default ("required" where there is none), the
constraints the schema checks, and what the field does. Rules that tie fields together (and the target's own
rules) are checked too; they are not repeated here.
"""


def _comments(cls: type) -> dict[str, str]:
    """{field: the comments beside it in ``cls``'s source}: the comment lines just above the field, then the
    comment on its own line(s)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comment_at: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    out: dict[str, str] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comment_at and line not in code_lines:
            above.insert(0, comment_at[line])
            line -= 1
        inline = [comment_at[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comment_at]
        text = " ".join(above + inline).strip()
        if text:
            out[node.target.id] = text
    return out


def _constraints(info: FieldInfo) -> str:
    parts = []
    for m in info.metadata:
        for kind, attr, sign in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(m, kind):
                parts.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, MinLen):
            parts.append(f"length >= {m.min_length}")
        if isinstance(m, MaxLen):
            parts.append(f"length <= {m.max_length}")
        if type(m).__name__ == "AfterValidator":  # SafeName: a name usable as a folder and a Triton model name
            parts.append("a plain name: letters, digits, '.', '_', '-', at most 64 characters")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
        if len(json.dumps(value)) > 60:
            return "its fields' defaults"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, default=str)}`"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (a section, a list of rules, a discriminated union's variants)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for a in typing.get_args(annotation):
        out += _models_in(a)
    return out


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: pipes escaped, and outside `code` spans the characters Markdown would
    take for HTML or emphasis (``<work dir>``, ``*.bin``)."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts).replace("|", "\\|")


# Fields the schema's source leaves without a comment: their description here (a field in neither place fails
# tests/test_docs.py, naming it)
DESCRIPTIONS = {
    "name": "the config's name: its work dir is <work root>/<name>/ (default: the file's name without .yaml)",
    "description": "free text, shown in the report",
    "model": "the model: where it comes from, and the dtype of the prepared folder",
    "model.source": "where the model comes from: hub, local, gguf_file or gguf_package",
    "sensitivity": "the per-layer error table",
    "plan": "which layers keep high precision or take another format",
    "quantization": "ModelOpt's formats and the accuracy gate",
    "build": "the build target and the engine's limits",
    "triton": "the Triton model repository publish writes, and the runtime's serving settings",
    "model.source.kind": "which source this is",
    "model.source.include": "file patterns fetched from the Hub repository",
    "model.source.exclude": "file patterns not fetched",
    "model.source.path": "the local HF folder or GGUF file (relative to the YAML file that names it)",
    "model.source.file": "the GGUF file's name inside the package",
    "text.source": "where the documents come from: pydoc_topics, files or dataset",
    "text.source.kind": "which source this is",
    "text.source.paths": "the text files, one document each (relative to the YAML file)",
    "text.source.repo_id": "a Hub dataset, 'owner/name' (or give files)",
    "text.source.files": "local data files (relative to the YAML file), one split: train",
    "text.source.split": "the dataset split read",
    "text.source.text_field": "the column holding each row's document (or chat messages with chat: true)",
    "text.seed": "seeds the document shuffle that splits calibration from evaluation",
    "text.calibration": "the calibration token set (sensitivity, ModelOpt's calibration)",
    "text.evaluation": "the evaluation token set (the accuracy gate, bench prompts), from documents calibration "
                       "never sees",
    "num_samples": "sequences in the set",
    "seq_len": "tokens per sequence",
    "sensitivity.formats": "the formats measured per layer (the table's columns); the plan's decision column and "
                           "any budget.wider_formats must be among them",
    "plan.mode": "threshold: keep layers whose error exceeds sensitivity.threshold; budget: best error within "
                 "plan.budget",
    "plan.budget": "the size limit for mode: budget (exactly one of weight_bytes, avg_bits_per_weight)",
    "plan.rules": "fnmatch rules over layer names, applied after the mode; the last match wins",
    "plan.budget.weight_bytes": "total bytes of the linear layers' weights",
    "plan.budget.avg_bits_per_weight": "average bits per weight over the linear layers",
    "plan.rules.keep_high_precision": "keep the matching layers unquantized",
    "plan.rules.format": "give the matching layers this format",
    "quantization.weight_format": "the base weight format ModelOpt quantizes with (none: the unquantized baseline)",
    "quantization.kv_cache": "the KV-cache format calibrated and exported (autoconfig may choose it where unset)",
    "quantization.awq_group_size": "INT4 AWQ's group size; must divide every INT4 layer's input width",
    "quantization.accuracy": "the accuracy gate's bounds (quantized against original, on the evaluation set)",
    "quantization.accuracy.max_perplexity_increase_pct": "largest perplexity increase, in percent",
    "quantization.accuracy.min_top1_agreement": "smallest share of evaluation tokens whose top-1 prediction "
                                                "agrees with the original's",
    "quantization.accuracy.max_kl_divergence": "largest mean KL(original || quantized) per token",
    "quantization.accuracy.min_task_recovery": "smallest share of each task's original score the quantized model "
                                               "keeps (docs/concepts/accuracy-gate.md)",
    "build.dtype": "the engine's dtype for unquantized parts",
    "build.max_batch_size": "most sequences batched at once",
    "build.max_input_len": "longest prompt, in tokens",
    "build.max_seq_len": "longest sequence: prompt plus generated tokens",
    "build.max_num_tokens": "most tokens in one engine step (prefill and decode together)",
    "build.max_beam_width": "beam search width the engine is built for (1: greedy and sampling)",
    "build.kv_cache": "the paged KV cache",
    "build.cuda_graphs": "CUDA graphs for decode steps (GPU targets)",
    "build.tensor_parallel_size": "GPUs each layer is split over",
    "build.pipeline_parallel_size": "GPUs the layers are divided over",
    "build.multiple_profiles": "tensorrt target: build several TensorRT optimisation profiles",
    "build.target_sm": "the compute capability x 10 this profile is sized for",
    "build.kv_cache.tokens_per_block": "tokens per KV-cache block (a power of two)",
    "build.kv_cache.free_gpu_memory_fraction": "GPU targets: the share of free GPU memory given to the KV cache",
    "build.kv_cache.enable_block_reuse": "reuse the KV blocks of a shared prompt prefix",
    "build.cuda_graphs.enabled": "capture CUDA graphs (vllm target: enforce_eager when false)",
    "build.cuda_graphs.enable_padding": "pad a batch up to the next captured size",
    "triton.model_name": "the ensemble's name; the other models are <model_name>_<part>",
    "triton.instance_count": "instances of the engine model per server",
    "triton.max_queue_delay_us": "how long Triton's dynamic batcher waits to fill a batch",
    "triton.keep_versions": "model versions kept in the live repository",
    "triton.default_priority_level": "the level of a request that names none (default: the lowest)",
    "triton.watchdog": "the serving model's watchdog",
    "triton.watchdog.memory_window_s": "the window over which memory growth is measured, in seconds",
    "bench.concurrency": "the concurrency levels swept (requests in flight)",
    "bench.output_tokens": "tokens generated per request",
    "bench.request_timeout_s": "a request slower than this fails",
    "bench.metrics_url": "with grpc_url: the running server's metrics URL",
    "alerts.kv_cache_used_fraction": "share of a pod's KV-cache blocks in use",
    "alerts.restarts_in_15m": "container restarts in 15 minutes",
    "alerts.gpu_util_percent": "GPU utilisation (DCGM)",
    "alerts.mem_copy_util_percent": "GPU memory-copy utilisation (DCGM)",
    "alerts.latency_jitter": "latency standard deviation / mean over the last minute",
    "image.platform": "the image's platform",
}


def _described(dotted: str, name: str, info: FieldInfo, comments: dict[str, str]) -> str:
    """A field's description: its Field(description=...), the comments beside it, DESCRIPTIONS, or for a
    section the first sentence of its docstring."""
    text = info.description or comments.get(name) or DESCRIPTIONS.get(dotted) or DESCRIPTIONS.get(name, "")
    models = _models_in(info.annotation)
    if not text and len(models) == 1 and models[0].__doc__:
        text = inspect.cleandoc(models[0].__doc__).split("\n\n")[0].replace("\n", " ")
    return text


def _sections(model: type[BaseModel], path: str) -> list[tuple[type[BaseModel], str]]:
    """Every model under ``model`` with its YAML path, depth first (a model reached at two paths, twice)."""
    out = [(model, path)]
    for name, info in model.model_fields.items():
        for sub in _models_in(info.annotation):
            out += _sections(sub, f"{path}.{name}" if path else name)
    return out


def _discriminator(model: type[BaseModel]) -> str:
    kind = model.model_fields.get("kind")
    if kind is not None and typing.get_origin(kind.annotation) is Literal:
        return str(typing.get_args(kind.annotation)[0])
    return ""


def _anchor(path: str, model: type[BaseModel]) -> str:
    kind = _discriminator(model)
    return (path.replace(".", "-") or "top-level") + (f"-{kind}" if kind else "")


def _type_name(annotation: Any, path: str) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0], path)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        names = [_type_name(a, path) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin in (tuple, list):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {_type_name(inner[0], path)}" if inner else "list"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        kind = _discriminator(annotation)
        return f"[{kind or 'section'}](#{_anchor(path, annotation)})"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "Path": "path",
            "ByteSize": "size (e.g. \"24GB\", \"2.5GiB\")"}.get(getattr(annotation, "__name__", ""), str(annotation))


def undocumented() -> list[str]:
    """The YAML paths of fields with no description anywhere."""
    out = []
    for model, path in _sections(PipelineConfig, ""):
        comments = _comments(model)
        for name, info in model.model_fields.items():
            dotted = f"{path}.{name}" if path else name
            if not _described(dotted, name, info, comments):
                out.append(dotted)
    return out


def render() -> str:
    """The page, as Markdown."""
    lines = [_HEADER]
    for model, path in _sections(PipelineConfig, ""):
        kind = _discriminator(model)
        title = (f"`{path}`" + (f" (`kind: {kind}`)" if kind else "")) if path else "Top level"
        lines += [f"## {title} {{#{_anchor(path, model)}}}", ""]
        if model.__doc__ and model is not PipelineConfig:
            lines += [" ".join(inspect.cleandoc(model.__doc__).split()), ""]
        comments = _comments(model)
        lines += ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
        for name, info in model.model_fields.items():
            dotted = f"{path}.{name}" if path else name
            lines.append(f"| `{dotted}` | {_cell(_type_name(info.annotation, dotted))} | {_cell(_default(info))} | "
                         f"{_cell(_constraints(info))} | {_cell(_described(dotted, name, info, comments))} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def field_paths() -> set[str]:
    """Every YAML path the schema takes (``quantization.kv_cache``, ``model.source.repo_id``), sections included."""
    paths: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            dotted = f"{prefix}.{name}" if prefix else name
            paths.add(dotted)
            for sub in _models_in(info.annotation):
                walk(sub, dotted)

    walk(PipelineConfig, "")
    return paths


def write(root: Path) -> Path:
    """Rewrite the page under the repository ``root``; returns its path."""
    page = root / PAGE
    page.write_text(render(), encoding="utf-8")
    return page


def stale(root: Path) -> bool:
    """Whether the committed page differs from the schema's."""
    page = root / PAGE
    return not page.is_file() or page.read_text(encoding="utf-8") != render()


def build_site(root: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``root``'s mkdocs.yml into ``site_dir``, its output captured (a broken link or
    anchor, a page missing from the nav, is a warning that --strict makes a failure, and the output names it)."""
    if importlib.util.find_spec("mkdocs") is None:
        raise EnvironmentProblem("mkdocs is not installed in this environment (the dev extra has mkdocs-material): "
                                 "run `bash scripts/setup-env`")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, on every build
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site_dir)],
                          capture_output=True, text=True, env=env, timeout=600)
