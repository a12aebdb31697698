"""The router's ASGI application: wiring only. Its layers, outside in:

    Cors                         worker.protocol.front (the same rules as the worker's)
    ErrorEnvelope                router.http.error_envelope with router.anthropic.errors: errors on
                                 /v1/messages in Anthropic's envelope
    ErrorEnvelope                router.http.error_envelope with router.ollama.errors: errors on
                                 /api/* in Ollama's {"error": "..."}
    KeyGuard                     router.keys.guard: the route table's access, a key's limits
    Front                        router.http.front: body limit, dispatch
      proxied routes             router.http.forwarding (raw ASGI, the hot path)
      web UI files               router.http.webui
      the router's own routes    Starlette: router.http.admin, the log and profiling routes
                                 (router.observability), the Responses API (router.responses),
                                 Anthropic's Messages API (router.anthropic), Ollama's API
                                 (router.ollama), pulls (router.hub: /models/pull, /api/pull);
                                 unknown routes logged once (router.http.unknown_routes)

The translated APIs reach a model through `ChatBridge.open_chat` (router.responses.bridge), the
same admission and request tracing (router.observability.requests) as a proxied request.
Keys (`--api-key`, `--keys FILE`; router.keys): one middleware and one table of routes; the
request's key is what `Pool.get` and the model listings consult to show a key only its models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from router.anthropic import errors as anthropic_errors
from router.anthropic.routes import MessagesRoutes
from router.endless import EndlessStreams
from router.http.admin import AdminRoutes
from router.http.error_envelope import ErrorEnvelope
from router.http.forwarding import Forwarder
from router.http.front import DEFAULT_MAX_BODY_SIZE, PROXY_GET, PROXY_POST, Front
from router.http.unknown_routes import UnknownRoutes
from router.http.webui import WebUI
from router.hub.download import Pulled
from router.hub.pulls import PULLS
from router.hub.routes import PullRoutes
from router.keys.book import KeyBook
from router.keys.guard import KeyGuard
from router.keys.keyfile import load_keyring
from router.keys.routes import KeyRoutes
from router.lifecycle.gpu_admission import GpuPlacement
from router.lifecycle.pool import Pool
from router.log_ring import ROUTER_LOG, RingHandler
from router.observability.gpu_metrics import GpuCollector
from router.observability.logs import LogRoutes, log_requests
from router.observability.metrics import RouterMetrics
from router.observability.profiling import RouterProfiling
from router.observability.requests import ActiveRequests
from router.ollama import errors as ollama_errors
from router.ollama.routes import OllamaRoutes
from router.presets import PresetError
from router.responses.bridge import ChatBridge
from router.responses.routes import ResponsesRoutes
from router.responses.service import ResponsesService
from router.responses.store import Store
from router.speech.chat import SpokenChat
from worker.protocol.errors import APIError, api_error_handler, http_exception_handler
from worker.protocol.front import Cors

__all__ = ["PROXY_GET", "PROXY_POST", "ResponsesConfig", "RouterApp"]

log = logging.getLogger("omni.router.app")


@dataclass
class ResponsesConfig:
    """The Responses API's store: `max_entries` 0 turns it off."""

    data_dir: Path | None = None
    max_entries: int = 0
    ttl_s: float = 30 * 24 * 3600.0


class RouterApp:
    """The ASGI application served by `omni-router`."""

    def __init__(
        self,
        pool: Pool,
        *,
        api_keys: list[str] | None = None,
        cors_origins: list[str] | None = None,
        responses: ResponsesConfig | None = None,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        keys_file: Path | None = None,
    ) -> None:
        self.pool = pool
        rc = responses or ResponsesConfig()
        data_dir = rc.data_dir or Path(".")
        self.events = pool.events
        self.profiling = RouterProfiling(self.events, pool.handles, pool.client, data_dir)
        plain_keys = list(api_keys or [])
        self.keys = KeyBook(load_keyring(keys_file, plain_keys),
                            source=None if keys_file is None else lambda: load_keyring(keys_file, plain_keys))
        self.requests = ActiveRequests(self.events, self.profiling, self.keys.record)
        self.forwarder = Forwarder(pool, self.requests)
        self.store = Store(data_dir / "responses.sqlite3", max_entries=rc.max_entries, ttl_s=rc.ttl_s)
        bridge = ChatBridge(pool, self.requests)
        self.forwarder.spoken = SpokenChat(pool, bridge)  # chat answers spoken by a paired voice
        self.responses = ResponsesService(self.store, bridge.open_chat)
        self.metrics = RouterMetrics(self.events, pool.handles, pool.client, self.requests.active.values)
        if isinstance(pool.placement, GpuPlacement):  # per-GPU gauges (router/observability/gpu_metrics.py)
            self.metrics.registry.register(GpuCollector(pool.placement.figures))
        self.metrics.registry.register(self.keys.usage)  # requests and tokens by key and model
        self.endless = EndlessStreams()  # router.cli's server closes them as its shutdown begins
        self.logs = LogRoutes(self._canonical_name, endless=self.endless)
        self.webui = WebUI()  # the bundled chat page (webui/), if present
        self.admin_routes = AdminRoutes(pool, self.forwarder, self.metrics, self.route_table,
                                        reload_keys=self.keys.prepare_reload, endless=self.endless)
        self.admin = Starlette(
            routes=[
                *self.admin_routes.routes(),
                *KeyRoutes(self.keys).routes(),
                *self.logs.routes(),
                *self.profiling.routes(),
                *ResponsesRoutes(self.responses, self.forwarder.resolve_model).routes(),
                *MessagesRoutes(bridge.open_chat, bridge.call_json, self.forwarder.resolve_model).routes(),
                *OllamaRoutes(pool, bridge.open_chat, bridge.call_json,
                              self.forwarder.resolve_model).routes(),
                *PullRoutes(PULLS, self._after_pull).routes(),  # POST /models/pull, /api/pull (router/hub)
            ],
            exception_handlers={APIError: api_error_handler, HTTPException: http_exception_handler,
                                500: api_error_handler},
            lifespan=self._lifespan,
        )
        inner: ASGIApp = Front(self.forwarder, self.webui, UnknownRoutes(self.admin), max_body_size)
        inner = KeyGuard(inner, self.keys)  # open when no key is configured
        # errors on /v1/messages in Anthropic's envelope, the 401 too
        inner = ErrorEnvelope(inner, anthropic_errors.PATH_PREFIX, anthropic_errors.envelope)
        # errors on /api/* as Ollama writes them, the 401 too
        inner = ErrorEnvelope(inner, ollama_errors.PATH_PREFIX, ollama_errors.envelope,
                              ollama_errors.CONTENT_TYPE)
        origins = cors_origins or []
        self._asgi = Cors(inner, "*" if "*" in origins else ",".join(origins))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._asgi(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        observers = [asyncio.create_task(self.metrics.run(), name="metrics"),
                     asyncio.create_task(log_requests(self.events), name="request-log")]
        log_handler = RingHandler(ROUTER_LOG)
        logging.getLogger().addHandler(log_handler)
        await asyncio.sleep(0)  # the observers subscribe before the first event
        await self.pool.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(
            NotImplementedError, RuntimeError, ValueError
        ):  # not the main thread, or no SIGHUP
            loop.add_signal_handler(signal.SIGHUP, self.admin_routes.reload_in_background)
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

    async def _after_pull(self, pulled: Pulled) -> str | None:
        """A model just pulled is served once the presets are read again (the hub cache is
        discovered): the name it is served under, if it is."""
        with contextlib.suppress(PresetError):
            await self.pool.reload()
        handle = self.pool.get(pulled.name)
        return None if handle is None else handle.name

    def _canonical_name(self, name: str) -> str | None:
        handle = self.pool.get(name)
        return None if handle is None else handle.name
