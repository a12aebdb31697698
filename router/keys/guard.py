"""The one middleware for keys: who is calling, may they, and how much.

For each HTTP request (an OPTIONS preflight passes: Cors answers it outside us):

    access = access_for(method, path)        router.keys.access: the route table
    PUBLIC                                   pass
    no key, or an unknown one                401
    ADMIN route, user key                    403 naming the role it needs
    the key is set for the request           router.keys.context (Pool.get and the views read it)
    POST of a USER route (inference)         the key's rpm/tpm buckets (429 + Retry-After), then
                                             its concurrency gate (wait in line; a full line: 429)
    ADMIN route                              an audit line naming the key, the route and the status
                                             (a path in no rule is ADMIN too, but not audited)

The key comes from `Authorization: Bearer KEY` or `X-Api-Key: KEY` (the anthropic SDK's header;
llama-server takes it on every route, and so do we). Errors are in OpenAI's envelope; the layers
outside us put them in Anthropic's on /v1/messages (router.anthropic.errors) and in Ollama's
`{"error": "..."}` on /api/* (router.ollama.errors).

Without `--api-key` or `--keys` nothing is checked: every route is open and cards are whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.keys.access import UNKNOWN, Access, rule_for
from router.keys.book import KeyBook
from router.keys.context import CURRENT
from router.keys.keyfile import Key
from router.keys.limits import Gate, GateFull
from router.keys.views import PROPS_INTERNALS
from worker.protocol.errors import error_body

audit = logging.getLogger("omni.router.audit")


class KeyGuard:
    def __init__(self, app: ASGIApp, book: KeyBook) -> None:
        self._app = app
        self._book = book

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._book.keyring.is_enabled:
            await self._app(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"]
        rule = rule_for(method, path, scope.get("query_string", b"").decode("latin-1"))
        access = UNKNOWN if rule is None else rule
        if access is Access.PUBLIC:
            await self._app(scope, receive, send)
            return
        key = self._book.keyring.identify(_token(scope["headers"]))
        if key is None:
            await _deny(
                scope,
                send,
                401,
                "authentication_error",
                401,  # llama-server's code
                "Invalid API Key",  # llama-server's words, which clients match
            )
            return
        if access is Access.ADMIN and not key.is_admin:
            await _deny(
                scope,
                send,
                403,
                "permission_error",
                "insufficient_permissions",
                f"key {key.name!r} has role {key.role.value}: {method} {path} needs role admin",
            )
            return
        token = CURRENT.set(key)
        try:
            if rule is Access.ADMIN:  # (a path no rule covers is answered 404: no action to audit)
                await self._audited(key, scope, receive, send)
            elif method == "POST":
                await self._metered(key, scope, receive, send)
            elif path == "/props" and not key.is_admin:
                await self._app(scope, receive, _without_internals(send))
            else:
                await self._app(scope, receive, send)
        finally:
            CURRENT.reset(token)

    async def _metered(self, key: Key, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self._book.limits(key)
        if limits is None:
            await self._app(scope, receive, send)
            return
        over = limits.admit(time.monotonic())
        if over is not None:
            kind, wait = over
            limit = key.rpm if kind == "requests" else key.tpm
            await _deny(
                scope,
                send,
                429,
                "rate_limit_error",
                "rate_limit_exceeded",
                f"key {key.name!r} is over its {kind} per minute ({limit}); retry in {wait:.1f} s",
                retry_after_s=wait,
            )
            return
        gate = limits.gate
        if gate is None:
            await self._app(scope, receive, send)
            return
        try:
            replay = await _wait_in_line(gate, receive)
        except GateFull:
            await _deny(
                scope,
                send,
                429,
                "rate_limit_error",
                "concurrency_limit_exceeded",
                f"key {key.name!r} has {gate.active} requests running (its concurrency) and "
                f"{gate.num_waiting} waiting (its queue)",
                retry_after_s=1.0,
            )
            return
        if replay is None:
            return  # the client left while waiting in line: nothing to answer
        try:
            await self._app(scope, replay, send)
        finally:
            gate.release()

    async def _audited(self, key: Key, scope: Scope, receive: Receive, send: Send) -> None:
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, watched)
        finally:
            query = scope.get("query_string", b"").decode("latin-1")
            audit.info(
                "audit: key %r (%s) %s %s%s -> %s",
                key.name,
                key.role.value,
                scope["method"],
                scope["path"],
                f"?{query}" if query else "",
                status or "no answer",
            )


async def _wait_in_line(gate: Gate, receive: Receive) -> Receive | None:
    """`gate.acquire()`, reading the request meanwhile so that a client who leaves while it waits
    gives up its place (None: nobody to answer). Returns the `receive` for the app: what was read
    while waiting, then the rest (a read still pending first: it will be the disconnect)."""
    if gate.can_enter():
        await gate.acquire()
        return receive
    buffered: list[Message] = []
    turn = asyncio.ensure_future(gate.acquire())
    read: asyncio.Future[Message] | None = None
    try:
        while not turn.done():
            if read is None:
                read = asyncio.ensure_future(receive())
            await asyncio.wait((turn, read), return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                continue
            message = read.result()
            read = None
            if message["type"] == "http.disconnect":
                turn.cancel()  # the gate passes on a turn handed over just then
                with contextlib.suppress(asyncio.CancelledError, GateFull):
                    await turn
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    gate.release()  # our turn came before the cancel did
                return None
            buffered.append(message)
        turn.result()  # GateFull: the line is full
    except BaseException:
        turn.cancel()
        if read is not None:
            read.cancel()
        raise
    pending = read

    async def replay() -> Message:
        nonlocal pending
        if buffered:
            return buffered.pop(0)
        if pending is not None:
            waiting, pending = pending, None
            return await waiting
        return await receive()

    return replay


def _token(headers: list[tuple[bytes, bytes]]) -> bytes:
    auth = api_key = b""
    for k, v in headers:
        if k == b"authorization":
            auth = v
        elif k == b"x-api-key":
            api_key = v
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    return b"" if auth else api_key.strip()


async def _deny(
    scope: Scope,
    send: Send,
    status: int,
    kind: str,
    code: str | int,
    message: str,
    retry_after_s: float | None = None,
) -> None:
    body = error_body(message, kind, None, code)  # the outer layers rewrite it for Anthropic and Ollama
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry_after_s is not None:
        headers += [
            (b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(retry_after_s * 1000))).encode()),
        ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _without_internals(send: Send) -> Send:
    """`send` for a user key's /props: a worker's props (`?model=`) lose `model_path`."""
    start: Message | None = None
    chunks: list[bytes] = []

    async def filtered(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                await send(message)
                return
            start = message
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        try:
            data = json.loads(body)
            if isinstance(data, dict) and any(k in data for k in PROPS_INTERNALS):
                body = json.dumps({k: v for k, v in data.items() if k not in PROPS_INTERNALS}).encode()
        except ValueError:
            pass
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return filtered
