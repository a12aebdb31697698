"""Anthropic's error envelope: `{"type": "error", "error": {"type", "message"}}`.

Our errors are `APIError`s (OpenAI's envelope). `envelope` is what router.http.error_envelope's
layer (wired in router.http.app) makes of every error answer on the Messages API's paths,
whoever made it (the API key layer, the body-size limit, the routes, Starlette's 404/405):
Anthropic's envelope, with Anthropic's error type for the status and 529 `overloaded_error`
where we would send 503. Successful answers (and streams) pass through untouched.
"""

from __future__ import annotations

from typing import Any

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


def envelope(status: int, message: str) -> tuple[int, object]:
    return status_of(status), error_body(status, message)
