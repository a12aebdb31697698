"""The router's own routes (Starlette): /health, /v1/models, /models/load|unload|sleep|reload,
/models/sse, /props, /metrics, /openapi.json, Dynamo's /dynamo/alpha/list-models and
llama-server's /tools. The log, profiling and Responses routes are
added beside them by their own modules (router.http.app wires them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.endless import EndlessStreams
from router.http.forwarding import Forwarder
from router.http.openapi import openapi_document
from router.keys import views
from router.lifecycle.model import ModelHandle
from router.lifecycle.pool import Pool
from router.observability.metrics import RouterMetrics
from router.presets import PresetError
from worker.protocol.errors import APIError, not_found, parse_model
from worker.protocol.strict import StrictModel

log = logging.getLogger("omni.router.app")
SSE_KEEPALIVE_S = 15.0


class ModelRef(StrictModel):
    """The body of /models/load, /models/unload and /models/sleep."""

    model: str | None = None  # optional when the router serves one model


class AdminRoutes:
    def __init__(self, pool: Pool, forwarder: Forwarder, metrics: RouterMetrics,
                 route_table: Callable[[], list[tuple[str, str]]],
                 reload_keys: Callable[[], Awaitable[Callable[[], None]]] | None = None,
                 endless: EndlessStreams | None = None) -> None:
        self.pool = pool
        self._endless = endless or EndlessStreams()  # /models/sse ends when the router stops
        self._reload_keys = reload_keys  # parses the keys file, returns what swaps it in (router.keys.book)
        self._forwarder = forwarder
        self._metrics = metrics
        self._route_table = route_table
        self._background: set[asyncio.Task[Any]] = set()

    def routes(self) -> list[Route]:
        return [
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
            Route("/dynamo/alpha/list-models", self.dynamo_list_models),
            Route("/tools", self.tools),
        ]

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def dynamo_list_models(self, request: Request) -> Response:
        """Dynamo's list of models by endpoint: a generation model serves both; an embedding
        model or reranker neither (it is listed in /v1/models)."""
        names = [h.name for h in views.visible(self.pool.handles.values())
                 if not (h.preset.embedding or h.preset.reranking)]
        return JSONResponse({"chat_completion_models": names, "completion_models": names})

    async def tools(self, request: Request) -> Response:
        """llama-server's built-in tools (its `--tools`): none are configured here (with
        `?model=`, the model's worker answers, router.http.front's PROXY_GET)."""
        return JSONResponse([])

    async def list_models(self, request: Request) -> Response:
        if request.query_params.get("reload", "").lower() in ("1", "true", "yes", "on"):
            await self.reload()  # llama.cpp's `GET /models?reload=1`
        return JSONResponse({"object": "list", "data": views.cards(self.pool)})

    async def reload_models(self, request: Request) -> Response:
        return JSONResponse({"success": True, **await self.reload()})

    async def reload(self) -> dict[str, list[str]]:
        """Re-read the presets and the keys file; a broken file changes nothing and is a 400 that
        says why. Running requests keep their key (and their stream)."""
        install_keys = await self._reload_keys() if self._reload_keys is not None else None
        try:
            changes = await self.pool.reload()
        except PresetError as e:
            log.error("preset reload rejected, running config unchanged: %s", e)
            raise APIError(
                f"preset reload rejected, running config unchanged: {e}", code="invalid_preset"
            ) from None
        if install_keys is not None:
            install_keys()
        return changes

    def reload_in_background(self) -> None:
        """SIGHUP: reload; errors are logged (by `reload`)."""
        async def run() -> None:
            with contextlib.suppress(APIError):
                await self.reload()

        self._spawn(run())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        handle = self.pool.get(name)
        if handle is None:
            raise not_found(f"model {name!r} not found")
        return JSONResponse(views.card(handle))

    async def _handle_from_body(self, request: Request) -> ModelHandle:
        body = await request.body()
        if body.strip():
            parse_model(ModelRef, body)  # any other field is a 400 naming it
        name = self._forwarder.model_from_body(body)
        handle = self.pool.get(name)
        if handle is None:
            raise not_found(f"model {name!r} not found")
        return handle

    async def load_model(self, request: Request) -> Response:
        handle = await self._handle_from_body(request)
        self._spawn(self.pool.load(handle))
        return JSONResponse({"success": True})

    async def unload_model(self, request: Request) -> Response:
        handle = await self._handle_from_body(request)
        if not await handle.unload():
            raise APIError(f"model {handle.name!r} is not loaded", param="model", code="model_not_loaded")
        return JSONResponse({"success": True})

    async def sleep_model(self, request: Request) -> Response:
        handle = await self._handle_from_body(request)
        if not await handle.sleep():
            raise APIError(
                f"model {handle.name!r} is not loaded and idle", param="model", code="model_not_loaded"
            )
        return JSONResponse({"success": True})

    async def models_sse(self, request: Request) -> Response:
        events = self.pool.events

        async def stream() -> AsyncIterator[bytes]:
            async with events.subscribe(frozenset({"status_change"})) as queue:
                for h in views.visible(self.pool.handles.values()):
                    yield _sse("model_status", {"model": h.name, "status": views.shown_status(h.status())})
                while True:
                    try:
                        event, data = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    shown = self._shown_event(data)
                    if shown is not None:
                        yield _sse(event, shown)

        return self._endless.response(stream())

    def _shown_event(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """A status event as the request's key may see it (None: not one of its models)."""
        handle = self.pool.handles.get(str(data.get("model")))
        if handle is not None and not views.is_visible(handle):
            return None
        if isinstance(data.get("status"), dict):
            return {**data, "status": views.shown_status(data["status"])}
        return data

    async def openapi(self, request: Request) -> Response:
        """An OpenAPI 3.1 document of every route (router.http.openapi), built from the route table."""
        return JSONResponse(openapi_document(self._route_table(),
                                             [h.name for h in views.visible(self.pool.handles.values())]))

    async def metrics_text(self, request: Request) -> Response:
        """Prometheus text: the router's series and every running worker's (router.observability.metrics)."""
        return Response(await self._metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def props(self, request: Request) -> Response:
        return JSONResponse({
            "role": "router",
            "build_info": "omni-router",
            "models": views.cards(self.pool),
            "models_max": self.pool.config.models_max,
            "models_autoload": self.pool.config.autoload,
        })


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
