"""The one place where lifecycle and request events are emitted.

`EventBus.emit(event, data)` fans out to subscribers (each a bounded asyncio.Queue; a
subscriber that falls behind loses its oldest events rather than slowing the router).
`/models/sse` subscribes here; metrics can subscribe later.

Event names follow llama.cpp's router: `status_change` when a model's status changes
(`{"model": name, "status": {...}}`). `/models/sse` also sends one `model_status` event per
model on connect (a snapshot). Request events are `request` (`{"model", "path", "status",
"duration_ms"}`), emitted only when someone listens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

Event = tuple[str, dict[str, Any]]


class EventBus:
    def __init__(self, queue_size: int = 1000) -> None:
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._queue_size = queue_size

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def emit(self, event: str, data: dict[str, Any]) -> None:
        for q in self._subscribers:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait((event, data))

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[asyncio.Queue[Event]]:
        q: asyncio.Queue[Event] = asyncio.Queue(self._queue_size)
        self._subscribers.add(q)
        try:
            yield q
        finally:
            self._subscribers.discard(q)
