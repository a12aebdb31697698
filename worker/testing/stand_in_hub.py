"""A stand-in Hugging Face hub for tests: a real HTTP server in a thread, serving the endpoints
`huggingface_hub` (and router/hub) call, with the headers the real hub sends.

    GET  /api/models/ORG/REPO[/revision/REV]   model info: `sha` (the commit) and `siblings`
                                               with `size`, `blobId` and, for LFS files,
                                               `lfs: {size, sha256, pointerSize}` (?blobs=true)
    HEAD|GET /ORG/REPO/resolve/REV/PATH        the file: ETag (the sha256 for LFS files, else
                                               the git blob id), X-Repo-Commit, X-Linked-Etag and
                                               X-Linked-Size (LFS), Content-Length,
                                               Accept-Ranges; `Range: bytes=N-` answers 206
    404s carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound) and
    X-Error-Message, as huggingface_hub's `hf_raise_for_status` reads them.

Control for tests (all thread-safe): `fail_with = 503` answers everything so (the hub down);
`hold_after(n)` makes every file transfer stop after n
bytes until `release()` (progress is then observable by condition, never by timing);
`cut_after(n)` closes each transfer after n bytes (a connection lost halfway); `corrupt(path)`
serves a file with one byte changed; `ranges` records the Range headers seen, `served` the bytes
sent per path. `.gguf`, `.safetensors` and `.bin` files are LFS files, as on the hub.

Usage in a test:  with StandInHub() as hub: hub.add_repo("org/x-GGUF", {"x-Q4_K_M.gguf": path});
env HF_ENDPOINT=hub.url.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

_LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass(frozen=True)
class HubFile:
    data: bytes
    sha256: str
    blob_id: str
    is_lfs: bool


@dataclass
class HubRepo:
    name: str
    commit: str
    files: dict[str, HubFile]


def _hub_file(path: str, data: bytes) -> HubFile:
    blob_id = hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()
    return HubFile(data, hashlib.sha256(data).hexdigest(), blob_id, path.endswith(_LFS_SUFFIXES))


@dataclass
class StandInHub:
    host: str = "127.0.0.1"
    repos: dict[str, HubRepo] = field(default_factory=dict)
    ranges: list[str] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    fail_with: int | None = None  # every request answers this status (a hub that is down: 503)
    _hold: int | None = None
    _cut: int | None = None
    _corrupt: set[str] = field(default_factory=set)
    _gate: threading.Condition = field(default_factory=threading.Condition)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    # ---- repos

    def add_repo(self, name: str, files: Mapping[str, Path | bytes | str]) -> HubRepo:
        """A repo of `files` (repo path -> a file on disk, bytes or text); its commit is derived
        from the contents (the same files: the same commit)."""
        built = {}
        for path, src in files.items():
            data = src.read_bytes() if isinstance(src, Path) else src.encode() if isinstance(src, str) \
                else src
            built[path] = _hub_file(path, data)
        commit = hashlib.sha1("".join(f"{p}:{f.sha256}" for p, f in sorted(built.items())).encode(),
                              usedforsecurity=False).hexdigest()
        repo = HubRepo(name, commit, built)
        self.repos[name] = repo
        return repo

    # ---- control

    def hold_after(self, n: int) -> None:
        """Every transfer sends n bytes (of its response) at most, then waits: call again with a
        larger n to let each go on to it, or `release()`."""
        with self._gate:
            self._hold = n
            self._gate.notify_all()

    def release(self) -> None:
        with self._gate:
            self._hold = None
            self._gate.notify_all()

    def cut_after(self, n: int | None) -> None:
        self._cut = n

    def corrupt(self, path: str) -> None:
        self._corrupt.add(path)

    def bytes_served(self, path: str) -> int:
        with self._lock:
            return self.served.get(path, 0)

    # ---- server

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    def __enter__(self) -> StandInHub:
        hub = self

        class Handler(_Handler):
            stand_in = hub

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        server = self._server
        self._thread = threading.Thread(target=lambda: server.serve_forever(0.05), name="stand-in-hub",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


_INFO_RE = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?/?$")
_RESOLVE_RE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    stand_in: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet in test output
        pass

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, name: str, revision: str | None) -> HubRepo | None:
        repo = self.stand_in.repos.get(name)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if revision not in (None, "main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def do_GET(self) -> None:
        hub = self.stand_in
        path = unquote(urlsplit(self.path).path)
        hub.requests.append(f"{self.command} {path}")
        if hub.fail_with is not None:
            self._error(hub.fail_with, "ServiceUnavailable", "the stand-in hub is down")
            return
        if (m := _INFO_RE.match(path)) is not None:
            repo = self._repo(m.group(1), m.group(2))
            if repo is not None:
                self._info(repo)
            return
        if (m := _RESOLVE_RE.match(path)) is not None:
            repo = self._repo(m.group(1), m.group(2))
            if repo is not None:
                self._resolve(repo, m.group(3))
            return
        self._error(404, "NotFound", f"no route {path}")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _info(self, repo: HubRepo) -> None:
        siblings = []
        for path, f in sorted(repo.files.items()):
            entry: dict[str, Any] = {"rfilename": path, "size": len(f.data), "blobId": f.blob_id}
            if f.is_lfs:
                entry["lfs"] = {"size": len(f.data), "sha256": f.sha256, "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps({"_id": repo.commit[:24], "id": repo.name, "modelId": repo.name,
                           "sha": repo.commit, "private": False, "gated": False, "disabled": False,
                           "downloads": 0, "likes": 0, "tags": ["gguf"], "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _resolve(self, repo: HubRepo, path: str) -> None:
        hub = self.stand_in
        f = repo.files.get(path)
        if f is None:
            self._error(404, "EntryNotFound", f"{path} does not exist on \"main\"", repo.commit)
            return
        data = f.data
        if path in hub._corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        rng = self.headers.get("Range")
        if rng:
            hub.ranges.append(rng)
            if (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())) is not None:
                start = min(int(m.group(1)), len(data))
        self.send_response(206 if start else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", repo.commit)
        etag = f.sha256 if f.is_lfs else f.blob_id
        self.send_header("ETag", f'"{etag}"')
        if f.is_lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(len(f.data)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if self.command == "HEAD":
            return
        self._send_body(path, data, start)

    def _send_body(self, path: str, data: bytes, start: int) -> None:
        hub = self.stand_in
        pos, sent = start, 0
        step = 64 * 1024
        try:
            while pos < len(data):
                cut = hub._cut
                if cut is not None and sent >= cut:
                    self.close_connection = True
                    return  # a connection lost halfway: fewer bytes than Content-Length
                with hub._gate:
                    hub._gate.wait_for(lambda sent=sent: hub._hold is None or sent < hub._hold)  # type: ignore[misc]
                    hold = hub._hold
                limits = [x - sent for x in (hold, cut) if x is not None]
                n = min([step, *limits])
                chunk = data[pos:pos + n]
                self.wfile.write(chunk)
                self.wfile.flush()
                pos += len(chunk)
                sent += len(chunk)
                with hub._lock:
                    hub.served[path] = hub.served.get(path, 0) + len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
