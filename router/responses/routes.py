"""The Responses API's HTTP routes, under `/v1`, without it, and under `/v3` (OpenVINO Model
Server's path): `/responses[...]` and `/conversations[...]`.

Each handler reads the request's key here, on the event loop (router.keys.context), and hands
the service its `Owner`: the store's thread never sees the ContextVar."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from router.keys.context import current_key
from router.observability.request_trace import request_id
from router.responses.service import ResponsesService
from router.responses.store import ANYONE, Owner, page
from router.responses.wire import AddItems, CreateConversation, CreateResponse
from worker.protocol.errors import APIError, parse_model

PREFIXES = ("/v1", "", "/v3")
T = TypeVar("T")
ResolveModel = Callable[[str | None, Scope], str]  # 404 / 400 for a model the router cannot serve


def _owner() -> Owner:
    """The request's key as an owner: its name goes on what it stores; an admin key (and a router
    without keys) sees every stored object, a user key only its own."""
    key = current_key()
    return ANYONE if key is None else Owner(key.name, sees_all=key.is_admin)


def _page_args(request: Request) -> dict[str, Any]:
    q = request.query_params
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError("Invalid value for 'limit': expected an integer from 1 to 100", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError("Invalid value for 'order': expected 'asc' or 'desc'", param="order")
    return {"limit": limit, "order": order, "after": q.get("after")}


def _event_stream(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> Response:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                      **(headers or {})})


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run `work` (a response without streaming); a client that disconnects cancels it (None),
    which closes the upstream stream, so the worker stops generating. A plain handler would run
    on to the last token: Starlette notices a disconnect only when it writes."""
    task = asyncio.ensure_future(work)

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_left())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise  # we are cancelled ourselves (shutdown)
        return None


class ResponsesRoutes:
    def __init__(self, service: ResponsesService, resolve_model: ResolveModel) -> None:
        self.service = service
        self.resolve_model = resolve_model

    def routes(self) -> list[Route]:
        out = []
        for p in PREFIXES:
            out += [
                Route(f"{p}/responses", self.create, methods=["POST"]),
                Route(f"{p}/responses/{{rid}}", self.get, methods=["GET"]),
                Route(f"{p}/responses/{{rid}}", self.delete, methods=["DELETE"]),
                Route(f"{p}/responses/{{rid}}/cancel", self.cancel, methods=["POST"]),
                Route(f"{p}/responses/{{rid}}/input_items", self.input_items, methods=["GET"]),
                Route(f"{p}/conversations", self.create_conversation, methods=["POST"]),
                Route(f"{p}/conversations/{{cid}}", self.get_conversation, methods=["GET"]),
                Route(f"{p}/conversations/{{cid}}", self.update_conversation, methods=["POST"]),
                Route(f"{p}/conversations/{{cid}}", self.delete_conversation, methods=["DELETE"]),
                Route(f"{p}/conversations/{{cid}}/items", self.items, methods=["GET"]),
                Route(f"{p}/conversations/{{cid}}/items", self.add_items, methods=["POST"]),
                Route(f"{p}/conversations/{{cid}}/items/{{item_id}}", self.get_item, methods=["GET"]),
                Route(f"{p}/conversations/{{cid}}/items/{{item_id}}", self.delete_item, methods=["DELETE"]),
            ]
        return out

    # ---- responses

    async def create(self, request: Request) -> Response:
        req = parse_model(CreateResponse, await request.body())
        model = self.resolve_model(req.model, request.scope)
        rid = request_id(request.scope["headers"])
        prepared = await self.service.prepare(req, model, rid, _owner())
        headers = {"x-request-id": rid}
        if req.stream:
            return _event_stream(await self.service.stream(prepared), headers)
        if req.background:
            return JSONResponse(await self.service.create(prepared), headers=headers)
        body = await _unless_client_leaves(request, self.service.create(prepared))
        if body is None:
            return Response(status_code=499)  # nobody is there to read it (nginx's "client closed request")
        return JSONResponse(body, headers=headers)

    async def get(self, request: Request) -> Response:
        rid = request.path_params["rid"]
        if request.query_params.get("stream", "false").lower() == "true":
            try:
                after = int(request.query_params.get("starting_after", "-1"))
            except ValueError:
                raise APIError("Invalid value for 'starting_after': expected an integer",
                               param="starting_after") from None
            return _event_stream(self.service.follow(rid, after, _owner()))
        return JSONResponse(await self.service.get(rid, _owner()))

    async def delete(self, request: Request) -> Response:
        return JSONResponse(await self.service.delete(request.path_params["rid"], _owner()))

    async def cancel(self, request: Request) -> Response:
        return JSONResponse(await self.service.cancel(request.path_params["rid"], _owner()))

    async def input_items(self, request: Request) -> Response:
        args = _page_args(request)
        items = await self.service.input_items(request.path_params["rid"], _owner())
        return JSONResponse(page(items, **args))

    # ---- conversations

    async def create_conversation(self, request: Request) -> Response:
        body = await request.body()
        req = parse_model(CreateConversation, body or b"{}")
        return JSONResponse(await self.service.create_conversation(req, _owner()))

    async def get_conversation(self, request: Request) -> Response:
        return JSONResponse(await self.service.get_conversation(request.path_params["cid"], _owner()))

    async def update_conversation(self, request: Request) -> Response:
        req = parse_model(CreateConversation, await request.body())
        return JSONResponse(
            await self.service.update_conversation(request.path_params["cid"], req.metadata or {}, _owner())
        )

    async def delete_conversation(self, request: Request) -> Response:
        return JSONResponse(await self.service.delete_conversation(request.path_params["cid"], _owner()))

    async def items(self, request: Request) -> Response:
        args = _page_args(request)
        return JSONResponse(page(await self.service.items(request.path_params["cid"], _owner()), **args))

    async def add_items(self, request: Request) -> Response:
        req = parse_model(AddItems, await request.body())
        added = await self.service.add_items(request.path_params["cid"], req, _owner())
        return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"],
                             "last_id": added[-1]["id"], "has_more": False})

    async def get_item(self, request: Request) -> Response:
        cid, item_id = request.path_params["cid"], request.path_params["item_id"]
        return JSONResponse(await self.service.get_item(cid, item_id, _owner()))

    async def delete_item(self, request: Request) -> Response:
        cid, item_id = request.path_params["cid"], request.path_params["item_id"]
        return JSONResponse(await self.service.delete_item(cid, item_id, _owner()))
