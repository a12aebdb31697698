"""Anthropic's error envelope: `{"type": "error", "error": {"type", "message"}}`.

Our errors are `APIError`s (OpenAI's envelope). `AnthropicErrors` is an ASGI layer that
rewrites every error answer on the Messages API's paths, whoever made it (the API key layer,
the body-size limit, the routes, Starlette's 404/405), into Anthropic's envelope, with
Anthropic's error type for the status and 529 `overloaded_error` where we would send 503.
Successful answers (and streams) pass through untouched.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATH_PREFIX = "/v1/messages"
OVERLOADED = 529

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}


def status_of(status: int) -> int:
    return OVERLOADED if status == 503 else status


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status_of(status)), "message": message}}


def _message(raw: bytes, status: int) -> str:
    """The message of an error body in OpenAI's envelope (param named), or the body's text."""
    try:
        err = json.loads(raw)["error"]
        message, param = str(err["message"]), err.get("param")
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500] or f"status {status}"
    return message if not param or param in message else f"{param}: {message}"


class AnthropicErrors:
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
            out = json.dumps(error_body(status, _message(b"".join(body), status))).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                           b"content-type")]
            await send(
                {
                    **start,
                    "status": status_of(status),
                    "headers": [
                        *headers,
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(out)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": out})

        await self._app(scope, receive, rewrite)
