"""Logs: each worker's output in a ring buffer, the router's own log likewise, one structured
line per proxied request, and the routes that serve them.

    GET /logs[?model=NAME][&lines=N]          the last N lines (text/plain; no model: the router's)
    GET /logs/stream[?model=NAME][&no-history] SSE, one `data:` line per log line as it is written

`WORKER_LOGS` is process-wide (keyed by model name) because the reader of a worker's pipe
(`router.process.WorkerProcess`) has no path to the app; a model's ring outlives its process,
so the output of a worker that crashed is still there. Rings are bounded (`RING_LINES`), and
so is each subscriber's queue (one that falls behind loses its oldest lines, never the router's
time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from router.events import EventBus
from worker.errors import APIError, not_found

RING_LINES = 2000
SUBSCRIBER_LINES = 1000
KEEPALIVE_S = 15.0
request_log = logging.getLogger("omni.router.request")


class LogRing:
    """The last `maxlen` lines of one source, and live subscribers (any thread may append)."""

    def __init__(self, maxlen: int = RING_LINES) -> None:
        self.lines: deque[str] = deque(maxlen=maxlen)
        self._subscribers: dict[asyncio.Queue[str], asyncio.AbstractEventLoop] = {}
        self._lock = threading.Lock()

    def append(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
            subscribers = list(self._subscribers.items())
        for q, loop in subscribers:
            if _running_loop() is loop:
                _put_dropping_oldest(q, line)
            else:
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    loop.call_soon_threadsafe(_put_dropping_oldest, q, line)

    @contextlib.asynccontextmanager
    async def subscribe(self, with_history: bool) -> AsyncIterator[asyncio.Queue[str]]:
        q: asyncio.Queue[str] = asyncio.Queue(SUBSCRIBER_LINES)
        with self._lock:  # history and subscription at once: no line lost or doubled between them
            if with_history:
                for line in list(self.lines)[-SUBSCRIBER_LINES:]:
                    q.put_nowait(line)
            self._subscribers[q] = asyncio.get_running_loop()
        try:
            yield q
        finally:
            with self._lock:
                self._subscribers.pop(q, None)

    def tail(self, n: int) -> list[str]:
        with self._lock:
            return list(self.lines)[-n:] if n > 0 else []


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _put_dropping_oldest(q: asyncio.Queue[str], line: str) -> None:
    if q.full():
        with contextlib.suppress(asyncio.QueueEmpty):
            q.get_nowait()
    q.put_nowait(line)


class LogBook:
    """One ring per model name."""

    def __init__(self) -> None:
        self._rings: dict[str, LogRing] = {}

    def ring(self, name: str) -> LogRing:
        ring = self._rings.get(name)
        if ring is None:
            ring = self._rings.setdefault(name, LogRing())
        return ring


WORKER_LOGS = LogBook()
ROUTER_LOG = LogRing()


class RingHandler(logging.Handler):
    """Copies the router's own log records into `ROUTER_LOG`."""

    def __init__(self, ring: LogRing) -> None:
        super().__init__()
        self._ring = ring
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.exc_info or record.stack_info or not hasattr(record, "asctime"):
                line = self.format(record)
            else:  # the console handler formatted it already: reuse its time stamp (strftime is slow)
                line = f"{record.asctime} {record.levelname} {record.name}: {record.getMessage()}"
            self._ring.append(line)
        except Exception:
            self.handleError(record)


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
                 router_ring: LogRing = ROUTER_LOG) -> None:
        self._resolve = resolve
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

        return StreamingResponse(lines(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
