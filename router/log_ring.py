"""Bounded line rings: each worker's output (`WORKER_LOGS`, one ring per model name) and the
router's own log (`ROUTER_LOG`), with live subscribers. A leaf: the process that reads a worker's
pipe (router.lifecycle.process) writes here, the log routes (router.observability.logs) read.

`WORKER_LOGS` is process-wide (keyed by model name) because the reader of a worker's pipe has no
path to the app; a model's ring outlives its process, so the output of a worker that crashed is
still there. Rings are bounded (`RING_LINES`), and so is each subscriber's queue (one that falls
behind loses its oldest lines, never the router's time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator

RING_LINES = 2000
SUBSCRIBER_LINES = 1000


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
