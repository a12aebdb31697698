"""A cap on a request's reasoning: llama.cpp's `thinking_budget_tokens`.

Once `budget` tokens were generated inside the reasoning block (counted as the chat parser
counts `reasoning_tokens`: from the start marker's last token to the end marker's), the
block's end marker is forced: its tokens replace what the sampler draws, one per step, and the
model then answers after a closed block. What was thought stays in the output. A block the
model closes itself within the budget is left alone; an output without a block is untouched.

Requests with a grammar get no budget (worker/server/prepare.py): their output is constrained from
the first token, so it cannot open a reasoning block, and a forced marker would break the grammar.

`ReasoningBudget` is the request's (frozen, in `SamplingParams`); `BudgetTracker` is the task's
state, owned by the engine thread like the task's sampler and matcher.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from worker.text.reasoning import ReasoningMarkers, ReasoningSplitter


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    budget: int  # reasoning tokens allowed before the end marker is forced (0: close it at once)
    markers: ReasoningMarkers
    starts_inside: bool  # the prompt opened the block (worker/text/reasoning.py)
    end_tokens: tuple[int, ...]  # the end marker, tokenized

    def tracker(self) -> BudgetTracker:
        return BudgetTracker(self)


def reasoning_budget(
    value: int | None,
    markers: ReasoningMarkers | None,
    starts_inside: bool,
    has_grammar: bool,
    tokenize: Callable[[str], list[int]],
) -> ReasoningBudget | None:
    """A request's budget; None when it asks for none (None or -1), when its reasoning is not
    parsed (`reasoning_format: none`) or when it has a grammar (see the module docstring)."""
    if value is None or value < 0 or markers is None or has_grammar:
        return None
    return ReasoningBudget(value, markers, starts_inside, tuple(tokenize(markers.end)))


class BudgetTracker:
    __slots__ = ("_forced", "_is_over", "_spec", "_splitter", "num_reasoning")

    def __init__(self, spec: ReasoningBudget) -> None:
        self._spec = spec
        self._splitter = ReasoningSplitter(spec.markers, starts_inside=spec.starts_inside)
        self._forced: deque[int] = deque()
        self._is_over = False  # the block ended, or its end is being forced
        self.num_reasoning = 0
        if spec.starts_inside and spec.budget == 0:
            self._forced.extend(spec.end_tokens)
            self._is_over = True

    def next_token(self, sampled: int) -> int:
        """The token to commit this step: the next forced one, else what was sampled."""
        return self._forced.popleft() if self._forced else sampled

    def observe(self, text: str) -> None:
        """The committed token's text (after the stop-string matcher)."""
        if self._is_over:
            return
        was_reasoning = self._splitter.in_reasoning
        self._splitter.feed(text)
        is_reasoning = self._splitter.in_reasoning
        if was_reasoning or is_reasoning:
            self.num_reasoning += 1
        if was_reasoning and not is_reasoning:
            self._is_over = True  # closed by the model itself
        elif is_reasoning and self.num_reasoning >= self._spec.budget:
            self._forced.extend(self._spec.end_tokens)
            self._is_over = True
