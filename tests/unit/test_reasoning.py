"""Table tests for worker.text.reasoning (pure, no I/O); streaming must equal the whole-text split."""

from __future__ import annotations

import pytest

from tests.unit.test_tool_calls import chunkings
from worker.text.reasoning import (
    THINK,
    ReasoningMarkers,
    ReasoningSplitter,
    TrimmedStream,
    detect_markers,
    partial_suffix_len,
    split_reasoning,
    starts_in_reasoning,
)

MAGISTRAL = ReasoningMarkers("[THINK]", "[/THINK]")
COMMAND = ReasoningMarkers("<|START_THINKING|>", "<|END_THINKING|>")
SEED = ReasoningMarkers("<seed:think>", "</seed:think>")

# (text, markers, starts_inside, reasoning, content)
CASES: list[tuple[str, ReasoningMarkers, bool, str | None, str]] = [
    ("<think>a</think>b", THINK, False, "a", "b"),
    ("  <think>\n I think.\n\n</think>\n\n Answer.\n", THINK, False, "I think.", "Answer.\n"),
    ("<think>a  b\n c</think>d  e ", THINK, False, "a  b\n c", "d  e "),
    ("Hello", THINK, False, None, "Hello"),
    ("  Hello \n", THINK, False, None, "  Hello \n"),
    ("", THINK, False, None, ""),
    (" \n ", THINK, False, None, " \n "),
    ("Hi <think>x</think> y", THINK, False, None, "Hi <think>x</think> y"),
    ("<thin", THINK, False, None, "<thin"),
    ("<thinking>x</thinking>", THINK, False, None, "<thinking>x</thinking>"),
    ("<think>unterminated <b> ", THINK, False, "unterminated <b>", ""),
    ("<think>a </thi", THINK, False, "a </thi", ""),
    ("<think></think>", THINK, False, "", ""),
    ("<think>\n\n</think>\n\nOk", THINK, False, "", "Ok"),
    ("<think>a</think>b</think>c", THINK, False, "a", "b</think>c"),
    ("<think>a<think>b</think>c", THINK, False, "a<think>b", "c"),
    ("<think>a</think><think>b</think>c", THINK, False, "a", "<think>b</think>c"),
    # the prompt opened the block
    ("reasoning</think>answer", THINK, True, "reasoning", "answer"),
    ("\n step 1\n</think>\n\nanswer", THINK, True, "step 1", "answer"),
    ("<think>again</think>answer", THINK, True, "again", "answer"),
    ("still thinking ", THINK, True, "still thinking", ""),
    ("", THINK, True, "", ""),
    ("<thin", THINK, True, "<thin", ""),
    ("<thinx</think>y", THINK, True, "<thinx", "y"),
    ("</think>x", THINK, True, "", "x"),
    # other families
    ("[THINK]plan[/THINK]Done", MAGISTRAL, False, "plan", "Done"),
    ("<|START_THINKING|>p<|END_THINKING|>\nr", COMMAND, False, "p", "r"),
    ("<seed:think>p</seed:think>r", SEED, False, "p", "r"),
    ("<think>p</think>r", MAGISTRAL, False, None, "<think>p</think>r"),
]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (None, THINK),
        ("{{ '<|im_start|>assistant\\n<think>\\n' }}", THINK),
        ("{%- if m.thinking %}[THINK]{{ m.thinking }}[/THINK]{% endif %}", MAGISTRAL),
        ("<|START_THINKING|>{{ r }}<|END_THINKING|>", COMMAND),
        ("<seed:think>{{ r }}</seed:think>", SEED),
        ("{{ '<start_of_turn>model\\n' }}", THINK),
    ],
)
def test_detect_markers(source: str | None, expected: ReasoningMarkers) -> None:
    assert detect_markers(source) == expected


@pytest.mark.parametrize(
    ("prompt", "markers", "expected"),
    [
        ("<|im_start|>assistant\n<think>\n", THINK, True),  # Qwen3
        ("<｜Assistant｜><think>\n", THINK, True),  # DeepSeek-R1
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK, False),  # Qwen3, enable_thinking false
        ("<|im_start|>assistant\n", THINK, False),
        ("<think> earlier </think> user text <|im_start|>assistant\n", THINK, False),
        ("[INST]q[/INST][THINK]", MAGISTRAL, True),
        ("[INST]q[/INST]<think>", MAGISTRAL, False),
    ],
)
def test_starts_in_reasoning(prompt: str, markers: ReasoningMarkers, expected: bool) -> None:
    assert starts_in_reasoning(prompt, markers) is expected


@pytest.mark.parametrize(
    ("text", "marker", "expected"),
    [("abc<", "<think>", 1), ("abc<thi", "<think>", 4), ("<think>", "<think>", 0), ("abc", "<think>", 0),
     ("", "<think>", 0), ("<<", "<<x", 2), ("a]", "]", 0)],
)
def test_partial_suffix_len(text: str, marker: str, expected: int) -> None:
    assert partial_suffix_len(text, marker) == expected


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (["  a", " b ", " ", "\n", "c\n"], ["a", " b", "", "", "  \nc"]),
        ([" ", "", "\t"], ["", "", ""]),
        (["a b"], ["a b"]),
    ],
)
def test_trimmed_stream(pieces: list[str], expected: list[str]) -> None:
    t = TrimmedStream()
    assert [t.feed(p) for p in pieces] == expected


@pytest.mark.parametrize(("text", "markers", "starts_inside", "reasoning", "content"), CASES)
def test_split(
    text: str, markers: ReasoningMarkers, starts_inside: bool, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(text, markers, starts_inside=starts_inside) == (reasoning, content)


@pytest.mark.parametrize(("text", "markers", "starts_inside", "reasoning", "content"), CASES)
def test_stream_equals_split(
    text: str, markers: ReasoningMarkers, starts_inside: bool, reasoning: str | None, content: str
) -> None:
    for pieces in chunkings(text):
        s = ReasoningSplitter(markers, starts_inside=starts_inside)
        parts = [s.feed(p) for p in pieces] + [s.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or ""), pieces
        assert "".join(c for _, c in parts) == content, pieces


@pytest.mark.parametrize(
    ("tokens", "starts_inside", "expected"),
    [
        # a token counts as reasoning if in_reasoning was true before or after feeding it
        (["<th", "ink>", "\n", "Let me", "</th", "ink>", "\n\n", "Hi"], False, [0, 1, 1, 1, 1, 1, 0, 0]),
        (["<think>", "a", "</think>", "b"], False, [1, 1, 1, 0]),
        (["\n", "Hello", "<think>"], False, [0, 0, 0]),
        (["<", "b>"], False, [0, 0]),
        (["a", "</think>", "b"], True, [1, 1, 0]),
        (["a", "b"], True, [1, 1]),
    ],
)
def test_in_reasoning_counts_tokens(tokens: list[str], starts_inside: bool, expected: list[int]) -> None:
    s = ReasoningSplitter(THINK, starts_inside=starts_inside)
    counted = []
    for token in tokens:
        before = s.in_reasoning
        s.feed(token)
        counted.append(int(before or s.in_reasoning))
    assert counted == expected


def test_partial_markers_are_held_and_released() -> None:
    s = ReasoningSplitter(THINK)
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>Hm, ") == ("Hm,", "")
    assert s.feed("ok </th") == (" ok", "")
    assert s.feed("ing") == (" </thing", "")
    assert s.feed("</think>\n") == ("", "")
    assert s.feed("\nAnswer") == ("", "Answer")
    assert s.finish() == ("", "")
