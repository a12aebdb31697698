"""Splitting a chat model's reasoning (`<think>...</think>`) from its answer, whole or streamed.

Rules (llama-server's `reasoning_format: deepseek`):
- A reasoning block is recognized only at the very start of the output (after optional
  whitespace), or from the first character when the prompt already opened it (`starts_inside`:
  DeepSeek-R1 and Qwen3 templates end the generation prompt with `<think>`); then a start marker
  repeated at the start of the output is skipped. A start marker anywhere else is content.
- Reasoning is the text between the markers, stripped of surrounding whitespace. Content is what
  follows the end marker, leading whitespace stripped. An unterminated block is all reasoning.
- Without a block the output is content, unchanged.

`ReasoningSplitter` gives the same split for text arriving in arbitrary pieces: it holds back a
suffix that may be the beginning of a marker and whitespace that may turn out to be trailing, so
the concatenated deltas equal `split_reasoning` of the whole text (`""` for `None`).

`partial_suffix_len` and `TrimmedStream` are the two holding-back primitives; worker/text/tool_calls.py
uses them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    start: str
    end: str


THINK = ReasoningMarkers("<think>", "</think>")

# (text in the template source, the family's markers), first match wins; THINK otherwise.
_FAMILIES: tuple[tuple[str, ReasoningMarkers], ...] = (
    ("[THINK]", ReasoningMarkers("[THINK]", "[/THINK]")),  # Magistral
    ("<|START_THINKING|>", ReasoningMarkers("<|START_THINKING|>", "<|END_THINKING|>")),  # Command A
    ("<seed:think>", ReasoningMarkers("<seed:think>", "</seed:think>")),  # Seed-OSS
)


def detect_markers(template_source: str | None) -> ReasoningMarkers:
    """The reasoning markers of the model family whose chat template this is."""
    for needle, markers in _FAMILIES:
        if template_source and needle in template_source:
            return markers
    return THINK


def starts_in_reasoning(prompt_text: str, markers: ReasoningMarkers) -> bool:
    """Whether the rendered prompt leaves a reasoning block open for the output to continue.

    True when the prompt ends (trailing whitespace aside) with the start marker. Qwen3 with
    `enable_thinking: false` renders `<think>\\n\\n</think>\\n\\n`: closed, so False.
    """
    return prompt_text.rstrip().endswith(markers.start)


def split_reasoning(
    text: str, markers: ReasoningMarkers, *, starts_inside: bool = False
) -> tuple[str | None, str]:
    """(reasoning, content) of a complete output; reasoning is None when there was no block.

    An empty block gives `""`. Content after a block is `text[len(text) - len(content):]`, a
    suffix of `text` (callers use that to keep the block's raw text).
    """
    head = text.lstrip()
    if head.startswith(markers.start):
        region = head[len(markers.start) :]
    elif starts_inside:
        region = head
    else:
        return None, text
    end = region.find(markers.end)
    if end < 0:
        return region.strip(), ""
    return region[:end].strip(), region[end + len(markers.end) :].lstrip()


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class TrimmedStream:
    """Streams text with its surrounding whitespace stripped.

    Leading whitespace is dropped; trailing whitespace is held until more non-whitespace text
    follows, and dropped if none does (so there is nothing to flush at the end).
    """

    __slots__ = ("_held", "_started")

    def __init__(self) -> None:
        self._held = ""
        self._started = False

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        buf = self._held + text
        body = buf.rstrip()
        self._held = buf[len(body) :]
        return body


class _Phase(Enum):
    START = "start"  # before the first non-whitespace text: is there a block?
    INSIDE = "inside"  # in the block; `_held` may be the beginning of the end marker
    AFTER = "after"  # after the end marker, dropping whitespace before the content
    CONTENT = "content"  # content, passed through


class ReasoningSplitter:
    """`split_reasoning` for text that arrives in pieces; see the module docstring.

    Phases: START -> INSIDE (start marker, or `starts_inside`) -> AFTER (end marker) -> CONTENT
    (first non-whitespace after it); START -> CONTENT when the output does not open a block.
    """

    __slots__ = ("_held", "_markers", "_num_fed", "_phase", "_prefix_len", "_reasoning", "_starts_inside")

    def __init__(self, markers: ReasoningMarkers, *, starts_inside: bool = False) -> None:
        self._markers = markers
        self._starts_inside = starts_inside
        self._phase = _Phase.START
        self._held = ""  # START: everything fed; INSIDE: a possible beginning of the end marker
        self._reasoning = TrimmedStream()
        self._num_fed = 0
        self._prefix_len = 0  # once in CONTENT: length of the raw text before the content

    @property
    def in_reasoning(self) -> bool:
        """True inside an open block: from the complete start marker (or the first character, with
        `starts_inside`) until the end marker is complete."""
        if self._phase is _Phase.START:
            return self._starts_inside
        return self._phase is _Phase.INSIDE

    @property
    def reasoning_raw_len(self) -> int:
        """How many leading characters of the text fed so far are known to be the block's raw text
        (whitespace before it, markers, reasoning, whitespace after it); 0 without a block."""
        if self._phase is _Phase.START:
            return self._num_fed if self._starts_inside else 0
        if self._phase is _Phase.CONTENT:
            return self._prefix_len
        return self._num_fed

    def feed(self, delta: str) -> tuple[str, str]:
        """Add generated text; return the (reasoning, content) text that is now certain."""
        self._num_fed += len(delta)
        return self._advance(delta, at_end=False)

    def finish(self) -> tuple[str, str]:
        """End of output: return what was held back."""
        return self._advance("", at_end=True)

    def _advance(self, delta: str, *, at_end: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase is _Phase.START:
            rest = self._leave_start(delta, at_end=at_end)
            if rest is None:
                return "", ""
            delta = rest
        if self._phase is _Phase.INSIDE:
            reasoning, delta = self._inside(delta, at_end=at_end)
        if self._phase is _Phase.AFTER:
            delta = delta.lstrip()
            if delta:
                self._phase = _Phase.CONTENT
                self._prefix_len = self._num_fed - len(delta)
        if self._phase is _Phase.CONTENT:
            content = delta
        return reasoning, content

    def _leave_start(self, delta: str, *, at_end: bool) -> str | None:
        """Decide whether the output opens a block; return the text to go on with, or None to wait."""
        self._held += delta
        head = self._held.lstrip()
        start = self._markers.start
        if head.startswith(start):
            self._phase, rest = _Phase.INSIDE, head[len(start) :]
        elif not at_end and start.startswith(head):  # empty, or a possible start marker
            return None
        elif self._starts_inside:
            self._phase, rest = _Phase.INSIDE, head
        else:
            self._phase, rest = _Phase.CONTENT, self._held
        self._held = ""
        return rest

    def _inside(self, delta: str, *, at_end: bool) -> tuple[str, str]:
        """(reasoning now certain, text after the end marker if it was found)."""
        buf = self._held + delta
        end = self._markers.end
        i = buf.find(end)
        if i >= 0:
            self._held = ""
            self._phase = _Phase.AFTER
            return self._reasoning.feed(buf[:i]), buf[i + len(end) :]
        keep = 0 if at_end else partial_suffix_len(buf, end)
        self._held = buf[len(buf) - keep :]
        return self._reasoning.feed(buf[: len(buf) - keep]), ""
