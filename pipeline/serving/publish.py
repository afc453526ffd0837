"""publish stage: the build -> a versioned Triton model repository, written atomically.

Models (``M`` = ``triton.model_name``; all share one version number per publish):

- ``M``                 ensemble: ``text_input`` + ``max_tokens`` (+ optional sampling) -> ``text_output``
- ``M_preprocessing``   Python: text -> token ids (tokenizer, chat template, stop words)
- ``M_tensorrt_llm``    the target's engine, one I/O for all targets: ``tensorrtllm`` backend (tensorrt), a
                        Python model over TensorRT-LLM's LLM API (pytorch), the CPU reference runtime (cpu),
                        vLLM's async engine (vllm; its export is also what vLLM's own OpenAI server loads)
- ``M_postprocessing``  Python: token ids -> text (incremental, with the tokens already shown as context)
- ``M_stream``          Python BLS, decoupled: text in, text out token by token (gRPC streams, generate_stream);
                        it turns tokens into text itself, with its own copy of the tokenizer
- ``M_tensorrt_llm_unary`` Python BLS: ``M_tensorrt_llm`` as one request -> one response. Triton counts an
                        ensemble with a decoupled step as decoupled and refuses it on the HTTP and gRPC infer
                        endpoints, so with ``triton.decoupled`` the ensemble calls this instead.

Every ``config.pbtxt`` is a ``ModelConfig`` protobuf message written with ``text_format`` and parsed back
(no text templates, nothing left unfilled). The model code comes from ``triton_repo/``.

Where things go. The runner swaps a whole stage folder into place on every run, so a repository inside
``<work>/publish/`` could not accumulate versions. Two places, then:

- ``triton.repository_dir`` (default ``<work dir>/model_repository``): the live repository a server reads.
  Each publish adds version N+1 and keeps the newest ``keep_versions``. It is replaced as a whole: the new
  repository is assembled beside it (hard links: unchanged files cost nothing), ``config.pbtxt`` files and
  ``provenance.json`` written last, then swapped in with one atomic rename (``renameat2(RENAME_EXCHANGE)``).
  A server polling it sees the old repository or the new one, never half a model; a publish killed midway
  leaves the old one in place. Nothing is staged inside the repository: Triton takes any folder there for
  a model, so the staging folder is a hidden sibling.
- ``<work>/publish/model_repository`` (the stage's output, what verify, bench and image use): a complete
  repository holding only the version just published, plus ``provenance.json``.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import re
import shutil
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from pipeline import __version__, artifacts, constants, records, targets
from pipeline.engines.trtllm.targets import serving_llm_api_options
from pipeline.errors import EnvironmentProblem, InputError, StageFailed, UserError
from pipeline.fsutil import (
    digest_of_files,
    fsync_dir,
    fsync_tree,
    list_files,
    remove_tree,
    sha256_file,
)
from pipeline.serving.image_tags import trtllm_version_of_tag
from pipeline.summaries import PublishSummary
from pipeline.targets.base import tenant_parameters

log = logging.getLogger(__name__)

TRITON_SOURCE = constants.REPO_ROOT / "triton_repo"
# modules of this project that the Triton models import where it is not installed (vLLM's environment, its images),
# copied beside every model's code: the tenants' book and gate (triton_repo/tensorrt_llm_vllm imports ``tenancy``)
SHIPPED_MODULES = (constants.REPO_ROOT / "pipeline" / "tenancy.py",)
# tokenizer files the Python models load (config.json lets AutoTokenizer find the tokenizer class)
TOKENIZER_FILES = (*artifacts.TOKENIZER_FILES, "config.json")
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@dataclass(frozen=True)
class ModelNames:
    ensemble: str
    preprocessing: str
    tensorrt_llm: str
    postprocessing: str
    stream: str
    unary: str

    def all(self) -> list[str]:
        """Load order: what the ensemble and the streaming model call comes first."""
        return [self.preprocessing, self.tensorrt_llm, self.postprocessing, self.unary, self.stream, self.ensemble]


def model_names(model_name: str) -> ModelNames:
    names = ModelNames(model_name, f"{model_name}_preprocessing", f"{model_name}_tensorrt_llm",
                       f"{model_name}_postprocessing", f"{model_name}_stream", f"{model_name}_tensorrt_llm_unary")
    for name in names.all():
        if not _MODEL_NAME_RE.match(name):
            raise InputError(
                f"triton.model_name {model_name!r} gives the model name {name!r}, which is not a safe directory "
                f"name: use letters, digits, '_' and '-', starting with a letter or digit (at most 100 characters)"
            )
    return names


# ---------------------------------------------------------------- model configs (protobuf)


def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _tensor(cls, name: str, *, dtype: str, dims: list[int], optional: bool = False, ragged: bool = False,
            reshape: Optional[list[int]] = None):
    pb = _pb()
    t = cls(name=name, data_type=getattr(pb, f"TYPE_{dtype}"), dims=dims)
    if optional:
        t.optional = True
    if ragged:
        t.allow_ragged_batch = True
    if reshape is not None:
        t.reshape.shape.extend(reshape)
    return t


def _inp(name: str, dtype: str, dims: list[int], **flags: Any):
    return _tensor(_pb().ModelInput, name, dtype=dtype, dims=dims, **flags)


def _out(name: str, dtype: str, dims: list[int]):
    pb = _pb()
    return pb.ModelOutput(name=name, data_type=getattr(pb, f"TYPE_{dtype}"), dims=dims)


def _params(msg, values: dict) -> None:
    for k, v in values.items():
        msg.parameters[k].string_value = (str(v).lower() if isinstance(v, bool) else str(v))


def _base(name: str, max_batch_size: int, backend: Optional[str] = None, platform: Optional[str] = None):
    pb = _pb()
    msg = pb.ModelConfig(name=name, max_batch_size=max_batch_size)
    if backend:
        msg.backend = backend
    if platform:
        msg.platform = platform
    if platform != "ensemble":
        msg.version_policy.latest.num_versions = 1  # the newest version serves; older ones are kept for rollback
    return msg


def _instances(msg, count: int, kind: str = "KIND_CPU") -> None:
    pb = _pb()
    msg.instance_group.append(pb.ModelInstanceGroup(count=count, kind=getattr(pb.ModelInstanceGroup, kind)))


def _batching(msg, triton) -> None:
    """Triton's queue in front of the model; with request classes, ordered by priority level (1 the highest),
    which a request's priority parameter sets (the ensemble passes its own on to each step)."""
    msg.dynamic_batching.max_queue_delay_microseconds = triton.max_queue_delay_us
    if triton.priority_levels:
        msg.dynamic_batching.priority_levels = triton.priority_levels
        msg.dynamic_batching.default_priority_level = triton.default_priority_level or triton.priority_levels


# the client-facing inputs shared by the ensemble and the streaming model
def _text_inputs(triton, tenanted: bool) -> list:
    return [
        _inp("text_input", "STRING", [1]),
        _inp("max_tokens", "INT32", [1]),
        _inp("stop_words", "STRING", [-1], optional=True),
        _inp("apply_chat_template", "BOOL", [1], optional=True),
        _inp("end_id", "INT32", [1], optional=True),
        _inp("temperature", "FP32", [1], optional=True),
        _inp("top_k", "INT32", [1], optional=True),
        _inp("top_p", "FP32", [1], optional=True),
        _inp("seed", "UINT64", [1], optional=True),
        *_priority_input(triton),
        *_tenant_input(tenanted),
    ]


def _priority_input(triton, **kwargs) -> list:
    """The request's class (1..priority_levels, 1 the highest), where request classes are on."""
    return [_inp("priority", "INT32", [1], optional=True, **kwargs)] if triton.priority_levels else []


def _tenant_input(tenanted: bool, **kwargs) -> list:
    """The tenant a request belongs to (none: the default tenant), where the config has tenants."""
    return [_inp("tenant", "STRING", [1], optional=True, **kwargs)] if tenanted else []


def _llm_io(msg, triton, *, tenanted: bool, reshape: bool = True, streaming: bool = True, text: bool = False) -> None:
    """The tensorrtllm backend's inputs/outputs; the Python variants take exactly these too. ``text``: text in and
    out besides (the Python-backend engine models: llm_serving.py), the token inputs then optional."""
    scalar: dict[str, list[int]] = dict(reshape=[]) if reshape else {}
    msg.input.extend([
        _inp("input_ids", "INT32", [-1], ragged=True, optional=text),
        _inp("input_lengths", "INT32", [1], optional=text, **scalar),
        _inp("request_output_len", "INT32", [1], optional=text, **scalar),
        _inp("end_id", "INT32", [1], optional=True, **scalar),
        _inp("pad_id", "INT32", [1], optional=True, **scalar),
        _inp("stop_words_list", "INT32", [2, -1], optional=True, ragged=True),
        _inp("temperature", "FP32", [1], optional=True, **scalar),
        _inp("runtime_top_k", "INT32", [1], optional=True, **scalar),
        _inp("runtime_top_p", "FP32", [1], optional=True, **scalar),
        _inp("seed", "UINT64", [1], optional=True, **scalar),
        *_priority_input(triton, **scalar),
        *_tenant_input(tenanted, **scalar),
    ])
    if streaming:
        msg.input.append(_inp("streaming", "BOOL", [1], optional=True, **scalar))
    if text:
        msg.input.extend([_inp("text_input", "STRING", [1], optional=True),
                          _inp("max_tokens", "INT32", [1], optional=True, **scalar),
                          _inp("stop_words", "STRING", [-1], optional=True),
                          _inp("apply_chat_template", "BOOL", [1], optional=True, **scalar)])
    msg.output.extend([_out("output_ids", "INT32", [-1, -1]), _out("sequence_length", "INT32", [-1])])
    if text:
        msg.output.append(_out("text_output", "STRING", [1]))


# the streaming ensemble's inputs (_text_inputs) as the engine model names them, where the names differ
_ENGINE_NAMES = {"top_k": "runtime_top_k", "top_p": "runtime_top_p"}


def build_model_configs(triton, settings: records.BuildSettings, *, names: ModelNames, version: int, serving_root: str,
                        adaptive_target_ms: Optional[float] = None, tenants: Sequence[Any] = ()) -> dict:
    """{model name: ModelConfig message} for the built target (``settings``: build_settings.json). ``tenants``: the
    config's (a ``tenant`` input on every client-facing model and the engine model, and the engine model's
    ``tenants`` parameter; the config admits them only on a target whose runtime reads them)."""
    tenanted = bool(tenants)
    pb = _pb()
    target = settings.target
    bs = settings.max_batch_size
    out = {}

    pre = _base(names.preprocessing, bs, backend="python")
    pre.input.extend([
        _inp("text_input", "STRING", [1]),
        _inp("max_tokens", "INT32", [1]),
        _inp("stop_words", "STRING", [-1], optional=True),
        _inp("apply_chat_template", "BOOL", [1], optional=True),
        _inp("end_id", "INT32", [1], optional=True),
        *_tenant_input(tenanted),
    ])
    pre.output.extend([_out("input_ids", "INT32", [-1]), _out("input_lengths", "INT32", [1]),
                       _out("request_output_len", "INT32", [1]), _out("end_id", "INT32", [1]),
                       _out("pad_id", "INT32", [1]), _out("stop_words_list", "INT32", [2, -1])])
    if tenanted:  # the tenant input or the x-tenant header, which the ensemble hands to this first step alone
        pre.output.append(_out("tenant", "STRING", [1]))
    prompting = {"tokenizer_dir": artifacts.TOKENIZER_DIR, "add_special_tokens": True,  # llm_io.Prompter's
                 "apply_chat_template": triton.apply_chat_template, "max_input_len": settings.max_input_len,
                 "max_seq_len": settings.max_seq_len}
    _params(pre, prompting)
    _instances(pre, triton.instance_count)
    _batching(pre, triton)
    out[pre.name] = pre

    engine = targets.get(target)
    text = engine_takes_text(target)
    llm = _base(names.tensorrt_llm, bs, backend=engine.triton_backend)
    llm.model_transaction_policy.decoupled = triton.decoupled
    _llm_io(llm, triton, tenanted=tenanted, text=text)
    _batching(llm, triton)
    params, count, kind = engine.llm_model(triton, settings, serving_root=serving_root, llm_model=names.tensorrt_llm,
                                           preprocessing=names.preprocessing, version=version,
                                           adaptive_target_ms=adaptive_target_ms)
    _params(llm, {**params, **tenant_parameters(tenants), **(prompting if text else {})})
    _instances(llm, count, kind)
    out[llm.name] = llm

    post = _base(names.postprocessing, bs, backend="python")
    post.input.extend([_inp("output_ids", "INT32", [-1, -1]), _inp("sequence_length", "INT32", [-1]),
                       _inp("prefix_ids", "INT32", [-1], optional=True)])
    post.output.extend([_out("text_output", "STRING", [-1])])
    _params(post, {"tokenizer_dir": artifacts.TOKENIZER_DIR})
    _instances(post, triton.instance_count)
    _batching(post, triton)
    out[post.name] = post

    if triton.decoupled:
        unary = _base(names.unary, bs, backend="python")
        # no "streaming" input: one response is the point; no reshape: its tensors go on to tensorrt_llm as they came
        _llm_io(unary, triton, tenanted=tenanted, reshape=False, streaming=False)
        _params(unary, {"tensorrt_llm_model": names.tensorrt_llm})
        _instances(unary, triton.instance_count)
        _batching(unary, triton)
        out[unary.name] = unary

        out[names.stream] = _stream_ensemble(triton, bs, names, tenanted) if text else _stream_bls(
            triton, bs, names, tenanted, prompting)

    ens = _base(names.ensemble, bs, platform="ensemble")
    ens.input.extend(_text_inputs(triton, tenanted))
    ens.output.extend([_out("text_output", "STRING", [-1]), _out("output_ids", "INT32", [-1, -1]),
                       _out("sequence_length", "INT32", [-1])])
    step = pb.ModelEnsembling.Step
    pre_step = step(model_name=names.preprocessing, model_version=-1)
    tenant = ("tenant",) if tenanted else ()
    for name in ("text_input", "max_tokens", "stop_words", "apply_chat_template", "end_id", *tenant):
        pre_step.input_map[name] = name
    for name in ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list", *tenant):
        pre_step.output_map[name] = f"_{name}"
    llm_step = step(model_name=names.unary if triton.decoupled else names.tensorrt_llm, model_version=-1)
    for name in ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list", *tenant):
        llm_step.input_map[name] = f"_{name}"
    for theirs, ours in (("temperature", "temperature"), ("runtime_top_k", "top_k"), ("runtime_top_p", "top_p"),
                         ("seed", "seed"), *((("priority", "priority"),) if triton.priority_levels else ())):
        llm_step.input_map[theirs] = ours
    llm_step.output_map["output_ids"] = "output_ids"
    llm_step.output_map["sequence_length"] = "sequence_length"
    post_step = step(model_name=names.postprocessing, model_version=-1)
    post_step.input_map["output_ids"] = "output_ids"
    post_step.input_map["sequence_length"] = "sequence_length"
    post_step.output_map["text_output"] = "text_output"
    ens.ensemble_scheduling.step.extend([pre_step, llm_step, post_step])
    out[ens.name] = ens
    return out


def engine_takes_text(target: str) -> bool:
    """Whether the target's engine model is one of ours in the Python backend (``Target.model_code``: a
    llm_serving.GenerationModel), which takes text and streams it itself; the tensorrtllm backend's model takes
    token ids only."""
    return targets.get(target).model_code is not None


def _stream_ensemble(triton, bs: int, names: ModelNames, tenanted: bool):
    """The streaming model where the engine model streams text itself: an ensemble of that model alone, so each
    token goes from the engine's stub to the client through Triton's core, with no other stub process on the way.
    Not a decoupled BLS call: one stub process less per token (scripts/bench_stream_path.py). An ensemble holding
    a decoupled model streams (gRPC streams, generate_stream) and refuses plain infer, as the decoupled model does.
    Triton checks a cancelled request only between an ensemble's steps (triton-inference-server/core pull 263),
    so a client's cancel does not reach the engine: docs/serving/publish-verify.md."""
    pb = _pb()
    stream = _base(names.stream, bs, platform="ensemble")
    stream.input.extend(_text_inputs(triton, tenanted))
    stream.output.extend([_out("text_output", "STRING", [1]), _out("output_ids", "INT32", [-1, -1])])
    step = pb.ModelEnsembling.Step(model_name=names.tensorrt_llm, model_version=-1)
    for i in stream.input:
        step.input_map[_ENGINE_NAMES.get(i.name, i.name)] = i.name
    for name in ("text_output", "output_ids"):
        step.output_map[name] = name
    stream.ensemble_scheduling.step.append(step)
    return stream


def _stream_bls(triton, bs: int, names: ModelNames, tenanted: bool, prompting: dict):
    """The streaming model over the tensorrtllm backend's model, which takes token ids: a decoupled Python model
    (triton_repo/stream) that tokenizes, calls the engine model by BLS and turns its tokens into text."""
    stream = _base(names.stream, bs, backend="python")
    stream.model_transaction_policy.decoupled = True
    stream.input.extend(_text_inputs(triton, tenanted))
    stream.output.extend([_out("text_output", "STRING", [1]), _out("output_ids", "INT32", [-1])])
    _params(stream, {"tensorrt_llm_model": names.tensorrt_llm, **prompting})  # it tokenizes itself
    _instances(stream, triton.instance_count)
    return stream


def config_text(msg) -> str:
    """The config.pbtxt text of a message, checked by parsing it back into an equal message."""
    from google.protobuf import text_format

    text = text_format.MessageToString(msg)
    back = text_format.Parse(text, _pb().ModelConfig())
    if back != msg:
        raise StageFailed(f"internal: the generated config of model {msg.name!r} does not parse back to itself")
    return text


def read_config(path: Path):
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(), _pb().ModelConfig())


# ---------------------------------------------------------------- checks before anything is written


def runtime_trtllm_version(config) -> tuple[str, str]:
    """The TensorRT-LLM of the image that will serve, and where that figure comes from."""
    image = config.image
    if image.base_trtllm_version:
        return image.base_trtllm_version, "image.base_trtllm_version"
    if image.base_tag and (tag_version := trtllm_version_of_tag(image.base_tag)):
        return tag_version, f"image.base_tag {image.base_tag}"
    return config.build.trtllm_version, "build.trtllm_version"


def check_build(config, settings: records.BuildSettings, build_dir: Path) -> Path:
    """Refuse a build the configured target cannot serve; returns the artifact folder."""
    target = config.build.target
    if settings.target != target:
        raise InputError(
            f"target/engine mismatch: build.target is {target!r} but {build_dir / artifacts.BUILD_SETTINGS_FILE} is a "
            f"{settings.target!r} build. Run `invoke build --force` for the {target} target."
        )
    artifact = build_dir / settings.artifact_dir
    engine = targets.get(target)
    if settings.artifact_dir != engine.artifact_dir or not artifact.is_dir():
        raise InputError(f"target/engine mismatch: a {target} build is {engine.artifact_dir}/ in {build_dir}, "
                         f"found {settings.artifact_dir!r}{'' if artifact.is_dir() else ' (missing)'}")
    lacking = engine.missing_artifacts(artifact)
    if lacking:
        raise InputError(f"target/engine mismatch: {artifact} is not a {target} build (no {', '.join(lacking)}); "
                         f"run `invoke build --force`")
    if engine.engine_per_rank:  # an engine loads only under the release that built it
        engine_cfg = json.loads((artifact / "config.json").read_text())
        recorded = settings.trtllm_version or engine_cfg.get("version")
        want, source = runtime_trtllm_version(config)
        if not recorded:
            raise InputError(f"{artifact} records no TensorRT-LLM version; an engine only loads under the release "
                             f"that built it. Rebuild it with `invoke build --force`.")
        if recorded != want:
            raise InputError(
                f"the engine in {artifact} was built with TensorRT-LLM {recorded}, but the runtime image serves "
                f"{want} ({source}); an engine only loads under the release that built it. Rebuild it in the "
                f"{want} image, or set build.trtllm_version / image.base_image to match {recorded}."
            )
    return artifact


def _owned(dest: Path) -> tuple[Optional[records.Provenance], list[str]]:
    """(the destination's provenance, None where it has none of this pipeline's; its model folders)."""
    prov = None
    if (dest / artifacts.PROVENANCE_FILE).is_file():
        try:
            prov = records.read_provenance(dest)
        except InputError:  # not written by this pipeline's publish: its models count as someone else's
            prov = None
    models = sorted(p.name for p in dest.iterdir() if p.is_dir()) if dest.is_dir() else []
    return prov, models


def check_destination(dest: Path, config_name: str, names: ModelNames, overwrite: bool) -> list[str]:
    """Refuse a destination holding models this pipeline did not write; returns the foreign ones kept."""
    if dest.exists() and not dest.is_dir():
        raise InputError(f"triton.repository_dir {dest} exists and is not a folder")
    prov, models = _owned(dest)
    mine = set(prov.models) if prov and prov.config_name == config_name else set()
    foreign = [m for m in models if m not in mine]
    if foreign and not overwrite:
        who = (f"config {prov.config_name!r}" if prov
               else "someone else (no provenance.json of this pipeline)")
        raise UserError(
            f"{dest} holds models this pipeline did not write: {', '.join(foreign)} (written by {who}). "
            f"Publish elsewhere (triton.repository_dir), or set triton.overwrite: true to replace "
            f"{', '.join(sorted(set(foreign) & set(names.all()))) or 'nothing'} and keep the others."
        )
    return [m for m in foreign if m not in names.all()]


# ---------------------------------------------------------------- writing


def _link_tree(src: Path, dst: Path) -> None:
    """Recreate src under dst, hard-linking files (copying across filesystems); empty folders too."""
    for dirpath, _, _ in os.walk(src):
        (dst / Path(dirpath).relative_to(src)).mkdir(parents=True, exist_ok=True)
    for rel in list_files(src):
        s, d = src / rel, dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            shutil.copy2(s, d)
            continue
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)


def _versions(model_dir: Path) -> list[int]:
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def exchange_dirs(a: Path, b: Path) -> None:
    """Swap two folders atomically (Linux renameat2 RENAME_EXCHANGE); two renames where not supported."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None and fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return
    err = ctypes.get_errno() if fn is not None else 0
    log.warning("atomic folder exchange unavailable here (%s); swapping %s with two renames",
                os.strerror(err) if err else "no renameat2", b)
    tmp = b.with_name(f".{b.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(b, tmp)
    os.replace(a, b)
    os.replace(tmp, a)


class _DestinationLock:
    """Two publishes into one repository (from different work dirs) wait for each other."""

    def __init__(self, dest: Path):
        self.path = dest.parent / f".{dest.name}.lock"

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def sources_digest() -> str:
    """sha256 over the serving model code publish copies (triton_repo/*/*.py and SHIPPED_MODULES, names and
    contents): an input of publish, so a repository published before the code changed is published again."""
    files = {f.relative_to(TRITON_SOURCE).as_posix(): sha256_file(f) for f in TRITON_SOURCE.glob("*/*.py")}
    return digest_of_files({**files, **{f"shipped/{f.name}": sha256_file(f) for f in SHIPPED_MODULES}})


def _copy_sources(model_src: str, version_dir: Path) -> None:
    version_dir.mkdir(parents=True, exist_ok=True)
    for f in [*sorted((TRITON_SOURCE / model_src).glob("*.py")), *sorted((TRITON_SOURCE / "common").glob("*.py")),
              *SHIPPED_MODULES]:
        shutil.copy2(f, version_dir / f.name)


def _copy_tokenizer(src_dir: Path, dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    copied = [n for n in TOKENIZER_FILES if (src_dir / n).is_file()]
    if not any(n in copied for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise InputError(f"{src_dir} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    for n in copied:
        shutil.copy2(src_dir / n, dst / n)
    return copied


def assemble(config, settings: records.BuildSettings, *, artifact: Path, tokenizer_dir: Path, names: ModelNames,
             version: int, serving_root: str, repo: Path) -> dict:
    """Write one version of every model into ``repo`` (files first, each config.pbtxt last). Returns {model
    name: its ModelConfig}."""
    adaptive = config.sla.p99_itl_ms if config.triton.adaptive_batch else None
    configs = build_model_configs(config.triton, settings, names=names, version=version, serving_root=serving_root,
                                  tenants=config.tenants,
                                  adaptive_target_ms=adaptive)
    texts = {name: config_text(msg) for name, msg in configs.items()}
    for name, src in ((names.preprocessing, "preprocessing"), (names.postprocessing, "postprocessing")):
        _copy_sources(src, repo / name / str(version))
        _copy_tokenizer(tokenizer_dir, repo / name / str(version) / artifacts.TOKENIZER_DIR)
    llm_dir = repo / names.tensorrt_llm / str(version)
    llm_dir.mkdir(parents=True)
    engine = targets.get(settings.target)
    if engine.model_code is not None:  # a Python-backend model runs it (a C++ backend needs no code)
        _copy_sources(engine.model_code, llm_dir)
        _copy_tokenizer(tokenizer_dir, llm_dir / artifacts.TOKENIZER_DIR)  # it takes text too (engine_takes_text)
    if engine.serves_hf_checkpoint:  # the LLM API's options (the triton section's settings applied) and checkpoint
        _write_llm_api_options(config.triton, artifact / artifacts.LLM_API_OPTIONS_FILE,
                               llm_dir / artifacts.LLM_API_OPTIONS_FILE)
        _link_tree(artifact / artifacts.LLM_API_CHECKPOINT_DIR, llm_dir / artifacts.LLM_API_CHECKPOINT_DIR)
    else:  # the build's folder whole (the vllm export: Triton's model loads it, and so does vLLM's OpenAI server)
        _link_tree(artifact, llm_dir / engine.artifact_dir)
        engine.apply_serving_settings(config.triton, llm_dir / engine.artifact_dir, config.tenants)
    if names.stream in configs and configs[names.stream].platform == "ensemble":
        (repo / names.stream / str(version)).mkdir(parents=True)
    elif names.stream in configs:
        _copy_sources("stream", repo / names.stream / str(version))
        _copy_tokenizer(tokenizer_dir, repo / names.stream / str(version) / artifacts.TOKENIZER_DIR)
    if names.unary in configs:
        _copy_sources("unary", repo / names.unary / str(version))
    (repo / names.ensemble / str(version)).mkdir(parents=True)  # an ensemble's version folder stays empty
    for name in names.all():  # configs last: a model folder is only a model once its config is there
        if name in texts:
            (repo / name / artifacts.MODEL_CONFIG_FILE).write_text(texts[name])
    return configs


def _write_llm_api_options(triton, built: Path, dest: Path) -> None:
    """The pytorch target's LLM-API options: the build's file as it is, or, where the triton section sets a
    serving key (max_running, scheduler_policy, kv_cache_free_gpu_memory_fraction, adaptive_batch), the
    build's options with them applied (targets.serving_llm_api_options)."""
    opts = yaml.safe_load(built.read_text())
    served = serving_llm_api_options(opts, triton)
    if served == opts:
        shutil.copy2(built, dest)
        return
    changed = sorted(k for k in served if served[k] != opts.get(k))
    dest.write_text(f"# The build's {built.name} with the config's triton serving keys applied by publish "
                    f"(changed: {', '.join(changed)}).\n" + yaml.safe_dump(served, sort_keys=False))


def _provenance(config, config_name: str, *, settings: records.BuildSettings, names: ModelNames, version: int,
                work_dir: Path, repo: Path) -> records.Provenance:
    files = {rel: sha256_file(repo / rel) for rel in list_files(repo) if rel != artifacts.PROVENANCE_FILE}
    model_manifest = _read_json(work_dir / "model" / artifacts.MANIFEST_FILE)
    plan_file = work_dir / "plan" / "plan.yaml"
    world_size = settings.tensor_parallel_size * settings.pipeline_parallel_size
    return records.Provenance.model_validate({
        "pipeline_version": __version__,
        "config_name": config_name,
        "model_name": names.ensemble,
        "models": [n for n in names.all() if (repo / n).is_dir()],
        "version": version,
        "model_source": (model_manifest or {}).get("summary", {}).get("source"),
        "plan_sha256": sha256_file(plan_file) if plan_file.is_file() else None,
        "quantization": {"weight_format": config.quantization.weight_format,
                         "kv_cache": config.quantization.kv_cache},
        "checkpoint_sha256": settings.checkpoint_sha256,
        "build": {"target": settings.target, "trtllm_version": settings.trtllm_version,
                  "world_size": world_size,
                  "server_ranks": world_size if targets.get(settings.target).engine_per_rank else 1,
                  "tensorrt_llm_model": names.tensorrt_llm,
                  "provenance": settings.provenance},
        "repository_digest": digest_of_files(files),
    })


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def destination(config, work_dir: Path) -> Path:
    dest = config.triton.repository_dir or (work_dir / artifacts.DEFAULT_REPOSITORY_DIR)
    publish_dir = (work_dir / "publish").resolve()
    resolved = dest.resolve()
    if resolved == publish_dir or publish_dir in resolved.parents or resolved in publish_dir.parents:
        raise InputError(
            f"triton.repository_dir {dest} overlaps the publish stage folder {publish_dir}, which the runner "
            f"replaces on every run; versions could not accumulate there. Choose another folder."
        )
    return dest


def publish(config, config_name: str, *, work_dir: Path, build_dir: Path, model_dir: Path,
            out_dir: Path) -> PublishSummary:
    """The publish stage: check, write a new version into the live repository, snapshot it into out_dir.

    ``model_dir``: the HF model folder (its tokenizer); the cpu target uses the copy inside its bundle."""
    triton = config.triton
    names, settings, artifact, tokenizer_dir = _sources(config, build_dir, model_dir)
    dest = destination(config, work_dir)
    serving_root = (triton.serving_repository_path or str(dest.resolve())).rstrip("/")
    with _DestinationLock(dest):
        foreign = check_destination(dest, config_name, names, triton.overwrite)
        prov, _ = _owned(dest)
        mine = set(prov.models) if prov and prov.config_name == config_name else set()
        version = max([0] + [v for n in names.all() for v in _versions(dest / n)]) + 1
        snapshot = out_dir / artifacts.MODEL_REPOSITORY_DIR
        configs = assemble(config, settings, artifact=artifact, tokenizer_dir=tokenizer_dir, names=names,
                           version=version, serving_root=serving_root, repo=snapshot)
        provenance = _provenance(config, config_name, settings=settings, names=names, version=version,
                                 work_dir=work_dir, repo=snapshot)
        records.write_provenance(snapshot, provenance)

        staging = dest.parent / f".{dest.name}.publishing"  # a sibling: never a folder inside the repository
        remove_tree(staging)  # left by a publish that was killed
        new = staging / uuid.uuid4().hex[:8]
        new.mkdir(parents=True)
        kept: dict[str, list[int]] = {}
        for item in (sorted(dest.iterdir()) if dest.is_dir() else []):
            if item.name == artifacts.PROVENANCE_FILE or item.name in names.all() or item.name in mine:
                continue  # ours: rebuilt below (our models that this publish no longer writes are dropped)
            if item.is_dir():
                _link_tree(item, new / item.name)
            else:
                shutil.copy2(item, new / item.name)
        for name in names.all():
            if name not in configs:
                continue
            # earlier versions of our own models are kept; a foreign model replaced (overwrite) loses its
            old = _versions(dest / name)[-(triton.keep_versions - 1):] if name in mine and triton.keep_versions > 1 \
                else []
            for v in old:
                _link_tree(dest / name / str(v), new / name / str(v))
            _link_tree(snapshot / name / str(version), new / name / str(version))
            kept[name] = old + [version]
        for name in configs:
            shutil.copy2(snapshot / name / artifacts.MODEL_CONFIG_FILE, new / name / artifacts.MODEL_CONFIG_FILE)
        history = [h.model_dump(exclude_unset=True) for h in (prov.history if prov else [])
                   if h.version in set(kept[names.ensemble])]
        records.write_provenance(new, records.Provenance.model_validate({
            **provenance.model_dump(exclude_unset=True), "versions": kept[names.ensemble],
            "history": history + [{"version": version, "repository_digest": provenance.repository_digest,
                                   "checkpoint_sha256": provenance.checkpoint_sha256}],
        }))
        fsync_tree(new)
        if dest.is_dir():
            exchange_dirs(new, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(new, dest)
        fsync_dir(dest.parent)
        remove_tree(staging)
    log.info("published %s version %d to %s (versions kept: %s)", names.ensemble, version, dest,
             kept[names.ensemble])
    reload = reload_models(triton.server_url, [n for n in names.all() if n in configs]) \
        if triton.server_url else None
    return {"model_name": names.ensemble, "version": version, "models": sorted(configs),
            "repository_dir": str(dest), "versions_kept": kept[names.ensemble], "target": settings.target,
            "repository_digest": provenance.repository_digest, "foreign_models_kept": foreign,
            "reloaded": reload}


def _sources(config, build_dir: Path, model_dir: Path) -> tuple[ModelNames, records.BuildSettings, Path, Path]:
    """(model names, build settings, the checked build artifact, the tokenizer folder) of what is published."""
    settings = records.read_build_settings(build_dir)
    artifact = check_build(config, settings, build_dir)
    engine = targets.get(settings.target)
    return (model_names(config.triton.model_name), settings, artifact,
            artifact / engine.tokenizer_subdir if engine.tokenizer_subdir else model_dir)


def write_repository(config, config_name: str, *, work_dir: Path, build_dir: Path, model_dir: Path, repo: Path) -> None:
    """A standalone repository at ``repo`` (version 1, its provenance beside it) of this build with ``config``'s
    serving settings: what `invoke tune` measures a setting on. Not the live repository: no versions, no lock."""
    names, settings, artifact, tokenizer_dir = _sources(config, build_dir, model_dir)
    assemble(config, settings, artifact=artifact, tokenizer_dir=tokenizer_dir, names=names, version=1,
             serving_root=str(repo.resolve()), repo=repo)
    records.write_provenance(repo, _provenance(config, config_name, settings=settings, names=names, version=1,
                                               work_dir=work_dir, repo=repo))


def reload_models(server_url: str, models: list[str], timeout_s: float = 600) -> dict:
    """Ask a running server (explicit model control) to load the new versions, dependencies first."""
    base = server_url if "://" in server_url else f"http://{server_url}"
    base = base.rstrip("/")
    done = []
    for name in models:
        req = urllib.request.Request(f"{base}/v2/repository/models/{name}/load", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s):
                done.append(name)
        except urllib.error.HTTPError as e:
            raise StageFailed(
                f"the repository was published, but the server at {base} refused to load {name}: HTTP {e.code} "
                f"{e.read().decode(errors='replace')[:300]}. The server must run with --model-control-mode="
                f"explicit for reloads (or poll the repository itself: then unset triton.server_url)."
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise EnvironmentProblem(
                f"the repository was published, but the server at {base} could not be reached to reload {name}: "
                f"{e}. Start it, or unset triton.server_url."
            ) from None
    return {"server_url": base, "models": done}
