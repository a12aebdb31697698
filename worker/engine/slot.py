"""A slot: one KV-cache sequence (`seq_id` = slot id) and the task it is serving, if any.

Invariant: `cache` is exactly the token sequence whose KV entries sequence `id` holds, at
positions 0..len(cache)-1. Only the engine thread touches slots; every change to the backend's
KV for this sequence goes with the matching change to `cache`.

`feed` holds the tokens to decode next: the rest of the prompt while `is_prefill`, then the one
token sampled last (not yet in the KV cache) while generating.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from worker.engine.task import Task


@dataclass(eq=False, slots=True)
class Slot:
    id: int
    cache: list[int] = field(default_factory=list)
    task: Task | None = None
    feed: list[int] = field(default_factory=list)
    is_prefill: bool = False
    t_last_used: float = field(default_factory=time.monotonic)

    @property
    def is_idle(self) -> bool:
        return self.task is None

    @property
    def is_decoding(self) -> bool:
        return self.task is not None and not self.is_prefill

    def release(self) -> Task | None:
        """Detach the task; the KV cache stays for prefix reuse by the next task."""
        task, self.task = self.task, None
        self.feed = []
        self.is_prefill = False
        self.t_last_used = time.monotonic()
        return task
