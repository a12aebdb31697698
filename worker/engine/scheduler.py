"""The slots, the queue of waiting tasks and the KV-cache accounting (engine thread only).

`Scheduler` turns "who is waiting, who is generating" into the next batch:

    reap_cancelled() -> admit() -> plan() -> [backend.decode] -> commit() | on_no_kv_space()

KV space: the backend has `n_ctx` cells shared by all sequences, and the scheduler knows exactly
how many each slot holds (`len(slot.cache)`). Before a step it makes room for one new cell per
generating slot: first by dropping idle slots' cached prefixes (least recently used first),
then by preempting the youngest request (its KV is dropped and it goes back to the head of the
queue with what it generated so far; it owns its sampler and text state, so it resumes exactly
where it was). Prompt chunks only use what is left. If llama.cpp still reports no room (it
rounds internally), the prompt part is halved for the next try; a batch of decode tokens only
is answered by another preemption. So a full cache never fails a request.

With a prompt cache (worker/engine/prompt_cache.py, `--cache-ram`), idle slots do not stay in the KV
cache: each admission saves every other idle slot's state to host RAM and clears it, and a
prompt that matches a saved entry better than any resident slot gets it restored into its slot.
KV pressure offloads idle caches the same way instead of dropping them, and a preempted
request's KV is saved too, so when it is readmitted only its last sampled token runs again.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from worker.backends.base import Backend, BatchEntry
from worker.engine.metrics import WorkerMetrics
from worker.engine.policy import common_prefix_len, kv_victims, pick_slot, youngest
from worker.engine.prompt_cache import PromptCache
from worker.engine.slot import Slot
from worker.engine.task import Task

log = logging.getLogger("worker.engine.engine")

Planned = list[tuple[Slot, BatchEntry]]

# Restore a saved prompt only when it saves at least this many tokens of prefill, and at least
# 1/16 of the entry's length (copying a cell back costs well under 1/16 of evaluating it).
_MIN_RESTORE_GAIN = 8
_RESTORE_COST_RATIO = 16


class Scheduler:
    def __init__(
        self, backend: Backend, n_slots: int, metrics: WorkerMetrics, prompt_cache: PromptCache | None = None
    ) -> None:
        self._backend = backend
        self._metrics = metrics
        self.prompt_cache = prompt_cache
        self.slots = [Slot(i) for i in range(n_slots)]
        self.waiting: deque[Task] = deque()
        self._prefill_cap: int | None = None  # set after llama.cpp found no KV room

    # -- state ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting) or self.n_busy() > 0

    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.task is not None)

    def kv_used(self) -> int:
        return sum(len(s.cache) for s in self.slots)

    def enqueue(self, task: Task) -> None:
        self.waiting.append(task)

    def take_all(self) -> list[Task]:
        """Detach every task (running or waiting) and forget all KV: after an error, at exit."""
        tasks = [t for t in (s.release() for s in self.slots) if t is not None] + list(self.waiting)
        self.waiting.clear()
        self.forget_kv()
        return tasks

    def forget_kv(self) -> None:
        if not self._backend.is_sleeping:
            for s in self.slots:
                self._backend.seq_rm(s.id, 0)
        for s in self.slots:
            s.cache.clear()
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
            self._update_cache_gauges()

    # -- before the decode ------------------------------------------------------------------------
    def reap_cancelled(self) -> list[Task]:
        """Free the slots of cancelled tasks and drop cancelled waiting tasks; return them all."""
        dropped = []
        for s in self.slots:
            if s.task is not None and s.task.is_cancelled:
                task = s.release()
                assert task is not None
                log.info("task %d cancelled (slot %d freed after %d tokens)", task.id, s.id, task.stats.n_decoded)
                dropped.append(task)
        if any(t.is_cancelled for t in self.waiting):
            for t in self.waiting:
                if t.is_cancelled:
                    log.info("task %d cancelled while waiting", t.id)
                    dropped.append(t)
            self.waiting = deque(t for t in self.waiting if not t.is_cancelled)
        return dropped

    def admit(self) -> None:
        """Waiting tasks (FIFO) into idle slots, each to the slot that shares most of its prompt."""
        admitted = False
        while self.waiting:
            task = self.waiting[0]
            tokens = task.tokens()
            p = task.params
            slot = pick_slot(self.slots, tokens, id_slot=p.id_slot, cache_prompt=p.cache_prompt)
            if slot is None:
                break
            self.waiting.popleft()
            if self.prompt_cache is not None:
                restored = p.cache_prompt and self._restore(slot, tokens)
                kept = common_prefix_len(slot.cache, tokens) if p.cache_prompt else 0
                if not restored and kept < len(slot.cache):
                    self._save(slot)  # the tail the new task overwrites stays reusable
            self._assign(slot, task, tokens)
            admitted = True
        if admitted and self.prompt_cache is not None:
            for s in self.slots:
                if s.task is None and s.cache:
                    self._offload(s)

    # -- the prompt cache --------------------------------------------------------------------------
    def _save(self, slot: Slot) -> None:
        """Copy a slot's KV state into the prompt cache."""
        assert self.prompt_cache is not None
        state = self._backend.seq_state_get(slot.id)
        if state is not None:
            self.prompt_cache.put(slot.cache, state)
            self._update_cache_gauges()

    def _offload(self, slot: Slot) -> None:
        """Empty a slot's KV: saved to the prompt cache first when there is one."""
        if slot.cache and self.prompt_cache is not None:
            self._save(slot)
        self._backend.seq_rm(slot.id, 0)
        slot.cache.clear()

    def _restore(self, slot: Slot, tokens: list[int]) -> bool:
        """Load the saved prompt that shares most with `tokens` into `slot`, if that beats its cache."""
        assert self.prompt_cache is not None
        entry, n = self.prompt_cache.best(tokens)
        gain = n - common_prefix_len(slot.cache, tokens)
        if entry is None or gain < _MIN_RESTORE_GAIN or gain * _RESTORE_COST_RATIO < len(entry.tokens):
            return False
        self._offload(slot)
        if len(entry.tokens) > self._kv_free() or not self._backend.seq_state_set(slot.id, entry.state):
            self._backend.seq_rm(slot.id, 0)
            log.info("prompt cache: no KV room to restore %d tokens into slot %d", len(entry.tokens), slot.id)
            return False
        slot.cache.extend(entry.tokens)
        self._metrics.prompt_cache_restored.inc(n)
        log.info("prompt cache: restored %d tokens into slot %d (%d of them reused)", len(entry.tokens), slot.id, n)
        return True

    def _update_cache_gauges(self) -> None:
        if self.prompt_cache is not None:
            self._metrics.prompt_cache_bytes.set(self.prompt_cache.n_bytes)
            self._metrics.prompt_cache_entries.set(len(self.prompt_cache))

    def _assign(self, slot: Slot, task: Task, tokens: list[int]) -> None:
        n_keep = common_prefix_len(slot.cache, tokens) if task.params.cache_prompt else 0
        n_keep = min(n_keep, len(tokens) - 1)  # at least one token to decode, for its logits
        if n_keep < len(slot.cache):
            self._backend.seq_rm(slot.id, n_keep)
            del slot.cache[n_keep:]
        slot.task = task
        slot.feed = tokens[n_keep:]
        slot.is_prefill = True
        if task.sampler is None:  # first admission (a preempted task keeps its sampler)
            task.sampler = self._backend.new_sampler(task.params, task.seed)
            task.stats.n_cached = n_keep
            task.stats.t_start = time.monotonic()

    def plan(self) -> Planned:
        """One token per generating slot, then prompt chunks (oldest first); KV room made first."""
        decoding = [s for s in self.slots if s.is_decoding]
        free = self._kv_free()  # one pass over the slots per step; recounted only after evictions
        while free < len(decoding):
            if not self._evict_idle_cache():
                self._preempt_youngest()
                decoding = [s for s in self.slots if s.is_decoding]
            free = self._kv_free()
        planned: Planned = [(s, BatchEntry(s.id, s.feed, len(s.cache), True)) for s in decoding]

        free -= len(planned)
        budget = self._backend.n_batch - len(planned)
        if self._prefill_cap is not None:
            budget = min(budget, self._prefill_cap)
        prefilling = sorted((s for s in self.slots if s.task and s.is_prefill), key=_arrival)
        for s in prefilling:
            if budget <= 0:
                break
            want = min(len(s.feed), budget)
            while free < want and self._evict_idle_cache():
                free = self._kv_free() - sum(len(e.tokens) for _, e in planned)
            n = min(want, free)
            if n <= 0:
                break
            planned.append((s, BatchEntry(s.id, s.feed[:n], len(s.cache), n == len(s.feed))))
            budget -= n
            free -= n
        if not planned and self.n_busy() > 0:
            # Prompts fill the cache and nothing can move: the youngest gives its cells back.
            self._preempt_youngest()
        return planned

    def _kv_free(self) -> int:
        return self._backend.n_ctx - self.kv_used()

    def _evict_idle_cache(self) -> bool:
        victims = kv_victims(self.slots)
        if not victims:
            return False
        self._offload(victims[0])
        return True

    def _preempt_youngest(self) -> None:
        slot = youngest(self.slots)
        if slot is None:
            return
        task = slot.release()
        assert task is not None
        self._offload(slot)  # with a prompt cache, readmission restores it
        task.n_preempted += 1
        self.waiting.appendleft(task)
        self._metrics.n_preempted.inc()
        log.warning(
            "KV cache full: task %d preempted from slot %d (%d tokens generated, requeued)",
            task.id, slot.id, len(task.generated),
        )

    # -- after the decode -------------------------------------------------------------------------
    def on_no_kv_space(self, planned: Planned) -> None:
        """llama_decode found no room: halve the prompt part, or preempt if there is none."""
        self._metrics.n_decode.inc()
        n_prompt = sum(len(e.tokens) for s, e in planned if s.is_prefill)
        if n_prompt > 1:
            self._prefill_cap = n_prompt // 2
            log.warning("llama_decode: no KV room for the batch; retrying with %d prompt tokens", n_prompt // 2)
        else:
            self._preempt_youngest()

    def commit(self, planned: Planned) -> list[Slot]:
        """The batch is in the KV cache: move fed tokens into each slot's cache; return the slots
        whose last entry asked for logits, in batch order (the order `sample` expects)."""
        self._metrics.n_decode.inc()
        self._prefill_cap = None
        to_sample: list[Slot] = []
        for slot, entry in planned:
            n = len(entry.tokens)
            slot.cache.extend(entry.tokens)
            slot.feed = slot.feed[n:]  # a new list: a decode entry's tokens are the old feed
            if slot.is_prefill and slot.task is not None:
                slot.task.stats.n_evaluated += n
            if entry.logits:
                to_sample.append(slot)
        return to_sample


def _arrival(slot: Slot) -> float:
    return slot.task.stats.t_arrival if slot.task else 0.0
