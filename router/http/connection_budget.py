"""The router's connection budget: how many client connections it holds before it answers 503.

Every descriptor the router has comes out of its RLIMIT_NOFILE (raised to the hard limit at start,
`router/cli.py`). A client connection holds one. A request forwarded to one of our own workers
holds a second, but those are bounded (a model's slots + `--forward-margin`,
`router/lifecycle/model.py`), so they fit in a reserve with the workers' pipes (three each), the
log files, the model files read for their headers and the upstream keep-alive pool. A `cmd` or
`remote` upstream is not bounded (its capacity is unknown), so with one in the presets each client
connection may hold two:

    reserve = max(128, limit // 16)
    budget  = (limit - reserve) // (2 if an unbounded upstream is configured else 1)

`--max-connections N` sets it by hand (0: this rule). Past the budget, uvicorn's
`limit_concurrency` answers the new connection's request before the app runs, and closes it; the
answer is ours (OpenAI's error envelope, `Retry-After: 1`), not uvicorn's plain text. The streams
already running keep going: nothing they hold is taken. Out of descriptors for real (a budget set
above the limit), uvloop accepts and at once closes a waiting connection (the client sees a reset):
the budget is what turns that into a 503. uvicorn logs each refusal; a filter keeps that to one
line per 10 s with the count in between, and counts every one for /metrics
(`omni_router:connections_refused_total`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from router.observability.metrics import CONNECTION_REFUSALS

RESERVE_MIN = 128
RESERVE_SHARE = 16  # 1/16 of the limit: 1,250 of 20,000
_LOG_EVERY_S = 10.0
_UVICORN_REFUSAL = "Exceeded concurrency limit."

_BODY = json.dumps({"error": {
    "message": "the router is at its connection budget (--max-connections); retry shortly",
    "type": "service_unavailable", "param": None, "code": "connection_budget",
}}).encode()


def connection_budget(limit: int, *, unbounded_upstreams: bool) -> int:
    """Client connections the router holds at most, from its open-files limit (the rule above)."""
    reserve = max(RESERVE_MIN, limit // RESERVE_SHARE)
    return max(1, (limit - reserve) // (2 if unbounded_upstreams else 1))


async def _service_unavailable(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close"),
    ]})
    await send({"type": "http.response.body", "body": _BODY, "more_body": False})


class _RefusalLogFilter(logging.Filter):
    """uvicorn's one warning per refused connection, thinned to one line per 10 s with a count."""

    def __init__(self) -> None:
        super().__init__()
        self._last = 0.0
        self._since = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != _UVICORN_REFUSAL:
            return True
        CONNECTION_REFUSALS.count += 1  # /metrics: omni_router:connections_refused_total
        self._since += 1
        now = time.monotonic()
        if now - self._last < _LOG_EVERY_S:
            return False
        record.msg = "connection budget reached: %d connection(s) answered 503 since the last line"
        record.args = (self._since,)
        self._last, self._since = now, 0
        return True


def install() -> None:
    """Our 503 in place of uvicorn's, and the thinned log line; before `uvicorn.run`."""
    import importlib

    for name in ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # httptools not installed: h11 only
            continue
        if hasattr(module, "service_unavailable"):
            setattr(module, "service_unavailable", _service_unavailable)  # noqa: B010  # a module of uvicorn: mypy cannot see the name
    logging.getLogger("uvicorn.error").addFilter(_RefusalLogFilter())
