"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: one message's run.

The router hands us `open_chat(model, body, route)` (admits the request as a proxied one,
yields the upstream's parsed chat chunks; leaving closes the upstream stream), `call_json(model,
path, body)` (one admitted JSON call) and `resolve_model` (the proxy's 400/404 for a model it
cannot serve). Errors are raised as `APIError`s; router.anthropic.errors' layer puts every error
answer on these paths into Anthropic's envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from router.anthropic.builder import MessageBuilder, sse
from router.anthropic.translate import chat_body, count_body
from router.anthropic.wire import CountTokensRequest, CreateMessage, parse_request
from router.responses.bridge import chunk_error
from worker.protocol.errors import APIError

Chunk = dict[str, Any]
OpenChat = Callable[..., AbstractAsyncContextManager[AsyncIterator[Chunk]]]
CallJSON = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]
ResolveModel = Callable[[str | None, Scope], str]
PING_INTERVAL_S = 15.0
QUEUE_CHUNKS = 64  # chunks read ahead of a slow client before the upstream waits
COUNT_PATH = "/v1/chat/completions/input_tokens"  # the worker's count for a chat request


async def _pump(chunks: AsyncIterator[Chunk], queue: asyncio.Queue[Chunk | None]) -> None:
    """The upstream's chunks into `queue`, then None (an error chunk if reading failed)."""
    try:
        async for chunk in chunks:
            await queue.put(chunk)
    except Exception as e:  # the bridge turns transport errors into error chunks; anything else is a bug
        await queue.put({"error": {"message": f"reading the upstream failed: {e!r}"}})
    await queue.put(None)



class MessagesRoutes:
    def __init__(self, open_chat: OpenChat, call_json: CallJSON, resolve_model: ResolveModel) -> None:
        self.open_chat = open_chat
        self.call_json = call_json
        self.resolve_model = resolve_model

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        req = parse_request(CreateMessage, await request.body())
        model = self.resolve_model(req.model, request.scope)
        body = chat_body(req, model)
        builder = MessageBuilder(model, tuple(req.stop_sequences or ()))
        stack = AsyncExitStack()
        chunks = await stack.enter_async_context(self.open_chat(model, body, route="/v1/messages"))
        if req.stream:
            return StreamingResponse(self._stream(builder, stack, chunks), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        async with stack:
            async for chunk in chunks:
                failed = chunk_error(chunk)
                if failed is not None:
                    raise APIError(failed, status_code=500, type="server_error")
                builder.feed(chunk)
        builder.finish()
        return JSONResponse(builder.snapshot())

    async def _stream(
        self, b: MessageBuilder, stack: AsyncExitStack, chunks: AsyncIterator[Chunk]
    ) -> AsyncIterator[bytes]:
        """The SSE bytes: message_start, a ping, the blocks, message_delta, message_stop; a ping
        whenever the upstream is silent for PING_INTERVAL_S; an `error` event if it dies.

        One task reads the upstream into a small queue (so waiting for a chunk can time out
        without cancelling the upstream's generator mid-read); leaving cancels it."""
        async with stack:
            queue: asyncio.Queue[Chunk | None] = asyncio.Queue(QUEUE_CHUNKS)
            pump = asyncio.create_task(_pump(chunks, queue))
            try:
                for ev in b.start():
                    yield sse(ev)
                yield sse({"type": "ping"})
                while True:
                    try:
                        async with asyncio.timeout(PING_INTERVAL_S):
                            chunk = await queue.get()
                    except TimeoutError:
                        yield sse({"type": "ping"})
                        continue
                    if chunk is None:
                        break
                    failed = chunk_error(chunk)
                    if failed is not None:
                        yield sse({"type": "error", "error": {"type": "api_error", "message": failed}})
                        return
                    for ev in b.feed(chunk):
                        yield sse(ev)
                for ev in b.finish():
                    yield sse(ev)
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    async def count_tokens(self, request: Request) -> Response:
        req = parse_request(CountTokensRequest, await request.body())
        model = self.resolve_model(req.model, request.scope)
        counted = await self.call_json(model, COUNT_PATH, count_body(req, model))
        return JSONResponse({"input_tokens": int(counted["input_tokens"])})
