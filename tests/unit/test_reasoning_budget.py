"""The reasoning budget's tracker (worker/engine/reasoning_budget.py), fed token texts as the
engine feeds it: which step starts forcing the end marker, and what it forces."""

from __future__ import annotations

import pytest

from worker.engine.reasoning_budget import ReasoningBudget, reasoning_budget
from worker.text.reasoning import THINK

END = (901, 902)  # the end marker's tokens (any ids: the tracker only hands them back)
SAMPLED = 7


def run(budget: int, pieces: list[str], *, starts_inside: bool = False) -> list[int]:
    """The committed token of each step: `pieces[i]` is the text the step's token adds, unless
    the step commits a forced token (then its text is the marker's, which the tracker ignores)."""
    tracker = ReasoningBudget(budget, THINK, starts_inside, END).tracker()
    out = []
    for piece in pieces:
        token = tracker.next_token(SAMPLED)
        out.append(token)
        tracker.observe(piece if token == SAMPLED else "")
    return out


@pytest.mark.parametrize(("budget", "pieces", "starts_inside", "forced_at"), [
    # <think> (1 token, counted), then 2 more: the 3rd reasoning token triggers; the next 2 steps are forced
    (3, ["<think>", "a", "b", "c", "d", "e"], False, 3),
    # the model closes its block within the budget: nothing forced
    (3, ["<think>", "a", "</think>", "x", "y", "z"], False, None),
    # no block at all: nothing forced
    (1, ["hello", " world", "!", "?"], False, None),
    # the prompt opened the block: the first token already counts
    (2, ["a", "b", "c", "d"], True, 2),
    # budget 0 with an open block: the marker comes at once
    (0, ["a", "b", "c"], True, 0),
    # budget 0, block opened by the output: closed right after the start marker
    (0, ["<think>", "a", "b", "c"], False, 1),
])
def test_the_end_marker_is_forced_once_the_budget_is_spent(
    budget: int, pieces: list[str], starts_inside: bool, forced_at: int | None
) -> None:
    out = run(budget, pieces, starts_inside=starts_inside)
    if forced_at is None:
        assert out == [SAMPLED] * len(pieces)
    else:
        assert out == [SAMPLED] * forced_at + list(END) + [SAMPLED] * (len(pieces) - forced_at - len(END))


def test_a_marker_split_across_tokens_is_still_one_start() -> None:
    assert run(2, ["<th", "ink>", "a", "b", "c", "d"]) == [SAMPLED] * 3 + list(END) + [SAMPLED]


@pytest.mark.parametrize(("value", "has_grammar", "is_none"), [
    (None, False, True), (-1, False, True), (5, True, True), (5, False, False), (0, False, False)])
def test_which_requests_get_a_budget(value: int | None, has_grammar: bool, is_none: bool) -> None:
    got = reasoning_budget(value, THINK, False, has_grammar, lambda text: [1, 2])
    assert (got is None) == is_none
    if got is not None:
        assert got.end_tokens == (1, 2) and got.budget == value
    assert reasoning_budget(5, None, False, False, lambda text: [1]) is None  # reasoning not parsed
