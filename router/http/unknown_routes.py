"""Requests no route serves, logged once per (method, path) with the client's user-agent.

The router's access log is off (uvicorn's `access_log=False`: a line per request is too much
for the hot path), so an app that calls a route we do not have (Open WebUI's Ollama connection
asked for /api/ps and /api/version, read our 404s as an empty list and showed nothing) left no
trace. This layer sits in front of the router's own routes (the proxied ones never reach it):
a request that matches none of them is logged the first time its method and path are seen
(at most `MAX_SEEN` of them, so a scanner cannot grow the set), then answered as before.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

log = logging.getLogger("omni.router.app")
MAX_SEEN = 1024


class UnknownRoutes:
    def __init__(self, app: Starlette) -> None:
        self._app = app
        self._seen: set[tuple[str, str]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._is_served(scope):
            key = (scope["method"], scope["path"])
            if key not in self._seen and len(self._seen) < MAX_SEEN:
                self._seen.add(key)
                agent = next((v for k, v in scope["headers"] if k == b"user-agent"), b"-").decode("latin-1")
                log.warning("no route for %s %s (user-agent %r); answered 404/405, logged once", *key, agent)
        await self._app(scope, receive, send)

    def _is_served(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] is Match.FULL for route in self._app.routes)
