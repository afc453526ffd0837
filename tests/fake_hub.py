"""A local stand-in for the Hugging Face Hub HTTP API, for tests.

The real ``huggingface_hub`` client (``HfApi.model_info``, ``snapshot_download``,
``hf_hub_download``, ``HfApi.list_repo_tree``) runs against it unchanged: pass
``endpoint=hub.endpoint`` (or call :meth:`FakeHub.install_as_default`).

Standard library only.  The server binds 127.0.0.1 on a free port and serves from a
background thread.  What it implements, as the 0.36.x client uses it:

* ``GET /api/models/{repo_id}`` and ``GET /api/models/{repo_id}/revision/{rev}`` --
  model info JSON (``sha``, ``siblings`` ...).  ``?blobs=True`` (``files_metadata=True``)
  adds ``size``/``blobId``/``lfs`` to each sibling; ``?securityStatus=True`` adds
  ``securityRepoStatus``; ``?expand=...`` restricts the keys returned.
* ``GET /api/models/{repo_id}/tree/{rev}[/{path}]`` -- ``list_repo_tree`` entries
  (``?recursive=True``), in one page.
* ``HEAD``/``GET /{repo_id}/resolve/{rev}/{filename}`` -- file metadata and content,
  with ``X-Repo-Commit``, ``ETag``, ``Content-Length`` and, for LFS files,
  ``X-Linked-Etag``/``X-Linked-Size``.  ``GET`` honours a single ``Range`` header
  (``bytes=N-``, ``bytes=N-M``, ``bytes=-K``) with ``206``/``Content-Range``.

Revisions are branch names (any ref given to :meth:`FakeHub.add_commit`, slashes
allowed, percent-encoded or not) or full 40-hex commit shas.

Errors carry the ``X-Error-Code`` header that ``huggingface_hub.utils.hf_raise_for_status``
maps to its exception classes:

* unknown repo -> 404 ``RepoNotFound`` -> ``RepositoryNotFoundError``
  (NB: the code the client matches is ``RepoNotFound``, not ``RepositoryNotFound``)
* unknown revision -> 404 ``RevisionNotFound`` -> ``RevisionNotFoundError``
* missing file/path -> 404 ``EntryNotFound`` (+ ``X-Repo-Commit``) -> ``EntryNotFoundError``
* protected repo, no token -> 401 ``RepoNotFound`` (private) -> ``RepositoryNotFoundError``,
  or 401 ``GatedRepo`` (gated) -> ``GatedRepoError`` (a subclass of ``RepositoryNotFoundError``)
* protected repo, wrong token -> 404 ``RepoNotFound`` (private) or 403 ``GatedRepo`` (gated),
  as the Hub answers a valid account that lacks access.

The client only infers ``RepositoryNotFoundError`` from a *bare* 401 for ``https://`` URLs,
so the explicit error code matters here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import socket
import socketserver
import threading
import traceback
from collections import namedtuple
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterable, List, Mapping, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeHub", "RecordedRequest", "FileRequest", "LFS_SUFFIXES"]

#: File name endings stored as LFS files (everything else is a regular git blob).
LFS_SUFFIXES: Tuple[str, ...] = (".safetensors", ".bin", ".pt", ".gguf", ".pth", ".msgpack", ".h5")

#: One request the server received: method, raw request target (path + query string, as
#: sent), and the headers with lower-cased names.
RecordedRequest = namedtuple("RecordedRequest", ["method", "path", "headers"])

#: One ``/resolve/`` request after routing: method, repo id, revision as requested (branch
#: or sha, decoded) and file name (decoded).
FileRequest = namedtuple("FileRequest", ["method", "repo_id", "revision", "filename"])

_SHA1_HEX = re.compile(r"^[0-9a-f]{40}$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_EPOCH = _dt.datetime(2024, 1, 1, tzinfo=_dt.timezone.utc)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _timestamp(index: int) -> str:
    when = _EPOCH + _dt.timedelta(minutes=index)
    return when.strftime("%Y-%m-%dT%H:%M:%S.000Z")


@dataclass(frozen=True)
class _File:
    path: str
    data: bytes
    is_lfs: bool
    sha256: str
    blob_id: str  # git oid: of the content, or of the LFS pointer for LFS files
    pointer_size: Optional[int]

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def etag(self) -> str:
        return self.sha256 if self.is_lfs else self.blob_id

    @classmethod
    def build(cls, path: str, data: bytes) -> "_File":
        sha256 = hashlib.sha256(data).hexdigest()
        if path.lower().endswith(LFS_SUFFIXES):
            pointer = _lfs_pointer(sha256, len(data))
            return cls(path, data, True, sha256, _git_blob_sha1(pointer), len(pointer))
        return cls(path, data, False, sha256, _git_blob_sha1(data), None)


@dataclass
class _Commit:
    sha: str
    files: Dict[str, _File]
    last_modified: str


@dataclass
class _Repo:
    repo_id: str
    created_at: str
    commits: Dict[str, _Commit] = field(default_factory=dict)
    refs: Dict[str, str] = field(default_factory=dict)
    token: Optional[str] = None
    gated: bool = False


@dataclass
class _Response:
    status: int
    headers: List[Tuple[str, str]]
    body: bytes = b""
    # Content-Length to advertise on HEAD (the body itself is never sent for HEAD).
    head_length: Optional[int] = None


class _RouteError(Exception):
    def __init__(self, response: _Response):
        super().__init__(response.status)
        self.response = response


def _error(status: int, code: Optional[str], message: str, extra: Iterable[Tuple[str, str]] = ()) -> _RouteError:
    headers = [("Content-Type", "application/json; charset=utf-8"), ("X-Error-Message", message)]
    if code is not None:
        headers.append(("X-Error-Code", code))
    headers.extend(extra)
    return _RouteError(_Response(status, headers, json.dumps({"error": message}).encode()))


def _json(obj, status: int = 200) -> _Response:
    return _Response(status, [("Content-Type", "application/json; charset=utf-8")], json.dumps(obj).encode())


def _truthy(values: Optional[List[str]]) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: "FakeHub"

    def server_bind(self):
        # Skip HTTPServer.server_bind's getfqdn() (a reverse DNS lookup).
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = host, port


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"
    timeout = 30  # idle keep-alive connections are dropped after this many seconds
    server: _Server

    def setup(self):
        super().setup()
        self.server.hub._track(self.connection, add=True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.hub._track(self.connection, add=False)

    def log_message(self, format, *args):  # noqa: A002 - keep test output quiet
        pass

    def do_GET(self):
        self._serve("GET")

    def do_HEAD(self):
        self._serve("HEAD")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def do_PATCH(self):
        self._serve("PATCH")

    def do_DELETE(self):
        self._serve("DELETE")

    def _serve(self, method: str):
        hub = self.server.hub
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)  # drain any body so keep-alive stays in sync
        headers = {k.lower(): v for k, v in self.headers.items()}
        hub._record(RecordedRequest(method, self.path, headers))
        try:
            response = hub._route(method, self.path, headers)
        except _RouteError as exc:
            response = exc.response
        except Exception as exc:  # a bug in the fake: report it, and keep serving
            hub._record_error(exc)
            response = _error(500, None, f"FakeHub internal error: {exc!r}").response
        self._send(response, head=(method == "HEAD"))

    def _send(self, response: _Response, head: bool):
        self.send_response(response.status)
        for name, value in response.headers:
            self.send_header(name, value)
        if head and response.head_length is not None:
            self.send_header("Content-Length", str(response.head_length))
        else:
            self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if not head and response.body:
            self.wfile.write(response.body)


class FakeHub:
    """In-process fake of the Hugging Face Hub HTTP API on ``http://127.0.0.1:<port>``.

    The server starts when the object is created; use it as a context manager or call
    :meth:`stop`.  All methods are thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._repos: Dict[str, _Repo] = {}
        self._corrupt: Dict[Tuple[str, str, str], bytes] = {}
        self._requests: List[RecordedRequest] = []
        self._file_requests: List[FileRequest] = []
        self._errors: List[str] = []
        self._conns: set = set()
        self._clock = 0
        self._stopped = False
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="FakeHub", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """Base URL to pass as ``endpoint=`` / ``HF_ENDPOINT``: ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self._port}"

    def stop(self) -> None:
        """Shut the server down, drop open connections and join the serving thread (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.shutdown()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> "FakeHub":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ------------------------------------------------------------------ repo set-up

    def add_commit(self, repo_id: str, files: Mapping[str, bytes], refs: Iterable[str] = ("main",)) -> str:
        """Register a commit holding exactly ``files`` and point each ref (branch) at it.

        Returns the commit sha: 40 hex digits derived from ``repo_id`` and the files
        (names and contents), so the same call gives the same sha.  Files ending in one of
        :data:`LFS_SUFFIXES` are LFS files.  ``refs`` may be a single string.
        """
        self._check_repo_id(repo_id)
        if isinstance(refs, str):
            refs = (refs,)
        refs = list(refs)
        built: Dict[str, _File] = {}
        for path, data in files.items():
            if not isinstance(path, str) or not path or path.startswith("/") or path.endswith("/"):
                raise ValueError(f"invalid file name {path!r}")
            if any(part in ("", ".", "..") for part in path.split("/")):
                raise ValueError(f"invalid file name {path!r}")
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"content of {path!r} must be bytes, not {type(data).__name__}")
            built[path] = _File.build(path, bytes(data))
        for ref in refs:
            if not ref or _SHA1_HEX.match(ref):
                raise ValueError(f"invalid ref name {ref!r}")
        digest = hashlib.sha1(b"fake-hub commit\0" + repo_id.encode() + b"\0")
        for path in sorted(built):
            digest.update(path.encode() + b"\0" + built[path].sha256.encode() + b"\0")
        sha = digest.hexdigest()
        with self._lock:
            repo = self._ensure_repo(repo_id)
            if sha not in repo.commits:
                self._clock += 1
                repo.commits[sha] = _Commit(sha, built, _timestamp(self._clock))
            for ref in refs:
                repo.refs[ref] = sha
        return sha

    def set_ref(self, repo_id: str, ref: str, revision: str) -> str:
        """Point branch ``ref`` at ``revision`` (a sha or another ref); returns the sha."""
        with self._lock:
            repo = self._get_repo(repo_id)
            sha = self._resolve_or_raise(repo, revision)
            repo.refs[ref] = sha
            return sha

    def corrupt(self, repo_id: str, revision_sha: str, filename: str, data: bytes) -> None:
        """From now on serve ``data`` as the content of ``filename`` at that commit.

        Every piece of metadata (sizes, sha256, blob id, ETag, X-Linked-*) still describes
        the original content; only the bytes of a GET change.  ``revision_sha`` may also be
        a ref, resolved now.
        """
        with self._lock:
            repo = self._get_repo(repo_id)
            sha = self._resolve_or_raise(repo, revision_sha)
            if filename not in repo.commits[sha].files:
                raise KeyError(f"{filename!r} is not in {repo_id}@{sha}")
            self._corrupt[(repo_id, sha, filename)] = bytes(data)

    def require_token(self, repo_id: str, token: Optional[str], gated: bool = False) -> None:
        """Protect the repo: requests need ``Authorization: Bearer <token>``.

        ``gated=False`` makes it private (401 ``RepoNotFound`` without a token, 404 with a
        wrong one); ``gated=True`` makes it gated (401 / 403 ``GatedRepo``).
        ``token=None`` makes the repo public again.  The repo is created if unknown.
        """
        self._check_repo_id(repo_id)
        with self._lock:
            repo = self._ensure_repo(repo_id)
            repo.token = token
            repo.gated = bool(gated) and token is not None

    # ------------------------------------------------------------------ observation

    @property
    def requests(self) -> List[RecordedRequest]:
        """Snapshot of every request received so far: ``(method, path, headers)`` tuples.

        ``path`` is the raw request target (percent-encoding and query string as sent);
        header names are lower-cased (``headers["authorization"]``).
        """
        with self._lock:
            return list(self._requests)

    @property
    def file_requests(self) -> List[FileRequest]:
        """Snapshot of the ``/resolve/`` requests, decoded: ``(method, repo_id, revision, filename)``."""
        with self._lock:
            return list(self._file_requests)

    def downloaded_files(self, repo_id: Optional[str] = None) -> List[str]:
        """File names fetched with GET on ``/resolve/`` (in order, repeats kept)."""
        return [
            r.filename for r in self.file_requests if r.method == "GET" and (repo_id is None or r.repo_id == repo_id)
        ]

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()
            self._file_requests.clear()

    @property
    def errors(self) -> List[str]:
        """Tracebacks of unexpected exceptions inside the fake (served as 500s); should stay empty."""
        with self._lock:
            return list(self._errors)

    # ------------------------------------------------------------------ client wiring

    def install_as_default(self, monkeypatch) -> None:
        """Make huggingface_hub use this hub when no ``endpoint=`` is passed (pytest ``monkeypatch``).

        Setting ``HF_ENDPOINT`` after ``huggingface_hub`` is imported is not enough: the
        library freezes it at import in ``constants.ENDPOINT``, in
        ``file_download.HUGGINGFACE_CO_URL_TEMPLATE`` and in the module-level ``HfApi``
        behind ``huggingface_hub.model_info`` & co.  This patches all of them (and sets the
        env var for subprocesses).
        """
        import importlib

        constants = importlib.import_module("huggingface_hub.constants")
        file_download = importlib.import_module("huggingface_hub.file_download")
        hf_api = importlib.import_module("huggingface_hub.hf_api")
        template = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setenv("HF_ENDPOINT", self.endpoint)
        monkeypatch.setattr(constants, "ENDPOINT", self.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(hf_api.api, "endpoint", self.endpoint)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_repo_id(repo_id: str) -> None:
        parts = repo_id.split("/") if isinstance(repo_id, str) else []
        if not 1 <= len(parts) <= 2 or not all(parts) or any(p in (".", "..") for p in parts):
            raise ValueError(f"invalid repo id {repo_id!r}")

    def _ensure_repo(self, repo_id: str) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            self._clock += 1
            repo = self._repos[repo_id] = _Repo(repo_id, _timestamp(self._clock))
        return repo

    def _get_repo(self, repo_id: str) -> _Repo:
        try:
            return self._repos[repo_id]
        except KeyError:
            raise KeyError(f"unknown repo {repo_id!r}") from None

    @staticmethod
    def _resolve(repo: _Repo, revision: str) -> Optional[str]:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in repo.commits:
            return revision
        return None

    def _resolve_or_raise(self, repo: _Repo, revision: str) -> str:
        sha = self._resolve(repo, revision)
        if sha is None:
            raise KeyError(f"unknown revision {revision!r} of {repo.repo_id}")
        return sha

    def _track(self, conn, add: bool) -> None:
        with self._lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))

    # --- routing

    def _route(self, method: str, target: str, headers: Dict[str, str]) -> _Response:
        split = urlsplit(target)
        query = parse_qs(split.query, keep_blank_values=True)
        segs = split.path.split("/")[1:]  # still percent-encoded: %2F inside a segment stays put
        if len(segs) >= 3 and segs[0] == "api" and segs[1] == "models":
            if method != "GET":
                raise _error(405, None, f"{method} not supported by FakeHub")
            return self._route_api(segs[2:], query, headers)
        if "resolve" in segs[1:3]:
            if method not in ("GET", "HEAD"):
                raise _error(405, None, f"{method} not supported by FakeHub")
            return self._route_resolve(method, segs, headers)
        raise _error(404, None, f"FakeHub does not implement {method} {split.path}")

    def _route_api(self, rest: List[str], query, headers) -> _Response:
        for i in (2, 1):
            if len(rest) > i + 1 and rest[i] in ("revision", "tree"):
                repo_id = "/".join(unquote(s) for s in rest[:i])
                action, tail = rest[i], rest[i + 1 :]
                break
        else:
            if len(rest) > 2:
                raise _error(404, None, "FakeHub does not implement this API route")
            repo_id, action, tail = "/".join(unquote(s) for s in rest), "revision", []
        with self._lock:
            repo = self._authorize(repo_id, headers)
            if action == "revision":
                revision = unquote("/".join(tail)) if tail else ("main" if "main" in repo.refs else "")
                sha = self._sha_or_404(repo, revision)
                return _json(self._model_info(repo, sha, query))
            # tree/{revision}[/{path}]: the client encodes both with safe="", so the revision
            # is one segment; an unencoded slashed branch name is matched greedily.
            revision, path = self._split_revision(repo, tail)
            sha = self._sha_or_404(repo, revision)
            return _json(self._tree(repo, sha, path, _truthy(query.get("recursive"))))

    def _route_resolve(self, method: str, segs: List[str], headers) -> _Response:
        candidates = [i for i in (2, 1) if len(segs) >= i + 3 and segs[i] == "resolve"]
        if not candidates:
            raise _error(404, None, "malformed resolve URL")
        with self._lock:
            chosen = candidates[0]
            for i in candidates:
                if "/".join(unquote(s) for s in segs[:i]) in self._repos:
                    chosen = i
                    break
            repo_id = "/".join(unquote(s) for s in segs[:chosen])
            revision, filename = self._split_revision(self._repos.get(repo_id), segs[chosen + 1 :])
            self._file_requests.append(FileRequest(method, repo_id, revision, filename))
            repo = self._authorize(repo_id, headers)
            sha = self._sha_or_404(repo, revision)
            entry = repo.commits[sha].files.get(filename)
            if entry is None:
                raise _error(404, "EntryNotFound", "Entry not found", [("X-Repo-Commit", sha)])
            served = self._corrupt.get((repo_id, sha, filename), entry.data)
        return self._file_response(method, sha, entry, served, headers.get("range"))

    def _split_revision(self, repo: Optional[_Repo], parts: List[str]) -> Tuple[str, str]:
        """Split ``[rev, *path]`` segments; tolerate a branch name sent with raw slashes."""
        if not parts:
            return "", ""
        if repo is not None and self._resolve(repo, unquote(parts[0])) is None:
            for k in range(2, len(parts) + 1):
                candidate = unquote("/".join(parts[:k]))
                if candidate in repo.refs:
                    return candidate, unquote("/".join(parts[k:]))
        return unquote(parts[0]), unquote("/".join(parts[1:]))

    def _authorize(self, repo_id: str, headers: Dict[str, str]) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _error(404, "RepoNotFound", "Repository not found")
        if repo.token is None:
            return repo
        auth = headers.get("authorization", "")
        scheme, _, presented = auth.partition(" ")
        if scheme.lower() == "bearer" and presented.strip() == repo.token:
            return repo
        if repo.gated:
            if not auth:
                raise _error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be"
                    " authenticated to access it. Please log in.",
                )
            raise _error(
                403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized list.",
            )
        if not auth:
            raise _error(401, "RepoNotFound", "Repository not found")
        raise _error(404, "RepoNotFound", "Repository not found")

    def _sha_or_404(self, repo: _Repo, revision: str) -> str:
        sha = self._resolve(repo, revision)
        if sha is None:
            raise _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    # --- payloads

    def _model_info(self, repo: _Repo, sha: str, query) -> dict:
        commit = repo.commits[sha]
        with_blobs = _truthy(query.get("blobs"))
        siblings = []
        for path in sorted(commit.files):
            entry = commit.files[path]
            sibling: dict = {"rfilename": path}
            if with_blobs:
                sibling["blobId"] = entry.blob_id
                sibling["size"] = entry.size
                if entry.is_lfs:
                    sibling["lfs"] = {"sha256": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
            siblings.append(sibling)
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
            "sha": sha,
            "lastModified": commit.last_modified,
            "createdAt": repo.created_at,
            "private": repo.token is not None and not repo.gated,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(f.size for f in commit.files.values()),
        }
        if _truthy(query.get("securityStatus")):
            info["securityRepoStatus"] = {"scansDone": True, "filesWithIssues": []}
        expand = query.get("expand")
        if expand:
            keep = set(expand) | {"_id", "id"}
            info = {k: v for k, v in info.items() if k in keep}
        return info

    def _tree(self, repo: _Repo, sha: str, path: str, recursive: bool) -> list:
        files = repo.commits[sha].files
        prefix = path.strip("/")
        if prefix and prefix in files:
            raise _error(400, None, f"{prefix} is a file, not a directory")
        base = prefix + "/" if prefix else ""
        entries: Dict[str, dict] = {}
        for name in sorted(files):
            if not name.startswith(base):
                continue
            parts = name[len(base) :].split("/")
            # every directory between base and the file (only the first one when not recursive)
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                dir_path = base + "/".join(parts[:depth])
                entries.setdefault(
                    dir_path,
                    {
                        "type": "directory",
                        "oid": hashlib.sha1(f"tree\0{sha}\0{dir_path}".encode()).hexdigest(),
                        "size": 0,
                        "path": dir_path,
                    },
                )
            if recursive or len(parts) == 1:
                entry = files[name]
                item = {"type": "file", "oid": entry.blob_id, "size": entry.size, "path": name}
                if entry.is_lfs:
                    item["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
                entries[name] = item
        if prefix and not entries:
            raise _error(404, "EntryNotFound", f"{prefix} does not exist on {sha}", [("X-Repo-Commit", sha)])
        return sorted(entries.values(), key=lambda e: (e["type"] != "directory", e["path"]))

    @staticmethod
    def _file_response(method: str, sha: str, entry: _File, served: bytes, range_header: Optional[str]) -> _Response:
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("Accept-Ranges", "bytes"),
            ("X-Repo-Commit", sha),
            ("ETag", f'"{entry.etag}"'),
        ]
        if entry.is_lfs:
            headers += [("X-Linked-Etag", f'"{entry.sha256}"'), ("X-Linked-Size", str(entry.size))]
        # HEAD advertises the original size; a GET must send the length of what it sends.
        if method == "HEAD":
            return _Response(200, headers, b"", head_length=entry.size)
        match = _RANGE.match(range_header.strip()) if range_header else None
        if match is None:
            return _Response(200, headers, served)
        total = len(served)
        first, last = match.groups()
        if first:
            start = int(first)
            end = min(int(last), total - 1) if last else total - 1
            if last and int(last) < start:
                return _Response(200, headers, served)  # syntactically invalid: ignore the Range
        elif last:
            start, end = max(total - int(last), 0), total - 1
        else:
            return _Response(200, headers, served)
        if start >= total or end < start:
            err = _error(416, None, "Requested range not satisfiable", [("Content-Range", f"bytes */{total}")])
            return err.response
        headers.append(("Content-Range", f"bytes {start}-{end}/{total}"))
        return _Response(206, headers, served[start : end + 1])
