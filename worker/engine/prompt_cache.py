"""The host-RAM prompt cache: KV states of sequences kept off the KV cache (llama-server's
`--cache-ram`).

What goes in: the part of a slot's cache that a new task is about to overwrite (so a later
prompt can still find it), a preempted request's sequence (one KV pool shared by all slots),
and the prompt of a request that was prefilled in the staging sequence while every slot was
busy ("parked": its first token is already out, and it continues from here when a slot
frees). With one KV pool shared by all slots, idle slots are also moved here when a task is
admitted, because llama.cpp attends over every cell of that pool up to the highest one used.

Entries are (tokens, opaque state, what kind of rows they are, maybe the logits after the
last token, the LoRA adapter set they were computed with), looked up only among entries of
the request's own adapter set, then by the longest prefix that may be reused (`policy.reusable`), evicted
least recently used first beyond `limit_bytes` or `max_entries` (a parked request's entry is
pinned until it is taken, unless nothing else is left to evict). An entry whose tokens are a
prefix of a newer one of the same kind (and adapter set) is replaced by it. Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.engine.policy import Rows, common_prefix_len, reusable
from worker.protocol.sampling import LoraKey


@dataclass(slots=True)
class CachedPrompt:
    tokens: tuple[int, ...]
    state: bytearray
    rows: Rows
    logits: np.ndarray | None = None  # at position len(tokens)-1, when a prompt ended there
    is_pinned: bool = False
    lora: LoraKey = ()  # the adapter set its rows were computed with

    @property
    def n_bytes(self) -> int:
        return len(self.state) + (self.logits.nbytes if self.logits is not None else 0)


class PromptCache:
    def __init__(self, limit_bytes: int | None, max_entries: int = 256, decode_class: int = 0) -> None:
        """`limit_bytes` None: no limit. `max_entries` bounds the linear scan of `best`."""
        self.limit_bytes = limit_bytes
        self.max_entries = max_entries
        self.decode_class = decode_class
        self._entries: OrderedDict[int, CachedPrompt] = OrderedDict()  # id -> entry, LRU first
        self._next_id = 0
        self.n_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, tokens: Sequence[int], state: bytearray, rows: Rows, logits: np.ndarray | None = None,
        *, pin: bool = False, lora: LoraKey = (),
    ) -> CachedPrompt | None:
        """Store a sequence's state; None if it does not fit in the limit at all."""
        entry = CachedPrompt(tuple(tokens), state, rows, logits, pin, lora)
        if not tokens or (self.limit_bytes is not None and entry.n_bytes > self.limit_bytes):
            return None
        key = entry.tokens
        for eid, old in list(self._entries.items()):
            if old.lora != lora:
                continue
            n = len(old.tokens)
            if n <= len(key) and key[:n] == old.tokens and self._covers(entry, old) and not old.is_pinned:
                self._drop(eid)  # the new entry covers this one
            elif n > len(key) and old.tokens[: len(key)] == key and self._covers(old, entry) and not pin:
                self._entries.move_to_end(eid)  # an existing entry already covers the new one
                return old
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.n_bytes += entry.n_bytes
        self._shrink()
        return entry

    def _covers(self, longer: CachedPrompt, shorter: CachedPrompt) -> bool:
        n = len(shorter.tokens)
        return reusable(n, longer.rows, shorter.rows, self.decode_class) == n and (
            shorter.logits is None or len(longer.tokens) == n
        )

    def best(
        self, prompt: Sequence[int], wanted: Rows, *, any_class: bool = False, lora: LoraKey = (),
    ) -> tuple[CachedPrompt | None, int]:
        """The entry of adapter set `lora` whose rows the prompt may reuse most, and how many (0:
        none). `any_class`: a history reuse, every row of the common prefix counts (policy.MIXED_CLASS)."""
        best_id, best_n = -1, 0
        for eid, entry in self._entries.items():
            if entry.lora != lora:
                continue
            n = common_prefix_len(entry.tokens, prompt)
            if not any_class:
                n = reusable(n, entry.rows, wanted, self.decode_class)
            if n > best_n:
                best_id, best_n = eid, n
        if best_id < 0:
            return None, 0
        self._entries.move_to_end(best_id)
        return self._entries[best_id], best_n

    def most_recent_first(self) -> list[CachedPrompt]:
        return list(reversed(self._entries.values()))

    def unpin(self, entry: CachedPrompt) -> None:
        entry.is_pinned = False
        self._shrink()

    def clear(self) -> None:
        self._entries.clear()
        self.n_bytes = 0

    def _shrink(self) -> None:
        while (self.limit_bytes is not None and self.n_bytes > self.limit_bytes) or len(
            self._entries
        ) > self.max_entries:
            victim = next((eid for eid, e in self._entries.items() if not e.is_pinned), None)
            self._drop(next(iter(self._entries)) if victim is None else victim)

    def _drop(self, eid: int) -> None:
        self.n_bytes -= self._entries.pop(eid).n_bytes
