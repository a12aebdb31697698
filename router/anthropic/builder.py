"""The upstream's chat-completion chunks -> the Messages API's message and its stream events (pure).

`MessageBuilder`, fed the chunks one by one, keeps the message and returns the Anthropic
stream events each chunk makes. A non-streamed response is the fold of the same events, so the
two cannot differ. Invariant: at most one content block is open at a time; a new kind of delta
(thinking, text, another tool call) closes the open one first, so `content_block_start` and
`content_block_stop` pair up in index order.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("omni.router.anthropic")

Event = dict[str, Any]

# chat finish_reason -> Anthropic stop_reason ("stop" is end_turn unless a stop sequence matched)
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class _Open:
    """The content block being streamed."""

    kind: str  # "thinking" | "text" | "tool_use"
    index: int
    tool_index: int = -1  # the chat delta's tool call index
    arguments: str = ""  # a tool call's JSON, as streamed


@dataclass
class MessageBuilder:
    model: str
    stop_sequences: tuple[str, ...] = ()
    id: str = field(default_factory=lambda: new_id("msg"))
    content: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    _open: _Open | None = None

    # ---- the object

    def usage(self) -> dict[str, Any]:
        """Anthropic's usage: `input_tokens` are the prompt tokens not read from the prefix cache."""
        return {"input_tokens": self.input_tokens - self.cached_tokens, "output_tokens": self.output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached_tokens}

    def snapshot(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(),
        }

    # ---- events

    def start(self) -> list[Event]:
        return [{"type": "message_start", "message": self.snapshot()}]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """One chat-completion chunk -> the events it makes."""
        events: list[Event] = []
        u = chunk.get("usage")
        if u:
            self.input_tokens = int(u.get("prompt_tokens") or 0)
            self.cached_tokens = min(self.input_tokens,
                                     int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
            self.output_tokens = int(u.get("completion_tokens") or 0)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._delta(
                    "thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                )
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            reason = choice.get("finish_reason")
            if reason:
                self._finish_reason(reason, choice.get("stop_reason"))
        return events

    def finish(self) -> list[Event]:
        """Close the open block, then `message_delta` (stop reason, final usage) and `message_stop`."""
        events = self._close()
        if self.stop_reason is None:
            self.stop_reason = "end_turn"
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                       "usage": self.usage()})
        events.append({"type": "message_stop"})
        return events

    def _finish_reason(self, reason: str, stop_word: Any) -> None:
        if reason == "stop" and isinstance(stop_word, str) and stop_word in self.stop_sequences:
            self.stop_reason, self.stop_sequence = "stop_sequence", stop_word
        else:
            self.stop_reason = _STOP_REASONS.get(reason, "end_turn")

    # ---- blocks

    def _begin(self, kind: str, block: dict[str, Any], tool_index: int = -1) -> list[Event]:
        events = self._close()
        self.content.append(block)
        self._open = _Open(kind, len(self.content) - 1, tool_index)
        return [
            *events,
            {"type": "content_block_start", "index": self._open.index, "content_block": dict(block)},
        ]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events += self._begin(kind, empty)
        assert self._open is not None
        self.content[self._open.index][kind] += delta[kind]
        return [*events, {"type": "content_block_delta", "index": self._open.index, "delta": delta}]

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = int(call.get("index", 0))
        fn = call.get("function") or {}
        if self._open is None or self._open.kind != "tool_use" or self._open.tool_index != index:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu"),
                "name": fn.get("name") or "",
                "input": {},
            }
            events += self._begin("tool_use", block, index)
        assert self._open is not None
        if fn.get("arguments"):
            self._open.arguments += fn["arguments"]
            events.append({"type": "content_block_delta", "index": self._open.index,
                           "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return events

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        op, self._open = self._open, None
        if op.kind == "tool_use":
            block = self.content[op.index]
            try:
                parsed = json.loads(op.arguments) if op.arguments.strip() else {}
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                # the worker's parser only emits calls whose arguments are a JSON object
                log.warning(
                    "tool call %s: arguments are not a JSON object: %r", block["name"], op.arguments[:200]
                )
                parsed = {}
            block["input"] = parsed
        return [{"type": "content_block_stop", "index": op.index}]


def sse(event: Event) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
