"""The model stage against a Hub: the real huggingface_hub client talking to FakeHub (tests/fake_hub.py),
which serves the real tiny Llama folder (safetensors + tokenizer) from the `tiny_model_dir` fixture.

Nothing of pipeline.source.hub / pipeline.source.download is mocked: revisions are resolved over HTTP, files are
downloaded into a per-test cache_dir, checked against the sha256 / git blob ids the fake Hub lists, and
linked into the model stage's output. The user's real HF cache and token are never used: the token env
vars are removed, the token file is redirected to a missing tmp file, and every config sets cache_dir.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_invoke, tree_snapshot, write_yaml
from fake_hub import FakeHub

from pipeline import artifacts, constants
from pipeline.config import load_config
from pipeline.errors import ConfigError, InputError, IntegrityError
from pipeline.runner import Runner
from pipeline.source.download import inspect_hf_folder
from pipeline.stages import STAGES

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

REPO = "acme/tiny-llama"
NAME = "hubtest"
WEIGHTS = "model.safetensors"
EXTRA = {"pytorch_model.bin": b"\x80\x02not really a pickle" * 64, "README.md": b"# tiny llama\n"}
TOKEN = "hf_TestTokenDoNotLeak0123456789abcdef"
SHA_RE = re.compile(r"^[0-9a-f]{40}$")


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def _isolated_hf_env(monkeypatch, tmp_path):
    """No machine token, no real cache, no proxy, online; huggingface_hub's import-time copies patched too."""
    from huggingface_hub import constants as hf_constants
    from huggingface_hub.utils import reset_sessions

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT",
                "HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    secrets = tmp_path / "hf_secrets"  # never created: no token file to find
    # get_token() reads the file named by the import-time constant; subprocesses read the env var
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(secrets / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(secrets / "stored_tokens"))
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(secrets / "token"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # for subprocesses: nothing of the user's cache
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if hf_constants.HF_HUB_OFFLINE:
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    reset_sessions()
    yield
    reset_sessions()  # pooled keep-alive connections belong to a FakeHub that is gone


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h
    assert h.errors == []


@pytest.fixture(scope="module")
def model_files(tiny_model_dir) -> dict[str, bytes]:
    """The tiny model folder's files; all of them are in the default include list."""
    files = {p.name: p.read_bytes() for p in sorted(tiny_model_dir.iterdir()) if p.is_file()}
    assert WEIGHTS in files and "config.json" in files and "tokenizer.json" in files
    import fnmatch

    assert all(any(fnmatch.fnmatch(n, pat) for pat in constants.HUB_DEFAULT_INCLUDE) for n in files), files
    return files


@pytest.fixture(scope="module")
def model_facts(tiny_model_dir) -> dict:
    return inspect_hf_folder(tiny_model_dir)


def flip_tail(data: bytes, n: int = 64) -> bytes:
    """Same size, same safetensors header, different weight bytes (the last n bytes inverted)."""
    return data[:-n] + bytes(b ^ 0xFF for b in data[-n:])


def config_file(tmp_path: Path, revision: str = "main", repo: str = REPO, extra: str = "",
                name: str = "hub.yaml") -> Path:
    return write_yaml(tmp_path / "configs" / name, f"""
        name: {NAME}
        model:
          source: {{kind: hub, repo_id: {repo}, revision: {revision}, cache_dir: {tmp_path / 'hf_cache'}{extra}}}
        text:
          source: {{kind: pydoc_topics}}
        build: {{target: cpu, dtype: float32, max_batch_size: 4, max_input_len: 128, max_seq_len: 256,
                max_num_tokens: 512}}
        bench: {{concurrency: [1, 2]}}
        """)


def run_model(cfg: Path, work_root: Path) -> list[str]:
    lines: list[str] = []
    Runner(load_config(cfg), STAGES, work_root).run(["model"], echo=lines.append)
    return lines


def model_dir(work_root: Path) -> Path:
    return work_root / NAME / "model"


def manifest(work_root: Path) -> dict:
    return json.loads((model_dir(work_root) / artifacts.MANIFEST_FILE).read_text())


def hf_files(work_root: Path) -> dict[str, bytes]:
    root = model_dir(work_root) / artifacts.MODEL_DIR
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def blob_path(tmp_path: Path, data: bytes, lfs: bool = True, repo: str = REPO) -> Path:
    """Where huggingface_hub caches a file: blobs/<etag>, the sha256 for LFS files, else the git blob sha1."""
    import hashlib

    etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return tmp_path / "hf_cache" / f"models--{repo.replace('/', '--')}" / "blobs" / etag


def resolve_gets(hub: FakeHub) -> list[str]:
    return [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]


# ---------------------------------------------------------------- 1. happy path


def test_download_main_records_sha_checks_and_reuses(hub, tmp_path, model_files, model_facts):
    sha = hub.add_commit(REPO, {**model_files, **EXTRA})
    cfg, work = config_file(tmp_path), tmp_path / "work"

    lines = run_model(cfg, work)

    assert any(line.startswith("model: done") for line in lines), lines
    m = manifest(work)
    assert m["status"] == "ok"
    src = m["summary"]["source"]
    assert SHA_RE.match(src["revision"]) and src["revision"] == sha
    assert src["repo_id"] == REPO and src["verified_against_hub"] is True
    assert m["inputs"]["external"] == {"kind": "hub", "repo_id": REPO, "commit": sha}
    # exactly the default-included files, byte for byte; the pickle and the README stayed on the Hub
    assert hf_files(work) == model_files
    assert sorted(src["files"]) == sorted(model_files)
    assert sorted(hub.downloaded_files(REPO)) == sorted(model_files)
    assert not [f for f in hub.file_requests if f.filename in EXTRA]
    assert not list((tmp_path / "hf_cache").rglob("pytorch_model.bin"))
    # the folder was inspected, and its facts recorded
    assert m["summary"]["model"] == model_facts
    assert model_facts["architecture"] == "LlamaForCausalLM" and model_facts["num_hidden_layers"] == 2
    assert sorted(m["outputs"]["files"]) == sorted(f"{artifacts.MODEL_DIR}/{n}" for n in model_files)

    # a second run: the revision is resolved again (metadata only), nothing is downloaded or rewritten
    before = tree_snapshot(model_dir(work))
    hub.clear_requests()
    lines = run_model(cfg, work)
    assert len(lines) == 1 and lines[0].startswith("model: up to date"), lines
    assert resolve_gets(hub) == [] and hub.downloaded_files() == []
    assert hub.requests, "the branch should still have been resolved against the Hub"
    assert tree_snapshot(model_dir(work)) == before


# ---------------------------------------------------------------- 2. revision pinning


def test_revision_pinning_and_moved_branch(hub, tmp_path, model_files):
    weights_b = flip_tail(model_files[WEIGHTS])
    sha_a = hub.add_commit(REPO, {**model_files, **EXTRA})
    cfg_main = config_file(tmp_path)
    run_model(cfg_main, tmp_path / "w_main")
    assert manifest(tmp_path / "w_main")["summary"]["source"]["revision"] == sha_a

    sha_b = hub.add_commit(REPO, {**model_files, WEIGHTS: weights_b})  # moves main
    assert sha_b != sha_a

    # the plan says the model input changed, naming the old and the new commit
    [st] = Runner(load_config(cfg_main), STAGES, tmp_path / "w_main").explain(["model"])
    assert not st.up_to_date
    assert any("commit" in r and sha_a in r and sha_b in r for r in st.reasons), st.reasons
    lines = run_model(cfg_main, tmp_path / "w_main")
    assert lines[0].startswith("model: running (input commit changed"), lines
    assert sha_a in lines[0] and sha_b in lines[0]
    m = manifest(tmp_path / "w_main")
    assert m["summary"]["source"]["revision"] == sha_b and m["inputs"]["external"]["commit"] == sha_b
    assert hf_files(tmp_path / "w_main") == {**model_files, WEIGHTS: weights_b}

    # pinned to the first commit: its bytes, even though main has moved on; all from the cache
    hub.clear_requests()
    cfg_pin = config_file(tmp_path, revision=sha_a, name="pinned.yaml")
    run_model(cfg_pin, tmp_path / "w_pin")
    m = manifest(tmp_path / "w_pin")
    assert m["summary"]["source"]["revision"] == sha_a and m["inputs"]["external"]["commit"] == sha_a
    assert hf_files(tmp_path / "w_pin") == model_files
    assert hub.downloaded_files() == []
    # a pinned sha is not resolved by asking the Hub what main is
    assert not [r for r in hub.requests if r.path.split("?")[0] in (f"/api/models/{REPO}",
                                                                     f"/api/models/{REPO}/revision/main")]
    # and it stays up to date while main keeps moving
    hub.add_commit(REPO, {**model_files, WEIGHTS: flip_tail(model_files[WEIGHTS], 128)})
    assert run_model(cfg_pin, tmp_path / "w_pin")[0].startswith("model: up to date")


# ---------------------------------------------------------------- 3. integrity


def test_corrupt_download_is_refused_and_evicted(hub, tmp_path, model_files):
    good = model_files[WEIGHTS]
    sha = hub.add_commit(REPO, model_files)
    hub.corrupt(REPO, sha, WEIGHTS, flip_tail(good))
    cfg, work = config_file(tmp_path, revision=sha), tmp_path / "work"

    with pytest.raises(IntegrityError) as err:
        run_model(cfg, work)
    assert WEIGHTS in str(err.value) and "corrupt" in str(err.value)
    assert not model_dir(work).exists()
    assert list((work / NAME / artifacts.STAGING_DIR).iterdir()) == []
    assert (work / NAME / "logs" / "model.failed.log").is_file()
    assert not blob_path(tmp_path, good).exists(), "the bad blob must not stay in the cache"
    assert blob_path(tmp_path, model_files["config.json"], lfs=False).is_file()  # the good ones stay

    # once the Hub serves the right bytes, a rerun fetches only the evicted file again, and succeeds
    hub.corrupt(REPO, sha, WEIGHTS, good)
    hub.clear_requests()
    run_model(cfg, work)
    assert hub.downloaded_files(REPO) == [WEIGHTS]
    assert hf_files(work) == model_files
    assert blob_path(tmp_path, good).read_bytes() == good


def test_corrupt_new_commit_leaves_previous_output_untouched(hub, tmp_path, model_files):
    sha_a = hub.add_commit(REPO, model_files)
    work = tmp_path / "work"
    run_model(config_file(tmp_path, revision=sha_a), work)
    before = tree_snapshot(model_dir(work))

    weights_b = flip_tail(model_files[WEIGHTS])
    sha_b = hub.add_commit(REPO, {**model_files, WEIGHTS: weights_b}, refs=())
    hub.corrupt(REPO, sha_b, WEIGHTS, flip_tail(weights_b, 16))
    with pytest.raises(IntegrityError, match=re.escape(WEIGHTS)):
        run_model(config_file(tmp_path, revision=sha_b, name="b.yaml"), work)

    assert tree_snapshot(model_dir(work)) == before
    assert manifest(work)["summary"]["source"]["revision"] == sha_a
    assert hf_files(work) == model_files
    assert not blob_path(tmp_path, weights_b).exists()
    assert blob_path(tmp_path, model_files[WEIGHTS]).is_file()  # commit A's weights are still cached


# ---------------------------------------------------------------- 4. tokens


@pytest.mark.parametrize("gated", [False, True], ids=["private", "gated"])
def test_token_required(hub, tmp_path, model_files, monkeypatch, gated):
    sha = hub.add_commit(REPO, model_files)
    hub.require_token(REPO, TOKEN, gated=gated)
    cfg, work = config_file(tmp_path), tmp_path / "work"

    with pytest.raises(InputError) as err:
        run_model(cfg, work)
    assert constants.HF_TOKEN_ENV in str(err.value) and REPO in str(err.value)
    assert ("gated" in str(err.value)) == gated
    assert not model_dir(work).exists()
    assert all("authorization" not in r.headers for r in hub.requests)

    wrong = "hf_WrongTokenAlsoSecret987654321"
    monkeypatch.setenv("HF_TOKEN", wrong)
    with pytest.raises(InputError) as err:
        run_model(cfg, work)
    assert wrong not in str(err.value) and constants.HF_TOKEN_ENV in str(err.value)

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.clear_requests()
    run_model(cfg, work)
    assert manifest(work)["summary"]["source"]["revision"] == sha
    assert hf_files(work) == model_files
    assert hub.requests and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests)

    leaks = [p for root in (work, tmp_path / "hf_cache") for p in root.rglob("*")
             if p.is_file() and (TOKEN.encode() in p.read_bytes() or wrong.encode() in p.read_bytes())]
    assert leaks == []


# ---------------------------------------------------------------- 5. pickle weights


def test_pickle_only_repo_is_refused(hub, tmp_path, model_files):
    repo = "acme/pickle-only"
    hub.add_commit(repo, {"config.json": model_files["config.json"],
                          "tokenizer.json": model_files["tokenizer.json"],
                          "pytorch_model.bin": EXTRA["pytorch_model.bin"]})
    work = tmp_path / "work"
    with pytest.raises(InputError) as err:
        run_model(config_file(tmp_path, repo=repo), work)
    msg = str(err.value)
    assert "allow_pickle" in msg and "pytorch_model.bin" in msg and "safetensors" in msg
    assert not model_dir(work).exists()
    assert hub.downloaded_files() == []


def test_pickle_include_needs_allow_pickle(tmp_path):
    cfg = config_file(tmp_path, extra=", include: ['*.bin', 'config.json']")
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "allow_pickle" in str(err.value) and "*.bin" in str(err.value)
    ok = config_file(tmp_path, extra=", include: ['*.bin', 'config.json'], allow_pickle: true", name="ok.yaml")
    assert load_config(ok).config.model.source.allow_pickle is True


# ---------------------------------------------------------------- 6. not found


@pytest.mark.parametrize("repo,revision,expect", [
    ("acme/no-such-model", "main", "not found"),
    (REPO, "doesnotexist", "'doesnotexist'"),
    (REPO, "0123456789abcdef0123456789abcdef01234567", "'0123456789abcdef0123456789abcdef01234567'"),
], ids=["repo", "branch", "sha"])
def test_not_found(hub, tmp_path, model_files, repo, revision, expect):
    hub.add_commit(REPO, model_files)
    work = tmp_path / "work"
    with pytest.raises(InputError) as err:
        run_model(config_file(tmp_path, repo=repo, revision=revision), work)
    assert expect in str(err.value) and repo in str(err.value)
    assert not isinstance(err.value, IntegrityError)
    assert not model_dir(work).exists()
    assert hub.downloaded_files() == []


# ---------------------------------------------------------------- 7. offline


def test_offline_uses_the_cache(hub, tmp_path, model_files, monkeypatch):
    sha = hub.add_commit(REPO, model_files)
    other = hub.add_commit(REPO, {**model_files, WEIGHTS: flip_tail(model_files[WEIGHTS])}, refs=("other",))
    run_model(config_file(tmp_path), tmp_path / "w_online")  # revision main, online
    assert manifest(tmp_path / "w_online")["summary"]["source"]["revision"] == sha

    hub.stop()  # nothing listens on its port any more
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    run_model(config_file(tmp_path, revision=sha, name="pinned.yaml"), tmp_path / "w_pinned")
    m = manifest(tmp_path / "w_pinned")
    assert m["summary"]["source"]["revision"] == sha and m["summary"]["source"]["verified_against_hub"] is False
    assert hf_files(tmp_path / "w_pinned") == model_files

    # a branch resolves through the cache's refs/main, written by the online run
    ref = tmp_path / "hf_cache" / f"models--{REPO.replace('/', '--')}" / "refs" / "main"
    assert ref.read_text().strip() == sha
    run_model(config_file(tmp_path), tmp_path / "w_main")
    m = manifest(tmp_path / "w_main")
    assert m["summary"]["source"]["revision"] == sha and m["summary"]["source"]["verified_against_hub"] is False
    assert hf_files(tmp_path / "w_main") == model_files

    # what was never downloaded is an actionable error, not a network timeout
    with pytest.raises(InputError, match="revision 'other' cannot be resolved offline"):
        run_model(config_file(tmp_path, revision="other", name="x.yaml"), tmp_path / "w_other")
    with pytest.raises(InputError) as err:
        run_model(config_file(tmp_path, revision=other, name="y.yaml"), tmp_path / "w_other_sha")
    msg = str(err.value)
    assert "not in the local Hugging Face cache" in msg and constants.HF_OFFLINE_ENV in msg, msg
    assert "missing on the server" not in msg
    assert not model_dir(tmp_path / "w_other").exists() and not model_dir(tmp_path / "w_other_sha").exists()


# ---------------------------------------------------------------- 8. the real CLI


def test_invoke_download_subprocess(hub, tmp_path, model_files):
    sha = hub.add_commit(REPO, {**model_files, **EXTRA})
    cfg, work = config_file(tmp_path), tmp_path / "work"

    ok = run_invoke("download", "--config", str(cfg), "--work-root", str(work), env={"HF_ENDPOINT": hub.endpoint})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "model: done" in ok.stdout and "text: done" in ok.stdout, ok.stdout
    assert hf_files(work) == model_files
    assert (work / NAME / "text" / artifacts.CALIBRATION_TOKENS_FILE).is_file()
    assert sorted(hub.downloaded_files(REPO)) == sorted(model_files)

    bad = run_invoke("download", "--config", str(cfg), "--work-root", str(work),
                     "--set", "model.source.revision=doesnotexist", env={"HF_ENDPOINT": hub.endpoint})
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
    err = bad.stderr.strip()
    assert err.startswith("error: ") and "\n\n" not in err and err.count("error:") == 1, err
    assert "doesnotexist" in err and REPO in err
    assert manifest(work)["summary"]["source"]["revision"] == sha  # the good run's output is kept
