"""The proxied request flow: pick the model from the request, admit it, forward it, release it.

Raw ASGI on the hot path (no Starlette): the body is read once, the model comes from its
`model` field with one `json.loads` (or a multipart form field, or `?model=`), the model's
owner admits the request (`ensure_ready`: autoload, queue, `--models-max`), and router.http.proxy
pipes the bytes. A chat that asks for a spoken answer (`"audio"` in the body, then parsed) goes
to router.speech.chat instead. A client disconnect cancels whatever the request is waiting on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from urllib.parse import parse_qs

from starlette.types import Receive, Scope, Send

from router.http.form import boundary, form_field
from router.http.hints import reword_body
from router.http.proxy import UpstreamUnavailable, forward, json_response_messages, request_headers
from router.lifecycle.model import ModelHandle
from router.lifecycle.pool import Pool, upstream_model
from router.lifecycle.request_queue import REQUEUES, WorkerGone, died_on_it, is_gone, is_slot_free
from router.lifecycle.state import ModelState
from router.observability.request_trace import REQUEST_ID_HEADER, request_id
from router.observability.requests import ActiveRequests
from router.speech.chat import SpokenChat
from worker.protocol.errors import APIError, not_found, parse_json

log = logging.getLogger("omni.router.app")

Headers = list[tuple[bytes, bytes]]


def header(headers: Headers, name: bytes) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


async def send_error(send: Send, exc: APIError, cors: Headers | None = None) -> None:
    extra = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
    start, body = json_response_messages(exc.status_code, exc.body(), [*extra, *(cors or [])])
    await send(start)
    await send(body)


class Forwarder:
    def __init__(self, pool: Pool, requests: ActiveRequests) -> None:
        self.pool = pool
        self.requests = requests
        self.spoken: SpokenChat | None = None  # chat answers spoken by a paired voice (set by the app)

    async def proxy_body(self, scope: Scope, receive: Receive, send: Send, upstream_path: str) -> None:
        """A POST routed by its body's `model` (or `?model=`)."""
        try:
            body = await read_body(receive)
            name = self.model_from_body(
                body, scope.get("query_string", b""), header(scope["headers"], b"content-type")
            )
            handle = self.lookup(name, scope)
            if (upstream := upstream_model(handle.preset, name)) is not None:
                body = _with_model(body, upstream)  # a LoRA alias ("<model>:<adapter>"), `name:latest`
            body = self._with_defaults(body, name, handle, upstream_path)
            if self.spoken is not None and upstream_path == "/v1/chat/completions" and b'"audio"' in body:
                data = parse_json(body)  # a chat that asks for a spoken answer (router/speech/)
                if isinstance(data, dict) and self.spoken.takes(handle.preset, data):
                    await self.spoken(scope, receive, send, handle.preset, data)
                    return
        except APIError as e:
            await send_error(send, e)
            return
        await self._run(scope, receive, send, handle, "POST", upstream_path, body)

    def _with_defaults(self, body: bytes, name: str, handle: ModelHandle, upstream_path: str) -> bytes:
        """A variant's (or its model's) request defaults written into a JSON body (router/variants.py);
        the body as it is when there are none (no parse on the hot path)."""
        if not (handle.preset.request_defaults or self.pool.variant(name) is not None):
            return body
        data = parse_json(body) if body.lstrip()[:1] == b"{" else None
        if not isinstance(data, dict):
            return body  # a form body (an upload): its model field routes it, defaults are for text
        return json.dumps(self.pool.with_defaults(name, data, upstream_path)).encode()

    async def proxy_get(self, scope: Scope, receive: Receive, send: Send, upstream_path: str) -> None:
        """A GET routed by `?model=`."""
        query = parse_qs(scope["query_string"].decode("latin-1"))
        try:
            handle = self.lookup(query["model"][0], scope)
        except APIError as e:
            await send_error(send, e)
            return
        await self._run(scope, receive, send, handle, "GET", upstream_path, b"")

    def model_from_body(self, body: bytes, query: bytes = b"", content_type: bytes | None = None) -> str:
        sep = boundary(content_type) if content_type is not None else None
        name: object
        if sep is not None:
            name = form_field(body, sep, "model")
        else:
            data = parse_json(body)
            if isinstance(data, dict):
                name = data.get("model")
            elif isinstance(data, list) and query:  # POST /lora-adapters: an array, the model in ?model=
                name = None
            else:
                raise APIError("Request body must be a JSON object")
        if name is None and query:
            name = parse_qs(query.decode("latin-1")).get("model", [None])[0]
        if name is None and len(self.pool.handles) == 1:
            return next(iter(self.pool.handles))
        if not isinstance(name, str) or not name:
            raise APIError("'model' is required (a name from GET /v1/models)", param="model")
        return name

    def lookup(self, name: str, scope: Scope) -> ModelHandle:
        handle = self.pool.get(name)
        if handle is None:
            raise not_found(f"model {name!r} not found (see GET /v1/models)")
        if handle.state in (ModelState.READY, ModelState.SLEEPING, ModelState.LOADING,
                            ModelState.DOWNLOADING):
            return handle
        if not self.pool.config.autoload or not query_autoload(scope.get("query_string", b"")):
            raise APIError(f"model {name!r} is not loaded (autoload is off; POST /models/load first)",
                           param="model", code="model_not_loaded")
        return handle

    def resolve_model(self, name: str | None, scope: Scope) -> str:
        """The model a translated request (the Responses API) goes to, or the proxy's 400/404."""
        if name is None and len(self.pool.handles) == 1:
            return next(iter(self.pool.handles))
        if not name:
            raise APIError("'model' is required (a name from GET /v1/models)", param="model")
        self.lookup(name, scope)
        return name

    async def _run(self, scope: Scope, receive: Receive, send: Send, handle: ModelHandle, method: str,
                   upstream_path: str, body: bytes) -> None:
        """Admit, forward, release; a client disconnect cancels whatever we are waiting on."""
        task = asyncio.current_task()
        assert task is not None
        done = False

        async def cancel_on_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not done:
                        task.cancel()
                    return

        watcher = asyncio.create_task(cancel_on_disconnect())
        trace = self.requests.begin(request_id(scope["headers"]), handle, scope["path"])
        send = trace.wrap(send)
        qs = scope.get("query_string", b"")
        target = upstream_path + ("?" + qs.decode("latin-1") if qs and method == "GET" else "")
        occupies_slot = not is_slot_free(upstream_path)  # /metrics, /tokenize, ... skip the bound
        try:
            for attempt in range(1 + REQUEUES):
                base = await self.requests.admit(handle, trace, requeued=attempt > 0,
                                                 occupies_slot=occupies_slot)
                try:
                    trace.status = await self._forward_with_retry(
                        send, handle, method, base, target, scope, body, trace.request_id,
                        can_requeue=attempt < REQUEUES)
                    break
                except WorkerGone:
                    continue  # it never reached the worker: back in the queue for the respawned one
                finally:
                    handle.release(occupies_slot)
        except APIError as e:
            trace.status = e.status_code
            await send_error(send, e)
        except Exception as e:  # a bug: answer with the envelope if nothing was sent yet
            trace.status = 500
            log.exception("proxying to model %s failed", handle.name)
            with contextlib.suppress(Exception):
                await send_error(
                    send, APIError(f"internal error: {e!r}", status_code=500, type="server_error")
                )
        except asyncio.CancelledError:
            # The client left (the watcher cancelled us), or uvicorn's graceful shutdown ran out:
            # either way there is nobody left to answer (the trace still reports it).
            trace.is_cancelled = True
            return
        finally:
            done = True
            watcher.cancel()
            self.requests.end(trace)

    async def _forward_with_retry(self, send: Send, handle: ModelHandle, method: str, base: str, target: str,
                                  scope: Scope, body: bytes, rid: str, can_requeue: bool = False) -> int:
        """Forward once, and once more on a fresh connection if a reused keep-alive connection
        was closed before any response byte. The crash requeue (router.lifecycle.request_queue):
        only a request the worker provably never read (every attempt refused, or reset with the
        request unread: `never_sent`) goes back to the queue (`WorkerGone`) once the worker is
        seen gone. Any other failure of a worker that has gone (it read the request: it may be what
        crashed it) is a 502, not replayed."""
        headers = [*request_headers(scope["headers"]), (REQUEST_ID_HEADER, rid.encode())]
        may_have_reached = False  # a failed attempt may have reached the worker
        for attempt in (1, 2):
            try:
                return await forward(
                    self.pool.upstream,
                    self.pool.client,
                    send,
                    method,
                    base,
                    target,
                    headers,
                    body,
                    model=handle.name,
                    reword_error=lambda data: reword_body(data, handle.preset),
                )
            except UpstreamUnavailable as e:
                may_have_reached = may_have_reached or not e.never_sent
                if attempt == 1 and e.retryable:
                    continue  # a keep-alive connection the worker closed just as we reused it
                never_sent = not may_have_reached
                if never_sent and can_requeue and await is_gone(handle, base):
                    raise WorkerGone from None  # wait for the respawn
                if not never_sent and await is_gone(handle, base):
                    raise died_on_it(handle.name, e) from None
                raise APIError(
                    str(e),
                    status_code=503,
                    type="unavailable_error",
                    code=503,
                    headers={"Retry-After": "1"},
                ) from None
        raise AssertionError("unreachable")


def _with_model(body: bytes, model: str) -> bytes:
    """A JSON body with its `model` replaced (a form body, whose model is the alias, is refused:
    adapters serve text)."""
    data = parse_json(body)
    if not isinstance(data, dict):
        raise APIError("a LoRA adapter's model name takes a JSON body", param="model")
    data["model"] = model
    return json.dumps(data).encode()


def query_autoload(query: bytes) -> bool:
    """`?autoload=false` (or 0/no/off) turns autoload off for one request."""
    if b"autoload=" not in query:
        return True
    value = parse_qs(query.decode("latin-1")).get("autoload", ["true"])[0].lower()
    return value not in ("false", "0", "no", "off")


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
