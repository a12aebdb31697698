"""The scheduler with LoRA adapter sets (worker/engine/scheduler.py, "LoRA adapters"): every KV
reuse is keyed by the set, a step serves one set, and the fairness rule lets no request starve
behind a stream of another adapter's. Against the recording KV of tests/worker/test_scheduler.py
(no model)."""

from __future__ import annotations

from tests.worker.test_scheduler import make, step, task
from worker.engine.prompt_cache import PromptCache

A = ((0, 1.0),)
B = ((1, 1.0),)
HALF = ((0, 0.5),)
PROMPT = list(range(100, 140))


def test_a_slots_rows_are_reused_only_under_the_same_adapter_set() -> None:
    b, kv = make(n_slots=1)
    b.enqueue(task(PROMPT, lora=A))
    step(b, kv)
    b.slots[0].release()
    b.enqueue(task([*PROMPT, 1], lora=HALF))  # same tokens, another scale: nothing reused
    plan = step(b, kv)
    assert plan.entries[0][1].pos == 0 and plan.lora == HALF
    b.slots[0].release()
    b.enqueue(task([*PROMPT, 1, 2], lora=HALF))  # the same set again: its prefix is reused
    plan = step(b, kv)
    assert plan.entries[0][1].pos > 0


def test_a_busy_slots_prefix_is_not_shared_across_adapter_sets() -> None:
    b, kv = make(n_slots=2, n_batch=64)
    b.enqueue(task(PROMPT, lora=()))
    step(b, kv)
    b.enqueue(task([*PROMPT, 3], lora=A))
    step(b, kv)
    assert b.slots[1].task is not None and b.slots[1].n_reused == 0
    assert not kv.copies, "no rows copied from the base model's slot"


def test_the_prompt_cache_is_keyed_by_the_adapter_set() -> None:
    cache = PromptCache(None)
    b, kv = make(n_slots=1, prompt_cache=cache)
    b.enqueue(task(PROMPT, lora=A))
    for _ in range(3):
        step(b, kv)
    b.slots[0].release()
    b.enqueue(task([7] * 20))  # pushes the adapter's rows into the prompt cache
    step(b, kv)
    b.slots[0].release()
    assert cache.best(PROMPT, (40, 0), any_class=True, lora=())[1] == 0
    assert cache.best(PROMPT, (40, 0), any_class=True, lora=A)[1] == len(PROMPT)
    b.enqueue(task([*PROMPT, 5], lora=B))  # another adapter: not restored
    assert step(b, kv).entries[0][1].pos == 0
    b.slots[0].release()
    b.enqueue(task([*PROMPT, 5, 6], lora=A))  # its own: restored
    assert step(b, kv).entries[0][1].pos == len(PROMPT)


def test_a_step_serves_one_adapter_set_and_the_sets_take_turns() -> None:
    b, kv = make(n_slots=3, n_batch=64)
    for lora in ((), A, B):
        b.enqueue(task([1, 2, 3], lora=lora))
    served = []
    for _ in range(9):
        plan = step(b, kv)
        assert {s.task.params.lora for s, _ in plan.entries if s.task} <= {plan.lora}
        served.append(plan.lora)
    assert served[:3] == [(), A, B], "oldest first among sets never served"
    assert served[3:6] == served[:3] and served[6:] == served[:3], "then in turn"


def test_no_request_starves_behind_a_stream_of_another_adapter() -> None:
    """One request of adapter A while requests of B keep coming (a new one every step, each
    finishing after 2 tokens): A still gets every other step, and finishes its 10 tokens."""
    b, kv = make(n_slots=4, n_batch=64)
    victim = task([9, 9, 9], lora=A, max_tokens=10)
    b.enqueue(victim)
    for i in range(40):
        b.enqueue(task([i + 1, 2, 3], lora=B))
        step(b, kv)
        for s in b.slots:  # B's requests stop after 2 tokens: a stream, never idle
            t = s.task
            if t is not None and t.params.lora == B and len(t.generated) >= 2:
                s.release()
            if t is victim and len(t.generated) >= 10:
                s.release()
        if victim.generated and len(victim.generated) >= 10:
            break
    assert len(victim.generated) >= 10 and i < 25, f"A got {len(victim.generated)} tokens in {i + 1} steps"
