"""One chat-completion choice's generated text -> an OpenAI assistant message, whole or streamed.

Reasoning is split off first (worker/text/reasoning.py), then tool calls are parsed from what
follows it (worker/text/tool_calls.py). `ChatOutputStream` turns the text of each generated
token into deltas; the concatenated deltas equal `parse_output` of the whole text, and so does
`ChatOutputStream.result()`.

`legacy_reasoning` (llama-server's `reasoning_format: deepseek-legacy`): reasoning_content is
filled and content keeps the block's raw text too (markers, reasoning and the whitespace around
them, exactly as generated) followed by the usual content. Unlike llama-server, streaming does
the same: the block's raw text goes out as content deltas as it is generated, alongside the
reasoning deltas, so streamed and non-streamed results agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.text.reasoning import ReasoningMarkers, ReasoningSplitter, split_reasoning
from worker.text.tool_calls import (
    ContentDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    ToolCallStream,
    ToolFormat,
    parse_tool_calls,
)

__all__ = [
    "ChatOutputConfig",
    "ChatOutputStream",
    "ContentDelta",
    "Delta",
    "ParsedMessage",
    "ReasoningDelta",
    "ToolArgsDelta",
    "ToolCall",
    "ToolCallStart",
    "parse_output",
]


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


Delta = ContentDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta


@dataclass(frozen=True, slots=True)
class ChatOutputConfig:
    tool_format: ToolFormat | None = None  # None: no tools requested, no tool parsing
    parallel_tool_calls: bool = True
    reasoning: ReasoningMarkers | None = None  # None: reasoning_format "none", no split
    starts_in_reasoning: bool = False  # the prompt opened the reasoning block
    legacy_reasoning: bool = False  # "deepseek-legacy": content keeps the block's raw text


@dataclass(slots=True)
class ParsedMessage:
    content: str | None  # None only when empty and there are tool calls (as OpenAI)
    reasoning_content: str | None  # None when there was no reasoning, or it was empty
    tool_calls: list[ToolCall]


def _message(content: str, reasoning: str, calls: list[ToolCall]) -> ParsedMessage:
    return ParsedMessage(None if not content and calls else content, reasoning or None, calls)


def parse_output(config: ChatOutputConfig, text: str) -> ParsedMessage:
    """The message of a complete output."""
    reasoning: str | None = None
    rest = text
    if config.reasoning is not None:
        reasoning, rest = split_reasoning(text, config.reasoning, starts_inside=config.starts_in_reasoning)
    content, calls = rest, list[ToolCall]()
    if config.tool_format is not None:
        content, calls = parse_tool_calls(config.tool_format, rest, parallel=config.parallel_tool_calls)
    if config.legacy_reasoning and reasoning is not None:
        content = text[: len(text) - len(rest)] + content
    return _message(content, reasoning or "", calls)


class ChatOutputStream:
    """`parse_output` for text that arrives token by token, as deltas; see the module docstring.

    `in_reasoning` is for counting reasoning tokens: a token is reasoning if `in_reasoning` was
    true before or after feeding its text.
    """

    def __init__(self, config: ChatOutputConfig) -> None:
        self._config = config
        self._splitter = (
            None
            if config.reasoning is None
            else ReasoningSplitter(config.reasoning, starts_inside=config.starts_in_reasoning)
        )
        self._tools = (
            None
            if config.tool_format is None
            else ToolCallStream(config.tool_format, parallel=config.parallel_tool_calls)
        )
        # legacy_reasoning: raw text fed and not yet sent as content, while it may be the block's
        self._raw_pending: str | None = "" if config.legacy_reasoning and self._splitter else None
        self._raw_sent = 0
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[tuple[str, str, list[str]]] = []  # (id, name, argument pieces)

    @property
    def in_reasoning(self) -> bool:
        return self._splitter is not None and self._splitter.in_reasoning

    def feed(self, text: str) -> list[Delta]:
        if self._splitter is None:
            return self._record(self._after_reasoning("", text, text, at_end=False))
        reasoning, content = self._splitter.feed(text)
        return self._record(self._after_reasoning(reasoning, text, content, at_end=False))

    def finish(self) -> list[Delta]:
        if self._splitter is None:
            return self._record(self._after_reasoning("", "", "", at_end=True))
        reasoning, content = self._splitter.finish()
        return self._record(self._after_reasoning(reasoning, "", content, at_end=True))

    def result(self) -> ParsedMessage:
        """The message the deltas sent so far add up to (call after `finish`)."""
        retracted = self._tools is not None and self._tools.calls_retracted
        calls = [] if retracted else [ToolCall(name, "".join(args), id) for id, name, args in self._calls]
        return _message("".join(self._content), "".join(self._reasoning), calls)

    def _after_reasoning(self, reasoning: str, raw: str, content: str, *, at_end: bool) -> list[Delta]:
        """Deltas for one step: reasoning, the block's raw text (legacy), then content and calls."""
        out: list[Delta] = [ReasoningDelta(reasoning)] if reasoning else []
        if self._raw_pending is not None and self._splitter is not None:
            self._send_raw_block(self._splitter, raw, content, out)
        if self._tools is None:
            if content:
                out.append(ContentDelta(content))
            return out
        out += self._tools.feed(content)
        if at_end:
            out += self._tools.finish()
        return out

    def _send_raw_block(self, splitter: ReasoningSplitter, raw: str, content: str, out: list[Delta]) -> None:
        pending = (self._raw_pending or "") + raw
        n = splitter.reasoning_raw_len - self._raw_sent
        if n > 0:
            out.append(ContentDelta(pending[:n]))
            self._raw_sent += n
        # Once content has begun, the block's extent is final: stop keeping raw text.
        self._raw_pending = None if content else pending[max(n, 0) :]

    def _record(self, deltas: list[Delta]) -> list[Delta]:
        for d in deltas:
            if isinstance(d, ContentDelta):
                self._content.append(d.text)
            elif isinstance(d, ReasoningDelta):
                self._reasoning.append(d.text)
            elif isinstance(d, ToolCallStart):
                self._calls.append((d.id, d.name, []))
            else:
                self._calls[d.index][2].append(d.text)
        return deltas
