"""The bundled chat page (webui/): static files for `/`, `/static/` and `/assets/`.

Files are read once, then kept in memory with their gzip form and a content ETag (a file that
changes on disk is read again: its mtime is checked on each request). Caching: `index.html`
and unversioned files are `no-cache` (the browser revalidates with the ETag and gets a 304);
a file whose name carries a version or a content hash (`marked-15.0.12.min.js`,
`app.3f9a0c1d.js`) and everything under `/assets/` (a bundler's hashed output) is immutable.
The page gets a Content-Security-Policy that allows scripts from this origin only, so even
model output that slipped past the sanitizer could not run inline script.
"""

from __future__ import annotations

import gzip
import hashlib
import mimetypes
import re
from dataclasses import dataclass
from pathlib import Path

from starlette.types import Receive, Scope, Send

WEBUI_DIR = Path(__file__).resolve().parents[2] / "webui"
INDEX_PATHS = frozenset({"/", "/index.html"})
PREFIXES = {"/static/": "static", "/assets/": "assets"}
VERSIONED = re.compile(r"[-.](\d+\.\d+\.\d+|[0-9a-f]{8,})[-.]")
COMPRESSIBLE = ("text/", "application/javascript", "application/json", "image/svg+xml")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
       "media-src 'self' blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'self'")
NO_CACHE = b"no-cache"
IMMUTABLE = b"public, max-age=31536000, immutable"


@dataclass(frozen=True)
class _File:
    mtime_ns: int
    body: bytes
    gzipped: bytes | None
    etag: bytes
    content_type: bytes


class WebUI:
    """Serves GET/HEAD for the page; `handles(method, path)` says whether a request is ours."""

    def __init__(self, root: Path = WEBUI_DIR) -> None:
        self.root = root.resolve()
        self.enabled = (self.root / "index.html").is_file()
        self._cache: dict[Path, _File] = {}

    def handles(self, method: str, path: str) -> bool:
        return (self.enabled and method in ("GET", "HEAD")
                and (path in INDEX_PATHS or path == "/favicon.ico" or path.startswith(tuple(PREFIXES))))

    def resolve(self, path: str) -> Path | None:
        """The file for a URL path, or None (unknown, a directory, or outside webui/)."""
        if path in INDEX_PATHS:
            return self.root / "index.html"
        if path == "/favicon.ico":
            path = "/static/favicon.svg"
        for prefix, folder in PREFIXES.items():
            if path.startswith(prefix):
                base = (self.root / folder).resolve()
                try:
                    target = (base / path[len(prefix):]).resolve()
                    if target.is_relative_to(base) and target.is_file():
                        return target
                except (OSError, ValueError):  # a name too long for the OS, a NUL byte: no such file
                    return None
        return None

    def _load(self, file: Path) -> _File:
        mtime_ns = file.stat().st_mtime_ns
        cached = self._cache.get(file)
        if cached is not None and cached.mtime_ns == mtime_ns:
            return cached
        body = file.read_bytes()
        ctype = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if file.suffix in (".js", ".mjs"):
            ctype = "application/javascript"
        if ctype.startswith("text/") or ctype == "application/javascript":
            ctype += "; charset=utf-8"
        gz = gzip.compress(body, 9, mtime=0) if ctype.startswith(COMPRESSIBLE) and len(body) > 512 else None
        etag = b'"' + hashlib.sha256(body).hexdigest()[:20].encode() + b'"'
        entry = _File(mtime_ns, body, gz, etag, ctype.encode())
        self._cache[file] = entry
        return entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        file = self.resolve(path)
        if file is None:
            body = (
                b'{"error": {"message": "not found", "type": "not_found_error", "param": null, "code": 404}}'
            )
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        entry = self._load(file)
        req = dict(scope["headers"])
        is_index = file.name == "index.html"
        immutable = path.startswith("/assets/") or bool(VERSIONED.search(file.name))
        headers = [(b"content-type", entry.content_type), (b"etag", entry.etag),
                   (b"cache-control", IMMUTABLE if immutable else NO_CACHE),
                   (b"x-content-type-options", b"nosniff"), (b"vary", b"Accept-Encoding")]
        if is_index:
            headers += [(b"content-security-policy", CSP.encode()), (b"referrer-policy", b"no-referrer")]
        if entry.etag in req.get(b"if-none-match", b"").replace(b"W/", b"").split(b", "):
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        body = entry.body
        if entry.gzipped is not None and b"gzip" in req.get(b"accept-encoding", b""):
            body = entry.gzipped
            headers.append((b"content-encoding", b"gzip"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
