"""The fake Hub (tests/fake_hub.py) driven by the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
import requests
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder
from huggingface_hub.utils import reset_sessions

pytestmark = pytest.mark.unit  # `invoke test --unit`: no model run, no server start

try:  # tests/ may or may not become a package
    from tests.fake_hub import FakeHub
except ImportError:  # pragma: no cover - depends on how pytest puts tests/ on sys.path
    from fake_hub import FakeHub

REPO = "acme/tiny-model"
CONFIG = b'{"model_type": "llama", "hidden_size": 8}\n'
TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE"}}\n'
WEIGHTS = bytes(range(256)) * 40  # 10 KiB, LFS
BIN = b"\x80\x02pickle-ish" * 10  # LFS, usually filtered out
README = b"# tiny\n"
FILES = {
    "config.json": CONFIG,
    "tokenizer.json": TOKENIZER,
    "model.safetensors": WEIGHTS,
    "pytorch_model.bin": BIN,
    "README.md": README,
    "extra/notes.txt": b"notes\n",
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def files_under(folder: str) -> dict:
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(autouse=True)
def _client_env(monkeypatch):
    # Make the client talk to 127.0.0.1 directly even if the environment says otherwise.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    if constants.HF_HUB_OFFLINE:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        reset_sessions()
    yield
    reset_sessions()


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h
        assert h.errors == []


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.endpoint, token=False)


def test_binds_loopback_and_stops(tmp_path):
    hub = FakeHub()
    assert hub.endpoint.startswith("http://127.0.0.1:")
    port = int(hub.endpoint.rsplit(":", 1)[1])
    hub.add_commit(REPO, {"a.txt": b"a"})
    # a pooled keep-alive connection must not keep stop() waiting
    session = requests.Session()
    assert session.get(f"{hub.endpoint}/{REPO}/resolve/main/a.txt").content == b"a"
    hub.stop()
    hub.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    session.close()


def test_model_info_sha_and_lfs_metadata(hub, api):
    sha = hub.add_commit(REPO, FILES)
    assert len(sha) == 40 and int(sha, 16) >= 0
    assert hub.add_commit(REPO, FILES) == sha  # deterministic

    info = api.model_info(REPO, files_metadata=True)
    assert info.id == REPO and info.sha == sha
    assert info.private is False and info.gated is False
    assert info.last_modified is not None
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == set(FILES)
    lfs = siblings["model.safetensors"].lfs
    assert lfs is not None and lfs.sha256 == sha256(WEIGHTS) and lfs.size == len(WEIGHTS)
    assert lfs.pointer_size > 0
    assert siblings["pytorch_model.bin"].lfs.sha256 == sha256(BIN)
    assert siblings["config.json"].lfs is None
    assert siblings["config.json"].size == len(CONFIG)
    assert siblings["config.json"].blob_id == git_sha1(CONFIG)

    # without files_metadata the Hub lists names only
    plain = api.model_info(REPO, revision="main")
    assert plain.sha == sha and all(s.size is None and s.lfs is None for s in plain.siblings)

    paths = [r.path for r in hub.requests]
    assert paths[0] == f"/api/models/{REPO}?blobs=True"
    assert paths[1] == f"/api/models/{REPO}/revision/main"


def test_snapshot_download_allow_patterns(hub, tmp_path):
    sha = hub.add_commit(REPO, FILES)
    folder = snapshot_download(
        REPO,
        allow_patterns=["*.json", "*.safetensors"],
        cache_dir=tmp_path,
        endpoint=hub.endpoint,
        token=False,
    )
    assert Path(folder).name == sha
    wanted = {k: v for k, v in FILES.items() if k.endswith((".json", ".safetensors"))}
    assert files_under(folder) == wanted
    assert sorted(hub.downloaded_files()) == sorted(wanted)
    # every resolve call pinned the commit sha obtained from the API call
    assert {r.revision for r in hub.file_requests} == {sha}
    assert (tmp_path / "models--acme--tiny-model" / "refs" / "main").read_text() == sha
    # LFS blobs are stored under their sha256, git files under their blob sha1
    blobs = {p.name for p in (tmp_path / "models--acme--tiny-model" / "blobs").iterdir()}
    assert sha256(WEIGHTS) in blobs and git_sha1(CONFIG) in blobs


def test_hf_hub_download_subfolder_and_local_dir(hub, tmp_path):
    hub.add_commit(REPO, FILES)
    path = hf_hub_download(
        REPO, "notes.txt", subfolder="extra", cache_dir=tmp_path / "c", endpoint=hub.endpoint, token=False
    )
    assert Path(path).read_bytes() == b"notes\n"
    local = snapshot_download(
        REPO, local_dir=tmp_path / "local", cache_dir=tmp_path / "c", endpoint=hub.endpoint, token=False
    )
    assert {k: v for k, v in files_under(local).items() if not k.startswith(".cache/")} == FILES


def test_pinned_old_sha_after_main_moves(hub, api, tmp_path):
    old = hub.add_commit(REPO, {"config.json": b'{"v": 1}', "model.safetensors": b"old-weights"})
    new = hub.add_commit(REPO, {"config.json": b'{"v": 2}', "model.safetensors": b"new-weights!"})
    assert old != new
    assert api.model_info(REPO).sha == new
    assert api.model_info(REPO, revision=old).sha == old

    old_dir = snapshot_download(REPO, revision=old, cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    new_dir = snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    assert files_under(old_dir) == {"config.json": b'{"v": 1}', "model.safetensors": b"old-weights"}
    assert files_under(new_dir) == {"config.json": b'{"v": 2}', "model.safetensors": b"new-weights!"}
    one = hf_hub_download(REPO, "config.json", revision=old, cache_dir=tmp_path / "x", endpoint=hub.endpoint,
                          token=False)
    assert Path(one).read_bytes() == b'{"v": 1}'

    # a cached pinned sha is served by the client without touching /resolve/ again
    hub.clear_requests()
    snapshot_download(REPO, revision=old, cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    assert hub.file_requests == []

    # refs can be moved back explicitly, and other branches exist independently
    hub.set_ref(REPO, "main", old)
    assert api.model_info(REPO).sha == old


def test_corrupted_lfs_file_is_not_caught_by_the_client(hub, api, tmp_path):
    sha = hub.add_commit(REPO, FILES)
    bad = bytes(b ^ 0xFF for b in WEIGHTS)  # same size, different bytes
    hub.corrupt(REPO, sha, "model.safetensors", bad)

    info = api.model_info(REPO, revision=sha, files_metadata=True)
    expected = {s.rfilename: s for s in info.siblings}["model.safetensors"].lfs
    assert expected.sha256 == sha256(WEIGHTS)  # metadata still advertises the original

    folder = snapshot_download(
        REPO, allow_patterns="*.safetensors", cache_dir=tmp_path, endpoint=hub.endpoint, token=False
    )
    got = (Path(folder) / "model.safetensors").read_bytes()
    assert got == bad and len(got) == expected.size
    assert sha256(got) != expected.sha256  # only the caller's own sha256 check can notice
    # the client even filed it under the advertised sha256
    assert (tmp_path / "models--acme--tiny-model" / "blobs" / expected.sha256).read_bytes() == bad

    # the HEAD metadata is untouched too
    head = requests.head(f"{hub.endpoint}/{REPO}/resolve/{sha}/model.safetensors")
    assert head.headers["X-Linked-Etag"] == f'"{sha256(WEIGHTS)}"'
    assert head.headers["X-Linked-Size"] == str(len(WEIGHTS))


def test_corrupted_file_of_another_size_fails_the_size_check(hub, tmp_path):
    sha = hub.add_commit(REPO, {"model.safetensors": WEIGHTS})
    hub.corrupt(REPO, sha, "model.safetensors", WEIGHTS[:-10])
    with pytest.raises(EnvironmentError, match="Consistency check failed"):
        hf_hub_download(REPO, "model.safetensors", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)


def test_private_repo_needs_token(hub, tmp_path):
    hub.add_commit(REPO, FILES)
    hub.require_token(REPO, "hf_secret")
    anon = HfApi(endpoint=hub.endpoint, token=False)

    with pytest.raises(RepositoryNotFoundError) as excinfo:
        anon.model_info(REPO)
    assert excinfo.value.response.status_code == 401
    assert not isinstance(excinfo.value, GatedRepoError)
    with pytest.raises(RepositoryNotFoundError) as excinfo:
        snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    assert excinfo.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(REPO, "config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    with pytest.raises(RepositoryNotFoundError) as excinfo:  # a wrong token: 404, like the Hub
        HfApi(endpoint=hub.endpoint, token="hf_wrong").model_info(REPO)
    assert excinfo.value.response.status_code == 404
    assert all("authorization" not in r.headers for r in hub.requests[:-1])

    hub.clear_requests()
    info = HfApi(endpoint=hub.endpoint, token="hf_secret").model_info(REPO)
    assert info.private is True
    folder = snapshot_download(
        REPO, allow_patterns="config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token="hf_secret"
    )
    assert files_under(folder) == {"config.json": CONFIG}
    assert hub.requests and all(r.headers["authorization"] == "Bearer hf_secret" for r in hub.requests)


def test_gated_repo(hub, tmp_path):
    hub.add_commit(REPO, FILES)
    hub.require_token(REPO, "hf_ok", gated=True)
    with pytest.raises(GatedRepoError) as excinfo:
        hf_hub_download(REPO, "config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    assert excinfo.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as excinfo:
        snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.endpoint, token="hf_nope")
    assert excinfo.value.response.status_code == 403
    path = hf_hub_download(REPO, "config.json", cache_dir=tmp_path, endpoint=hub.endpoint, token="hf_ok")
    assert Path(path).read_bytes() == CONFIG
    assert HfApi(endpoint=hub.endpoint, token="hf_ok").model_info(REPO).gated == "manual"


def test_not_found_errors(hub, api, tmp_path):
    sha = hub.add_commit(REPO, FILES)
    kw = dict(cache_dir=tmp_path, endpoint=hub.endpoint, token=False)

    for call in (
        lambda: api.model_info("acme/missing"),
        lambda: snapshot_download("acme/missing", **kw),
        lambda: hf_hub_download("acme/missing", "config.json", **kw),
    ):
        with pytest.raises(RepositoryNotFoundError) as excinfo:
            call()
        assert excinfo.value.response.status_code == 404
        assert excinfo.value.response.headers["X-Error-Code"] == "RepoNotFound"

    for call in (
        lambda: api.model_info(REPO, revision="no-such-branch"),
        lambda: api.model_info(REPO, revision="f" * 40),
        lambda: snapshot_download(REPO, revision="no-such-branch", **kw),
        lambda: hf_hub_download(REPO, "config.json", revision="0" * 40, **kw),
    ):
        with pytest.raises(RevisionNotFoundError):
            call()

    with pytest.raises(EntryNotFoundError) as excinfo:
        hf_hub_download(REPO, "missing.json", **kw)
    assert not isinstance(excinfo.value, RepositoryNotFoundError)
    # the client caches the non-existence under the commit from X-Repo-Commit
    assert (tmp_path / "models--acme--tiny-model" / ".no_exist" / sha / "missing.json").exists()


def test_branch_with_slash_and_bare_repo_name(hub, api, tmp_path):
    sha = hub.add_commit("gpt2", {"config.json": b"{}"}, refs=["main", "refs/pr/1", "feature/x"])
    assert api.model_info("gpt2", revision="refs/pr/1").sha == sha
    folder = snapshot_download("gpt2", revision="feature/x", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    assert files_under(folder) == {"config.json": b"{}"}
    assert any(r.path == "/api/models/gpt2/revision/feature%2Fx" for r in hub.requests)
    url = f"{hub.endpoint}/gpt2/resolve/refs%2Fpr%2F1/config.json"
    head = requests.head(url)
    assert head.status_code == 200 and head.headers["X-Repo-Commit"] == sha
    assert requests.get(f"{hub.endpoint}/gpt2/resolve/feature/x/config.json").content == b"{}"


def test_resolve_headers_and_ranges(hub):
    sha = hub.add_commit(REPO, FILES)
    base = f"{hub.endpoint}/{REPO}/resolve/main"

    head = requests.head(f"{base}/config.json")
    assert head.status_code == 200
    assert head.headers["X-Repo-Commit"] == sha
    assert head.headers["ETag"] == f'"{git_sha1(CONFIG)}"'
    assert head.headers["Content-Length"] == str(len(CONFIG))
    assert "X-Linked-Etag" not in head.headers

    head = requests.head(f"{base}/model.safetensors")
    assert head.headers["ETag"] == f'"{sha256(WEIGHTS)}"'

    r = requests.get(f"{base}/model.safetensors", headers={"Range": "bytes=100-"})
    assert r.status_code == 206 and r.content == WEIGHTS[100:]
    assert r.headers["Content-Range"] == f"bytes 100-{len(WEIGHTS) - 1}/{len(WEIGHTS)}"
    r = requests.get(f"{base}/model.safetensors", headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == WEIGHTS[10:20]
    r = requests.get(f"{base}/model.safetensors", headers={"Range": "bytes=-5"})
    assert r.status_code == 206 and r.content == WEIGHTS[-5:]
    r = requests.get(f"{base}/model.safetensors", headers={"Range": f"bytes={len(WEIGHTS)}-"})
    assert r.status_code == 416

    r = requests.get(f"{base}/missing.bin")
    assert r.status_code == 404 and r.headers["X-Error-Code"] == "EntryNotFound"
    assert r.headers["X-Repo-Commit"] == sha


def test_client_resumes_an_incomplete_download(hub, tmp_path):
    hub.add_commit(REPO, {"model.safetensors": WEIGHTS})
    blobs = tmp_path / "models--acme--tiny-model" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha256(WEIGHTS)}.incomplete").write_bytes(WEIGHTS[:1000])

    path = hf_hub_download(REPO, "model.safetensors", cache_dir=tmp_path, endpoint=hub.endpoint, token=False)
    assert Path(path).read_bytes() == WEIGHTS
    gets = [r for r in hub.requests if r.method == "GET"]
    assert len(gets) == 1 and gets[0].headers["range"] == "bytes=1000-"


def test_list_repo_tree(hub, api):
    sha = hub.add_commit(REPO, {"a.json": b"{}", "sub/b.bin": b"bb", "sub/deep/c.txt": b"c"})
    flat = list(api.list_repo_tree(REPO))
    assert [(type(e), e.path) for e in flat] == [(RepoFolder, "sub"), (RepoFile, "a.json")]
    deep = {e.path: e for e in api.list_repo_tree(REPO, recursive=True, revision=sha)}
    assert set(deep) == {"sub", "sub/deep", "a.json", "sub/b.bin", "sub/deep/c.txt"}
    assert deep["sub/b.bin"].lfs.sha256 == sha256(b"bb")
    assert deep["a.json"].blob_id == git_sha1(b"{}") and deep["a.json"].lfs is None
    assert [e.path for e in api.list_repo_tree(REPO, path_in_repo="sub")] == ["sub/deep", "sub/b.bin"]
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="nope"))


def test_install_as_default(hub, tmp_path, monkeypatch):
    sha = hub.add_commit(REPO, FILES)
    hub.install_as_default(monkeypatch)
    import huggingface_hub

    assert os.environ["HF_ENDPOINT"] == hub.endpoint
    assert huggingface_hub.model_info(REPO, token=False).sha == sha
    assert HfApi(token=False).model_info(REPO).sha == sha
    path = hf_hub_download(REPO, "config.json", cache_dir=tmp_path, token=False)
    assert Path(path).read_bytes() == CONFIG
    folder = snapshot_download(REPO, allow_patterns="*.md", cache_dir=tmp_path / "snap", token=False)
    assert files_under(folder) == {"README.md": README}
