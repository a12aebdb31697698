"""The router's raw ASGI front: the body-size limit, then dispatch. Proxied routes go to
router.http.forwarding without touching Starlette (the hot path); the web UI's files to
router.http.webui; everything else to the Starlette app of the router's own routes
(router.http.admin). Around it: the keys' middleware (router.keys.guard, with the route table
of who may call what) and CORS, the worker's own (worker.protocol.front).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.http.forwarding import Forwarder, header, send_error
from router.http.webui import WebUI
from worker.protocol.errors import APIError

# client path -> worker path, for POST routes routed by the body's `model` field (a JSON
# field, or a form field of a multipart body: the audio uploads). Paths a `cmd` upstream
# (llama-server, an OpenAI-compatible TTS/STT/image server) may serve go through unchanged.
PROXY_POST: dict[str, str] = {
    "/v1/chat/completions": "/v1/chat/completions",
    "/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
    "/completions": "/completions",  # llama-server's native shape, as /completion
    "/completion": "/completion",
    "/v1/embeddings": "/v1/embeddings",
    "/embeddings": "/embeddings",
    "/embedding": "/embedding",
    "/v1/rerank": "/v1/rerank",
    "/rerank": "/rerank",
    "/v1/reranking": "/v1/reranking",
    "/reranking": "/reranking",
    "/v1/audio/speech": "/v1/audio/speech",
    "/v1/audio/transcriptions": "/v1/audio/transcriptions",
    "/audio/transcriptions": "/audio/transcriptions",
    "/v1/audio/translations": "/v1/audio/translations",
    "/v1/images/generations": "/v1/images/generations",
    "/tokenize": "/tokenize",
    "/detokenize": "/detokenize",
    "/apply-template": "/apply-template",
    "/infill": "/infill",
    "/chat/completions/input_tokens": "/chat/completions/input_tokens",  # token counts (llama-server's)
    "/v1/chat/completions/input_tokens": "/v1/chat/completions/input_tokens",
    "/v1/responses/input_tokens": "/v1/responses/input_tokens",
    # LoRA adapters (a model's worker, by `?model=`: the bodies name none): global scales, run-time loads
    "/lora-adapters": "/lora-adapters",
    "/v1/load_lora_adapter": "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter": "/v1/unload_lora_adapter",
}
# GET routes proxied when `?model=` is given (without it, /props is the router's own)
PROXY_GET: dict[str, str] = {
    "/props": "/props", "/slots": "/slots", "/metrics": "/metrics", "/tools": "/tools",
    "/lora-adapters": "/lora-adapters",
}
_SLOT_ACTION = re.compile(r"^/slots/[^/]+$")  # POST /slots/{id}?action=save|restore|erase&model=
DEFAULT_MAX_BODY_SIZE = 100 * 1024 * 1024  # bytes; an audio upload is the largest body we expect


class Front:
    def __init__(self, forwarder: Forwarder, webui: WebUI, admin: ASGIApp, max_body_size: int) -> None:
        self._forwarder = forwarder
        self._webui = webui
        self._admin = admin
        self._max_body_size = max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._admin(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"]
        if self._max_body_size:
            too_large = self._body_too_large(scope["headers"])
            if too_large is not None:
                await send_error(send, too_large)
                return
            receive = _limit_body(receive, self._max_body_size)
        if method == "POST" and path in PROXY_POST:
            await self._forwarder.proxy_body(scope, receive, send, PROXY_POST[path])
        elif method == "POST" and _SLOT_ACTION.match(path):  # llama-server's slot files, routed by ?model=
            raw = (scope.get("raw_path") or path.encode()).decode("latin-1")  # still percent-encoded
            query = scope.get("query_string", b"").decode("latin-1")
            await self._forwarder.proxy_body(scope, receive, send, f"{raw}?{query}")
        elif method == "GET" and path in PROXY_GET and b"model=" in scope.get("query_string", b""):
            await self._forwarder.proxy_get(scope, receive, send, PROXY_GET[path])
        elif path == "/" and method in ("GET", "HEAD") and not accepts_html(scope["headers"]):
            await self._admin(scope, receive, send)  # "Ollama is running" (router/ollama/routes.py)
        elif self._webui.handles(method, path):
            await self._webui(scope, receive, send)
        else:
            await self._admin(scope, receive, send)

    def _body_too_large(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        length = header(headers, b"content-length")
        if length is None:
            return None  # chunked: `_limit_body` counts
        if not length.isdigit():
            return APIError("Invalid Content-Length header", param="content-length")
        if int(length) > self._max_body_size:
            return _too_large(self._max_body_size)
        return None


def accepts_html(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request asks for HTML (a browser gets the web UI at `/`; Ollama's clients,
    which send no such Accept, get "Ollama is running")."""
    return b"text/html" in (header(headers, b"accept") or b"")


def _too_large(limit: int) -> APIError:
    return APIError(f"request body is larger than the limit of {limit} bytes (--max-body-size)",
                    status_code=413, code="request_too_large")


def _limit_body(receive: Receive, limit: int) -> Receive:
    """`receive` that raises a 413 `APIError` once more than `limit` body bytes came in (a
    chunked body has no Content-Length to check up front)."""
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise _too_large(limit)
        return message

    return limited
