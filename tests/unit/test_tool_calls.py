"""Table tests for worker.text.tool_calls (pure, no I/O).

Every parse case is also streamed over every single split point, random chunkings (fixed seeds,
empty pieces included) and one-character pieces: the concatenated deltas must equal the
non-streamed result (ids aside).
"""

from __future__ import annotations

import random
import re

import pytest

from worker.text.tool_calls import (
    ContentDelta,
    Delta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    ToolCallStream,
    ToolFormat,
    detect_format,
    new_call_id,
    parse_tool_calls,
)

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL


def chunkings(text: str) -> list[list[str]]:
    """Every single split point, one-character pieces, and random pieces of 0-6 characters."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    for seed in range(4):
        rng = random.Random(seed)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(0, 6)
            pieces.append(text[i : i + n])
            i += n
        out.append(pieces)
    return out


def call(name: str, args: str) -> tuple[str, str]:
    return name, args


def hermes(name: str, args: str | None = None, *, key: str = "arguments") -> str:
    body = f'{{"name": "{name}"}}' if args is None else f'{{"name": "{name}", "{key}": {args}}}'
    return f"<tool_call>\n{body}\n</tool_call>"


NESTED = (
    '{"q": "a {b} [c] \\"d\\" }", "n": {"x": [1, {"y": null}], "z": -1.5e3}, "u": "héllo 世界 \\u00e9 \\\\"}'
)
WEATHER = '{"city": "Paris", "unit": "celsius"}'

# (format, text, parallel, content, calls). Malformed cases: content is the whole text, stripped.
CASES: list[tuple[ToolFormat, str, bool, str, list[tuple[str, str]]]] = [
    # ---- hermes
    (H, "Hello there.", True, "Hello there.", []),
    (H, "  \n Hi <b>there</b>\n\n ", True, "Hi <b>there</b>", []),
    (H, "", True, "", []),
    (H, hermes("get_weather", WEATHER), True, "", [call("get_weather", WEATHER)]),
    (H, hermes("f", NESTED), True, "", [call("f", NESTED)]),
    (H, hermes("f"), True, "", [call("f", "{}")]),
    (H, hermes("f", '{ \n "a" :  1 ,"b":[ ]\n}'), True, "", [call("f", '{ \n "a" :  1 ,"b":[ ]\n}')]),
    (
        H,
        '<tool_call>{"arguments": {"a": "}"}, "name": "late"}</tool_call>',
        True,
        "",
        [call("late", '{"a": "}"}')],
    ),
    (
        H,
        '<tool_call>{"name": "f", "id": "x", "meta": [1, {"k": "}"}], "n": 3.5, "t": true, "arguments": {}, '
        '"z": null}</tool_call>',
        True,
        "",
        [call("f", "{}")],
    ),
    (H, '<tool_call>{"name": "f\\u00e9\\"q", "arguments": {}}</tool_call>', True, "", [call('fé"q', "{}")]),
    (
        H,
        "Let me check.\n" + hermes("get_weather", WEATHER),
        True,
        "Let me check.",
        [call("get_weather", WEATHER)],
    ),
    (
        H,
        hermes("a", '{"x": 1}') + "\n" + hermes("b", '{"y": 2}'),
        True,
        "",
        [call("a", '{"x": 1}'), call("b", '{"y": 2}')],
    ),
    (H, hermes("a", '{"x": 1}') + "\n" + hermes("b", '{"y": 2}'), False, "", [call("a", '{"x": 1}')]),
    (
        H,
        "A " + hermes("a", "{}") + " B " + hermes("b", "{}") + " C\n",
        True,
        "A  B  C",
        [call("a", "{}"), call("b", "{}")],
    ),
    (H, "Text </tool_call> and <tool", True, "Text </tool_call> and <tool", []),
    # hermes, malformed: all content
    (
        H,
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
        True,
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
        [],
    ),
    (
        H,
        'Hi <tool_call>\n{"name": "f", "arguments": {}}\n',
        True,
        'Hi <tool_call>\n{"name": "f", "arguments": {}}',
        [],
    ),
    (
        H,
        'Hi <tool_call>\n{"name": "f", "arguments": {"a": "b',
        True,
        'Hi <tool_call>\n{"name": "f", "arguments": {"a": "b',
        [],
    ),
    (H, "<tool_call>", True, "<tool_call>", []),
    (H, '<tool_call>{"arguments": {}}</tool_call>', True, '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        H,
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        True,
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        [],
    ),
    (
        H,
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        True,
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        [],
    ),
    (
        H,
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
        True,
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
        [],
    ),
    (
        H,
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        True,
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        H,
        '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>',
        True,
        '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>',
        [],
    ),
    (
        H,
        '<tool_call>{"name": "f", "name": "g"}</tool_call>',
        True,
        '<tool_call>{"name": "f", "name": "g"}</tool_call>',
        [],
    ),
    (H, '<tool_call>{"name": "f",}</tool_call>', True, '<tool_call>{"name": "f",}</tool_call>', []),
    (
        H,
        '<tool_call>{"name": "f", "x": tru}</tool_call>',
        True,
        '<tool_call>{"name": "f", "x": tru}</tool_call>',
        [],
    ),
    (
        H,
        "ok " + hermes("a", "{}") + ' <tool_call>{"name": "b", "arguments": {',
        True,
        "ok " + hermes("a", "{}") + ' <tool_call>{"name": "b", "arguments": {',
        [],
    ),
    (H, '<tool_call>[{"name": "f"}]</tool_call>', True, '<tool_call>[{"name": "f"}]</tool_call>', []),
    # ---- llama3
    (L, "The answer is 4.", True, "The answer is 4.", []),
    (L, ' \nHere: {"name": "f", "parameters": {}}', True, 'Here: {"name": "f", "parameters": {}}', []),
    (L, '{"name": "get_weather", "parameters": ' + WEATHER + "}", True, "", [call("get_weather", WEATHER)]),
    (L, '\n {"name": "f", "arguments": ' + NESTED + "}\n", True, "", [call("f", NESTED)]),
    (L, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', True, "", [call("f", '{"a": 1}')]),
    (
        L,
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": ";"}};',
        True,
        "",
        [call("a", "{}"), call("b", '{"x": ";"}')],
    ),
    (L, '{"name": "a", "parameters": {}}\n{"name": "b"}', True, "", [call("a", "{}"), call("b", "{}")]),
    (L, '{"name": "a", "parameters": {}}\n{"name": "b"}', False, "", [call("a", "{}")]),
    (L, "<|python", True, "<|python", []),
    # llama3, malformed: all content
    (L, '{"answer": 4}', True, '{"answer": 4}', []),
    (L, '{"name": "f", "parameters": {"a": 1}', True, '{"name": "f", "parameters": {"a": 1}', []),
    (L, '{"name": "f", "parameters": {}} thanks', True, '{"name": "f", "parameters": {}} thanks', []),
    (L, '<|python_tag|>brave_search.call(query="x")', True, '<|python_tag|>brave_search.call(query="x")', []),
    (L, '{"name": "f", "parameters": 3}', True, '{"name": "f", "parameters": 3}', []),
    (
        L,
        '{"name": "f", "arguments": {}, "parameters": {}}',
        True,
        '{"name": "f", "arguments": {}, "parameters": {}}',
        [],
    ),
    # ---- mistral
    (M, "Bonjour.", True, "Bonjour.", []),
    (
        M,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]",
        True,
        "",
        [call("get_weather", WEATHER)],
    ),
    (
        M,
        'Checking. [TOOL_CALLS] [ {"name": "a", "arguments": {"x": "]"}} , {"name": "b", "arguments": '
        + NESTED
        + "} ]\n",
        True,
        "Checking.",
        [call("a", '{"x": "]"}'), call("b", NESTED)],
    ),
    (
        M,
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
        False,
        "",
        [call("a", "{}")],
    ),
    (M, "[TOOL_CALLS]get_weather[ARGS]" + WEATHER, True, "", [call("get_weather", WEATHER)]),
    (
        M,
        "Sure [TOOL_CALLS] f.x-1 [ARGS] " + NESTED + "\n[TOOL_CALLS]g[ARGS]{}",
        True,
        "Sure",
        [call("f.x-1", NESTED), call("g", "{}")],
    ),
    (
        M,
        '[TOOL_CALLS]a[ARGS]{"k": 1}[TOOL_CALLS][{"name": "b", "arguments": {}}]',
        True,
        "",
        [call("a", '{"k": 1}'), call("b", "{}")],
    ),
    (M, "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}", False, "", [call("a", "{}")]),
    (M, "Use [TOOL_CALL", True, "Use [TOOL_CALL", []),
    # mistral, malformed: all content
    (
        M,
        '[TOOL_CALLS][{"name": "a", "arguments": {}},]',
        True,
        '[TOOL_CALLS][{"name": "a", "arguments": {}},]',
        [],
    ),
    (M, "[TOOL_CALLS][]", True, "[TOOL_CALLS][]", []),
    (M, "[TOOL_CALLS]get_weather{}", True, "[TOOL_CALLS]get_weather{}", []),
    (M, "[TOOL_CALLS]get weather[ARGS]{}", True, "[TOOL_CALLS]get weather[ARGS]{}", []),
    (M, "[TOOL_CALLS][ARGS]{}", True, "[TOOL_CALLS][ARGS]{}", []),
    (M, "[TOOL_CALLS]f[ARGS][1]", True, "[TOOL_CALLS]f[ARGS][1]", []),
    (M, "[TOOL_CALLS]f[ARGS]{} and more", True, "[TOOL_CALLS]f[ARGS]{} and more", []),
    (
        M,
        '[TOOL_CALLS][{"name": "a", "arguments": {}}] done',
        True,
        '[TOOL_CALLS][{"name": "a", "arguments": {}}] done',
        [],
    ),
    (M, '[TOOL_CALLS]f[ARGS]{"a": 1', True, '[TOOL_CALLS]f[ARGS]{"a": 1', []),
]

IDS = [f"{fmt}-{i}" for i, (fmt, *_rest) in enumerate(CASES)]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (None, H),
        ("", H),
        ("{{ '<|im_start|>' }}{% if tools %}<tool_call>{% endif %}", H),
        ("[INST]{% if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]{% endif %}", M),
        ("<|start_header_id|>assistant<|end_header_id|>", L),
        ("{{ '<|python_tag|>' }}", L),
        ("{{ '<start_of_turn>' }}", H),
    ],
)
def test_detect_format(source: str | None, expected: ToolFormat) -> None:
    assert detect_format(source) is expected


def test_new_call_id() -> None:
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_tool_call_equality_ignores_id() -> None:
    assert ToolCall("f", "{}") == ToolCall("f", "{}")
    assert ToolCall("f", "{}").id != ToolCall("f", "{}").id


@pytest.mark.parametrize(("fmt", "text", "parallel", "content", "calls"), CASES, ids=IDS)
def test_parse(
    fmt: ToolFormat, text: str, parallel: bool, content: str, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = parse_tool_calls(fmt, text, parallel=parallel)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)


def fold(deltas: list[Delta]) -> tuple[str, list[tuple[str, str]]]:
    """What a client that concatenates the deltas ends up with; checks indices on the way."""
    content: list[str] = []
    calls: list[tuple[str, list[str]]] = []
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.text
            content.append(d.text)
        elif isinstance(d, ToolCallStart):
            assert d.index == len(calls) and d.id.startswith("call_")
            calls.append((d.name, []))
        else:
            assert d.text and 0 <= d.index < len(calls)
            calls[d.index][1].append(d.text)
    return "".join(content), [(name, "".join(args)) for name, args in calls]


def stream(fmt: ToolFormat, pieces: list[str], parallel: bool = True) -> tuple[ToolCallStream, list[Delta]]:
    s = ToolCallStream(fmt, parallel=parallel)
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += s.feed(piece)
    deltas += s.finish()
    return s, deltas


@pytest.mark.parametrize(("fmt", "text", "parallel", "content", "calls"), CASES, ids=IDS)
def test_stream_equals_parse(
    fmt: ToolFormat, text: str, parallel: bool, content: str, calls: list[tuple[str, str]]
) -> None:
    for pieces in chunkings(text):
        s, deltas = stream(fmt, pieces, parallel)
        got_content, got_calls = fold(deltas)
        assert got_content == content, pieces
        if calls or not s.calls_retracted:
            assert got_calls == calls, pieces
            assert not s.calls_retracted
        else:  # malformed after a call had started: the client saw a start; content is complete
            assert got_calls


def test_content_is_sent_before_a_possible_marker() -> None:
    s = ToolCallStream(H)
    assert s.feed("  Hello, ") == [ContentDelta("Hello,")]
    assert s.feed("world <tool") == [ContentDelta(" world")]  # " <tool" held: it may be a call
    assert s.feed("box> x") == [ContentDelta(" <toolbox> x")]
    assert s.feed("  \n") == []
    assert s.finish() == []


def test_call_streams_name_then_argument_fragments() -> None:
    s = ToolCallStream(H)
    assert s.feed('Ok <tool_call>\n{"name": "get_') == [ContentDelta("Ok")]
    out = s.feed('weather", "arguments": {"city": "Pa')
    assert isinstance(out[0], ToolCallStart) and out[0].name == "get_weather" and out[0].index == 0
    assert out[1:] == [ToolArgsDelta(0, '{"city": "Pa')]
    assert s.feed('ris"}') == [ToolArgsDelta(0, 'ris"}')]
    assert s.feed("}\n</tool_call>") == []
    assert s.finish() == []


def test_arguments_before_name_are_held_until_the_name() -> None:
    s = ToolCallStream(L)
    assert s.feed('{"parameters": {"a": [1, 2]}, ') == []
    out = s.feed('"name": "f"}')
    assert [type(d) for d in out] == [ToolCallStart, ToolArgsDelta]
    assert out[1] == ToolArgsDelta(0, '{"a": [1, 2]}')


def test_llama3_holds_a_message_that_may_be_a_call() -> None:
    s = ToolCallStream(L)
    assert s.feed(" {") == []
    assert s.feed('"answer": 4}') == []
    assert s.finish() == [ContentDelta('{"answer": 4}')]
    s = ToolCallStream(L)
    assert s.feed("<|py") == []
    assert s.feed("thon is nice") == [ContentDelta("<|python is nice")]


def test_malformed_after_a_start_retracts_the_call() -> None:
    s = ToolCallStream(H)
    out = s.feed('<tool_call>{"name": "f", "arguments": {"a": 1}')
    assert [type(d) for d in out] == [ToolCallStart, ToolArgsDelta]
    assert s.feed(" oops</tool_call>") == []
    assert s.finish() == [ContentDelta('<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call>')]
    assert s.calls_retracted


def test_parallel_off_streams_only_the_first_call() -> None:
    text = hermes("a", '{"x": 1}') + hermes("b", '{"y": 2}')
    s = ToolCallStream(H, parallel=False)
    deltas = s.feed(text)
    assert fold(deltas) == ("", [("a", '{"x": 1}')])
    assert s.finish() == []


def test_content_after_a_call_is_sent_at_the_end() -> None:
    s = ToolCallStream(H)
    assert fold(s.feed("A " + hermes("f") + " B ")) == ("A", [("f", "{}")])
    assert s.finish() == [ContentDelta("  B")]


def test_mistral_name_that_cannot_be_one_fails_early() -> None:
    s = ToolCallStream(M)
    assert s.feed("[TOOL_CALLS]I will call") == []
    assert s.feed(" f[ARGS]{}") == []  # no ToolCallStart for "I will call f"
    assert s.finish() == [ContentDelta("[TOOL_CALLS]I will call f[ARGS]{}")]
    assert not s.calls_retracted
