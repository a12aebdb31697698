"""The scheduler's bookkeeping against a recording in-memory KV cache (no model).

`KVRecorder` implements only what the scheduler calls on a backend and keeps the tokens each
sequence holds, so every test can check the scheduler's invariant: a slot's `cache` is exactly
what the backend holds for its sequence. It also checks the backend's side of the contract:
sequences are continued in order, pieces respect the recipe, nothing exceeds a stream.
"""

from __future__ import annotations

import json
from typing import Any, cast

import httpx
import numpy as np
import pytest

from worker.backends.base import Backend, BatchEntry, RowRecipe
from worker.engine.metrics import WorkerMetrics
from worker.engine.prompt_cache import PromptCache
from worker.engine.scheduler import SHORT_PROMPT, Plan, Scheduler
from worker.engine.task import Task
from worker.protocol.sampling import SamplingParams
from worker.testing.tiny_models import ModelPaths

FA_ON = RowRecipe(short_prompt=64)  # llama.cpp with flash attention
FA_OFF = RowRecipe()


class KVRecorder:
    def __init__(
        self,
        n_ctx: int,
        n_batch: int,
        n_slots: int,
        *,
        unified: bool = False,
        recipe: RowRecipe | None = None,
        n_ubatch: int | None = None,
        runs_by_seq_id: bool = False,
    ) -> None:
        self.n_seq_max = n_slots + 1
        self.kv_unified = unified
        self.runs_by_seq_id = runs_by_seq_id
        self.n_ctx = n_ctx if unified else n_ctx // n_slots * self.n_seq_max
        self.n_ctx_seq = n_ctx if unified else n_ctx // n_slots
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch or n_batch
        self.recipe = recipe or RowRecipe.exact()
        self.is_sleeping = False
        self.seqs: dict[int, list[int]] = {}
        self.n_rows_decoded = 0
        self.copies: list[tuple[int, int, int]] = []

    def seq_rm(self, seq_id: int, p0: int) -> None:
        del self.seqs.setdefault(seq_id, [])[p0:]

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        self.seqs[dst] = list(self.seqs.get(src, [])[:n])
        self.copies.append((src, dst, n))

    def new_sampler(self, params: SamplingParams, seed: int) -> Any:
        return object()

    def logits_row(self, i: int) -> np.ndarray:
        return np.array([float(i)])

    def decode(self, entries: list[BatchEntry]) -> None:
        assert sum(len(e.tokens) for e in entries) <= self.n_batch
        assert len({e.seq_id for e in entries}) == len(entries), "one entry per sequence"
        for e in entries:
            seq = self.seqs.setdefault(e.seq_id, [])
            assert len(seq) == e.pos, "entries must continue their sequence"
            assert len(e.tokens) <= self.n_ubatch
            seq.extend(e.tokens)
            assert len(seq) <= self.n_ctx_seq, "a sequence outgrew its stream"
            self.n_rows_decoded += len(e.tokens)
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
    n_slots: int = 2, n_ctx: int = 128, n_batch: int = 16, prompt_cache: PromptCache | None = None,
    *, reuse_history: bool = True, **kv: Any,
) -> tuple[Scheduler, KVRecorder]:
    kind = StatefulKVRecorder if prompt_cache is not None else KVRecorder
    rec = kind(n_ctx, n_batch, n_slots, **kv)
    if prompt_cache is not None:
        prompt_cache.decode_class = rec.recipe.decode_class
    return Scheduler(
        cast(Backend, rec), n_slots, WorkerMetrics(), prompt_cache, reuse_history=reuse_history
    ), rec


def task(prompt: list[int], **params: Any) -> Task:
    return Task(prompt, SamplingParams(**params), 0, lambda e: None)


def step(b: Scheduler, kv: KVRecorder, sampled_token: int = 7) -> Plan:
    """One engine step without a model: every slot that asked for logits 'samples' a token."""
    b.reap_cancelled()
    b.admit()
    plan = b.plan()
    if plan.entries:
        kv.decode([e for _, e in plan.entries])
    for slot in b.commit(plan) + plan.from_saved:
        assert slot.task is not None
        slot.is_prefill = False
        slot.task.generated.append(sampled_token)
        slot.feed = [sampled_token]
        if slot is b.staging:
            b.park(slot)
    for s in [*b.slots, *([b.staging] if b.staging else [])]:
        assert kv.seqs.get(s.id, []) == s.cache
    return plan


def shapes(plan: Plan) -> list[tuple[int, int, bool]]:
    return [(e.seq_id, len(e.tokens), e.logits) for _, e in plan.entries]


# -- pieces and batches ---------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_pieces_with_logits_at_the_end() -> None:
    b, kv = make(n_batch=16)
    b.enqueue(task(list(range(40))))
    assert [shapes(step(b, kv)) for _ in range(4)] == [
        [(0, 16, False)], [(0, 16, False)], [(0, 8, True)], [(0, 1, True)],
    ]


def test_decode_tokens_come_first_then_prompt_pieces() -> None:
    b, kv = make(n_batch=8)
    b.enqueue(task([1, 2, 3]))
    step(b, kv)  # prefill of the first task, which now generates
    b.enqueue(task(list(range(100, 120))))
    assert shapes(step(b, kv)) == [(0, 1, True), (1, 7, False)]


@pytest.mark.parametrize(
    ("n_prompt", "n_ubatch", "expected"),
    [
        (40, 512, [40]),  # shorter than 64: one piece, whatever the budget
        (64, 512, [64]),
        (200, 512, [200]),
        (200, 80, [72, 64, 64]),  # pieces <= ubatch, none under 64 rows
        (130, 100, [66, 64]),
    ],
)
def test_flash_attention_recipe_cuts_prompts_in_pieces_of_64_rows_or_more(
    n_prompt: int, n_ubatch: int, expected: list[int]
) -> None:
    b, kv = make(n_slots=1, n_ctx=1024, n_batch=1024, recipe=FA_ON, n_ubatch=n_ubatch)
    b.enqueue(task(list(range(1000, 1000 + n_prompt))))
    pieces = []
    while not b.slots[0].task or b.slots[0].is_prefill:
        pieces += [len(e.tokens) for _, e in step(b, kv).entries]
    assert pieces == expected


def test_without_flash_attention_no_piece_is_a_single_row() -> None:
    b, kv = make(n_slots=1, n_ctx=1024, n_batch=1024, recipe=FA_OFF, n_ubatch=10)
    b.enqueue(task(list(range(1000, 1021))))  # 21 = 10 + 9 + 2, never ... + 1
    pieces = []
    while not b.slots[0].task or b.slots[0].is_prefill:
        pieces += [len(e.tokens) for _, e in step(b, kv).entries]
    assert pieces == [10, 9, 2]


# -- reuse of what is cached ----------------------------------------------------------------------


def test_prefix_reuse_keeps_the_common_prefix() -> None:
    b, kv = make()
    b.enqueue(task([1, 2, 3, 4, 5]))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([1, 2, 3, 9]))
    plan = step(b, kv)
    assert plan.entries[0][1].tokens == [9] and plan.entries[0][1].pos == 3
    assert b.slots[0].task is not None and b.slots[0].task.stats.n_cached == 3


def test_a_fully_cached_prompt_is_sampled_from_its_saved_logits_without_a_decode() -> None:
    b, kv = make()
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    b.slots[0].release()
    rows = kv.n_rows_decoded
    b.enqueue(task([1, 2, 3]))
    plan = step(b, kv)
    assert plan.from_saved == [b.slots[0]] and not plan.entries
    assert kv.n_rows_decoded == rows


@pytest.mark.parametrize(("recipe", "redone"), [(RowRecipe.exact(), 1), (FA_OFF, 2), (FA_ON, 64)])
def test_a_cached_prompt_without_saved_logits_redoes_one_valid_piece(recipe: RowRecipe, redone: int) -> None:
    b, kv = make(n_slots=1, n_ctx=512, n_batch=256, recipe=recipe)
    prompt = list(range(100, 200))
    b.enqueue(task([*prompt, 5]))
    while not b.slots[0].task or b.slots[0].is_prefill:
        step(b, kv)
    b.slots[0].release()
    b.enqueue(task(prompt))  # a prefix of what is cached: its logits were never saved
    plan = step(b, kv)
    assert [(e.pos, len(e.tokens)) for _, e in plan.entries] == [(100 - redone, redone)]


def test_strict_reuse_takes_no_rows_of_a_short_prompt_computed_by_another_kernel() -> None:
    b, kv = make(n_slots=1, n_ctx=512, n_batch=256, recipe=FA_ON, reuse_history=False)
    short = list(range(100, 140))  # 40 tokens: one piece, the per-row kernel
    b.enqueue(task(short))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([*short, *range(300, 360)]))  # 100 tokens: the tiled kernel from row 0
    plan = step(b, kv)
    assert [(e.pos, len(e.tokens)) for _, e in plan.entries] == [(0, 100)]


@pytest.mark.parametrize(("recipe", "n_new", "pieces"), [
    (FA_ON, 60, [(40, 60)]),  # the rest is a short prompt of its own: one piece
    (FA_ON, 150, [(40, 150)]),  # a long one: pieces of 64 rows or more (here one)
    (FA_OFF, 1, [(39, 2)]),  # rows of the same class: a strict reuse, the recipe's last piece (2 rows)
    (RowRecipe.exact(), 5, [(40, 5)]),
])
def test_history_reuse_takes_a_finished_prompts_rows_and_computes_only_the_rest(
    recipe: RowRecipe, n_new: int, pieces: list[tuple[int, int]]
) -> None:
    b, kv = make(n_slots=1, n_ctx=512, n_batch=256, recipe=recipe)
    short = list(range(100, 140))  # 40 tokens: one piece, the per-row kernel (FA_ON)
    b.enqueue(task(short))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([*short, *range(300, 300 + n_new)]))
    plan = step(b, kv)
    assert [(e.pos, len(e.tokens)) for _, e in plan.entries] == pieces


@pytest.mark.parametrize("reuse_history", [True, False])
def test_a_short_prompt_reuses_a_finished_short_prompts_rows_of_its_own_class(reuse_history: bool) -> None:
    """A system prompt computed for one question stands in for another's (the per-row kernel
    gives a row the same bits in any piece of 2+ rows): a strict reuse, also with --strict-reuse."""
    b, kv = make(n_slots=1, n_ctx=512, n_batch=256, recipe=FA_ON, reuse_history=reuse_history)
    system = list(range(100, 130))
    b.enqueue(task([*system, *range(200, 214)]))  # 44 tokens
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([*system, *range(300, 320)]))  # 50 tokens, the same class
    plan = step(b, kv)
    assert [(e.pos, len(e.tokens)) for _, e in plan.entries] == [(30, 20)]
    assert b.slots[0].prompt_class == FA_ON.prompt_class(50)


def test_a_conversation_turn_reuses_the_previous_answer_and_computes_only_the_new_message() -> None:
    """Regression (issue 24): turn 2 re-evaluated the previous answer, whose KV rows were
    decode rows, and with flash attention a whole 64-row piece."""
    b, kv = make(n_slots=1, n_ctx=512, n_batch=256, recipe=FA_ON)
    turn1 = list(range(100, 180))  # 80 tokens: tiled pieces
    b.enqueue(task(turn1))
    for _ in range(12):  # the prompt, then 11 generated tokens (decode rows)
        step(b, kv)
    answer = b.slots[0].task.generated if b.slots[0].task else []
    assert len(answer) == 12
    b.slots[0].release()  # finished: the last sampled token was never decoded
    turn2 = [*turn1, *answer, *range(400, 417)]
    b.enqueue(task(turn2))
    plan = step(b, kv)
    assert [(e.pos, len(e.tokens)) for _, e in plan.entries] == [(80 + 11, 1 + 17)]
    assert b.slots[0].rows == (len(turn2), -1)  # MIXED_CLASS: no strict reuse takes these rows
    while b.slots[0].is_prefill:
        step(b, kv)
    b.slots[0].release()
    b.enqueue(task(turn2))  # the same turn again: sampled from the logits saved at its end
    plan = step(b, kv)
    assert not plan.entries and plan.from_saved == [b.slots[0]]


def test_a_prefix_is_copied_from_a_busy_slot() -> None:
    b, kv = make(n_slots=2)
    prefix = list(range(100, 130))
    b.enqueue(task([*prefix, 1]))
    for _ in range(3):
        step(b, kv)  # slot 0: prefilled, generating
    b.enqueue(task([*prefix, 2, 3]))
    plan = step(b, kv)
    assert kv.copies == [(0, 1, 30)]
    assert next(e for s, e in plan.entries if s.id == 1).pos == 30
    assert b.slots[1].task is not None and b.slots[1].task.stats.n_cached == 30


def test_busy_slots_stay_packed_and_a_conversation_is_copied_next_to_them() -> None:
    """llama.cpp decodes a run of consecutive busy sequences in one pass over the weights: with
    4 conversations whose turns were left in slots 0, 2, 4 and 6, the next turns run in slots
    0-3, their histories copied over (policy.pick_slot)."""
    b, kv = make(n_slots=8, n_ctx=8 * 64, n_batch=64, runs_by_seq_id=True)
    histories = [[100 + 10 * i + j for j in range(20)] for i in range(8)]
    for h in histories:  # one turn each, all at once: conversation i in slot i
        b.enqueue(task(h))
    for _ in range(3):
        step(b, kv)
    assert [s.cache[:20] for s in b.slots] == histories
    for s in b.slots:
        s.release()
    for i in (0, 2, 4, 6):
        b.enqueue(task([*b.slots[i].cache, 900 + i, 901 + i]))
    plan = step(b, kv)
    assert sorted(s.id for s in b.slots if s.task is not None) == [0, 1, 2, 3]
    assert sorted((src, dst) for src, dst, _ in kv.copies) == [(2, 1), (4, 2), (6, 3)]
    assert sorted(len(e.tokens) for _, e in plan.entries) == [2, 2, 2, 2]  # the new messages only


def test_without_runs_by_seq_id_a_conversation_stays_in_its_slot() -> None:
    b, kv = make(n_slots=4, n_ctx=4 * 64, n_batch=64)
    histories = [[100 + 10 * i + j for j in range(20)] for i in range(4)]
    for h in histories:
        b.enqueue(task(h))
    for _ in range(3):
        step(b, kv)
    for s in b.slots:
        s.release()
    b.enqueue(task([*b.slots[0].cache, 5]))
    b.enqueue(task([*b.slots[3].cache, 5]))
    step(b, kv)
    assert sorted(s.id for s in b.slots if s.task is not None) == [0, 3] and not kv.copies


def test_a_burst_with_a_common_prefix_computes_the_prefix_once() -> None:
    b, kv = make(n_slots=4, n_ctx=1024, n_batch=256)
    prefix = list(range(1000, 1100))
    tasks = [task([*prefix, 1, i, i + 1]) for i in range(4)]
    for t in tasks:
        b.enqueue(t)
    first = step(b, kv)
    assert shapes(first) == [(0, 103, True)]  # the others wait for slot 0's prefill
    second = step(b, kv)
    assert sorted(shapes(second)) == [(0, 1, True), (1, 2, True), (2, 2, True), (3, 2, True)]
    assert kv.n_rows_decoded == 103 + 1 + 3 * 2
    assert [t.stats.n_cached for t in tasks] == [0, 101, 101, 101]


def test_a_waiting_slot_computes_its_prefix_itself_if_the_source_is_cancelled() -> None:
    b, kv = make(n_slots=2, n_ctx=1024, n_batch=64)
    prefix = list(range(1000, 1100))
    first, second = task([*prefix, 1]), task([*prefix, 2])
    b.enqueue(first)
    b.enqueue(second)
    step(b, kv)  # slot 0 starts on the prefix, slot 1 waits for it
    assert b.slots[1].source is b.slots[0]
    first.cancel()
    step(b, kv)
    assert b.slots[1].source is None and b.slots[1].task is second
    while b.slots[1].is_prefill:
        step(b, kv)
    assert kv.seqs[1][:101] == [*prefix, 2]


# -- staging: prefill ahead when every slot is busy ------------------------------------------------


def test_a_waiting_prompt_is_prefilled_in_staging_and_resumes_from_the_prompt_cache() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=1, prompt_cache=cache)
    running, waiting = task([1, 2, 3], max_tokens=4), task(list(range(50, 60)))
    b.enqueue(running)
    b.enqueue(waiting)
    step(b, kv)  # slot 0 prefills `running`; `waiting` is prefilled in staging at the same time
    assert waiting.generated == [7] and waiting.parked is not None and waiting.parked.is_pinned
    assert list(b.waiting) == [waiting] and b.staging is not None and b.staging.cache == []
    running.cancel()
    plan = step(b, kv)  # the slot frees: `waiting` restores its prompt, decodes its first token
    assert [(e.pos, e.tokens) for _, e in plan.entries] == [(10, [7])]
    assert waiting.parked is None and not next(iter(cache._entries.values())).is_pinned


# -- budget ------------------------------------------------------------------------------------------


def test_prompt_rows_per_step_follow_the_budget_while_slots_generate() -> None:
    b, kv = make(n_slots=2, n_ctx=2048, n_batch=512)
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    b.budget.observe(10.0, 0, 0, 1)  # a step of one decode row: 10 ms
    b.budget.rows = 6.0
    b.enqueue(task(list(range(100, 100 + SHORT_PROMPT + 300))))
    rows = [sum(len(e.tokens) for s, e in step(b, kv).entries if s.id == 1) for _ in range(3)]
    assert rows == [6, 6, 6]
    b.budget.observe(30.0, 6, 0, 1)  # over 2 x 10 ms: fewer rows
    assert b.budget.rows == pytest.approx(4.8)
    b.budget.observe(12.0, 4, 0, 1)  # under: more
    assert b.budget.rows == pytest.approx(5.8)


def test_a_piece_bigger_than_the_budget_comes_when_the_credit_allows() -> None:
    b, kv = make(n_slots=2, n_ctx=2048, n_batch=512, recipe=FA_ON)
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    b.budget.observe(10.0, 0, 0, 1)
    b.budget.rows = 20.0
    b.enqueue(task(list(range(100, 100 + SHORT_PROMPT + 300))))
    rows = [sum(len(e.tokens) for s, e in step(b, kv).entries if s.id == 1) for _ in range(6)]
    assert rows == [0, 0, 0, 80, 0, 0]  # pieces of >= 64 rows: when 4 steps of 20 have added up
    b.budget.rows, b.budget.credit = 1.0, 0.0
    rows = [sum(len(e.tokens) for s, e in step(b, kv).entries if s.id == 1) for _ in range(8)]
    assert rows == [0, 0, 0, 64, 0, 0, 0, 64]  # the smallest piece at least every 4th step


def test_short_prompts_are_not_held_back_by_the_budget() -> None:
    b, kv = make(n_slots=3, n_ctx=3072, n_batch=512)
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    b.budget.observe(10.0, 0, 0, 1)
    b.budget.rows = 1.0
    b.enqueue(task(list(range(100, 300))))
    b.enqueue(task(list(range(300, 500))))
    assert sorted(shapes(step(b, kv))) == [(0, 1, True), (1, 200, True), (2, 200, True)]


# -- one KV pool shared by all slots (--kv-unified) ----------------------------------------------


def test_full_cache_drops_idle_prefixes_before_preempting() -> None:
    b, kv = make(n_slots=2, n_ctx=20, n_batch=16, unified=True)
    b.enqueue(task(list(range(12)), id_slot=1))
    step(b, kv)
    b.slots[1].release()  # 12 cells of idle cache
    b.enqueue(task(list(range(50, 62))))  # slot 0 needs 12 more: only 8 are free
    for _ in range(3):
        step(b, kv)
    assert b.slots[1].cache == [] and len(b.slots[0].cache) >= 12
    assert not b.waiting


def test_full_cache_preempts_the_youngest_and_requeues_it_with_its_tokens() -> None:
    b, kv = make(n_slots=2, n_ctx=20, n_batch=16, unified=True)
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


def test_admission_moves_other_idle_slots_to_the_prompt_cache_in_a_shared_pool() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=3, prompt_cache=cache, unified=True)
    first = list(range(10, 30))
    b.enqueue(task(first, id_slot=2))
    for _ in range(3):
        step(b, kv)
    b.slots[2].release()  # idle, its prompt and a generated token in the KV cache
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    assert b.slots[2].cache == [] and kv.seqs[2] == []  # cleared from the KV cache...
    entry, n = cache.best(first, (20, 0))
    assert entry is not None and n == 20  # ...and kept in RAM


def test_idle_slots_stay_in_their_own_streams() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=3, prompt_cache=cache)
    b.enqueue(task(list(range(10, 30)), id_slot=2))
    for _ in range(3):
        step(b, kv)
    b.slots[2].release()
    b.enqueue(task([1, 2, 3]))
    step(b, kv)
    assert len(b.slots[2].cache) == 21 and b.slots[0].task is not None


def test_a_saved_prompt_is_restored_and_only_the_new_tokens_run() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=1, prompt_cache=cache)
    prefix = list(range(100, 140))
    b.enqueue(task([*prefix, 1, 2]))
    for _ in range(4):
        step(b, kv)
    b.slots[0].release()
    b.enqueue(task([7] * 20))  # overwrites the only slot: what it held goes to RAM first
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([*prefix, 5, 6, 8]))  # restored, then cut back to the shared prefix
    plan = step(b, kv)
    entry = plan.entries[0][1]
    assert entry.pos == len(prefix) and entry.tokens == [5, 6, 8]
    t = b.slots[0].task
    assert t is not None and t.stats.n_cached == len(prefix)


def test_a_short_match_is_not_worth_a_restore() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=1, prompt_cache=cache)
    b.enqueue(task(list(range(100, 140))))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([7] * 20))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([100, 101, 102, 9, 9, 9]))  # 3 shared tokens: cheaper to evaluate them
    plan = step(b, kv)
    assert plan.entries[0][1].pos == 0


def test_kv_pressure_offloads_idle_caches_instead_of_dropping_them() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=2, n_ctx=20, n_batch=16, prompt_cache=cache, unified=True)
    b.enqueue(task(list(range(12)), id_slot=1))
    step(b, kv)
    b.slots[1].release()
    b.enqueue(task(list(range(50, 62)), cache_prompt=False))  # needs room: slot 1's 13 cells go
    for _ in range(3):
        step(b, kv)
    assert cache.best(list(range(12)), (12, 0))[1] == 12


def test_a_preempted_task_resumes_from_its_saved_state() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=2, n_ctx=24, n_batch=16, prompt_cache=cache, unified=True)
    old, young = task(list(range(8))), task(list(range(30, 38)))
    b.enqueue(old)
    b.enqueue(young)
    step(b, kv)
    while not b.waiting:
        step(b, kv)
    assert b.waiting[0] is young and cache.best(young.tokens(), (8, 0))[1] == len(young.tokens()) - 1
    old_slot = next(s for s in b.slots if s.task is old)
    old.cancel()
    b.reap_cancelled()
    old_slot.cache.clear()
    kv.seqs[old_slot.id] = []  # the old task's cells are gone: room to restore
    n_done = len(young.tokens())
    plan = step(b, kv)
    entry = next(e for s, e in plan.entries if s.task is young)
    assert entry.pos == n_done - 1 and len(entry.tokens) == 1  # only the last sampled token runs


def test_the_part_of_a_slot_a_new_task_overwrites_is_saved_first() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=1, prompt_cache=cache)
    first = list(range(10, 26))
    b.enqueue(task(first))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([10, 11, 99]))  # the only slot: keeps [10, 11], overwrites the rest
    plan = step(b, kv)
    assert plan.entries[0][1].pos == 2
    assert cache.best(first, (len(first), 0))[1] == len(first)


def test_prompt_longer_than_batch_size_is_prefilled_regression(tiny_models: ModelPaths) -> None:
    # Reproduces a hang: with flash attention a prompt under 64 tokens had to go in one piece,
    # so with `--batch-size 32` a 33-token prompt never fit a step and was never prefilled.
    from tests.worker.conftest import worker_process

    with worker_process(
        tiny_models.gguf_f32, "--parallel", "2", "--ctx-size", "1024", "--batch-size", "32"
    ) as (_, url):
        for n in (40, 300):  # a short prompt (one piece with flash attention), a long one (budgeted pieces)
            body = {"prompt": list(range(10, 10 + n)), "max_tokens": 4, "ignore_eos": True}  # 4, never fewer
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4


def test_a_long_text_run_of_a_media_prompt_goes_under_the_budget() -> None:
    """Issue 39: a 600-token document after an image went in whole (as short, a ubatch a step)
    beside generating slots; it now goes in budgeted pieces, as a long prompt's text does."""
    from worker.backends.media import chunk_ids

    b, kv = make(n_slots=2, n_ctx=4096, n_batch=512)
    b.enqueue(task([1, 2, 3]))
    step(b, kv)  # slot 0 generates from here on
    b.budget.observe(10.0, 0, 0, 1)
    b.budget.rows = 50.0
    image = chunk_ids(7, 4)
    prompt = [5, 6, *image, *range(100, 100 + 600), 9]
    t = task(prompt)
    t.media = {7: np.zeros((4, 1), dtype=np.float32)}
    b.enqueue(t)
    rows = [sum(len(e.tokens) for s, e in step(b, kv).entries if s.id == 1) for _ in range(4)]
    assert rows[:2] == [2, 4]  # the short text run whole, then the image's chunk
    # the document: the budget's rows a step (with what the two steps before left as credit), where
    # it went whole before (512 rows, a ubatch)
    assert 0 < rows[2] <= 100 and 0 < rows[3] <= 100, rows
