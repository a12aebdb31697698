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
from worker.protocol.errors import APIError

Chunk = dict[str, Any]
OpenChat = Callable[..., AbstractAsyncContextManager[AsyncIterator[Chunk]]]
CallJSON = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]
ResolveModel = Callable[[str | None, Scope], str]
PING_INTERVAL_S = 15.0
COUNT_PATH = "/v1/chat/completions/input_tokens"  # the worker's count for a chat request


def _upstream_failed(chunk: Chunk) -> str | None:
    err = chunk.get("error")
    if err is None:
        return None
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


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
                failed = _upstream_failed(chunk)
                if failed is not None:
                    raise APIError(failed, status_code=500, type="server_error")
                builder.feed(chunk)
        builder.finish()
        return JSONResponse(builder.snapshot())

    async def _stream(self, b: MessageBuilder, stack: AsyncExitStack, chunks: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
        """The SSE bytes: message_start, a ping, the blocks, message_delta, message_stop; a ping
        whenever the upstream is silent for PING_INTERVAL_S; an `error` event if it dies."""
        async with stack:
            for ev in b.start():
                yield sse(ev)
            yield sse({"type": "ping"})
            it = aiter(chunks)
            nxt: asyncio.Task[Chunk] | None = None
            try:
                while True:
                    if nxt is None:
                        nxt = asyncio.ensure_future(anext(it))
                    done, _ = await asyncio.wait({nxt}, timeout=PING_INTERVAL_S)
                    if not done:
                        yield sse({"type": "ping"})
                        continue
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        break
                    nxt = None
                    failed = _upstream_failed(chunk)
                    if failed is not None:
                        yield sse({"type": "error", "error": {"type": "api_error", "message": failed}})
                        return
                    for ev in b.feed(chunk):
                        yield sse(ev)
            finally:
                if nxt is not None and not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
            for ev in b.finish():
                yield sse(ev)

    async def count_tokens(self, request: Request) -> Response:
        req = parse_request(CountTokensRequest, await request.body())
        model = self.resolve_model(req.model, request.scope)
        counted = await self.call_json(model, COUNT_PATH, count_body(req, model))
        return JSONResponse({"input_tokens": int(counted["input_tokens"])})
