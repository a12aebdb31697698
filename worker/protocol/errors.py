"""The error envelope and request-body parsing, shared by the router and the worker.

Every HTTP error anywhere in the product is one envelope,
`{"error": {"message", "type", "param", "code"}}`, raised as `APIError` and rendered by
`api_error_handler` (register it with Starlette's `exception_handlers`). A body is parsed with
`parse_json` (any JSON) or `parse_model` (into a pydantic model); both raise a 400 `APIError`
naming the bad field, never a 500. No torch, no llama_cpp, no request models here.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.protocol.strict import unknown_fields_message

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "exceed_context_size_error",
    "unavailable_error",
    "server_error",
    "not_supported_error",
]


class APIError(Exception):
    """An error that becomes the OpenAI error envelope with the given HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        if status_code == 503 and not any(k.lower() == "retry-after" for k in headers or {}):
            headers = {**(headers or {}), "Retry-After": "1"}  # every 503 says when to come back
        if status_code == 501:  # not supported by this server's configuration: retrying cannot help
            headers = {**(headers or {}), "x-should-retry": "false"}  # (the openai SDK retries any other 5xx)
        self.headers = headers
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code, **self.extra)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The one error envelope. `extra` carries llama-server's additions (e.g. n_ctx)."""
    err: dict[str, Any] = {"message": message, "type": type, "param": param, "code": code}
    err.update(extra)
    return {"error": err}


def not_found(message: str, param: str | None = "model") -> APIError:
    return APIError(message, status_code=404, type="not_found_error", param=param, code="model_not_found")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for `APIError` (and, registered on 500, anything else)."""
    if isinstance(exc, APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)
    return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTPException (404 route, 405 method) in our envelope."""
    status = int(getattr(exc, "status_code", 500))
    detail = str(getattr(exc, "detail", "error"))
    kind: str = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse(error_body(detail, kind), status_code=status)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    """`('stop', 'list[str]', 0)` -> `stop.0`: drop pydantic's union-branch tags."""
    parts = [str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts)


def _describe_validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    unknown = list(dict.fromkeys(_field_path(tuple(e.get("loc", ())))
                                 for e in errors if e.get("type") == "extra_forbidden"))
    if unknown:  # one rule (worker/protocol/strict.py): every unknown field is named, before anything else
        return APIError(unknown_fields_message(unknown), param=unknown[0])
    first = errors[0]
    loc = _field_path(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    return APIError(f"Invalid value for '{loc}': {msg}" if loc else msg, param=loc or None)


M = TypeVar("M", bound=BaseModel)


# `\ud800`..`\udfff` escapes: only a body with one can decode to a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def parse_json(raw: bytes | bytearray) -> Any:
    """Any JSON value, or a 400: invalid JSON or UTF-8, nesting too deep for the decoder
    (a RecursionError), or a string with a lone surrogate (valid JSON, but no text: it
    would fail later, when the string is encoded for a tokenizer or a log)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"Invalid JSON body: {e}") from None
    except RecursionError:
        raise APIError("Invalid JSON body: nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise APIError("Invalid JSON body: a string holds a lone UTF-16 surrogate (not valid Unicode)")
    return data


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_model(model_cls: type[M], raw: bytes | Any) -> M:
    """Parse a request body (raw bytes or already-decoded JSON) or raise a 400 APIError."""
    data = parse_json(raw) if isinstance(raw, (bytes, bytearray)) else raw
    if not isinstance(data, dict):
        raise APIError("Request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise _describe_validation_error(e) from None
