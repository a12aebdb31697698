"""Ollama's error body: `{"error": "message"}`, with the status as it is (404 for an unknown
model, 400 for a bad field), so the `ollama` client raises its `ResponseError` with our message.

`envelope` is what router.http.error_envelope's layer (wired in router.http.app) makes of every
error answer on `/api/*`, whoever made it (the API key layer, the body-size limit, the routes,
Starlette's 404/405). Successful answers and streams pass untouched.
"""

from __future__ import annotations

PATH_PREFIX = "/api/"
CONTENT_TYPE = b"application/json; charset=utf-8"


def envelope(status: int, message: str) -> tuple[int, object]:
    return status, {"error": message}
