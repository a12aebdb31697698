"""The two outer ASGI layers of both servers, router and worker, with llama-server's rules:
the API key, then CORS around it. One implementation, so the two processes cannot drift apart.

`Cors` is outermost: an OPTIONS preflight is answered before the key is checked (browsers send
none), and a 401 still carries the CORS header, as llama-server's pre-routing handler does.
The only difference between the two servers is configuration: which paths are public, and
which origins are allowed (the worker's default is llama-server's `*`; the router's CORS is off
unless `--cors-origin` is given, and "off" means no CORS header at all, on a preflight too).
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.protocol.errors import APIError

WORKER_PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # as llama-server: everything else needs the key


class RequireAPIKey:
    """`--api-key`: `Authorization: Bearer KEY` or `X-Api-Key: KEY` on every route but the public
    ones (the worker's: /health, llama-server's rule); keys are compared in constant time."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        *,
        public_paths: frozenset[str] = WORKER_PUBLIC_PATHS,
        public_prefixes: tuple[str, ...] = (),
    ) -> None:
        self._app = app
        self._keys = [k.encode() for k in keys]
        self._public_paths = public_paths
        self._public_prefixes = public_prefixes

    def _is_public(self, path: str) -> bool:
        return path in self._public_paths or (
            bool(self._public_prefixes) and path.startswith(self._public_prefixes)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or self._is_public(scope["path"]):
            await self._app(scope, receive, send)
            return
        if self._is_authorized(dict(scope["headers"])):
            await self._app(scope, receive, send)
            return
        body = APIError("Invalid API Key", status_code=401, type="authentication_error", code=401).body()
        await JSONResponse(body, status_code=401)(scope, receive, send)

    def _is_authorized(self, headers: dict[bytes, bytes]) -> bool:
        token = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        if token[:7].lower() == b"bearer ":
            token = token[7:]
        token = token.strip()
        ok = False
        for key in self._keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(token, key)
        return ok


# Header names cased as llama-server writes them (HTTP does not care; clients comparing dict keys do).
_CORS_PREFLIGHT_HEADERS = [
    (b"Access-Control-Allow-Credentials", b"true"),
    (b"Access-Control-Allow-Methods", b"GET, POST, DELETE, OPTIONS"),
    (b"Access-Control-Allow-Headers", b"*"),
]


def is_localhost_origin(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class Cors:
    """llama-server's CORS (server-http.cpp's pre-routing handler), outermost: every response
    gets `Access-Control-Allow-Origin` for an allowed Origin, and any OPTIONS request is a
    preflight answered here with 200, before the API key is checked (browsers send none).

    `origins`: `*` (llama-server's default, with credentials: the Origin is echoed back),
    `localhost` (only http(s)://localhost, 127.0.0.1 or [::1] on any port), a comma-separated
    list of exact origins, or empty: CORS off (no header at all; a preflight is a bare 200)."""

    def __init__(self, app: ASGIApp, origins: str) -> None:
        self._app = app
        self._origins = origins
        self._listed = frozenset(o.strip() for o in origins.split(",") if o.strip())

    def allow_origin(self, origin: str) -> str | None:
        if not origin:
            return None
        if self._origins == "*":
            return origin
        if self._origins == "localhost":
            return origin if is_localhost_origin(origin) else None
        return origin if origin in self._listed else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        origin = dict(scope["headers"]).get(b"origin", b"").decode("latin-1")
        allowed = self.allow_origin(origin)
        extra = [(b"Access-Control-Allow-Origin", allowed.encode("latin-1"))] if allowed else []
        if scope["method"] == "OPTIONS":
            cors = [*extra, *_CORS_PREFLIGHT_HEADERS] if self._origins else []
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*cors, (b"content-type", b"text/html"), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if not extra:
            await self._app(scope, receive, send)
            return

        async def send_with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self._app(scope, receive, send_with_origin)
