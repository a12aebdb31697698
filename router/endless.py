"""Event streams that never end by themselves (/models/sse, /logs/stream) end as the router stops.

uvicorn's graceful shutdown waits for every request in flight, up to `timeout_graceful_shutdown`
(router.cli), before the lifespan's shutdown stops the workers. A completion ends by itself and
keeps that grace; an event stream never does, so one open web UI tab (it follows /models/sse)
made every stop wait out the whole bound, then log the stream's cancellation as an error with a
traceback. router.cli's server calls `close()` as its shutdown begins: each stream then ends at
once with a proper end of body (a client reconnects if it wants to), and so does any opened after.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class EndlessStreams:
    def __init__(self) -> None:
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every stream now (the router is stopping)."""
        self._closing.set()

    def response(self, chunks: AsyncIterator[bytes]) -> StreamingResponse:
        """An SSE response of `chunks` that ends when `close()` is called."""
        return StreamingResponse(self._until_closed(chunks), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _until_closed(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        closing = asyncio.ensure_future(self._closing.wait())
        step: asyncio.Future[bytes] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(chunks))
                await asyncio.wait((step, closing), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return  # closing: the finally cancels the step
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield chunk
        finally:
            closing.cancel()
            if step is not None and not step.done():
                # The stream's own cleanup (its unsubscribe) runs in that task as it is cancelled.
                step.cancel()
