"""Table tests for worker.text.chat_output (pure, no I/O): reasoning + tool calls, whole and streamed."""

from __future__ import annotations

import pytest

from tests.unit.test_tool_calls import chunkings, hermes
from worker.text.chat_output import (
    ChatOutputConfig,
    ChatOutputStream,
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    parse_output,
)
from worker.text.reasoning import THINK
from worker.text.tool_calls import ToolFormat

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL

PLAIN = ChatOutputConfig()
TOOLS = ChatOutputConfig(tool_format=H)
THINKS = ChatOutputConfig(reasoning=THINK)
THINKS_TOOLS = ChatOutputConfig(tool_format=H, reasoning=THINK)
FORCED = ChatOutputConfig(tool_format=H, reasoning=THINK, starts_in_reasoning=True)
LEGACY = ChatOutputConfig(reasoning=THINK, legacy_reasoning=True)
LEGACY_TOOLS = ChatOutputConfig(tool_format=H, reasoning=THINK, legacy_reasoning=True)
LEGACY_FORCED = ChatOutputConfig(reasoning=THINK, starts_in_reasoning=True, legacy_reasoning=True)
SERIAL = ChatOutputConfig(tool_format=M, parallel_tool_calls=False)
LLAMA_THINKS = ChatOutputConfig(tool_format=L, reasoning=THINK)

F = hermes("f", '{"a": 1}')


def msg(content: str | None, reasoning: str | None = None, *calls: tuple[str, str]) -> ParsedMessage:
    return ParsedMessage(content, reasoning, [ToolCall(name, args) for name, args in calls])


# (config, text, message)
CASES: list[tuple[ChatOutputConfig, str, ParsedMessage]] = [
    (PLAIN, "  Hi <think>x</think> " + F + " ", msg("  Hi <think>x</think> " + F + " ")),
    (PLAIN, "", msg("")),
    (TOOLS, F, msg(None, None, ("f", '{"a": 1}'))),
    (TOOLS, " \n Hi  \n", msg("Hi")),
    (TOOLS, "", msg("")),
    (TOOLS, "<think>r</think>" + F, msg("<think>r</think>", None, ("f", '{"a": 1}'))),
    (TOOLS, "<tool_call>{bad}</tool_call>", msg("<tool_call>{bad}</tool_call>")),
    (THINKS, "<think>a</think>\n\nb ", msg("b ", "a")),
    (THINKS, "<think>\n\n</think>\n\nb", msg("b")),
    (THINKS, "x <think>a</think>", msg("x <think>a</think>")),
    (THINKS, "<think>unterminated", msg("", "unterminated")),
    (
        THINKS_TOOLS,
        "<think>Need the weather.</think>\n\nChecking. " + F,
        msg("Checking.", "Need the weather.", ("f", '{"a": 1}')),
    ),
    (THINKS_TOOLS, "<think>maybe " + F + "</think>ok", msg("ok", "maybe " + F)),
    (THINKS_TOOLS, "<think>r</think>\n<tool_call>{bad", msg("<tool_call>{bad", "r")),
    (THINKS_TOOLS, "<think>r</think>" + F + "<tool_call>{", msg(F + "<tool_call>{", "r")),
    (FORCED, "hmm</think>\n" + F, msg(None, "hmm", ("f", '{"a": 1}'))),
    (FORCED, "still thinking", msg("", "still thinking")),
    (LEGACY, "<think>a</think>\n\nb", msg("<think>a</think>\n\nb", "a")),
    (LEGACY, " b", msg(" b")),
    (LEGACY, "<think>unterminated ", msg("<think>unterminated ", "unterminated")),
    (LEGACY, "<thin", msg("<thin")),
    (LEGACY_TOOLS, "  <think>a</think>\n" + F + "\n", msg("  <think>a</think>\n", "a", ("f", '{"a": 1}'))),
    (LEGACY_TOOLS, "<think>a</think> b " + F, msg("<think>a</think> b", "a", ("f", '{"a": 1}'))),
    (LEGACY_FORCED, "a</think>b", msg("a</think>b", "a")),
    (SERIAL, "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}", msg(None, None, ("a", "{}"))),
    (LLAMA_THINKS, '<think>x</think>\n{"name": "f", "parameters": {}}', msg(None, "x", ("f", "{}"))),
    (LLAMA_THINKS, '<think>x</think>\nSure: {"name": "f"}', msg('Sure: {"name": "f"}', "x")),
]


def fold(deltas: list[Delta]) -> ParsedMessage:
    """What a client that concatenates the deltas ends up with."""
    content, reasoning = [], []
    calls: list[tuple[str, list[str]]] = []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif isinstance(d, ReasoningDelta):
            reasoning.append(d.text)
        elif isinstance(d, ToolCallStart):
            calls.append((d.name, []))
        else:
            calls[d.index][1].append(d.text)
    return msg("".join(content) or (None if calls else ""), "".join(reasoning) or None,
               *[(name, "".join(args)) for name, args in calls])


@pytest.mark.parametrize(("config", "text", "expected"), CASES)
def test_parse_output(config: ChatOutputConfig, text: str, expected: ParsedMessage) -> None:
    assert parse_output(config, text) == expected


@pytest.mark.parametrize(("config", "text", "expected"), CASES)
def test_stream_equals_parse(config: ChatOutputConfig, text: str, expected: ParsedMessage) -> None:
    for pieces in chunkings(text):
        s = ChatOutputStream(config)
        deltas = [d for piece in pieces for d in s.feed(piece)] + s.finish()
        result = s.result()
        assert result == expected, pieces
        starts = [d for d in deltas if isinstance(d, ToolCallStart)]
        if result.tool_calls:
            assert [c.id for c in result.tool_calls] == [d.id for d in starts]
        if result.tool_calls or not starts:  # else a malformed call was started, then made content
            assert fold(deltas) == expected, pieces


def test_reasoning_tokens_are_counted() -> None:
    s = ChatOutputStream(THINKS_TOOLS)
    n_reasoning = 0
    for token in ["<think>", "Let", " me", " see", "</think>", "\n\n", "Done", "."]:
        before = s.in_reasoning
        s.feed(token)
        n_reasoning += before or s.in_reasoning
    assert n_reasoning == 5
    assert not ChatOutputStream(TOOLS).in_reasoning
    assert ChatOutputStream(FORCED).in_reasoning


def test_stream_order() -> None:
    s = ChatOutputStream(THINKS_TOOLS)
    out = s.feed("<think>plan</think>Checking. <tool_call>\n")
    assert out == [ReasoningDelta("plan"), ContentDelta("Checking.")]
    out = s.feed('{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert [type(d) for d in out] == [ToolCallStart, ToolArgsDelta]
    assert s.finish() == []
    assert s.result() == msg("Checking.", "plan", ("f", '{"a": 1}'))


def test_legacy_streams_the_block_as_content_too() -> None:
    s = ChatOutputStream(LEGACY)
    assert s.feed("<thi") == []
    assert s.feed("nk>a ") == [ReasoningDelta("a"), ContentDelta("<think>a ")]
    assert s.feed("</think>\n\nb") == [ContentDelta("</think>\n\n"), ContentDelta("b")]
