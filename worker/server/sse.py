"""ASGI responses that run a `Generation` and cancel it when the client goes away.

Starlette's StreamingResponse notices a disconnect only on the next write (ASGI >= 2.4), and a
plain JSONResponse never does; a request that waits for its last token would keep its slot.
Here a watcher task reads `receive()` until `http.disconnect` and cancels the tasks at once,
so the engine frees the slot within one step, for streaming and non-streaming requests alike.
Tasks are submitted when the body starts being produced, and cancelled on every way out.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from worker.server.generation import Generation

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

SSE_KEEPALIVE_S = 15.0
KEEPALIVE = b": keep-alive\n\n"

Producer = Callable[[Send], Awaitable[None]]


class GenerationResponse(Response):
    """Runs `produce(send)` (which drives `gen`) while watching for the client to leave."""

    def __init__(self, gen: Generation, produce: Producer) -> None:
        self.gen = gen
        self.produce = produce
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A plain asyncio task, not an anyio task group: creating, starting and cancelling a
        # task group cost ~0.3 ms of CPU per request (its cancel message formats the task's
        # repr), a sixth of a cached answer's worker time; this costs ~0.05 ms.
        gen = self.gen
        host = asyncio.current_task()
        assert host is not None
        state = {"done": False, "left": False}

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gen.cancel()
            if not state["done"]:
                state["left"] = True
                host.cancel()  # raised in produce, at the await it waits on

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            await self.produce(send)
        except OSError:  # the client went away mid-write
            pass
        except asyncio.CancelledError:
            if not state["left"] or host.uncancel() > 0:
                raise  # cancelled from outside as well
        finally:
            state["done"] = True
            watcher.cancel()
            gen.cancel()  # a no-op for finished tasks


def keepalive_interval() -> float:
    """Seconds without an event after which a stream gets a `: keep-alive` comment (Dynamo sends
    them too): a long prefill or a wait for a slot must not look like a dead connection to a
    proxy or a client's read timeout. OMNI_SSE_KEEPALIVE_S changes it (0: never)."""
    return float(os.environ.get("OMNI_SSE_KEEPALIVE_S", str(SSE_KEEPALIVE_S)))


def event_stream(gen: Generation, chunks: AsyncIterator[bytes]) -> GenerationResponse:
    """Server-sent events from `chunks` (an iterator over the generation's events), with a
    keep-alive comment whenever nothing was sent for `keepalive_interval()` seconds, or for the
    request's own `sse_ping_interval` (llama-server's; <= 0: none)."""
    asked = gen.params.sse_ping_interval
    interval = keepalive_interval() if asked is None else max(0.0, asked)

    async def produce(send: Send) -> None:
        # An event is one ASGI message, which the server writes whole, so the lock only orders a
        # comment against a pending event. asyncio's Lock takes its free path without yielding;
        # anyio's yields to the loop on every acquire (a checkpoint), one loop turn per token.
        lock = asyncio.Lock()
        clock = asyncio.get_running_loop().time
        last = clock()

        async def body(data: bytes) -> None:
            nonlocal last
            async with lock:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                last = clock()

        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(max(0.0, last + interval - clock()))
                if clock() - last >= interval:
                    await body(KEEPALIVE)

        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async with anyio.create_task_group() as tg:
            if interval > 0:
                tg.start_soon(keep_alive)
            async for data in chunks:
                await body(data)
            tg.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return GenerationResponse(gen, produce)


def aggregated(gen: Generation, build: Callable[[], Awaitable[tuple[int, Any]]]) -> GenerationResponse:
    """One JSON body, from `build()` -> (status, object) once the generation is done."""

    async def produce(send: Send) -> None:
        status, obj = await build()
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return GenerationResponse(gen, produce)
