"""The one place where lifecycle and request events are emitted.

`EventBus.emit(event, data)` fans out to subscribers (each a bounded asyncio.Queue; a
subscriber that falls behind loses its oldest events rather than slowing the router).

Event names follow llama.cpp's router: `status_change` when a model's status changes
(`{"model": name, "status": {...}}`). `/models/sse` also sends one `model_status` event per
model on connect (a snapshot). Request events are `request` (`{"model", "path", "status",
"duration_ms", "request_id", "queued_ms", "ttft_ms", "prompt_tokens", "completion_tokens",
"is_cancelled", "trace"}`; `trace` is the `router.observability.request_trace.RequestTrace`, not JSON), one
per proxied request when it ends. Lifecycle details for router.observability.metrics: `load_started` (a spawn
begins), `wake_started`, `evicted` (`{"model", "reason"}`: `lru`, `idle`).
Subscribers: /models/sse, router.observability.metrics, the request log (router.observability.logs),
router.observability.profiling.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

Event = tuple[str, dict[str, Any]]


class EventBus:
    def __init__(self, queue_size: int = 1000) -> None:
        self._subscribers: dict[asyncio.Queue[Event], frozenset[str] | None] = {}
        self._queue_size = queue_size

    def wants(self, event: str) -> bool:
        """Whether anyone listens for `event` (lets the hot path skip building the payload)."""
        return any(names is None or event in names for names in self._subscribers.values())

    def emit(self, event: str, data: dict[str, Any]) -> None:
        for q, names in self._subscribers.items():
            if names is not None and event not in names:
                continue
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait((event, data))

    @contextlib.asynccontextmanager
    async def subscribe(self, names: frozenset[str] | None = None) -> AsyncIterator[asyncio.Queue[Event]]:
        """A queue of (event, data) for the given event names (None: all)."""
        q: asyncio.Queue[Event] = asyncio.Queue(self._queue_size)
        self._subscribers[q] = names
        try:
            yield q
        finally:
            self._subscribers.pop(q, None)
