"""Content hashes and atomic writes: the two things every stage's bookkeeping rests on."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

_CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def hash_json(obj: Any) -> str:
    return sha256_bytes(canonical_json(obj).encode())


def digest_of_files(files: dict[str, str]) -> str:
    """One digest for a set of {relative path: sha256}: changes when any name or content changes."""
    return sha256_bytes("".join(f"{name}\0{sha}\n" for name, sha in sorted(files.items())).encode())


def list_files(root: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Relative POSIX paths of all regular files under root, sorted; symlinks are not followed."""
    skip = set(exclude)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel not in skip:
                out.append(rel)
    return sorted(out)


class HashCache:
    """sha256 of large files keyed by (path, size, mtime_ns, inode), so an unchanged 10 GB input is not
    re-read on every run. A file whose stat changed is hashed again; the cache is only a shortcut."""

    def __init__(self, path: Path | None):
        self.path = path
        self._entries: dict[str, list] = {}
        self._dirty = False
        if path is not None and path.is_file():
            try:
                self._entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self._entries = {}

    def sha256(self, file: Path) -> str:
        st = file.stat()
        key = str(file.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self._entries.get(key)
        if hit and hit[:3] == stamp:
            return hit[3]
        digest = sha256_file(file)
        self._entries[key] = [*stamp, digest]
        self._dirty = True
        return digest

    def save(self) -> None:
        if self.path is not None and self._dirty:
            atomic_write_text(self.path, json.dumps(self._entries))
            self._dirty = False


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory, fsync, then rename over the destination."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; artifacts are meant to be read by others (servers, CI)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath, name)
            if p.is_symlink():
                continue
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when possible (same filesystem, read-only use), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def replace_dir(staging: Path, dest: Path) -> None:
    """Put a finished folder at dest, replacing what was there (kept as dest.old until the rename is done)."""
    old = dest.with_name(dest.name + ".old")
    remove_tree(old)
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)
    remove_tree(old)
