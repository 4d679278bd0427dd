"""A small local Hugging Face Hub emulator for tests: the endpoints huggingface_hub 2.x calls to download a file.

Serves, on 127.0.0.1 with a free port, for repos held in memory:

- `HEAD|GET /{repo_id}/resolve/{revision}/{filename}`: what `hf_hub_download` calls (HEAD for metadata, then GET,
  with `Range: bytes=N-` when it resumes a cut download). Answers carry `X-Repo-Commit`, a quoted `ETag` (the
  sha256 of the bytes, as for LFS files), `X-Linked-Etag`, `X-Linked-Size` and `Content-Length`.
- `GET /api/models/{repo_id}[/revision/{revision}]`: `HfApi.model_info` (`sha` and `siblings`).
- `GET /api/models/{repo_id}/tree/{revision}`: `HfApi.list_repo_tree` / `list_repo_files`.

`Repo.declared_sizes` makes HEAD declare another size than a file has (a huge file, without serving its bytes).
Errors use the headers `hf_raise_for_status` maps to exceptions: `X-Error-Code: RepoNotFound` (404, or 401 for a
private repo asked without its token), `RevisionNotFound`, `EntryNotFound`. Fault modes, per repo (`Repo.fault`) or
per file (`Repo.file_faults`): "500" (HTTP 500), "hang" (no answer for `hang_s` seconds, or until the server
stops), "cut" (GET sends the headers with the full Content-Length, writes half of the bytes and closes the
connection; a resumed `Range` request gets its headers and is closed before any byte, like a link that always drops
at the same point), "slow" (a file's GET waits `slow_s` seconds before it is answered: a slow download). Every request
is recorded (`requests`: method, path, query, headers) before it is answered. `hub_env` points huggingface_hub at it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import types
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import constants as hf_constants
from huggingface_hub import hf_api

FAULTS = ("500", "hang", "cut", "slow")
HF_ENV = (
    "HF_ENDPOINT",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_OIDC_RESOURCE",
    "HUGGINGFACE_CO_STAGING",
)


def commit_of(repo_id: str, revision: str) -> str:
    """A stable 40-hex commit id per repo and branch name."""
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


@dataclass
class Repo:
    """One repo: branch name -> {filename: bytes}; `token` makes it private (only `Bearer <token>` may read it)."""

    revisions: dict[str, dict[str, bytes]]
    token: str | None = None
    fault: str | None = None
    file_faults: dict[str, str] = field(default_factory=dict)
    declared_sizes: dict[str, int] = field(default_factory=dict)  # what HEAD says a file's size is, if not its own

    def __post_init__(self):
        for mode in (self.fault, *self.file_faults.values()):
            assert mode is None or mode in FAULTS, mode


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names


class HubServer:
    """Context manager: `with HubServer({"owner/name": Repo(...)}) as hub:` then point HF_ENDPOINT at `hub.url`."""

    def __init__(self, repos: dict[str, Repo], hang_s: float = 5.0, slow_s: float = 3.0):
        self.repos = repos
        self.hang_s = hang_s
        self.slow_s = slow_s
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopping.set()  # release hanging handlers
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inspection -----------------------------------------------------------------------------------------------
    def paths(self, method: str | None = None) -> list[str]:
        with self._lock:
            return [r.path for r in self.requests if method is None or r.method == method]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


class _Handler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.0"  # one request per connection: a cut connection cannot leak into the next request

    def log_message(self, format, *args):  # keep pytest output clean
        pass

    def do_HEAD(self):
        self._dispatch(head=True)

    def do_GET(self):
        self._dispatch(head=False)

    # -- routing --------------------------------------------------------------------------------------------------
    def _dispatch(self, head: bool) -> None:
        hub = self.server_hub
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        hub._record(Request(self.command, path, parse_qs(parts.query), {k.lower(): v for k, v in self.headers.items()}))
        try:
            if path.startswith("/api/models/"):
                self._api(path[len("/api/models/") :], head)
            elif "/resolve/" in path:
                repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                revision, _, filename = rest.partition("/")
                self._resolve(repo_id, revision, filename, head)
            else:
                self._error(404, "", "Not found", head)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout): nothing left to answer
            pass

    def _repo(self, repo_id: str, head: bool) -> Repo | None:
        """The repo if it exists and the request may read it; else the error is already sent."""
        hub = self.server_hub
        repo = hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head)
            return None
        if repo.token is not None:
            auth = self.headers.get("Authorization")
            if auth is None:
                self._error(401, "RepoNotFound", "Invalid username or password.", head)
                return None
            if auth != f"Bearer {repo.token}":
                self._error(401, None, "Invalid credentials in Authorization header", head)
                return None
        return repo

    def _revision(self, repo_id: str, repo: Repo, revision: str, head: bool) -> tuple[str, dict[str, bytes]] | None:
        for name, files in repo.revisions.items():
            if revision in (name, commit_of(repo_id, name)):
                return commit_of(repo_id, name), files
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
        return None

    def _fault(self, mode: str | None, head: bool) -> bool:
        """Apply a non-download fault; True when the request has been answered (or abandoned)."""
        if mode == "500":
            self._error(500, None, "Internal Error - We're working hard to fix this as soon as possible!", head)
            return True
        if mode == "hang":
            self.server_hub._stopping.wait(self.server_hub.hang_s)
            self._error(504, None, "Gateway timeout", head)
            return True
        return False

    # -- endpoints ------------------------------------------------------------------------------------------------
    def _api(self, rest: str, head: bool) -> None:
        owner, _, rest = rest.partition("/")
        name, _, rest = rest.partition("/")
        repo_id = f"{owner}/{name}"
        kind, _, revision = rest.partition("/")
        repo = self._repo(repo_id, head)
        if repo is None or self._fault(repo.fault if repo.fault != "cut" else None, head):
            return
        resolved = self._revision(repo_id, repo, revision or "main", head)
        if resolved is None:
            return
        commit, files = resolved
        if kind in ("", "revision"):  # model_info
            body = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": repo.token is not None,
                "siblings": [{"rfilename": f} for f in sorted(files)],
            }
        elif kind == "tree":  # list_repo_tree (recursive: all files, no folders needed for flat repos)
            body = [
                {
                    "type": "file",
                    "path": f,
                    "size": len(data),
                    "oid": hashlib.sha1(data).hexdigest(),
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134},
                }
                for f, data in sorted(files.items())
            ]
        else:
            self._error(404, "", "Not found", head)
            return
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if not head:
            self.wfile.write(payload)

    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
        repo = self._repo(repo_id, head)
        if repo is None:
            return
        mode = repo.file_faults.get(filename, repo.fault)
        if self._fault(mode if mode != "cut" else None, head):
            return
        resolved = self._revision(repo_id, repo, revision, head)
        if resolved is None:
            return
        commit, files = resolved
        if filename not in files:
            self._error(404, "EntryNotFound", f"{filename} does not exist on {revision!r}", head, commit=commit)
            return
        data = files[filename]
        if mode == "slow" and not head:
            self.server_hub._stopping.wait(self.server_hub.slow_s)
        etag = hashlib.sha256(data).hexdigest()
        start = 0
        range_header = self.headers.get("Range")
        if range_header and not head:
            start = int(range_header.split("=", 1)[1].split("-", 1)[0] or 0)
        self.send_response(206 if start else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Linked-Etag", f'"{etag}"')
        size = repo.declared_sizes.get(filename, len(data)) if head else len(data)
        self.send_header("X-Linked-Size", str(size))
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", str(size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        if mode == "cut":
            cut_at = len(data) // 2  # the link always drops at the same byte
            if start < cut_at:
                self.wfile.write(data[start:cut_at])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # SHUT_RDWR: the client sees the connection end mid-body
            return
        self.wfile.write(data[start:])

    def _error(self, status: int, code: str | None, message: str, head: bool, commit: str | None = None) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if not head:
            self.wfile.write(payload)


# -- environment ---------------------------------------------------------------------------------------------------
def hub_env(monkeypatch, **env: str) -> None:
    """Set the HF_* environment and apply it to huggingface_hub.constants the way a fresh import would."""
    for name in HF_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("_hf_constants_fresh", hf_constants.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    for name, value in vars(fresh).items():
        if name.startswith("__") or callable(value) or isinstance(value, types.ModuleType):
            continue
        if getattr(hf_constants, name, None) != value:
            monkeypatch.setattr(hf_constants, name, value)
    # the module-level `HfApi()` behind `model_info` and `list_repo_files` (diffusers' downloads) read it at import
    monkeypatch.setattr(hf_api.api, "endpoint", hf_constants.ENDPOINT)
    if "HF_ENDPOINT" in env:
        assert hf_constants.ENDPOINT == env["HF_ENDPOINT"]
        assert hf_constants.HUGGINGFACE_CO_URL_TEMPLATE.startswith(env["HF_ENDPOINT"] + "/")
    assert Path(hf_constants.HF_HUB_CACHE) == Path(env["HF_HOME"]) / "hub"
    assert hf_constants.is_offline_mode() == (env.get("HF_HUB_OFFLINE") == "1")
