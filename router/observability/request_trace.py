"""One proxied request's timeline, as the router sees it: ids, wall-clock marks, outcome.

The app makes a `RequestTrace` per proxied request, marks it as the request moves (received,
queued, model ready, first response byte, end) and emits it as the payload of the `request`
event (`trace.event()`); metrics, the request log and the profiler read it from there.

The marks are `time.time()` (wall clock: comparable with the workers' profiling events on the
same host). Token counts are picked out of the response as it passes, without parsing it:
OpenAI `usage` (a non-streaming body, or a stream's last chunk with `include_usage`) or else
llama-server `timings` (`predicted_n`, `prompt_n`, one per choice at its end).
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Message, Send

_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d+)')
_PREDICTED_N = re.compile(rb'"predicted_n":\s*(\d+)')
_PROMPT_N = re.compile(rb'"prompt_n":\s*(\d+)')
_CACHE_N = re.compile(rb'"cache_n":\s*(\d+)')
REQUEST_ID_HEADER = b"x-request-id"
CLIENT_CLOSED = 499
_MAX_ID_LEN = 128


_ID_PREFIX = uuid.uuid4().hex[:8]  # per router process: ids stay unique across restarts
_next_id = itertools.count(1)


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's `X-Request-Id` (if short and printable), else a fresh one (no syscall)."""
    for k, v in headers:
        if k == REQUEST_ID_HEADER and 0 < len(v) <= _MAX_ID_LEN and v.isascii() and v.decode().isprintable():
            return v.decode()
    return f"{_ID_PREFIX}-{next(_next_id)}"


@dataclass(slots=True)
class RequestTrace:
    request_id: str
    model: str
    route: str
    key: str = ""  # the API key's name (router.keys), "" without keys
    t_received: float = field(default_factory=time.time)
    t_queued: float = 0.0  # 0: admitted at once
    state_when_queued: str = ""  # the model's state when it had to wait ("loaded" = waited for a slot)
    t_ready: float = 0.0  # admitted (a worker URL in hand)
    t_first_byte: float = 0.0  # first non-empty response body chunk sent to the client
    t_end: float = 0.0
    status: int = 0
    is_cancelled: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    _predicted_n: int = 0
    _prompt_n: int = 0
    _has_timings: bool = False

    def queued(self, state: str) -> None:
        self.t_queued = time.time()
        self.state_when_queued = state

    def ready(self) -> None:
        self.t_ready = time.time()

    def end(self) -> None:
        """The response is over (`status` and `is_cancelled` set by the caller). A request the
        client left is reported with status 499 (nginx's "client closed request")."""
        self.t_end = time.time()
        if self.is_cancelled:
            self.status = CLIENT_CLOSED
        if self.completion_tokens is None and self._has_timings:
            self.completion_tokens = self._predicted_n
            self.prompt_tokens = self._prompt_n

    def wrap(self, send: Send) -> Send:
        """`send` that adds `X-Request-Id` to the response and marks the first byte and tokens."""

        async def traced(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.body":
                body: bytes = message.get("body", b"")
                if body:
                    self.chunk(body)
            elif kind == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER, self.request_id.encode())]}
            await send(message)

        return traced

    def chunk(self, body: bytes) -> None:
        """A piece of the response body on its way to the client."""
        if not self.t_first_byte:
            self.t_first_byte = time.time()
        if b'_n"' in body or b'_tokens"' in body:
            self._count_tokens(body)

    def _count_tokens(self, body: bytes) -> None:
        if (m := _COMPLETION.search(body)) is not None:
            self.completion_tokens = int(m.group(1))
            if (p := _PROMPT.search(body)) is not None:
                self.prompt_tokens = int(p.group(1))
            return
        if b'"usage"' in body and (p := _PROMPT.search(body)) is not None:  # embeddings: no completion
            self.prompt_tokens = int(p.group(1))
            return
        for m in _PREDICTED_N.finditer(body):
            self._has_timings = True
            self._predicted_n += int(m.group(1))
        for m in _PROMPT_N.finditer(body):
            self._prompt_n += int(m.group(1))
        for m in _CACHE_N.finditer(body):
            self._prompt_n += int(m.group(1))

    # ---- derived

    @property
    def queued_s(self) -> float:
        return max(0.0, self.t_ready - self.t_queued) if self.t_queued and self.t_ready else 0.0

    @property
    def ttft_s(self) -> float | None:
        return max(0.0, self.t_first_byte - self.t_received) if self.t_first_byte else None

    @property
    def duration_s(self) -> float:
        return max(0.0, self.t_end - self.t_received)

    def event(self) -> dict[str, Any]:
        """The `request` event's payload (the old keys model/path/status/duration_ms, then ours)."""
        ttft = self.ttft_s
        return {
            "model": self.model,
            "path": self.route,
            "status": self.status,
            "duration_ms": round(self.duration_s * 1e3, 3),
            "request_id": self.request_id,
            "queued_ms": round(self.queued_s * 1e3, 3),
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "is_cancelled": self.is_cancelled,
            "trace": self,
        }
