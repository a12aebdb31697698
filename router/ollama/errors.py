"""Ollama's error body: `{"error": "message"}`, with the status as it is (404 for an unknown
model, 400 for a bad field), so the `ollama` client raises its `ResponseError` with our message.

`OllamaErrors` is an ASGI layer (as router/anthropic/errors.py) that rewrites every error answer
on `/api/*`, whoever made it (the API key layer, the body-size limit, the routes, Starlette's
404/405), from our OpenAI envelope into Ollama's. Successful answers and streams pass untouched.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATH_PREFIX = "/api/"


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


class OllamaErrors:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH_PREFIX):
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
            status = start["status"]
            out = json.dumps({"error": message_of(b"".join(body), status)}).encode()
            headers = [
                (k, v)
                for k, v in start.get("headers", [])
                if k.lower() not in (b"content-length", b"content-type")
            ]
            await send(
                {
                    **start,
                    "headers": [
                        *headers,
                        (b"content-type", b"application/json; charset=utf-8"),
                        (b"content-length", str(len(out)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": out})

        await self._app(scope, receive, rewrite)
