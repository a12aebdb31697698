"""Error answers on one path prefix rewritten into another API's envelope.

Our errors leave in OpenAI's envelope (`APIError`), Starlette's 404/405 and some outer layers'
as plain text. `ErrorEnvelope` is an ASGI layer that, on its prefix only, holds back an error
answer (status >= 400) until its whole body is in, takes its message (`message_of`) and sends
what the API's `envelope(status, message)` makes of it: the status to send and the JSON body.
Successful answers and streams pass untouched. router.anthropic.errors and router.ollama.errors
give the envelopes; router.http.app wires one layer per API.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (status, message) -> (the status to send, the JSON body)
Envelope = Callable[[int, str], tuple[int, object]]


def message_of(raw: bytes, status: int) -> str:
    """The message of an error body in our envelope (param named), or the body's text."""
    try:
        err = json.loads(raw)["error"]
        if isinstance(err, str):
            return err
        message, param = str(err["message"]), err.get("param")
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500] or f"status {status}"
    return message if not param or param in message else f"{param}: {message}"


class ErrorEnvelope:
    def __init__(self, app: ASGIApp, prefix: str, envelope: Envelope,
                 content_type: bytes = b"application/json") -> None:
        self._app = app
        self._prefix = prefix
        self._envelope = envelope
        self._content_type = content_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self._prefix):
            await self._app(scope, receive, send)
            return
        start: Message | None = None
        body: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole error body is in
                return
            if start is None:
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, out = self._envelope(start["status"], message_of(b"".join(body), start["status"]))
            raw = json.dumps(out).encode()
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() not in (b"content-length", b"content-type")]
            await send({
                **start,
                "status": status,
                "headers": [
                    *headers,
                    (b"content-type", self._content_type),
                    (b"content-length", str(len(raw)).encode()),
                ],
            })
            await send({"type": "http.response.body", "body": raw})

        await self._app(scope, receive, rewrite)
