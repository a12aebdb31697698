"""The host-RAM prompt cache: KV states of idle slots, kept off the KV cache (llama-server's
`--cache-ram` with `--cache-idle-slots`).

Why. The KV cache is unified, and llama.cpp attends over every cell up to the highest one in
use, masked per sequence. Idle slots that keep their last prompt in the KV cache for prefix
reuse therefore slow every decode of the busy ones: with 7 idle slots of ~100 tokens each, a
single-request decode of the "small" test model costs 4.6 ms instead of 4.1 ms. So, as
llama-server does, when a new task is admitted the scheduler saves each *other* idle slot's
sequence state here (`Backend.seq_state_get`, ~1 ms per 100 tokens) and clears it from the KV
cache; a later prompt that shares a longer prefix with a saved entry than with any slot still
in the KV cache gets that state restored into its slot (`seq_state_set`), then only its new
tokens are evaluated.

Entries are (tokens, opaque state), looked up by longest common prefix, evicted least
recently used first beyond `limit_bytes` (or `max_entries`). An entry whose tokens are a prefix of a newer one is
replaced by it. Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.policy import common_prefix_len


@dataclass(frozen=True, slots=True)
class CachedPrompt:
    tokens: tuple[int, ...]
    state: bytearray


class PromptCache:
    def __init__(self, limit_bytes: int | None, max_entries: int = 256) -> None:
        """`limit_bytes` None: no limit. `max_entries` bounds the linear scan of `best`."""
        self.limit_bytes = limit_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[int, CachedPrompt] = OrderedDict()  # id -> entry, LRU first
        self._next_id = 0
        self.n_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], state: bytearray) -> bool:
        """Store a sequence's state; False if it does not fit in the limit at all."""
        if not tokens or (self.limit_bytes is not None and len(state) > self.limit_bytes):
            return False
        key = tuple(tokens)
        for eid, entry in list(self._entries.items()):
            n = len(entry.tokens)
            if n <= len(key) and key[:n] == entry.tokens:
                self._drop(eid)  # the new entry covers this one
            elif n > len(key) and entry.tokens[: len(key)] == key:
                self._entries.move_to_end(eid)  # an existing entry already covers the new one
                return True
        self._entries[self._next_id] = CachedPrompt(key, state)
        self._next_id += 1
        self.n_bytes += len(state)
        while (self.limit_bytes is not None and self.n_bytes > self.limit_bytes) or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
        return True

    def best(self, prompt: Sequence[int]) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that length (0: none)."""
        best_id, best_n = -1, 0
        for eid, entry in self._entries.items():
            n = common_prefix_len(entry.tokens, prompt)
            if n > best_n:
                best_id, best_n = eid, n
        if best_id < 0:
            return None, 0
        self._entries.move_to_end(best_id)
        return self._entries[best_id], best_n

    def clear(self) -> None:
        self._entries.clear()
        self.n_bytes = 0

    def _drop(self, eid: int) -> None:
        self.n_bytes -= len(self._entries.pop(eid).state)
