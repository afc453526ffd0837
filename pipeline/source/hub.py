"""Hugging Face Hub access through the real ``huggingface_hub`` client.

The revision is resolved to a commit sha first and everything else is fetched at that sha. Files are
checked after download: LFS files against the sha256 the Hub reports, git files against their blob sha1;
a mismatching cached blob is deleted so the next run fetches it again instead of trusting it. The token
is whatever ``huggingface_hub`` finds (``HF_TOKEN``, or a login); this module never reads, prints or
records it. ``HF_HUB_OFFLINE=1`` uses the local cache only.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

from pipeline import constants, families
from pipeline.config import HubSource
from pipeline.errors import EnvironmentProblem, InputError, IntegrityError
from pipeline.fsutil import link_or_copy, sha256_file

log = logging.getLogger(__name__)


def offline() -> bool:
    return os.environ.get(constants.HF_OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> Optional[str]:
    # read at call time (huggingface_hub reads HF_ENDPOINT once, at import)
    return os.environ.get("HF_ENDPOINT") or None


def _hub_error(e: Exception, src: HubSource, revision: str) -> Exception:
    from huggingface_hub import errors as hf_errors

    repo = src.repo_id
    if isinstance(e, hf_errors.GatedRepoError):
        return InputError(
            f"Hub repo {repo} is gated: accept its terms on the Hub with your account, then export "
            f"{constants.HF_TOKEN_ENV} with a token that has access."
        )
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return InputError(f"Hub repo {repo} has no revision '{revision}'. Use a branch, tag or commit sha that exists.")
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return InputError(
            f"Hub repo {repo} was not found, or it is private and no valid token was given "
            f"(export {constants.HF_TOKEN_ENV}). Check model.source.repo_id."
        )
    # LocalEntryNotFoundError subclasses EntryNotFoundError: "not in the cache" is not "missing on the server"
    if isinstance(e, hf_errors.EntryNotFoundError) and not isinstance(e, hf_errors.LocalEntryNotFoundError):
        return InputError(f"Hub repo {repo}@{revision}: a listed file is missing on the server: {e}")
    if isinstance(e, (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled)) and offline():
        return InputError(
            f"{repo}@{revision} is not in the local Hugging Face cache and {constants.HF_OFFLINE_ENV} is set. "
            f"Download it once with network access, or unset {constants.HF_OFFLINE_ENV}."
        )
    return EnvironmentProblem(
        f"Could not reach the Hugging Face Hub for {repo}@{revision} ({type(e).__name__}). Check the network "
        f"or HF_ENDPOINT, or set {constants.HF_OFFLINE_ENV}=1 to use the local cache."
    )


def _ref_path(src: HubSource) -> Path:
    from huggingface_hub import constants as hf_constants

    cache = Path(src.cache_dir) if src.cache_dir else Path(hf_constants.HF_HUB_CACHE)
    return cache / f"models--{src.repo_id.replace('/', '--')}" / "refs" / src.revision


def _cached_ref(src: HubSource) -> Optional[str]:
    ref = _ref_path(src)
    return ref.read_text().strip() if ref.is_file() else None


def _record_ref(src: HubSource, sha: str) -> None:
    """Remember branch/tag -> sha in the cache, as huggingface_hub does, so the branch resolves offline later.

    Files are always fetched by sha (so the client itself never writes refs/<branch>); without this an
    offline run of a config that names a branch could never resolve it."""
    if src.pinned:
        return
    ref = _ref_path(src)
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(sha)
        os.replace(tmp, ref)
    except OSError as e:
        log.warning("could not record %s -> %s in the Hub cache: %s", src.revision, sha, e)


def resolve_revision(src: HubSource) -> str:
    """The commit sha the configured revision points at now (a sha is returned as it is)."""
    if src.pinned:
        return src.revision
    if offline():
        sha = _cached_ref(src)
        if sha is None:
            raise InputError(
                f"{src.repo_id}: revision '{src.revision}' cannot be resolved offline (it is not in the local "
                f"cache). Pin a commit sha, or run once with network access."
            )
        return sha
    from huggingface_hub import HfApi

    try:
        sha = HfApi(endpoint=_endpoint()).model_info(src.repo_id, revision=src.revision).sha
    except Exception as e:  # noqa: BLE001 - every client error is mapped to an actionable message
        raise _hub_error(e, src, src.revision) from None
    if sha is None:  # huggingface_hub's ModelInfo.sha is None when the Hub's answer carries none
        raise EnvironmentProblem(f"the Hugging Face Hub answered for {src.repo_id} revision '{src.revision}' without a "
                                 f"commit sha. Check HF_ENDPOINT, or pin model.source.revision to a commit sha.")
    return sha


def _selected(names: list[str], src: HubSource) -> list[str]:
    def hit(name: str, patterns) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    return sorted(n for n in names if hit(n, src.include) and not hit(n, src.exclude))


def _git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1()
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fetch_snapshot(src: HubSource, sha: str, dest: Path) -> dict:
    """Download the selected files of repo@sha into dest (an HF folder); return what was fetched."""
    from huggingface_hub import HfApi, snapshot_download

    is_offline = offline()
    expected: dict[str, dict] = {}
    siblings = None
    try:
        if is_offline:
            snapshot = Path(snapshot_download(src.repo_id, revision=sha, cache_dir=src.cache_dir,
                                              local_files_only=True))
            names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
        else:
            siblings = HfApi(endpoint=_endpoint()).model_info(src.repo_id, revision=sha, files_metadata=True).siblings
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, src, sha) from None
    if not is_offline:
        if siblings is None:  # huggingface_hub's ModelInfo.siblings is None when the Hub's answer has no file list
            raise EnvironmentProblem(f"the Hugging Face Hub answered for {src.repo_id}@{sha[:12]} without its file "
                                     f"list. Check HF_ENDPOINT, or retry.")
        names = [s.rfilename for s in siblings]
        for s in siblings:
            expected[s.rfilename] = {"sha256": s.lfs.sha256 if s.lfs else None, "blob_id": s.blob_id, "size": s.size}

    wanted = _selected(names, src)
    pickles = [n for n in wanted if n.endswith(constants.PICKLE_SUFFIXES)]
    if pickles and not src.allow_pickle:
        raise InputError(f"{src.repo_id}@{sha[:12]}: refusing pickle weights {pickles}; set allow_pickle: true "
                         "only if you trust the repository")
    has_weights = any(n.endswith(".safetensors") for n in wanted) or (src.allow_pickle and pickles)
    if not has_weights:
        pickle_only = [n for n in names if n.endswith(constants.PICKLE_SUFFIXES)]
        hint = (f" It has only pickle weights ({', '.join(pickle_only[:3])}): add them to include and set "
                "allow_pickle: true if you trust it." if pickle_only else "")
        raise InputError(f"{src.repo_id}@{sha[:12]}: no safetensors weights match model.source.include.{hint}")
    if "config.json" not in wanted:
        raise InputError(f"{src.repo_id}@{sha[:12]}: no config.json (is it a transformers model repo?)")

    log.info("fetching %d files of %s@%s", len(wanted), src.repo_id, sha)
    try:  # config.json first: a family outside the table is refused before any weight is downloaded
        config = Path(snapshot_download(src.repo_id, revision=sha, allow_patterns=["config.json"],
                                        cache_dir=src.cache_dir, endpoint=_endpoint(),
                                        local_files_only=is_offline)) / "config.json"
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, src, sha) from None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise InputError(f"{src.repo_id}@{sha[:12]}: config.json is not readable JSON: {e}") from None
    families.family(model_type)
    try:
        snapshot = Path(snapshot_download(src.repo_id, revision=sha, allow_patterns=wanted,
                                          cache_dir=src.cache_dir, endpoint=_endpoint(),
                                          local_files_only=is_offline))
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, src, sha) from None

    files = {}
    for name in wanted:
        cached = snapshot / name
        if not cached.is_file():
            raise IntegrityError(f"{src.repo_id}@{sha[:12]}: {name} is missing from the downloaded snapshot")
        blob = cached.resolve()
        digest = sha256_file(blob)
        exp = expected.get(name, {})
        bad = None
        if exp.get("sha256") and digest != exp["sha256"]:
            bad = f"sha256 {digest[:16]}... but the Hub lists {exp['sha256'][:16]}..."
        elif not exp.get("sha256") and exp.get("blob_id") and _git_blob_sha1(blob) != exp["blob_id"]:
            bad = "its git blob id does not match the Hub's"
        if bad:
            blob.unlink(missing_ok=True)  # never trust it again: the next run downloads it afresh
            raise IntegrityError(
                f"{src.repo_id}@{sha[:12]}: {name} is corrupt ({bad}). The bad copy was removed from the "
                f"cache; run again to download it afresh."
            )
        link_or_copy(blob, dest / name)
        files[name] = digest
    if not is_offline:
        _record_ref(src, sha)  # only once every file is fetched and verified
    return {"repo_id": src.repo_id, "revision": sha, "files": files, "verified_against_hub": not is_offline}
