"""Table tests for worker.text.stop_strings.StopMatcher (pure, no I/O)."""

from __future__ import annotations

import itertools
import random

import pytest

from worker.text.stop_strings import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    """Feed `pieces` one by one, flush if nothing matched; return (all emitted text, matched stop)."""
    matcher = StopMatcher(stops)
    out: list[str] = []
    for piece in pieces:
        emitted, matched = matcher.feed(piece)
        out.append(emitted)
        if matched is not None:
            return "".join(out), matched
    out.append(matcher.flush())
    return "".join(out), None


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The whole-text answer: the stop that completes first (ties: the longest), text before it."""
    best: tuple[int, int, str] | None = None
    for stop in filter(None, stops):
        i = text.find(stop)
        if i >= 0 and (best is None or (i + len(stop), -len(stop)) < best[:2]):
            best = (i + len(stop), -len(stop), stop)
    if best is None:
        return text, None
    return text[: best[0] + best[1]], best[2]


def splits(text: str) -> list[list[str]]:
    """Every way of cutting `text` into non-empty consecutive pieces."""
    result = []
    for mask in itertools.product([False, True], repeat=max(0, len(text) - 1)):
        pieces, start = [], 0
        for i, cut in enumerate(mask, start=1):
            if cut:
                pieces.append(text[start:i])
                start = i
        pieces.append(text[start:])
        result.append(pieces)
    return result


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        # no stops: pass-through
        ([], ["hello", " world"], ("hello world", None)),
        ([""], ["a", "b"], ("ab", None)),
        # whole stop inside one piece
        (["STOP"], ["abcSTOPdef"], ("abc", "STOP")),
        (["STOP"], ["STOP"], ("", "STOP")),
        # stop split across many pieces
        (["</s>"], ["hi<", "/", "s", ">more"], ("hi", "</s>")),
        (["<|im_end|>"], list("answer<|im_end|>"), ("answer", "<|im_end|>")),
        # partial match that fails is released
        (["</s>"], ["a<", "/x", "b"], ("a</xb", None)),
        (["ab"], list("aab"), ("a", "ab")),
        (["ab"], list("aaab"), ("aa", "ab")),
        (["abab"], list("abaabab"), ("aba", "abab")),
        # overlapping stops: the one that completes first wins; ties go to the longer one
        (["ab", "b"], ["ab"], ("", "ab")),
        (["ab", "b"], list("ab"), ("", "ab")),
        (["ab", "b"], ["xb"], ("x", "b")),
        (["abc", "b"], ["abc"], ("a", "b")),
        (["abc", "b"], list("abc"), ("a", "b")),
        # a stop that is a prefix of another
        (["ab", "abc"], ["abc"], ("", "ab")),
        (["abc", "ab"], list("xabc"), ("x", "ab")),
        # unicode, multi-char graphemes, CJK
        (["。"], ["你好", "。再见"], ("你好", "。")),
        (["🛑end"], ["ok 🛑", "en", "d tail"], ("ok ", "🛑end")),
        (["é"], ["cafe\u0301", "é"], ("cafe\u0301", "é")),
        # held text comes back on flush
        (["</s>"], ["done</"], ("done</", None)),
        (["STOP"], ["S", "T", "O"], ("STO", None)),
        # duplicates are harmless
        (["x", "x"], ["aax"], ("aa", "x")),
    ],
)
def test_table(stops: list[str], pieces: list[str], expected: tuple[str, str | None]) -> None:
    assert run(stops, pieces) == expected


@pytest.mark.parametrize(
    ("stops", "text"),
    [
        (["ab", "b"], "xxabyy"),
        (["abc", "b"], "zabcz"),
        (["aab"], "aaaab"),
        (["abab", "ba"], "abaabab"),
        (["<end>", "nd"], "e<en<end>"),
        (["STOP"], "no stop here"),
    ],
)
def test_result_does_not_depend_on_how_text_is_split(stops: list[str], text: str) -> None:
    want = reference(stops, text)
    for pieces in splits(text):
        assert run(stops, pieces) == want, pieces


def test_holds_back_exactly_the_longest_possible_stop_prefix() -> None:
    matcher = StopMatcher(["abcd", "cx"])
    assert matcher.feed("zzab") == ("zz", None)  # "ab" may become "abcd"
    assert matcher.feed("c") == ("", None)  # "abc" may become "abcd", "c" may become "cx"
    assert matcher.feed("y") == ("abcy", None)  # neither can complete any more
    assert matcher.feed("c") == ("", None)
    assert matcher.flush() == "c"
    assert matcher.flush() == ""


def test_feeds_after_a_match_are_ignored() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed("axb") == ("a", "x")
    assert matcher.is_done and matcher.matched == "x"
    assert matcher.feed("more x") == ("", None)
    assert matcher.flush() == ""


def test_no_stops_is_pass_through() -> None:
    matcher = StopMatcher([])
    piece = "anything </s> at all"
    emitted, matched = matcher.feed(piece)
    assert emitted is piece and matched is None
    assert matcher.flush() == ""


def test_randomized_against_reference() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 12)))
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 4)
            pieces.append(text[i : i + k])
            i += k
        assert run(stops, pieces) == reference(stops, text), (stops, pieces)


def longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Brute force: length of the longest suffix of `text` that is a proper prefix of a stop."""
    return max(
        (k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])),
        default=0,
    )


def test_emits_as_early_as_possible_and_never_retracts() -> None:
    rng = random.Random(99)
    for _ in range(500):
        stops = ["".join(rng.choices("xy", k=rng.randint(1, 5))) for _ in range(2)]
        text = "".join(rng.choices("xyz", k=20))
        final, _ = reference(stops, text)
        matcher, emitted = StopMatcher(stops), ""
        for i, ch in enumerate(text, start=1):
            out, matched = matcher.feed(ch)
            emitted += out
            assert final.startswith(emitted)
            if matched is not None:
                break
            assert len(emitted) == i - longest_stop_prefix_suffix(text[:i], stops)
        assert emitted + ("" if matcher.is_done else matcher.flush()) == final


def test_long_history_is_not_rescanned() -> None:
    # Each feed looks at the held tail plus the new piece only: the held tail stays bounded.
    matcher = StopMatcher(["<|im_end|>"])
    for _ in range(10_000):
        matcher.feed("token <|im")
        assert len(matcher._held) < len("<|im_end|>")
