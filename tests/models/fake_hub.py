"""A small Hugging Face Hub on 127.0.0.1: the endpoints huggingface_hub uses to pull a model.

Implemented (as huggingface_hub 2.x calls them):
- GET /api/models/{org}/{name}[/revision/{rev}][?blobs=true]: model info with `sha` and
  `siblings` (rfilename, size, blobId, and lfs {sha256, size, pointerSize} for weights).
- HEAD/GET /{org}/{name}/resolve/{rev}/{path}: the file, with X-Repo-Commit, ETag (the LFS
  sha256 or the git blob sha1), X-Linked-Etag/X-Linked-Size for LFS files, Content-Length,
  Accept-Ranges, and `Range: bytes=N-` answered with 206 and Content-Range.
- 404s with the X-Error-Code header the client maps to its exceptions (RepoNotFound,
  RevisionNotFound, EntryNotFound).

Faults, each for one request of a given file: `cut_once` sends the headers and half the body,
then drops the connection; `corrupt_once` serves the right length with one byte flipped;
`hold[file]` makes its GETs wait until the event is set (a slow network).
Every request is logged in `requests` as (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


@dataclass
class Logged:
    method: str
    path: str
    range: str | None


class FakeHub:
    """The Hub's state (repos, commits, refs), its HTTP server, faults and request log."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Logged] = []
        self.cut_once: set[str] = set()       # file paths: next GET is cut halfway
        self.corrupt_once: set[str] = set()   # file paths: next GET serves one flipped byte
        self.corrupt_always: set[str] = set()
        self.hold: dict[str, threading.Event] = {}  # file paths: GETs wait for the event (slow network)
        self._lock = threading.Lock()
        self._counter = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Make `files` (the whole tree) a new commit on `branch`; returns its sha."""
        with self._lock:
            self._counter += 1
            repo = self.repos.setdefault(repo_id, Repo())
            sha = hashlib.sha1(f"{repo_id}:{self._counter}".encode()).hexdigest()
            repo.commits[sha] = dict(files)
            repo.refs[branch] = sha
            return sha

    def gets_of(self, path_suffix: str) -> list[Logged]:
        """The logged GETs of files whose URL ends with `path_suffix`."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path
                and r.path.endswith(path_suffix)]

    def resolve_gets(self) -> list[Logged]:
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path]

    # -- lookups used by the handler ---------------------------------------------------------

    def lookup(self, repo_id: str, revision: str | None) -> tuple[str, dict[str, bytes]] | str:
        """(sha, files) of a revision, or the X-Error-Code of why not."""
        repo = self.repos.get(repo_id)
        if repo is None:
            return "RepoNotFound"
        sha = repo.refs.get(revision or "main", revision)
        if sha not in repo.commits:
            return "RevisionNotFound"
        return sha, repo.commits[sha]


def _is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


def _sibling(path: str, data: bytes) -> dict:
    entry = {"rfilename": path, "size": len(data)}
    if _is_lfs(path):
        sha256 = hashlib.sha256(data).hexdigest()
        entry["blobId"] = git_blob_sha1(f"oid sha256:{sha256}\nsize {len(data)}\n".encode())
        entry["lfs"] = {"sha256": sha256, "size": len(data), "pointerSize": 130}
    else:
        entry["blobId"] = git_blob_sha1(data)
    return entry


_INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _serve(self, head: bool) -> None:
            path = urlsplit(self.path).path
            with hub._lock:
                hub.requests.append(Logged(self.command, path, self.headers.get("Range")))
            if match := _INFO.match(path):
                return self._model_info(match.group(1), unquote(match.group(2)) if match.group(2) else None)
            if match := _RESOLVE.match(path):
                return self._resolve(match.group(1), unquote(match.group(2)), unquote(match.group(3)), head)
            self._error(404, "RepoNotFound", "no such endpoint")

        def _model_info(self, repo_id: str, revision: str | None) -> None:
            found = hub.lookup(repo_id, revision)
            if isinstance(found, str):
                return self._error(404, found, f"{repo_id}@{revision}: {found}")
            sha, files = found
            body = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "siblings": [_sibling(p, d) for p, d in sorted(files.items())]}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _resolve(self, repo_id: str, revision: str, file: str, head: bool) -> None:
            found = hub.lookup(repo_id, revision)
            if isinstance(found, str):
                return self._error(404, found, found)
            sha, files = found
            if file not in files:
                return self._error(404, "EntryNotFound", file, {"X-Repo-Commit": sha})
            data = files[file]
            etag = hashlib.sha256(data).hexdigest() if _is_lfs(file) else git_blob_sha1(data)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if _is_lfs(file):
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            if head:
                return self._send(200, b"", {**headers, "Content-Length": str(len(data))}, body=False)
            if (gate := hub.hold.get(file)) is not None:
                gate.wait(10)
            with hub._lock:
                cut = file in hub.cut_once
                hub.cut_once.discard(file)
                corrupt = file in hub.corrupt_once or file in hub.corrupt_always
                hub.corrupt_once.discard(file)
            if corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            start = 0
            status = 200
            if (wanted := self.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-(\d*)$", wanted)):
                start = int(m.group(1))
                end = int(m.group(2)) if m.group(2) else len(data) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data_part = data[start:end + 1]
                status = 206
            else:
                data_part = data
            if cut:
                return self._cut(status, headers, data_part)
            self._send(status, data_part, headers)

        def _cut(self, status: int, headers: dict, data: bytes) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

        def _error(self, status: int, code: str, message: str, extra: dict | None = None) -> None:
            body = json.dumps({"error": message}).encode()
            self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                      "Content-Type": "application/json", **(extra or {})})

        def _send(self, status: int, data: bytes, headers: dict, body: bool = True) -> None:
            self.send_response(status)
            headers = {"Content-Length": str(len(data)), **headers}
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if body and data:
                self.wfile.write(data)

    return Handler
