"""A slot: one KV sequence (`seq_id` = slot id) and the task it is serving, if any.

Invariant: `cache` is exactly the token sequence whose KV entries sequence `id` holds, at
positions 0..len(cache)-1. Only the engine thread touches slots; every change to the backend's
KV for this sequence goes with the matching change to `cache`.

What the rows *are* matters as much as which tokens they hold (see `RowRecipe` in
worker/backends/base.py): the first `n_prompt_rows` rows were computed as prompt pieces of
class `prompt_class`, the rest as decode rows. `logits` keeps the logits of the row at
position n_logits-1, saved when a prompt ended there, so that the same prompt, fully cached,
is sampled without any decode (a decode of its last row alone would be a row of another class).

`feed` holds the tokens to decode next: the rest of the prompt while `is_prefill`, then the one
token sampled last (not yet in the KV cache) while generating. A slot whose prompt shares a
prefix with what another slot is computing right now waits for it (`source`, `n_source`)
instead of computing the prefix a second time, then copies it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from worker.engine.task import Task
from worker.protocol.sampling import LoraKey


@dataclass(eq=False, slots=True)
class Slot:
    id: int
    cache: list[int] = field(default_factory=list)
    n_prompt_rows: int = 0  # cache[:n_prompt_rows] are prompt rows of `prompt_class`, the rest decode rows
    prompt_class: int = 0
    n_reused: int = 0  # rows the task found cached at admission; it computes the rest of its prompt
    logits: np.ndarray | None = None  # the logits at position n_logits-1, where a prompt ended
    n_logits: int = 0
    task: Task | None = None
    feed: list[int] = field(default_factory=list)
    is_prefill: bool = False
    source: Slot | None = None  # waiting for this slot to compute our shared prefix ...
    source_task: Task | None = None  # ... for this task of it ...
    n_source: int = 0  # ... up to this length
    t_last_used: float = field(default_factory=time.monotonic)
    lora: LoraKey = ()  # the adapter set `cache`'s rows were computed with (worker/engine/scheduler.py)

    @property
    def is_idle(self) -> bool:
        return self.task is None

    @property
    def is_decoding(self) -> bool:
        """Generating, with a token to decode (a beam search's slot waiting for its first beam
        has none: worker/engine/beam.py)."""
        return self.task is not None and not self.is_prefill and bool(self.feed)

    @property
    def rows(self) -> tuple[int, int]:
        """(n_prompt_rows, prompt_class): what `policy.reusable` compares."""
        return self.n_prompt_rows, self.prompt_class

    def truncate(self, n: int) -> None:
        """Forget the bookkeeping of positions >= n (the caller drops the KV)."""
        if n < len(self.cache):
            del self.cache[n:]
            self.n_prompt_rows = min(self.n_prompt_rows, n)
            if n < self.n_logits:
                self.logits, self.n_logits = None, 0

    def clear(self) -> None:
        self.truncate(0)

    def release(self) -> Task | None:
        """Detach the task; the KV cache stays for prefix reuse by the next task."""
        task, self.task = self.task, None
        self.feed = []
        self.is_prefill = False
        self.source, self.source_task, self.n_source = None, None, 0
        self.t_last_used = time.monotonic()
        return task
