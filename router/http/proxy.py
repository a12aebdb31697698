"""The streaming proxy: one request from the client to a worker and back, raw ASGI.

Hot path, so kept to what it must do: forward the body bytes untouched (the router only read
the `model` field), drop hop-by-hop headers both ways, reuse keep-alive connections
(router.upstream for local workers; httpx only for https remote upstreams). A JSON
response is read whole and sent in one message; an SSE response is forwarded chunk by chunk
as it arrives (no buffering). If the client disconnects, the caller cancels us and closing
the upstream response closes its connection, which the worker sees as a cancel. A body
without a content-length (chunked: streamed audio, say) is forwarded as it arrives too. If the
worker dies mid-stream, the client gets a final SSE `data: {"error": ...}` event instead of
a silent cut (the openai SDK raises it as an APIError).

API translation layers (e.g. the Responses API) plug in at `forward()`'s `upstream_path` and
body; this module stays a byte pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import httpx
from starlette.types import Send

from router.upstream import UpstreamClient, UpstreamError
from worker.protocol.errors import error_body

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
# x-request-id: the router sends its own (the client's if it gave one; router.observability.request_trace)
_DROP_REQUEST = HOP_BY_HOP | {
    b"authorization",
    b"x-api-key",
    b"accept-encoding",
    b"origin",
    b"cookie",
    b"expect",
    b"x-request-id",
}
_DROP_RESPONSE = HOP_BY_HOP | {b"date", b"server"}


# For comparison benchmarks only: OMNI_PROXY_CLIENT=httpx sends everything through httpx.
FORCE_HTTPX = os.environ.get("OMNI_PROXY_CLIENT") == "httpx"


class UpstreamUnavailable(Exception):
    """The worker could not be reached, or failed, before any response byte was sent to the
    client. `retryable`: a reused keep-alive connection closed before any response byte;
    `never_sent`: the worker provably never read the request (refused, or reset with it unread)."""

    def __init__(self, message: str, *, retryable: bool = False, never_sent: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.never_sent = never_sent


def request_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in _DROP_REQUEST]


def _response_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in _DROP_RESPONSE]


def _is_sse(headers: list[tuple[bytes, bytes]]) -> bool:
    for k, v in headers:
        if k.lower() == b"content-type":
            return v.startswith(b"text/event-stream")
    return False


def _has_length(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-length" for k, _ in headers)


def sse_error(message: str, code: int = 502) -> bytes:
    body = error_body(message, "server_error", None, code)
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _mid_stream(model: str, e: Exception) -> bytes:
    return sse_error(f"worker for model {model!r} stopped mid-stream ({e}); the response is incomplete")


async def forward(
    upstream: UpstreamClient,
    client: httpx.AsyncClient,
    send: Send,
    method: str,
    base_url: str,
    target: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    *,
    model: str,
    reword_error: Callable[[bytes], bytes] | None = None,
) -> int:
    """Proxy one request; returns the upstream status. Raises UpstreamUnavailable before headers.
    `reword_error`: applied to a whole (non-streamed) error body (router.http.hints)."""
    if FORCE_HTTPX or not base_url.startswith("http://"):
        return await _forward_httpx(client, send, method, base_url + target, headers, body, model=model)
    try:
        conn = await upstream.request(base_url, method, target, headers, body)
    except UpstreamError as e:
        raise UpstreamUnavailable(
            f"worker for model {model!r} is unreachable: {e}", retryable=e.retryable, never_sent=e.never_sent
        ) from None
    try:
        hdrs = _response_headers(conn.headers)
        is_sse = _is_sse(conn.headers)
        if not is_sse and _has_length(conn.headers):
            try:
                data = await conn.read_all()
            except UpstreamError as e:
                raise UpstreamUnavailable(f"worker for model {model!r} failed mid-response: {e}") from None
            if conn.status >= 400 and reword_error is not None:
                data = reword_error(data)
            hdrs.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": conn.status, "headers": hdrs})
            await send({"type": "http.response.body", "body": data})
            return conn.status
        await send({"type": "http.response.start", "status": conn.status, "headers": hdrs})
        try:
            async for chunk in conn.iter_body():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            if not is_sse:  # a cut chunked body (streamed audio, say): the client sees it end early
                raise
            await send({"type": "http.response.body", "body": _mid_stream(model, e), "more_body": True})
        except asyncio.CancelledError:  # the router is shutting down (or the client left: no-op)
            with contextlib.suppress(Exception):
                if is_sse:
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": False,
                            "body": sse_error("the request was cancelled: the router is shutting down", 503),
                        }
                    )
            raise
        await send({"type": "http.response.body", "body": b""})
        return conn.status
    finally:
        upstream.release(base_url, conn)  # closes it unless the exchange completed cleanly


async def _forward_httpx(client: httpx.AsyncClient, send: Send, method: str, url: str,
                         headers: list[tuple[bytes, bytes]], body: bytes, *, model: str) -> int:
    """The same for https upstreams (remote servers), through httpx."""
    req = client.build_request(method, url, headers=headers, content=body)
    try:
        resp = await client.send(req, stream=True)
    except httpx.TransportError as e:
        raise UpstreamUnavailable(f"upstream for model {model!r} is unreachable: {e!r}",
                                  never_sent=isinstance(e, httpx.ConnectError)) from None
    try:
        hdrs = _response_headers(resp.headers.raw)
        await send({"type": "http.response.start", "status": resp.status_code, "headers": hdrs})
        try:
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as e:
            if _is_sse(resp.headers.raw):
                await send({"type": "http.response.body", "body": _mid_stream(model, e), "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return resp.status_code
    finally:
        await resp.aclose()


def json_response_messages(
    status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    data = json.dumps(body).encode()
    hdrs = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *(headers or []),
    ]
    return ({"type": "http.response.start", "status": status, "headers": hdrs},
            {"type": "http.response.body", "body": data})
