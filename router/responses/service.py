"""One response's run: history, the upstream chat stream, events, the store, background tasks.

The router hands us `open_chat(model, body, rid=)`: an async context manager that admits one request
for the model through the router's own path (autoload, queue, `--models-max`), POSTs the
chat-completions body to its upstream and yields the parsed SSE chunks; leaving it closes the
upstream stream (the worker sees a cancel) and releases the model. An upstream error before
the stream (a 4xx/5xx) comes out of it as an `APIError` and reaches the client as it is.

Background responses are tasks owned here (`_live`); GET reads their live object, cancel
cancels the task, which closes the upstream stream on its way out.

Every call for a stored object takes the caller's `Owner` (router.responses.store), made from the
request's key by the routes: a response or conversation another user key made is answered as one
that does not exist, live ones included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.responses.builder import ResponseBuilder
from router.responses.store import ChainBroken, NotContinuable, Owner, Store
from router.responses.translate import chat_body, chat_messages, drop_oldest, echo, is_call_forced
from router.responses.wire import (
    AddItems,
    CreateConversation,
    CreateResponse,
    Item,
    dump_item,
    new_id,
    parse_items,
    with_id,
)
from worker.protocol.errors import APIError

log = logging.getLogger("omni.router.responses")

Chunk = dict[str, Any]


class OpenChat(Protocol):
    """(model, chat body, rid=the request id) -> the upstream's chunks (ChatBridge.open_chat)."""

    def __call__(self, model: str, body: dict[str, Any], *,
                 rid: str | None = None) -> AbstractAsyncContextManager[AsyncIterator[Chunk]]: ...


MAX_TRUNCATION_TRIES = 8


@dataclass
class Prepared:
    """A validated request, ready to run."""

    req: CreateResponse
    model: str
    input_items: list[Item]
    body: dict[str, Any]
    builder: ResponseBuilder
    is_stored: bool
    request_id: str  # X-Request-Id: the client's or a new one; sent upstream and returned
    owner: Owner  # whose it is (the request's key), for every store call it makes


@dataclass
class _Live:
    """A background response while it runs: its events so far, for anyone following them."""

    builder: ResponseBuilder
    owner: str | None  # the key that started it (Owner.name)
    task: asyncio.Task[None] | None = None
    events: list[Chunk] = field(default_factory=list)  # events[i]["sequence_number"] == i
    is_done: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, events: list[Chunk]) -> None:
        self.events.extend(events)
        self._wake.set()
        self._wake = asyncio.Event()

    def end(self) -> None:
        self.is_done = True
        self._wake.set()

    async def follow(self, after: int) -> AsyncIterator[Chunk]:
        i = max(after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.is_done:
                return
            await self._wake.wait()


def _sse(events: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        async for ev in events:
            yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return gen()


def _not_found(what: str, rid: str, param: str | None = None) -> APIError:
    return APIError(
        f"{what} with id '{rid}' not found.", status_code=404, type="not_found_error", param=param
    )


class ResponsesService:
    def __init__(self, store: Store, open_chat: OpenChat) -> None:
        self.store = store
        self.open_chat = open_chat
        self._live: dict[str, _Live] = {}

    def _need_store(self, param: str | None = None) -> None:
        if not self.store.is_enabled:
            raise APIError("the response store is disabled on this router (--responses-max-entries 0): "
                           "stored responses and conversations are not available", param=param)

    # ------------------------------------------------------------------ create

    async def prepare(self, req: CreateResponse, model: str, request_id: str, owner: Owner) -> Prepared:
        req.check()
        req.function_tools()  # 400 for a built-in tool type before anything else
        input_items = [with_id(it) for it in req.input_items()]
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            self._need_store("previous_response_id")
            try:
                history = await self.store.call(self.store.chain, req.previous_response_id, owner)
            except ChainBroken as e:
                raise _not_found("Previous response", str(e), "previous_response_id") from None
            except NotContinuable as e:
                raise APIError(f"Previous response '{e}' holds n > 1 samples: which one continues is the "
                               "client's choice; send that sample's output items in 'input' instead",
                               param="previous_response_id") from None
        elif req.conversation_id is not None:
            self._need_store("conversation")
            history = await self._conversation_items(req.conversation_id, owner, "conversation")
        if req.background:
            self._need_store("background")
        messages = chat_messages(req.instructions, parse_items(history, "history") + input_items)
        if not messages:
            raise APIError("'input' is empty", param="input")
        fields = echo(req, model)
        is_stored = req.store and self.store.is_enabled
        fields["store"] = is_stored
        builder = ResponseBuilder(new_id("resp"), fields,
                                  status="queued" if req.background else "in_progress",
                                  max_tool_calls=req.max_tool_calls, is_call_forced=is_call_forced(req),
                                  wants_summary=req.reasoning is not None and req.reasoning.wants_summary,
                                  num_choices=req.n)
        return Prepared(req, model, input_items, chat_body(req, model, messages), builder, is_stored,
                        request_id, owner)

    async def _connect(self, p: Prepared) -> tuple[AsyncExitStack, AsyncIterator[Chunk]]:
        """Open the upstream stream; with `truncation: auto`, drop the oldest messages until it fits."""
        body = p.body
        for _ in range(MAX_TRUNCATION_TRIES):
            stack = AsyncExitStack()
            try:
                return stack, await stack.enter_async_context(self.open_chat(p.model, body, rid=p.request_id))
            except APIError as e:
                await stack.aclose()
                if p.req.truncation != "auto" or e.type != "exceed_context_size_error":
                    raise
                n_ctx, n_prompt = e.extra.get("n_ctx"), e.extra.get("n_prompt_tokens")
                fraction = (
                    1 - n_ctx / n_prompt if isinstance(n_ctx, int) and isinstance(n_prompt, int) else 0.25
                )
                messages = drop_oldest(body["messages"], fraction)
                if messages is None:
                    raise
                body = {**body, "messages": messages}
        raise APIError("the input does not fit the model's context even after truncation", param="input",
                       type="exceed_context_size_error")

    async def _events(
        self, p: Prepared, stack: AsyncExitStack, chunks: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        """The response's events, from `response.created` to its final event; stores it at the end."""
        b = p.builder
        async with stack:
            for ev in b.start():
                yield ev
            async for chunk in chunks:
                if "error" in chunk:
                    err = chunk["error"]
                    message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    for ev in b.fail(message):
                        yield ev
                    break
                for ev in b.feed(chunk):
                    yield ev
            else:
                for ev in b.finish():
                    yield ev
        await self._save(p)

    async def _save(self, p: Prepared) -> None:
        if p.is_stored:
            await self.store.call(self.store.put_response, p.builder.snapshot(),
                                  [dump_item(it) for it in p.input_items], p.owner)
        cid = p.req.conversation_id
        if cid is not None and p.builder.status != "queued":
            items = [dump_item(it) for it in p.input_items] + [
                dump_item(with_id(it)) for it in p.builder.output
            ]
            await self.store.call(self.store.add_items, cid, items)

    async def create(self, p: Prepared) -> dict[str, Any]:
        """A response without streaming (or a background one: returned queued at once)."""
        if p.req.background:
            return await self._start_background(p)
        stack, chunks = await self._connect(p)
        async for _ in self._events(p, stack, chunks):
            pass
        return p.builder.snapshot()

    async def stream(self, p: Prepared) -> AsyncIterator[bytes]:
        """Connect first (so an upstream 4xx is an HTTP error), then the SSE bytes."""
        if p.req.background:
            await self._start_background(p)
            return self.follow(p.builder.id, -1, p.owner)
        stack, chunks = await self._connect(p)
        return _sse(self._events(p, stack, chunks))

    def follow(self, rid: str, after: int, owner: Owner) -> AsyncIterator[bytes]:
        """A running background response's events after sequence number `after` (leaving
        does not cancel it)."""
        live = self._live_for(rid, owner)
        if live is None:
            raise APIError(
                f"Response with id '{rid}' is not running in the background: only those can be streamed "
                "again (GET it without stream)",
                param="stream",
            )
        return _sse(live.follow(after))

    # ------------------------------------------------------------------ background

    async def _start_background(self, p: Prepared) -> dict[str, Any]:
        await self._save(p)  # queued: retrievable at once
        live = self._live[p.builder.id] = _Live(p.builder, p.owner.name)
        live.task = asyncio.create_task(self._run_background(p, live), name=f"response {p.builder.id}")
        live.task.add_done_callback(lambda _: self._live.pop(p.builder.id, None))
        return p.builder.snapshot()

    async def _run_background(self, p: Prepared, live: _Live) -> None:
        b = p.builder
        try:
            try:
                stack, chunks = await self._connect(p)
            except APIError as e:
                live.push(b.start() + b.fail(e.message, str(e.code or e.type)))
                await self._save(p)
                return
            async for ev in self._events(p, stack, chunks):
                live.push([ev])
        except asyncio.CancelledError:
            b.cancel()
            with contextlib.suppress(Exception):
                await asyncio.shield(self._save(p))
        except Exception as e:  # a bug: the response fails, the router goes on
            log.exception("background response %s failed", b.id)
            b.fail(f"internal error: {e!r}")
            with contextlib.suppress(Exception):
                await self._save(p)
        finally:
            live.end()

    def _live_for(self, rid: str, owner: Owner) -> _Live | None:
        """The running background response `rid`, if `owner` may see it."""
        live = self._live.get(rid)
        return live if live is not None and owner.can_see(live.owner) else None

    async def cancel(self, rid: str, owner: Owner) -> dict[str, Any]:
        live = self._live_for(rid, owner)
        if live is not None and live.task is not None:
            live.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(live.task), 10)
            return live.builder.snapshot()
        body = await self.get(rid, owner)
        if not body.get("background"):
            raise APIError(
                "Only responses created with background=true can be cancelled.", param="response_id"
            )
        return body  # already finished: cancelling again changes nothing

    async def close(self) -> None:
        tasks = [live.task for live in self._live.values() if live.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ stored responses

    async def _stored(self, rid: str, owner: Owner) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        self._need_store()
        found = await self.store.call(self.store.get_response, rid, owner)
        if found is None:
            raise _not_found("Response", rid, "response_id")
        return found

    async def get(self, rid: str, owner: Owner) -> dict[str, Any]:
        live = self._live_for(rid, owner)
        if live is not None:
            return live.builder.snapshot()
        return (await self._stored(rid, owner))[0]

    async def delete(self, rid: str, owner: Owner) -> dict[str, Any]:
        self._need_store()
        if self._live_for(rid, owner) is not None:
            await self.cancel(rid, owner)  # or its task would store it again when it ends
        if not await self.store.call(self.store.delete_response, rid, owner):
            raise _not_found("Response", rid, "response_id")
        return {"id": rid, "object": "response.deleted", "deleted": True}

    async def input_items(self, rid: str, owner: Owner) -> list[dict[str, Any]]:
        return (await self._stored(rid, owner))[1]

    # ------------------------------------------------------------------ conversations

    async def _conversation_items(
        self, cid: str, owner: Owner, param: str | None = None
    ) -> list[dict[str, Any]]:
        await self.get_conversation(cid, owner, param)
        return await self.store.call(self.store.items, cid)

    async def create_conversation(self, req: CreateConversation, owner: Owner) -> dict[str, Any]:
        self._need_store()
        items = [dump_item(with_id(it)) for it in parse_items(req.items, "items")]
        cid = new_id("conv")
        await self.store.call(self.store.put_conversation, cid, int(time.time()), req.metadata or {}, owner)
        if items:
            await self.store.call(self.store.add_items, cid, items)
        return await self.get_conversation(cid, owner)

    async def get_conversation(self, cid: str, owner: Owner, param: str | None = None) -> dict[str, Any]:
        self._need_store(param)
        conv = await self.store.call(self.store.get_conversation, cid, owner)
        if conv is None:
            raise _not_found("Conversation", cid, param)
        return conv

    async def update_conversation(self, cid: str, metadata: dict[str, str], owner: Owner) -> dict[str, Any]:
        self._need_store()
        if not await self.store.call(self.store.set_metadata, cid, metadata, owner):
            raise _not_found("Conversation", cid)
        return await self.get_conversation(cid, owner)

    async def delete_conversation(self, cid: str, owner: Owner) -> dict[str, Any]:
        self._need_store()
        if not await self.store.call(self.store.delete_conversation, cid, owner):
            raise _not_found("Conversation", cid)
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    async def items(self, cid: str, owner: Owner) -> list[dict[str, Any]]:
        return await self._conversation_items(cid, owner)

    async def add_items(self, cid: str, req: AddItems, owner: Owner) -> list[dict[str, Any]]:
        await self.get_conversation(cid, owner)
        items = [dump_item(with_id(it)) for it in parse_items(req.items, "items")]
        await self.store.call(self.store.add_items, cid, items)
        return items

    async def get_item(self, cid: str, item_id: str, owner: Owner) -> dict[str, Any]:
        for it in await self._conversation_items(cid, owner):
            if it.get("id") == item_id:
                return it
        raise _not_found("Item", item_id)

    async def delete_item(self, cid: str, item_id: str, owner: Owner) -> dict[str, Any]:
        conv = await self.get_conversation(cid, owner)
        if not await self.store.call(self.store.delete_item, cid, item_id):
            raise _not_found("Item", item_id)
        return conv
