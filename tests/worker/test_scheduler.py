"""The scheduler's bookkeeping against a recording in-memory KV cache (no model).

`KVRecorder` implements only what the scheduler calls on a backend (n_ctx, n_batch, seq_rm,
new_sampler, is_sleeping) and keeps the cells each sequence holds, so every test can check the
scheduler's invariant: a slot's `cache` is exactly what the backend holds for its sequence.
"""

from __future__ import annotations

import json
from typing import Any, cast

from worker.backends.base import Backend, BatchEntry
from worker.engine.metrics import WorkerMetrics
from worker.engine.prompt_cache import PromptCache
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Planned, Scheduler
from worker.engine.task import Task


class KVRecorder:
    def __init__(self, n_ctx: int, n_batch: int) -> None:
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.is_sleeping = False
        self.seqs: dict[int, list[int]] = {}

    def seq_rm(self, seq_id: int, p0: int) -> None:
        del self.seqs.setdefault(seq_id, [])[p0:]

    def new_sampler(self, params: SamplingParams, seed: int) -> Any:
        return object()

    def decode(self, entries: list[BatchEntry]) -> None:
        assert sum(len(e.tokens) for e in entries) <= self.n_batch
        for e in entries:
            seq = self.seqs.setdefault(e.seq_id, [])
            assert len(seq) == e.pos, "entries must continue their sequence"
            seq.extend(e.tokens)
        assert sum(len(s) for s in self.seqs.values()) <= self.n_ctx, "KV cache overflow"


class StatefulKVRecorder(KVRecorder):
    """Also saves and restores a sequence's state (its token list, as JSON bytes)."""

    def seq_state_get(self, seq_id: int) -> bytearray | None:
        return bytearray(json.dumps(self.seqs.get(seq_id, [])).encode())

    def seq_state_set(self, seq_id: int, state: bytearray) -> bool:
        assert not self.seqs.get(seq_id), "restores go into an empty sequence"
        self.seqs[seq_id] = json.loads(state)
        return True


def make(
    n_slots: int = 2, n_ctx: int = 64, n_batch: int = 16, prompt_cache: PromptCache | None = None
) -> tuple[Scheduler, KVRecorder]:
    kv = StatefulKVRecorder(n_ctx, n_batch) if prompt_cache is not None else KVRecorder(n_ctx, n_batch)
    return Scheduler(cast(Backend, kv), n_slots, WorkerMetrics(), prompt_cache), kv


def task(prompt: list[int], **params: Any) -> Task:
    return Task(prompt, SamplingParams(**params), 0, lambda e: None)


def step(b: Scheduler, kv: KVRecorder, sampled_token: int = 7) -> Planned:
    """One engine step without a model: every slot that asked for logits 'samples' a token."""
    b.admit()
    planned = b.plan()
    kv.decode([e for _, e in planned])
    for slot in b.commit(planned):
        assert slot.task is not None
        slot.is_prefill = False
        slot.task.generated.append(sampled_token)
        slot.feed = [sampled_token]
    for s in b.slots:
        assert kv.seqs.get(s.id, []) == s.cache
    return planned


def test_long_prompt_is_prefilled_in_chunks_with_logits_at_the_end() -> None:
    b, kv = make(n_batch=16)
    b.enqueue(task(list(range(40))))
    shapes = [[(len(e.tokens), e.logits) for _, e in step(b, kv)] for _ in range(4)]
    assert shapes == [[(16, False)], [(16, False)], [(8, True)], [(1, True)]]


def test_decode_tokens_come_first_then_prompt_chunks() -> None:
    b, kv = make(n_batch=8)
    b.enqueue(task([1, 2, 3]))
    step(b, kv)  # prefill of the first task, which now generates
    b.enqueue(task(list(range(100, 120))))
    planned = step(b, kv)
    assert [(len(e.tokens), e.logits) for _, e in planned] == [(1, True), (7, False)]


def test_prefix_reuse_keeps_the_common_prefix() -> None:
    b, kv = make()
    b.enqueue(task([1, 2, 3, 4, 5]))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([1, 2, 3, 9]))
    planned = step(b, kv)
    assert planned[0][1].tokens == [9] and planned[0][1].pos == 3
    assert b.slots[0].task is not None and b.slots[0].task.stats.n_cached == 3


def test_prompt_fully_cached_still_decodes_its_last_token() -> None:
    b, kv = make()
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([1, 2, 3]))
    planned = step(b, kv)
    assert planned[0][1].tokens == [3] and planned[0][1].pos == 2


def test_full_cache_drops_idle_prefixes_before_preempting() -> None:
    b, kv = make(n_slots=2, n_ctx=20, n_batch=16)
    b.enqueue(task(list(range(12))))
    step(b, kv)
    b.slots[0].release()  # 12 cells of idle cache
    b.enqueue(task(list(range(50, 62))))  # needs 12 more: only 8 are free
    for _ in range(3):
        step(b, kv)
    assert b.slots[0].cache == [] and len(b.slots[1].cache) >= 12
    assert not b.waiting


def test_full_cache_preempts_the_youngest_and_requeues_it_with_its_tokens() -> None:
    b, kv = make(n_slots=2, n_ctx=20, n_batch=16)
    old, young = task(list(range(8))), task(list(range(30, 38)))
    b.enqueue(old)
    b.enqueue(young)
    step(b, kv)  # both prompts in (16 cells), both generating
    while not b.waiting:
        step(b, kv)
    assert b.waiting[0] is young and young.generated
    assert young.tokens() == young.prompt + young.generated
    assert all(s.task is not young for s in b.slots)
    assert any(s.task is old for s in b.slots)


def test_cancelled_tasks_are_reaped() -> None:
    b, kv = make(n_slots=1)
    running, queued = task([1, 2]), task([3, 4])
    b.enqueue(running)
    b.enqueue(queued)
    step(b, kv)
    running.cancel()
    queued.cancel()
    assert set(map(id, b.reap_cancelled())) == {id(running), id(queued)}
    assert not b.has_work()


def test_admission_moves_other_idle_slots_to_the_prompt_cache() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=3, prompt_cache=cache)
    first = list(range(10, 30))
    b.enqueue(task(first))
    for _ in range(3):
        step(b, kv)
    b.slots[0].release()  # idle, its prompt and 2 generated tokens in the KV cache
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    assert b.slots[0].cache == [] and kv.seqs[0] == []  # cleared from the KV cache...
    entry, n = cache.best(first)
    assert entry is not None and n == 20  # ...and kept in RAM


def test_a_saved_prompt_is_restored_and_only_the_new_tokens_run() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=2, prompt_cache=cache)
    prefix = list(range(100, 140))
    b.enqueue(task([*prefix, 1, 2]))
    for _ in range(4):
        step(b, kv)
    b.slots[0].release()
    b.enqueue(task([7] * 12))  # takes slot 1; slot 0 goes to RAM
    step(b, kv)
    assert b.slots[0].cache == []
    b.enqueue(task([*prefix, 5, 6, 8]))  # slot 0: restored, then cut back to the shared prefix
    planned = step(b, kv)
    entry = next(e for s, e in planned if s.id == 0)
    assert entry.pos == len(prefix) and entry.tokens == [5, 6, 8]
    t = b.slots[0].task
    assert t is not None and t.stats.n_cached == len(prefix)


def test_a_short_match_is_not_worth_a_restore() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=2, prompt_cache=cache)
    b.enqueue(task(list(range(100, 140))))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([7] * 12))
    step(b, kv)
    b.enqueue(task([100, 101, 102, 9, 9, 9]))  # 3 shared tokens: cheaper to evaluate them
    planned = step(b, kv)
    assert next(e for s, e in planned if s.id == 0).pos == 0


def test_kv_pressure_offloads_idle_caches_instead_of_dropping_them() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=2, n_ctx=20, n_batch=16, prompt_cache=cache)
    b.enqueue(task(list(range(12))))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task(list(range(50, 62)), cache_prompt=False))  # needs room: slot 0's 13 cells go
    for _ in range(3):
        step(b, kv)
    assert cache.best(list(range(12)))[1] == 12


def test_a_preempted_task_resumes_from_its_saved_state() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=2, n_ctx=24, n_batch=16, prompt_cache=cache)
    old, young = task(list(range(8))), task(list(range(30, 38)))
    b.enqueue(old)
    b.enqueue(young)
    step(b, kv)
    while not b.waiting:
        step(b, kv)
    assert b.waiting[0] is young and cache.best(young.tokens())[1] == len(young.tokens()) - 1
    old_slot = next(s for s in b.slots if s.task is old)
    old.cancel()
    b.reap_cancelled()
    old_slot.cache.clear()
    kv.seqs[old_slot.id] = []  # the old task's cells are gone: room to restore
    n_done = len(young.tokens())
    planned = step(b, kv)
    entry = next(e for s, e in planned if s.task is young)
    assert entry.pos == n_done - 1 and len(entry.tokens) == 1  # only the last sampled token runs


def test_the_part_of_a_slot_a_new_task_overwrites_is_saved_first() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=1, prompt_cache=cache)
    first = list(range(10, 26))
    b.enqueue(task(first))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([10, 11, 99]))  # the only slot: keeps [10, 11], overwrites the rest
    planned = step(b, kv)
    assert planned[0][1].pos == 2
    assert cache.best(first)[1] == len(first)
