"""The router's HTTP surface: a thin raw-ASGI front (auth, CORS, the proxied routes) over a
Starlette app for the router's own routes (/v1/models, /models/load|unload|sleep|sse, /props, /health,
/metrics, /logs, /logs/stream, /start_profile and friends).

The proxied POST routes skip Starlette entirely (hot path): read the body, pick the model
from its `model` field with one `json.loads`, admit the request (`ensure_ready`), forward.
The Responses API (router.responses) is mounted on the Starlette app; it reaches a model
through `open_chat`, the same admission path as a proxied request.
API keys are compared in constant time (`hmac.compare_digest`) against every configured key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs

import httpx
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from router.events import EventBus
from router.form import boundary, form_field
from router.logs import ROUTER_LOG, LogRoutes, RingHandler, log_requests
from router.metrics import RouterMetrics
from router.model import ModelHandle
from router.openapi import openapi_document
from router.pool import Pool
from router.presets import PresetError
from router.profiling import RouterProfiling
from router.proxy import UpstreamUnavailable, forward, json_response_messages, request_headers
from router.request_trace import REQUEST_ID_HEADER, RequestTrace, request_id
from router.responses.routes import ResponsesRoutes
from router.responses.service import ResponsesService
from router.responses.store import Store
from router.state import ModelState
from router.webui import WebUI
from worker.errors import (
    APIError,
    ErrorType,
    api_error_handler,
    http_exception_handler,
    not_found,
    parse_json,
)

log = logging.getLogger("omni.router.app")

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
    "/v1/messages/count_tokens": "/v1/messages/count_tokens",
}
# GET routes proxied when `?model=` is given (without it, /props is the router's own)
PROXY_GET: dict[str, str] = {"/props": "/props", "/slots": "/slots", "/metrics": "/metrics"}
_SLOT_ACTION = re.compile(r"^/slots/[^/]+$")  # POST /slots/{id}?action=save|restore|erase&model=
PUBLIC_PATHS = frozenset({"/health", "/", "/index.html", "/favicon.ico"})
PUBLIC_PREFIXES = ("/static/", "/webui/", "/assets/")
SSE_KEEPALIVE_S = 15.0
DEFAULT_MAX_BODY_SIZE = 100 * 1024 * 1024  # bytes; an audio upload is the largest body we expect


@dataclass
class ResponsesConfig:
    """The Responses API's store: `max_entries` 0 turns it off."""

    data_dir: Path | None = None
    max_entries: int = 0
    ttl_s: float = 30 * 24 * 3600.0


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


class RouterApp:
    """The ASGI application served by `omni-router`."""

    def __init__(self, pool: Pool, *, api_keys: list[str] | None = None, cors_origins: list[str] | None = None,
                 responses: ResponsesConfig | None = None, max_body_size: int = DEFAULT_MAX_BODY_SIZE) -> None:
        self.pool = pool
        self.max_body_size = max_body_size
        rc = responses or ResponsesConfig()
        data_dir = rc.data_dir or Path(".")
        self.store = Store(data_dir / "responses.sqlite3", max_entries=rc.max_entries, ttl_s=rc.ttl_s)
        self.responses = ResponsesService(self.store, self.open_chat)
        self.events: EventBus = pool.events
        self.api_keys = [k.encode() for k in (api_keys or [])]
        self.cors_origins = set(cors_origins or [])
        self._background: set[asyncio.Task[None]] = set()
        self.active: dict[int, RequestTrace] = {}  # the proxied requests in progress
        self.metrics = RouterMetrics(self.events, pool.handles, pool.client, self.active.values)
        self.profiling = RouterProfiling(self.events, pool.handles, pool.client, data_dir)
        self.logs = LogRoutes(self._canonical_name)
        self.webui = WebUI()  # the bundled chat page (webui/), if present
        self.admin = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.list_models),
                Route("/models", self.list_models),
                Route("/v1/models/{model_id:path}", self.get_model),
                Route("/models/load", self.load_model, methods=["POST"]),
                Route("/models/unload", self.unload_model, methods=["POST"]),
                Route("/models/sleep", self.sleep_model, methods=["POST"]),
                Route("/models/reload", self.reload_models, methods=["POST"]),
                Route("/models/sse", self.models_sse),
                Route("/props", self.props),
                Route("/metrics", self.metrics_text),
                Route("/openapi.json", self.openapi),
                *self.logs.routes(),
                *self.profiling.routes(),
                *ResponsesRoutes(self.responses, self.resolve_model).routes(),
            ],
            exception_handlers={APIError: api_error_handler, HTTPException: http_exception_handler,
                                500: api_error_handler},
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        observers = [asyncio.create_task(self.metrics.run(), name="metrics"),
                     asyncio.create_task(log_requests(self.events), name="request-log")]
        log_handler = RingHandler(ROUTER_LOG)
        logging.getLogger().addHandler(log_handler)
        await asyncio.sleep(0)  # the observers subscribe before the first event
        await self.pool.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no SIGHUP
            loop.add_signal_handler(signal.SIGHUP, self._reload_in_background)
        try:
            yield
        finally:
            logging.getLogger().removeHandler(log_handler)
            await self.profiling.close()
            for t in observers:
                t.cancel()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGHUP)
            await self.responses.close()
            await self.pool.close()
            self.store.close()

    # ------------------------------------------------------------------ raw ASGI front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.admin(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"]
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        cors = self._cors_headers(headers) if self.cors_origins else None
        if method == "OPTIONS":
            await self._preflight(headers, cors, send)
            return
        if self.api_keys and not self._is_public(path) and not self._authorized(headers):
            await self._send_error(send, APIError("Invalid API Key", status_code=401, type="authentication_error",
                                                  code=401), cors)
            return
        if self.max_body_size:
            too_large = self._body_too_large(headers)
            if too_large is not None:
                await self._send_error(send, too_large, cors)
                return
            receive = _limit_body(receive, self.max_body_size)
        if method == "POST" and path in PROXY_POST:
            await self._proxy_body(scope, receive, send, PROXY_POST[path], cors)
            return
        if method == "POST" and _SLOT_ACTION.match(path):  # llama-server's slot files, routed by ?model=
            raw = (scope.get("raw_path") or path.encode()).decode("latin-1")  # still percent-encoded
            query = scope.get("query_string", b"").decode("latin-1")
            await self._proxy_body(scope, receive, send, f"{raw}?{query}", cors)
            return
        if method == "GET" and path in PROXY_GET and b"model=" in scope.get("query_string", b""):
            await self._proxy_get(scope, receive, send, PROXY_GET[path], cors)
            return
        if self.webui.handles(method, path):
            await self.webui(scope, receive, send)
            return
        if cors:
            send = self._with_headers(send, cors)
        await self.admin(scope, receive, send)

    def route_table(self) -> list[tuple[str, str]]:
        """Every (method, path) this app serves, path parameters as `{name}`: the proxied
        routes, the router's own (Starlette) routes and the web UI's files. /openapi.json and
        the security tests are built from it, so a new route is documented and tested as is."""
        table: dict[tuple[str, str], None] = {}
        for path in PROXY_POST:
            table["POST", path] = None
        for path in PROXY_GET:
            table["GET", path] = None
        table["POST", "/slots/{id_slot}"] = None
        for route in self.admin.routes:
            if isinstance(route, Route):
                path = route.path.replace(":path}", "}")
                for method in sorted((route.methods or {"GET"}) - {"HEAD"}):
                    table[method, path] = None
        if self.webui.enabled:
            for path in ("/", "/index.html", "/favicon.ico", "/static/{file}", "/assets/{file}"):
                table["GET", path] = None
        return list(table)

    def _body_too_large(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        length = _header(headers, b"content-length")
        if length is None:
            return None  # chunked: `_limit_body` counts
        if not length.isdigit():
            return APIError("Invalid Content-Length header", param="content-length")
        if int(length) > self.max_body_size:
            return _too_large(self.max_body_size)
        return None

    def _is_public(self, path: str) -> bool:
        return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        token = b""
        auth = _header(headers, b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            token = auth[7:].strip()
        else:
            token = (_header(headers, b"x-api-key") or b"").strip()
        ok = False
        for key in self.api_keys:  # no early exit: time does not depend on which key matched
            ok |= hmac.compare_digest(token, key)
        return ok

    def _cors_headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]] | None:
        origin = _header(headers, b"origin")
        if origin is None:
            return None
        if "*" in self.cors_origins:
            return [(b"access-control-allow-origin", b"*")]
        if origin.decode("latin-1") in self.cors_origins:
            return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        return None

    async def _preflight(self, headers: list[tuple[bytes, bytes]], cors: list[tuple[bytes, bytes]] | None,
                         send: Send) -> None:
        out: list[tuple[bytes, bytes]] = [(b"content-length", b"0")]
        if cors:
            req_headers = _header(headers, b"access-control-request-headers")
            out += [*cors, (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                    (b"access-control-allow-headers", req_headers or b"authorization, content-type, x-api-key"),
                    (b"access-control-max-age", b"600")]
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return wrapped

    @staticmethod
    async def _send_error(send: Send, exc: APIError, cors: list[tuple[bytes, bytes]] | None = None) -> None:
        extra = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
        start, body = json_response_messages(exc.status_code, exc.body(), [*extra, *(cors or [])])
        await send(start)
        await send(body)

    # ------------------------------------------------------------------ the proxied routes

    async def _proxy_body(self, scope: Scope, receive: Receive, send: Send, upstream_path: str,
                          cors: list[tuple[bytes, bytes]] | None) -> None:
        try:
            body = await _read_body(receive)
            name = self._model_from_body(body, scope.get("query_string", b""), _header(scope["headers"], b"content-type"))
            handle = self._lookup(name, scope)
        except APIError as e:
            await self._send_error(send, e, cors)
            return
        await self._run_proxied(scope, receive, send, handle, "POST", upstream_path, body, cors)

    async def _proxy_get(self, scope: Scope, receive: Receive, send: Send, upstream_path: str,
                         cors: list[tuple[bytes, bytes]] | None) -> None:
        query = parse_qs(scope["query_string"].decode("latin-1"))
        try:
            handle = self._lookup(query["model"][0], scope)
        except APIError as e:
            await self._send_error(send, e, cors)
            return
        await self._run_proxied(scope, receive, send, handle, "GET", upstream_path, b"", cors)

    def _model_from_body(self, body: bytes, query: bytes = b"", content_type: bytes | None = None) -> str:
        sep = boundary(content_type) if content_type is not None else None
        name: object
        if sep is not None:
            name = form_field(body, sep, "model")
        else:
            data = parse_json(body)
            if not isinstance(data, dict):
                raise APIError("Request body must be a JSON object")
            name = data.get("model")
        if name is None and query:
            name = parse_qs(query.decode("latin-1")).get("model", [None])[0]
        if name is None and len(self.pool.handles) == 1:
            return next(iter(self.pool.handles))
        if not isinstance(name, str) or not name:
            raise APIError("'model' is required (a name from GET /v1/models)", param="model")
        return name

    def _lookup(self, name: str, scope: Scope) -> ModelHandle:
        handle = self.pool.get(name)
        if handle is None:
            raise not_found(f"model {name!r} not found (see GET /v1/models)")
        if handle.state in (ModelState.READY, ModelState.SLEEPING, ModelState.LOADING):
            return handle
        if not self.pool.config.autoload or not _query_autoload(scope.get("query_string", b"")):
            raise APIError(f"model {name!r} is not loaded (autoload is off; POST /models/load first)",
                           param="model", code="model_not_loaded")
        return handle

    def resolve_model(self, name: str | None, scope: Scope) -> str:
        """The model a translated request (the Responses API) goes to, or the proxy's 400/404."""
        if name is None and len(self.pool.handles) == 1:
            return next(iter(self.pool.handles))
        if not name:
            raise APIError("'model' is required (a name from GET /v1/models)", param="model")
        self._lookup(name, scope)
        return name

    @contextlib.asynccontextmanager
    async def open_chat(self, model: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Admit one chat-completions stream for `model` and yield its parsed SSE chunks.

        The same admission as a proxied request (autoload, queue, --models-max); leaving closes
        the upstream stream (the worker cancels the request) and releases the model. An upstream
        error status comes out as its own `APIError`; a cut stream as a final `{"error"}` chunk.
        """
        handle = self.pool.get(model)
        if handle is None:
            raise not_found(f"model {model!r} not found (see GET /v1/models)")
        trace = self._begin_trace(request_id([]), handle, "/v1/responses")
        try:
            async with self._open_chat(model, handle, body, trace) as chunks:
                yield chunks
        except APIError as e:
            trace.status = e.status_code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.is_cancelled = True
            raise
        finally:
            self._end_trace(trace)

    @contextlib.asynccontextmanager
    async def _open_chat(self, model: str, handle: ModelHandle, body: dict[str, Any],
                         trace: RequestTrace) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        base = await self._admit(handle, trace)
        try:
            req = self.pool.client.build_request("POST", base + "/v1/chat/completions", json=body,
                                                 headers={"x-request-id": trace.request_id})
            try:
                resp = await self.pool.client.send(req, stream=True)
            except httpx.TransportError as e:
                raise APIError(f"upstream for model {model!r} is unreachable: {e!r}", status_code=503,
                               type="unavailable_error", code=503, headers={"Retry-After": "1"}) from None
            try:
                trace.status = resp.status_code
                if resp.status_code != 200:
                    raise _upstream_error(resp.status_code, await resp.aread())
                yield _sse_chunks(resp, model, trace)
            finally:
                await resp.aclose()
        finally:
            handle.release()

    # ---- request traces (router.request_trace): metrics, the request log and profiling read them

    def _begin_trace(self, rid: str, handle: ModelHandle, route: str) -> RequestTrace:
        trace = RequestTrace(rid, handle.name, route)
        self.active[id(trace)] = trace
        return trace

    async def _admit(self, handle: ModelHandle, trace: RequestTrace) -> str:
        """`handle.ensure_ready()`, marking whether (and in which model state) the request waited."""
        is_waiting = not handle.can_admit()
        if is_waiting:
            trace.queued(handle.state.value)
        base = await handle.ensure_ready()
        if is_waiting and self.profiling.profiler.is_active:
            try:
                await self.profiling.joined(handle.name)  # a worker that just loaded joins the run first
            except BaseException:
                handle.release()  # admitted, but the client left
                raise
        trace.ready()
        return base

    def _end_trace(self, trace: RequestTrace) -> None:
        del self.active[id(trace)]
        trace.end()
        self.events.emit("request", trace.event())

    async def _run_proxied(self, scope: Scope, receive: Receive, send: Send, handle: ModelHandle, method: str,
                           upstream_path: str, body: bytes, cors: list[tuple[bytes, bytes]] | None) -> None:
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
        trace = self._begin_trace(request_id(scope["headers"]), handle, scope["path"])
        send = trace.wrap(send)
        qs = scope.get("query_string", b"")
        target = upstream_path + ("?" + qs.decode("latin-1") if qs and method == "GET" else "")
        try:
            base = await self._admit(handle, trace)
            try:
                trace.status = await self._forward_with_retry(send, handle, method, base, target, scope, body, cors,
                                                              trace.request_id)
            finally:
                handle.release()
        except APIError as e:
            trace.status = e.status_code
            await self._send_error(send, e, cors)
        except Exception as e:  # a bug: answer with the envelope if nothing was sent yet
            trace.status = 500
            log.exception("proxying to model %s failed", handle.name)
            with contextlib.suppress(Exception):
                await self._send_error(send, APIError(f"internal error: {e!r}", status_code=500, type="server_error"))
        except asyncio.CancelledError:
            # The client left (the watcher cancelled us), or uvicorn's graceful shutdown ran out:
            # either way there is nobody left to answer (the trace still reports it).
            trace.is_cancelled = True
            return
        finally:
            done = True
            watcher.cancel()
            self._end_trace(trace)

    async def _forward_with_retry(self, send: Send, handle: ModelHandle, method: str, base: str, target: str,
                                  scope: Scope, body: bytes, cors: list[tuple[bytes, bytes]] | None,
                                  rid: str) -> int:
        headers = [*request_headers(scope["headers"]), (REQUEST_ID_HEADER, rid.encode())]
        for attempt in (1, 2):
            try:
                return await forward(self.pool.upstream, self.pool.client, send, method, base, target, headers,
                                     body, model=handle.name, cors=cors)
            except UpstreamUnavailable as e:
                # A keep-alive connection the worker closed just as we reused it: retry once.
                if attempt == 2 or not e.retryable:
                    raise APIError(str(e), status_code=503, type="unavailable_error", code=503,
                                   headers={"Retry-After": "1"}) from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ the router's own routes

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def list_models(self, request: Request) -> Response:
        if request.query_params.get("reload", "").lower() in ("1", "true", "yes", "on"):
            await self._reload()  # llama.cpp's `GET /models?reload=1`
        return JSONResponse({"object": "list", "data": self.pool.models()})

    async def reload_models(self, request: Request) -> Response:
        return JSONResponse({"success": True, **await self._reload()})

    async def _reload(self) -> dict[str, list[str]]:
        """Re-read the presets; a broken file changes nothing and is a 400 that says why."""
        try:
            return await self.pool.reload()
        except PresetError as e:
            log.error("preset reload rejected, running config unchanged: %s", e)
            raise APIError(f"preset reload rejected, running config unchanged: {e}", code="invalid_preset") from None

    def _reload_in_background(self) -> None:
        """SIGHUP: reload; errors are logged (by `_reload`)."""
        async def run() -> None:
            with contextlib.suppress(APIError):
                await self._reload()

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        handle = self.pool.get(name)
        if handle is None:
            raise not_found(f"model {name!r} not found")
        return JSONResponse(handle.card())

    async def _handle_from_body(self, request: Request) -> ModelHandle:
        body = await request.body()
        name = self._model_from_body(body)
        handle = self.pool.get(name)
        if handle is None:
            raise not_found(f"model {name!r} not found")
        return handle

    async def load_model(self, request: Request) -> Response:
        handle = await self._handle_from_body(request)
        task = asyncio.create_task(self.pool.load(handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return JSONResponse({"success": True})

    async def unload_model(self, request: Request) -> Response:
        handle = await self._handle_from_body(request)
        if not await handle.unload():
            raise APIError(f"model {handle.name!r} is not loaded", param="model", code="model_not_loaded")
        return JSONResponse({"success": True})

    async def sleep_model(self, request: Request) -> Response:
        handle = await self._handle_from_body(request)
        if not await handle.sleep():
            raise APIError(f"model {handle.name!r} is not loaded and idle", param="model", code="model_not_loaded")
        return JSONResponse({"success": True})

    async def models_sse(self, request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            async with self.events.subscribe(frozenset({"status_change"})) as queue:
                for h in self.pool.handles.values():
                    yield _sse("model_status", {"model": h.name, "status": h.status()})
                while True:
                    try:
                        event, data = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    yield _sse(event, data)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def openapi(self, request: Request) -> Response:
        """An OpenAPI 3.1 document of every route (router.openapi), built from `route_table()`."""
        return JSONResponse(openapi_document(self.route_table(), list(self.pool.handles)))

    async def metrics_text(self, request: Request) -> Response:
        """Prometheus text: the router's series and every running worker's (router.metrics)."""
        return Response(await self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _canonical_name(self, name: str) -> str | None:
        handle = self.pool.get(name)
        return None if handle is None else handle.name

    async def props(self, request: Request) -> Response:
        return JSONResponse({
            "role": "router",
            "build_info": "omni-router",
            "models": [h.card() for h in self.pool.handles.values()],
            "models_max": self.pool.config.models_max,
            "models_autoload": self.pool.config.autoload,
        })


def _query_autoload(query: bytes) -> bool:
    """`?autoload=false` (or 0/no/off) turns autoload off for one request."""
    if b"autoload=" not in query:
        return True
    value = parse_qs(query.decode("latin-1")).get("autoload", ["true"])[0].lower()
    return value not in ("false", "0", "no", "off")


def _upstream_error(status: int, raw: bytes) -> APIError:
    """An upstream's error answer, as the same envelope (a non-JSON body becomes the message)."""
    try:
        err = json.loads(raw)["error"]
        if not isinstance(err, dict):
            err = {"message": str(err)}
    except (ValueError, KeyError, TypeError):
        err = {"message": raw.decode(errors="replace")[:500] or f"upstream status {status}"}
    extra = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
    kind = cast(ErrorType, err.get("type") or ("invalid_request_error" if status < 500 else "server_error"))
    return APIError(str(err.get("message", "")), status_code=status, type=kind, param=err.get("param"),
                    code=err.get("code"), extra=extra)


async def _sse_chunks(resp: httpx.Response, model: str, trace: RequestTrace) -> AsyncIterator[dict[str, Any]]:
    try:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            trace.chunk(data.encode())
            yield json.loads(data)
    except (httpx.TransportError, ValueError) as e:
        yield {"error": {"message": f"upstream for model {model!r} stopped mid-stream ({e!r})"}}


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


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


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
