"""Resolve an adapter source to a local safetensors file: a local path, or a Hub repo through huggingface_hub.

huggingface_hub brings its cache, revision pinning, `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE`; its downloads go
to a temporary name and are renamed only when complete, so a cut connection never leaves a usable partial file.

Every network step is one bounded request first (`HUB_TIMEOUT_S`, or `HF_HUB_ETAG_TIMEOUT` when set): left alone,
huggingface_hub retries a failed metadata call with a 60 s timeout and exponential back-off (minutes on a hung Hub),
and its repo listing has no timeout at all. When that request fails for a reason other than a missing revision or
file, the local Hub cache is used if it holds the file, as huggingface_hub itself does offline.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx2  # huggingface_hub 2.x's HTTP client: its errors are what a failed request raises
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name

from ..errors import AdapterSourceError, AdapterTooLargeError
from .reader import PICKLE_SUFFIXES, check_file_name

# The Hub's own rule: "owner/name", letters, digits, '-', '_', '.', no '--' or '..', no leading/trailing '-' or '.'.
REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9_](?:[\w.-]{0,94}[\w])?$")
HUB_TIMEOUT_S = 30.0  # a hung endpoint must not hold the engine
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


def is_local_source(source: str) -> bool:
    """A source is local when it names a file: a safetensors (or pickle) suffix or a path separator up front."""
    return (
        source.lower().endswith((".safetensors", *PICKLE_SUFFIXES))
        or source.startswith(("/", ".", "~", "\\"))
        or (len(source) > 1 and source[1] == ":")
    )


def check_repo_id(source: str, adapter_id: str, allow_local: bool) -> None:
    """Validate a repo id before any request; name local paths when they are not allowed (the public UI)."""
    if is_local_source(source) or "\\" in source:
        if not allow_local:
            raise AdapterSourceError(
                f"Adapter {adapter_id!r}: {source!r} looks like a local path; local paths are not accepted here, "
                "only Hub repo ids like 'owner/name'.",
                adapter_id,
            )
        return
    if not REPO_ID.match(source):
        raise AdapterSourceError(
            f"Adapter {adapter_id!r}: {source!r} is not a valid Hub repo id; use 'owner/name' "
            "(letters, digits, '-', '_', '.').",
            adapter_id,
        )


def resolve(
    source: str,
    adapter_id: str,
    weight_name: str | None = None,
    revision: str | None = None,
    allow_local: bool = True,
    base_dir: Path | None = None,
    max_bytes: int | None = None,
) -> Path:
    """Return a local path to the adapter's safetensors file, downloading it into the Hub cache if needed. A file
    larger than `max_bytes` is refused: a Hub file from the size its metadata declares, before any byte of it."""
    check_repo_id(source, adapter_id, allow_local)
    if is_local_source(source) or "\\" in source:
        path = Path(source).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if weight_name:
            path = path / weight_name
        check_file_name(path, adapter_id)
        if not path.is_file():
            raise AdapterSourceError(f"Adapter {adapter_id!r}: no such file {path}.", adapter_id)
        check_size(path.stat().st_size, max_bytes, adapter_id, path.name)
        return path
    try:
        if weight_name is None:
            weight_name = _single_safetensors(source, adapter_id, revision)
        check_file_name(Path(weight_name), adapter_id)
        return _download(source, weight_name, revision, adapter_id, max_bytes)
    except AdapterSourceError:
        raise
    except Exception as e:
        raise _hub_error(e, source, adapter_id, weight_name, revision) from e


def check_size(nbytes: int | None, max_bytes: int | None, adapter_id: str, name: str) -> None:
    """Refuse a file larger than `max_bytes`, naming both sizes."""
    if max_bytes is not None and nbytes is not None and nbytes > max_bytes:
        raise AdapterTooLargeError(
            f"Adapter {adapter_id!r}: {name} is {nbytes / 2**20:.1f} MiB, more than the {max_bytes / 2**20:.1f} MiB "
            "limit for an adapter here (the largest LoRA the loaded template can hold, or the server's cap); it was "
            "not downloaded.",
            adapter_id,
        )


def hub_cache_files(source: str) -> set[Path]:
    """Every file and link the local Hub cache holds for a Hub repo (blobs, snapshot entries, refs); none for a path."""
    if is_local_source(source) or not REPO_ID.match(source):
        return set()
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=source, repo_type="model")
    return {p for p in storage.rglob("*") if p.is_file() or p.is_symlink()} if storage.is_dir() else set()


def remove_files(paths: set[Path]) -> None:
    """Delete Hub cache entries (what a refused or dropped addition downloaded), snapshot links before blobs."""
    for path in sorted(paths, key=lambda p: not p.is_symlink()):
        path.unlink(missing_ok=True)


def _timeout() -> float:
    """HUB_TIMEOUT_S, unless the user set HF_HUB_ETAG_TIMEOUT (huggingface_hub too lets it win over the argument)."""
    if constants.HF_HUB_ETAG_TIMEOUT != constants.DEFAULT_ETAG_TIMEOUT:
        return constants.HF_HUB_ETAG_TIMEOUT
    return HUB_TIMEOUT_S


def _download(repo_id: str, filename: str, revision: str | None, adapter_id: str, max_bytes: int | None) -> Path:
    """hf_hub_download behind one bounded metadata request, which also gives the file's size (checked against
    `max_bytes` before any byte is fetched); a failed request falls back to the cache, else raises."""
    if not constants.is_offline_mode():
        try:
            meta = get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), timeout=_timeout())
        except (RevisionNotFoundError, RemoteEntryNotFoundError):
            raise
        except Exception as e:  # timeout, connection, 5xx, 401: the cached file, if any, is still good
            try:
                path = Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=True))
            except LocalEntryNotFoundError:
                raise e from None
            check_size(path.stat().st_size, max_bytes, adapter_id, filename)
            return path
        check_size(meta.size, max_bytes, adapter_id, filename)
    path = Path(hf_hub_download(repo_id, filename, revision=revision, etag_timeout=_timeout()))
    check_size(path.stat().st_size, max_bytes, adapter_id, filename)
    return path


def _cached_files(repo_id: str, revision: str | None) -> list[str] | None:
    """Files of the revision's snapshot in the local Hub cache, None when it has none."""
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = revision or constants.DEFAULT_REVISION
    if not COMMIT_HASH.match(commit):
        ref = storage / "refs" / commit
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The repo's file names from one bounded model_info request, or from the cached snapshot when that fails."""
    if constants.is_offline_mode():
        files = _cached_files(repo_id, revision)
        if files is None:
            raise LocalEntryNotFoundError(f"{repo_id} has no cached snapshot and HF_HUB_OFFLINE is set.")
        return files
    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=_timeout())
    except RevisionNotFoundError:
        raise
    except Exception as e:  # as snapshot_download does: a cached snapshot still answers
        files = _cached_files(repo_id, revision)
        if files is None:
            raise e from None
        return files
    return [s.rfilename for s in info.siblings or ()]


def _single_safetensors(repo_id: str, adapter_id: str, revision: str | None) -> str:
    """The repo's one .safetensors file; several need an explicit weight_name, none means a pickle-only repo."""
    files = _repo_files(repo_id, revision)
    safetensors = sorted(f for f in files if f.endswith(".safetensors"))
    if len(safetensors) == 1:
        return safetensors[0]
    if not safetensors:
        pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
        hint = f" (it has only pickle files: {', '.join(pickles[:3])}, which are refused)" if pickles else ""
        raise AdapterSourceError(
            f"Adapter {adapter_id!r}: repo {repo_id!r} has no .safetensors file{hint}; convert the weights to "
            "safetensors.",
            adapter_id,
        )
    raise AdapterSourceError(
        f"Adapter {adapter_id!r}: repo {repo_id!r} has {len(safetensors)} .safetensors files "
        f"({', '.join(safetensors[:5])}); pass weight_name to pick one.",
        adapter_id,
    )


def _hub_error(e: Exception, repo_id: str, adapter_id: str, weight_name, revision) -> AdapterSourceError:
    """Translate huggingface_hub and network errors into one message with the fix."""
    where = f"{repo_id}" + (f"/{weight_name}" if weight_name else "") + (f"@{revision}" if revision else "")
    if isinstance(e, GatedRepoError):
        text = f"{where} is gated: accept its license on the Hub and set HF_TOKEN."
    elif isinstance(e, RepositoryNotFoundError):
        text = f"repo {repo_id!r} not found, or private (set HF_TOKEN if it is yours)."
    elif isinstance(e, RevisionNotFoundError):
        text = f"revision {revision!r} not found in {repo_id!r}."
    elif isinstance(e, LocalEntryNotFoundError):  # before EntryNotFoundError: it is a subclass of it
        text = f"{where} is not in the local Hub cache and the Hub cannot be reached (offline?)."
    elif isinstance(e, EntryNotFoundError):
        text = f"file {weight_name!r} not found in {repo_id!r}; check weight_name."
    elif isinstance(e, (TimeoutError, httpx2.TimeoutException)):
        text = f"the Hub did not answer in time for {where}; retry later."
    elif isinstance(e, HfHubHTTPError) and _status(e) in (401, 403):
        text = f"the Hub refused access to {where} (HTTP {_status(e)}); set HF_TOKEN to a valid token."
    elif isinstance(e, HfHubHTTPError):
        text = f"the Hub answered HTTP {_status(e) or '?'} for {where}; retry later."
    elif isinstance(e, (httpx2.HTTPError, OSError)):
        text = f"download of {where} failed ({type(e).__name__}: {e}); retry later."
    else:
        text = f"cannot fetch {where} ({type(e).__name__}: {e})."
    return AdapterSourceError(f"Adapter {adapter_id!r}: {text}", adapter_id)


def _status(e: Exception) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)
