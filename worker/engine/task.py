"""A generation request as the engine sees it, and the events it streams back.

A `Task` is created by an HTTP handler (plain types only: token ids and `SamplingParams`) and
handed to the engine; from then on only the engine thread mutates it, except `cancel()`, which
any thread may call (a single attribute write; the engine notices it at its next step).

Every result goes out through `emit`, called on the engine thread: one `TokenEvent` per sampled
token, then exactly one `FinishEvent` or `ErrorEvent`. A cancelled task gets no further events.
An embedding task (made with `on_embedding`, on an embedding model) samples nothing: once its
prompt is evaluated it gets one `EmbeddingEvent` through `on_embedding` (or an `ErrorEvent`
through `emit`) and is done.

The task, not the slot, owns what must survive preemption: the generated tokens, the sampler
(penalty history, RNG), the grammar's parser state, the detokenizer and the stop-string matcher.
A preempted task is re-admitted with `prompt + generated` as its prompt and continues where it stopped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from worker.protocol.sampling import SamplingParams
from worker.text.detok import IncrementalDetokenizer
from worker.text.stop_strings import StopMatcher

FinishReason = Literal["stop", "length"]
_task_ids = itertools.count(1)


@dataclass(slots=True)
class TaskStats:
    """Counts and monotonic timestamps; turned into `usage` and `timings` by the HTTP layer."""

    n_prompt: int = 0  # prompt tokens
    n_cached: int = 0  # prompt tokens reused from a slot's KV cache at first admission
    n_evaluated: int = 0  # prompt tokens actually decoded (re-evaluation after preemption included)
    n_decoded: int = 0  # generated tokens
    n_draft: int = 0  # speculative draft tokens verified (worker/engine/speculation.py)
    n_draft_accepted: int = 0  # of them accepted
    t_arrival: float = 0.0
    t_start: float = 0.0  # first admitted to a slot
    t_first_token: float = 0.0
    t_end: float = 0.0

    @property
    def prompt_ms(self) -> float:
        return max(0.0, self.t_first_token - self.t_start) * 1e3 if self.t_first_token else 0.0

    @property
    def predicted_ms(self) -> float:
        return max(0.0, self.t_end - self.t_first_token) * 1e3 if self.t_first_token else 0.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """What reading one sampled token decided (the engine reads, the scheduler applies): go on
    (`reason` None), finish with `reason` (and the stop word that ended it), or fail (`error`)."""

    reason: FinishReason | None = None
    stop_word: str | None = None
    error: str | None = None

    @property
    def is_final(self) -> bool:
        return self.reason is not None or self.error is not None


GO_ON = Verdict()


@dataclass(slots=True)
class TokenEvent:
    text: str  # text safe to show now (may be empty: held back or incomplete UTF-8)
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    prob: float | None = None  # post-sampling probability (params.post_sampling_probs)
    top_probs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class FinishEvent:
    reason: FinishReason
    text: str  # the held-back tail, flushed at the end
    stop_word: str | None
    stats: TaskStats
    score: float | None = None  # a beam search's answer: its score (worker/engine/beam.py)


@dataclass(slots=True)
class ErrorEvent:
    message: str
    status_code: int = 500
    type: str = "server_error"


@dataclass(slots=True)
class EmbeddingEvent:
    vectors: Any  # float32[rows, n] as the backend pooled it (worker/backends/base.py)
    stats: TaskStats


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """Prompt processing progress (only for params.return_progress): at admission, then after
    each decode that computed part of the prompt (llama-server's `prompt_progress`)."""

    total: int  # prompt tokens
    cache: int  # of them reused from the KV cache
    processed: int  # in the KV cache now (cache included)
    time_ms: float  # since the task was first admitted to a slot


Event = TokenEvent | FinishEvent | ErrorEvent | ProgressEvent


class TextOutput:
    """Token bytes -> complete characters -> text with stop strings held back and cut."""

    __slots__ = ("_detok", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._detok = IncrementalDetokenizer()
        self._stops = StopMatcher(stops)

    def push(self, piece: bytes) -> tuple[str, str | None]:
        text = self._detok.feed(piece)
        return self._stops.feed(text) if text else ("", None)

    def finish(self) -> str:
        tail, matched = self._stops.feed(self._detok.flush())
        return tail if matched else tail + self._stops.flush()


class Task:
    """One sequence to generate (a request with `n` > 1 becomes `n` tasks)."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        emit: Callable[[Event], None],
        *,
        on_embedding: Callable[[EmbeddingEvent], None] | None = None,
        media: dict[int, Any] | None = None,
    ) -> None:
        self.id = next(_task_ids)
        self.media: dict[int, Any] = media or {}  # the prompt's image chunks: key -> embeddings (media.py)
        self.on_embedding = on_embedding  # an embedding task: done when its prompt is evaluated
        self.is_embedding = on_embedding is not None
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.emit = emit
        self.is_cancelled = False
        self.generated: list[int] = []
        self.sampler: Any = None
        self.matcher = (
            params.grammar.matcher() if params.grammar is not None else None
        )  # owned like the sampler
        self.budget = (
            params.reasoning_budget.tracker() if params.reasoning_budget is not None else None
        )  # likewise
        self.output = TextOutput(params.stop)
        self.stats = TaskStats(n_prompt=len(prompt), t_arrival=time.monotonic())
        self.n_preempted = 0
        self.parked: Any = None  # the prompt-cache entry holding its prefill while it waits for a slot
        # Beam search (params.beam_width > 0): the search once admitted (worker/engine/beam.py), and
        # where its n answers go (the request's choices; the HTTP layer sets them, else this task's own)
        self.beam: Any = None
        self.choice_emits: list[Callable[[Event], None]] = [emit]

    def cancel(self) -> None:
        """Any thread: the engine drops the task (and frees its slot) at its next step."""
        self.is_cancelled = True

    def report_progress(self, processed: int) -> None:
        """Engine thread: a ProgressEvent, if the request asked for them, while the prompt is computed."""
        if self.params.return_progress and not self.generated:
            st = self.stats
            is_started = (
                processed > st.n_cached and st.t_start > 0
            )  # the first report comes before any decode
            elapsed_ms = (time.monotonic() - st.t_start) * 1e3 if is_started else 0.0
            total = len(self.prompt)
            self.emit(ProgressEvent(total, st.n_cached, min(processed, total), elapsed_ms))

    def tokens(self) -> list[int]:
        """What the slot must hold in its KV cache before the next token can be sampled."""
        return self.prompt + self.generated if self.generated else self.prompt

    def __repr__(self) -> str:
        return f"Task(id={self.id}, n_prompt={len(self.prompt)}, n_generated={len(self.generated)})"
