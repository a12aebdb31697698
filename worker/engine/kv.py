"""KV placement: where a slot's rows come from and where they go, on the engine thread.

The scheduler decides *which* slot serves which task and which rows it may reuse; this module
does the moving, and keeps each `Slot`'s record of its rows (`cache`, `n_prompt_rows`,
`prompt_class`, saved `logits`) equal to what the backend's sequence holds:

    copy     another slot's first n rows (shared or copied, by the backend's KV layout)
    save     a slot's sequence into the host-RAM prompt cache (`--cache-ram`)
    restore  a cached sequence into an empty slot
    offload  save (when there is a cache), then empty the slot
    drop     empty a slot, saving a tail worth keeping first
    snapshot / load / erase   llama-server's slot files (POST /slots/{id}?action=...)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from worker.backends.base import Backend
from worker.engine.metrics import WorkerMetrics
from worker.engine.policy import kv_victims
from worker.engine.prompt_cache import CachedPrompt, PromptCache
from worker.engine.slot import Slot

log = logging.getLogger("omni.worker.scheduler")

_MIN_SAVE = 8  # a tail shorter than this is not worth a copy of the whole sequence


class KvBook:
    def __init__(self, backend: Backend, metrics: WorkerMetrics, prompt_cache: PromptCache | None,
                 sequences: Sequence[Slot]) -> None:
        self._backend = backend
        self._metrics = metrics
        self.prompt_cache = prompt_cache
        self._all = sequences  # every sequence: the slots, then staging if there is one

    def used(self) -> int:
        return sum(len(s.cache) for s in self._all)

    def free(self) -> int:
        return self._backend.n_ctx - self.used()

    def forget_all(self) -> None:
        if not self._backend.is_sleeping:
            for s in self._all:
                self._backend.seq_rm(s.id, 0)
        for s in self._all:
            s.clear()
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
            self.update_cache_gauges()

    # -- between slots ------------------------------------------------------------------------------
    def copy(self, src: Slot, dst: Slot, n: int) -> None:
        """`dst` gets `src`'s first n rows (shared, or copied where the KV layout needs it)."""
        self._backend.seq_cp(src.id, dst.id, n)
        dst.cache[:] = src.cache[:n]
        dst.lora = src.lora
        dst.n_prompt_rows, dst.prompt_class = min(src.n_prompt_rows, n), src.prompt_class
        dst.logits, dst.n_logits = (src.logits, src.n_logits) if src.n_logits <= n else (None, 0)
        self._metrics.prompt_rows_shared.inc(n)

    def truncate(self, slot: Slot, n_keep: int) -> None:
        """Forget `slot`'s rows from n_keep on."""
        if n_keep < len(slot.cache):
            self._backend.seq_rm(slot.id, n_keep)
            slot.truncate(n_keep)

    def save_tail(self, slot: Slot, n_keep: int) -> None:
        """The cache of `slot` beyond n_keep is about to be overwritten: keep it findable, if
        that tail is worth a copy of the whole sequence (a few generated tokens after a kept
        prompt are not)."""
        tail = len(slot.cache) - n_keep
        if self.prompt_cache is not None and tail >= _MIN_SAVE and tail * 4 >= n_keep:
            self.save(slot)

    def drop(self, slot: Slot) -> None:
        self.save_tail(slot, 0)
        self._backend.seq_rm(slot.id, 0)
        slot.clear()

    # -- the prompt cache --------------------------------------------------------------------------
    def save(self, slot: Slot) -> None:
        """Copy a slot's KV state into the prompt cache."""
        assert self.prompt_cache is not None
        state = self._backend.seq_state_get(slot.id)
        if state is not None:
            logits = slot.logits if slot.n_logits == len(slot.cache) else None
            self.prompt_cache.put(slot.cache, state, slot.rows, logits, lora=slot.lora)
            self.update_cache_gauges()

    def offload(self, slot: Slot) -> None:
        """Empty a slot's KV: saved to the prompt cache first when there is one."""
        if slot.cache and self.prompt_cache is not None:
            self.save(slot)
        self._backend.seq_rm(slot.id, 0)
        slot.clear()

    def restore(self, slot: Slot, entry: CachedPrompt, n_reused: int) -> bool:
        """Load a saved sequence into `slot` (emptied first)."""
        t0 = time.perf_counter()
        self._backend.seq_rm(slot.id, 0)
        slot.clear()
        fits = not self._backend.kv_unified or len(entry.tokens) <= self.free()
        if not fits or not self._backend.seq_state_set(slot.id, entry.state):
            self._backend.seq_rm(slot.id, 0)
            log.info("prompt cache: no KV room to restore %d tokens into slot %d", len(entry.tokens), slot.id)
            return False
        slot.cache.extend(entry.tokens)
        slot.lora = entry.lora
        slot.n_prompt_rows, slot.prompt_class = entry.rows
        if entry.logits is not None:
            slot.logits, slot.n_logits = entry.logits, len(entry.tokens)
        self._metrics.prompt_cache_restored.inc(n_reused)
        log.info(
            "prompt cache: restored %d tokens into slot %d (%d of them reused) in %.1f ms",
            len(entry.tokens),
            slot.id,
            n_reused,
            (time.perf_counter() - t0) * 1e3,
        )
        return True

    def park(self, slot: Slot) -> CachedPrompt | None:
        """Staging's sequence into the prompt cache, pinned (its task resumes from it): the
        entry, or None when the state could not be read. The slot is emptied."""
        assert self.prompt_cache is not None
        key = None
        state = self._backend.seq_state_get(slot.id)
        if state is not None:
            key = self.prompt_cache.put(slot.cache, state, slot.rows, pin=True, lora=slot.lora)
            self.update_cache_gauges()
        self._backend.seq_rm(slot.id, 0)
        slot.clear()
        return key

    def evict_idle_cache(self) -> bool:
        """Shared pool: offload the idle slot whose cache is the best victim (False: none)."""
        victims = kv_victims(list(self._all))
        if not victims:
            return False
        self.offload(victims[0])
        return True

    def update_cache_gauges(self) -> None:
        if self.prompt_cache is not None:
            self._metrics.prompt_cache_bytes.set(self.prompt_cache.n_bytes)
            self._metrics.prompt_cache_entries.set(len(self.prompt_cache))

    # -- slot files (engine idle) -------------------------------------------------------------------
    def snapshot(self, slot: Slot) -> tuple[list[int], tuple[int, int], bytearray | None]:
        """What `slot` holds: (tokens, rows, KV state or None when it holds nothing)."""
        state = self._backend.seq_state_get(slot.id) if slot.cache else None
        return list(slot.cache), slot.rows, state

    def load(self, slot: Slot, tokens: list[int], rows: tuple[int, int], state: bytes) -> bool:
        """Load a snapshot into `slot` (whatever it held is dropped); False if it did not fit."""
        if not tokens:
            self.erase(slot)
            return True
        return self.restore(slot, CachedPrompt(tuple(tokens), bytearray(state), rows), 0)

    def erase(self, slot: Slot) -> int:
        """Forget `slot`'s KV cache; the number of tokens it held."""
        n = len(slot.cache)
        self._backend.seq_rm(slot.id, 0)
        slot.clear()
        return n
