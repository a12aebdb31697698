"""Logs: each worker's output in a ring buffer, the router's own log likewise, one structured
line per proxied request, and the routes that serve them.

    GET /logs[?model=NAME][&lines=N]          the last N lines (text/plain; no model: the router's)
    GET /logs/stream[?model=NAME][&no-history] SSE, one `data:` line per log line as it is written

The rings themselves are router/log_ring.py's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from router.endless import EndlessStreams
from router.events import EventBus
from router.log_ring import RING_LINES, ROUTER_LOG, WORKER_LOGS, LogBook, LogRing
from worker.protocol.errors import APIError, not_found

KEEPALIVE_S = 15.0
request_log = logging.getLogger("omni.router.request")


# --------------------------------------------------------------------------- the request log


def request_line(data: dict[str, Any]) -> str:
    """One `request` event as logfmt: `request id=... model=... route=... status=... ...`."""
    d = data
    return (f"request id={d['request_id']} model={d['model']} route={d['path']} status={d['status']} "
            f"queued_ms={d['queued_ms']} ttft_ms={_v(d['ttft_ms'])} total_ms={d['duration_ms']} "
            f"prompt_tokens={_v(d['prompt_tokens'])} completion_tokens={_v(d['completion_tokens'])} "
            f"cancelled={'true' if d['is_cancelled'] else 'false'}")


def _v(value: object) -> str:
    return "-" if value is None else str(value)


async def log_requests(events: EventBus) -> None:
    """Log one line per proxied request (logger `omni.router.request`, INFO)."""
    async with events.subscribe(frozenset({"request"})) as queue:
        while True:
            _, data = await queue.get()
            if request_log.isEnabledFor(logging.INFO):
                request_log.info("%s", request_line(data))


# --------------------------------------------------------------------------- routes


class LogRoutes:
    """`resolve(name)`: the model's canonical name (aliases allowed), or None if unknown."""

    def __init__(self, resolve: Callable[[str], str | None], book: LogBook = WORKER_LOGS,
                 router_ring: LogRing = ROUTER_LOG, endless: EndlessStreams | None = None) -> None:
        self._resolve = resolve
        self._endless = endless or EndlessStreams()  # /logs/stream ends when the router stops
        self._book = book
        self._router = router_ring

    def routes(self) -> list[Route]:
        return [Route("/logs", self.logs), Route("/logs/stream", self.stream)]

    def _ring(self, request: Request) -> LogRing:
        name = request.query_params.get("model")
        if not name:
            return self._router
        canonical = self._resolve(name)
        if canonical is None:
            raise not_found(f"model {name!r} not found (see GET /v1/models)")
        return self._book.ring(canonical)

    async def logs(self, request: Request) -> Response:
        ring = self._ring(request)
        try:
            n = int(request.query_params.get("lines", RING_LINES))
        except ValueError:
            raise APIError("lines must be an integer", param="lines") from None
        lines = ring.tail(n)
        return PlainTextResponse("".join(line + "\n" for line in lines))

    async def stream(self, request: Request) -> Response:
        ring = self._ring(request)
        q = request.query_params
        with_history = "no-history" not in q and "no_history" not in q

        async def lines() -> AsyncIterator[bytes]:
            async with ring.subscribe(with_history) as queue:
                yield b": connected\n\n"
                while True:
                    try:
                        line = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    yield b"data: " + line.encode() + b"\n\n"

        return self._endless.response(lines())
