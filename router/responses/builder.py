"""The upstream's chat-completion chunks -> the response object and its stream events (pure).

`ResponseBuilder`, fed the chunks one by one, keeps the response object and returns the typed
Responses stream events each chunk makes (with a monotonic `sequence_number`). Invariant: at
most one output item is open at a time; a new kind of delta (reasoning, text, another tool
call) closes the open one first, so `output_item.added` and `output_item.done` pair up in order.

`n` > 1 (`num_choices`): the upstream's choices interleave in its stream, but the output holds
the samples one after the other, in choice order. The builder works on one choice at a time:
the current one's deltas make events at once; a later choice's deltas wait in `_pending` and
are replayed when every choice before it has finished. So sample 0 streams live, and each
item's events stay contiguous with a final `output_index`. The per-sample state (the open item,
held text, the tool-call cap, being cut) starts afresh with each choice.

Tool calls: a call is `completed` only when its arguments are JSON; one cut short is
`incomplete`. Text that comes after a call, or any text when the call is forced (tool_choice
required or named: the upstream's grammar makes the whole output a call), is held to the end:
when the output was cut by max_output_tokens it is the cut call's raw markup (the upstream
gives an unparsable call back as text) and is dropped; otherwise it goes out then.
`max_tool_calls` drops the calls past the N-th.

Reasoning: `response.reasoning_text.*` always (OpenAI's raw reasoning events); when the client
asked for a summary (`reasoning.summary`), the same text also goes out as the item's
`summary_text` with `response.reasoning_summary_part.*` and `response.reasoning_summary_text.*`
(we do not summarize: the summary is the reasoning itself; docs/compatibility.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from router.responses.wire import (
    FunctionCallItem,
    Item,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    dump_item,
    new_id,
)


@dataclass
class _Open:
    """The output item being streamed."""

    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # its output_index
    tool_index: int = -1  # the chat delta's tool call index


@dataclass
class ResponseBuilder:
    """The response object and its stream events, built from chat-completion chunks."""

    id: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    output: list[Item] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    completed_at: int | None = None
    num_events: int = 0
    max_tool_calls: int | None = None
    is_call_forced: bool = False
    wants_summary: bool = False
    num_choices: int = 1  # the request's `n`
    _choice: int = 0  # the choice whose deltas make events now
    _pending: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # later choices' deltas
    _finished: set[int] = field(default_factory=set)  # choices whose finish_reason came
    # the current choice's state
    _open: _Open | None = None
    # text held back (see the module docstring)
    _held: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    _num_calls: int = 0
    _dropped_calls: set[int] = field(default_factory=set)  # chat tool indexes past max_tool_calls
    _is_cut: bool = False  # cut by max_output_tokens

    # ---- the object

    def output_text(self) -> str:
        return "".join(
            p.text
            for it in self.output
            if isinstance(it, MessageItem) and isinstance(it.content, list)
            for p in it.content
            if isinstance(p, OutputText)
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "output": [dump_item(it) for it in self.output],
            "output_text": self.output_text(),
            "usage": self.usage,
            **self.echo,
        }

    def _event(self, kind: str, **data: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.num_events, **data}
        self.num_events += 1
        return ev

    def _lifecycle(self, kind: str) -> dict[str, Any]:
        return self._event(kind, response=self.snapshot())

    # ---- events

    def start(self) -> list[dict[str, Any]]:
        """`response.created` (queued or in progress) and `response.in_progress`."""
        events = [self._lifecycle("response.created")]
        self.status = "in_progress"
        events.append(self._lifecycle("response.in_progress"))
        return events

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat-completion chunk -> the events it makes."""
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index") or 0)
            if index == self._choice:
                events += self._choice_delta(choice)
            elif self._choice < index < self.num_choices:
                self._pending.setdefault(index, []).append(choice)
        while self._choice in self._finished and self._choice + 1 < self.num_choices:
            events += self._next_choice()
        return events

    def _choice_delta(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """One delta of the current choice -> its events."""
        events: list[dict[str, Any]] = []
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            events += self._reasoning(delta["reasoning_content"])
        logprobs = ((choice.get("logprobs") or {}).get("content")) or []
        is_text_open = self._open is not None and self._open.kind == "message"
        # a token may end mid-character: no text yet
        if delta.get("content") or (logprobs and is_text_open):
            if self.is_call_forced or self._num_calls:
                self._held.append((delta.get("content") or "", logprobs))
            else:
                events += self._text(delta.get("content") or "", logprobs)
        for call in delta.get("tool_calls") or []:
            events += self._tool_call(call)
        if choice.get("finish_reason") is not None:
            self._finished.add(self._choice)
        if choice.get("finish_reason") == "length":
            self._is_cut = True
            self.incomplete_reason = "max_output_tokens"
        return events

    def _end_choice(self) -> list[dict[str, Any]]:
        """The current choice is over: its held text (unless cut: the cut call's markup), and
        its open item closed."""
        events: list[dict[str, Any]] = []
        held, self._held = self._held, []
        if not self._is_cut:
            for text, logprobs in held:
                events += self._text(text, logprobs)
        return events + self._close()

    def _next_choice(self) -> list[dict[str, Any]]:
        """End the current choice and make the next one current: its waiting deltas now."""
        events = self._end_choice()
        self._choice += 1
        self._num_calls, self._dropped_calls, self._is_cut = 0, set(), False
        for choice in self._pending.pop(self._choice, []):
            events += self._choice_delta(choice)
        return events

    def finish(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        while self._choice + 1 < self.num_choices:
            events += self._next_choice()
        events += self._end_choice()
        self.completed_at = int(time.time())
        if self.incomplete_reason:
            self.status = "incomplete"
            return [*events, self._lifecycle("response.incomplete")]
        self.status = "completed"
        return [*events, self._lifecycle("response.completed")]

    def fail(self, message: str, code: str = "server_error") -> list[dict[str, Any]]:
        events = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": code, "message": message}
        return [*events, self._lifecycle("response.failed")]

    def cancel(self) -> None:
        self._close("incomplete")
        self.status = "cancelled"

    # ---- one kind of delta each

    def _begin(self, kind: str, item: Item, tool_index: int = -1) -> list[dict[str, Any]]:
        events = self._close()
        self.output.append(item)
        self._open = _Open(kind, len(self.output) - 1, tool_index)
        return [*events, self._event("response.output_item.added", output_index=self._open.index,
                                     item=dump_item(item))]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != "reasoning":
            summary = [ReasoningText(type="summary_text", text="")] if self.wants_summary else []
            events += self._begin("reasoning", ReasoningItem(
                type="reasoning", id=new_id("rs"), summary=summary,
                content=[ReasoningText(type="reasoning_text", text="")], status="in_progress"))
            events.append(self._part_event("response.content_part.added",
                                           {"type": "reasoning_text", "text": ""}))
            if self.wants_summary:
                events.append(self._summary_event("response.reasoning_summary_part.added",
                                                  part={"type": "summary_text", "text": ""}))
        assert self._open is not None
        item = self.output[self._open.index]
        assert isinstance(item, ReasoningItem) and item.content
        item.content[0].text += text
        events.append(self._event("response.reasoning_text.delta", item_id=item.id,
                                  output_index=self._open.index,
                                  content_index=0, delta=text))
        if item.summary:
            item.summary[0].text += text
            events.append(self._summary_event("response.reasoning_summary_text.delta", delta=text))
        return events

    def _summary_event(self, kind: str, **data: Any) -> dict[str, Any]:
        assert self._open is not None
        item = self.output[self._open.index]
        return self._event(kind, item_id=item.id, output_index=self._open.index, summary_index=0, **data)

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != "message":
            events += self._begin(
                "message",
                MessageItem(
                    type="message",
                    id=new_id("msg"),
                    role="assistant",
                    content=[OutputText(type="output_text", text="")],
                    status="in_progress",
                ),
            )
            events.append(
                self._part_event(
                    "response.content_part.added",
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        assert self._open is not None
        item = self.output[self._open.index]
        assert isinstance(item, MessageItem) and isinstance(item.content, list)
        part = item.content[0]
        assert isinstance(part, OutputText)
        part.text += text
        lps = [_logprob(lp) for lp in logprobs]
        part.logprobs.extend(lps)
        return [
            *events,
            self._event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=self._open.index,
                content_index=0,
                delta=text,
                logprobs=lps,
            ),
        ]

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = int(call.get("index", 0))
        fn = call.get("function") or {}
        if index in self._dropped_calls:
            return events
        if self._open is None or self._open.kind != "function_call" or self._open.tool_index != index:
            if self.max_tool_calls is not None and self._num_calls >= self.max_tool_calls:
                self._dropped_calls.add(index)  # the soft cap: this call is not part of the response
                return events
            self._num_calls += 1
            events += self._begin("function_call", FunctionCallItem(
                type="function_call", id=new_id("fc"), call_id=call.get("id") or new_id("call"),
                name=fn.get("name") or "", arguments="", status="in_progress"), index)
        assert self._open is not None
        item = self.output[self._open.index]
        assert isinstance(item, FunctionCallItem)
        if fn.get("name") and not item.name:
            item.name = fn["name"]
        if fn.get("arguments"):
            item.arguments += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=self._open.index, call_id=item.call_id,
                                      delta=fn["arguments"]))
        return events

    def _part_event(self, kind: str, part: dict[str, Any]) -> dict[str, Any]:
        assert self._open is not None
        item = self.output[self._open.index]
        return self._event(kind, item_id=item.id, output_index=self._open.index, content_index=0, part=part)

    def _close(self, status: str | None = None) -> list[dict[str, Any]]:
        """Finish the open item: its `*.done` events, then `output_item.done`."""
        if self._open is None:
            return []
        op, self._open = self._open, None
        item = self.output[op.index]
        is_cut = isinstance(item, FunctionCallItem) and not _is_json(item.arguments)
        # each item type has its own status Literal; these values are valid for all
        item.status = status or ("incomplete" if self._is_cut or is_cut else "completed")  # type: ignore[assignment]
        ids = {"item_id": item.id, "output_index": op.index}
        events = []
        if isinstance(item, ReasoningItem) and item.content:
            text = item.content[0].text
            events += [self._event("response.reasoning_text.done", **ids, content_index=0, text=text),
                       self._event("response.content_part.done", **ids, content_index=0,
                                   part={"type": "reasoning_text", "text": text})]
            if item.summary:
                summary = item.summary[0].text
                events += [self._event("response.reasoning_summary_text.done", **ids, summary_index=0,
                                       text=summary),
                           self._event("response.reasoning_summary_part.done", **ids, summary_index=0,
                                       part={"type": "summary_text", "text": summary})]
        elif isinstance(item, MessageItem) and isinstance(item.content, list):
            part = item.content[0]
            assert isinstance(part, OutputText)
            events += [self._event("response.output_text.done", **ids, content_index=0, text=part.text,
                                   logprobs=part.logprobs),
                       self._event("response.content_part.done", **ids, content_index=0,
                                   part=part.model_dump(mode="json"))]
        elif isinstance(item, FunctionCallItem):
            events.append(self._event("response.function_call_arguments.done", **ids, call_id=item.call_id,
                                      name=item.name, arguments=item.arguments))
        events.append(self._event("response.output_item.done", output_index=op.index, item=dump_item(item)))
        return events


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    prompt = int(u.get("prompt_tokens") or 0)
    completion = int(u.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
        },
        "total_tokens": int(u.get("total_tokens") or prompt + completion),
    }


def _logprob(lp: dict[str, Any]) -> dict[str, Any]:
    tops = [{"token": t.get("token", ""), "logprob": t.get("logprob", 0.0), "bytes": t.get("bytes") or []}
            for t in lp.get("top_logprobs") or []]
    return {"token": lp.get("token", ""), "logprob": lp.get("logprob", 0.0), "bytes": lp.get("bytes") or [],
            "top_logprobs": tops}
