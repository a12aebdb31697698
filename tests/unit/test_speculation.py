"""Speculative decoding's logic without a model (worker/engine/speculation.py): the n-gram
drafter, the adaptive K, and that verification leaves the output distribution unchanged
(chi-square over 2,000 samples of the first three tokens, against the exact probabilities)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest

from worker.backends.base import Backend, Sample, SampleItem
from worker.engine.metrics import WorkerMetrics
from worker.engine.slot import Slot
from worker.engine.speculation import (
    SpecConfig,
    Speculator,
    _Pending,
    _SlotState,
    accept_point_mass,
    ngram_draft,
)
from worker.engine.task import Task
from worker.protocol.sampling import SamplingParams, SpecRequest

# chi-square critical values at alpha = 0.001
_CHI2_001 = {3: 16.27, 63: 103.4}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_ngram_draft_copies_what_followed_the_latest_match() -> None:
    h = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_draft(h, 3, 2) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert ngram_draft(h, 3, 10) == [7, 8, 1, 2, 3]
    assert ngram_draft(h, 4, 5) == []  # "3 1 2 3"... no: "8 1 2 3" never occurred before
    assert ngram_draft([5, 5, 5, 5], 1, 3) == [5]  # the match right before the end: one token follows
    assert ngram_draft([1, 2], 3, 4) == []
    assert ngram_draft(h, 3, 0) == []


# A toy model over 4 tokens: p(next | last token), skewed so that drafts are often right.
_P = np.array(
    [[0.55, 0.25, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.5, 0.1], [0.25, 0.25, 0.25, 0.25]]
)


class _ToyBackend:
    """What `Speculator.verify` calls: `sample` (row j: the token after the entry's j-th token)
    and `seq_rm`. Rows are set by the test as the verify entry's tokens."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.rows: list[int] = []
        self.removed: list[tuple[int, int]] = []

    def sample(self, items: Sequence[SampleItem], params: Sequence[SamplingParams]) -> list[Sample]:
        return [Sample(int(self.rng.choice(4, p=_P[self.rows[it.logits_index]]))) for it in items]

    def seq_rm(self, seq_id: int, p0: int) -> None:
        self.removed.append((seq_id, p0))


def _speculative_first_tokens(draft: list[int], rng: np.random.Generator) -> tuple[int, ...]:
    """The first 3 tokens after token 0 with one verify step of `draft` (then plain steps)."""
    backend = _ToyBackend(rng)
    spec = Speculator(SpecConfig("ngram-simple", size_n=1), WorkerMetrics())
    task = Task([0], SamplingParams(temperature=1.0), 1, lambda ev: None)
    slot = Slot(0, cache=[], task=task, feed=[0])
    task.generated = [0]  # the token fed this step (the engine's last sampled one)
    spec._pending = [_Pending(slot, task, list(draft))]
    slot.cache.extend([0, *draft])  # what commit records: the fed token and the drafts
    backend.rows = [0, *draft]
    spec.before_sampling({0: 0})
    assert slot.cache == [0]
    # row 0 is sampled with the step, as without speculation
    task.generated.append(backend.sample([SampleItem(None, 0)], [task.params])[0].token)

    def post(s: Slot, sample: Sample) -> None:
        task.generated.append(sample.token)

    spec.verify(cast(Backend, backend), post)  # post returns None: no task ends
    assert backend.removed == [(0, len(slot.cache))]
    out = task.generated[1:]
    while len(out) < 3:  # plain decoding after the verify step
        out.append(int(rng.choice(4, p=_P[out[-1]])))
    return tuple(out[:3])


def _exact_first_three() -> np.ndarray:
    probs = np.zeros(64)
    for a, b, c in itertools.product(range(4), repeat=3):
        probs[a * 16 + b * 4 + c] = _P[0, a] * _P[a, b] * _P[b, c]
    return probs


@pytest.mark.parametrize("draft", [[0, 0, 0], [1, 1], [3, 2, 1], [2]])
def test_verification_keeps_the_distribution_of_the_first_tokens(draft: list[int]) -> None:
    """2,000 samples of the first three tokens with speculation, whatever the draft (likely or
    not): chi-square against the exact non-speculative probabilities (64 cells, alpha 0.001)."""
    rng = np.random.default_rng(1234 + len(draft) + draft[0])
    counts = np.zeros(64)
    for _ in range(2000):
        a, b, c = _speculative_first_tokens(draft, rng)
        counts[a * 16 + b * 4 + c] += 1
    assert chi_square(counts, _exact_first_three()) < _CHI2_001[63]


@pytest.mark.parametrize("draft", [0, 2, 3])
def test_point_mass_rejection_sampling_is_the_target_distribution(draft: int) -> None:
    """Accept the draft with p(draft), else draw from the residual: the result is p."""
    rng = np.random.default_rng(7 + draft)
    p = _P[2]
    counts = np.bincount([accept_point_mass(draft, p, rng) for _ in range(2000)], minlength=4)
    assert chi_square(counts.astype(float), p) < _CHI2_001[3]


def _slot_with_task(params: SamplingParams, tokens: list[int]) -> Slot:
    task = Task(tokens[:-1], params, 1, lambda ev: None)
    task.generated = [tokens[-1]]
    task.stats.n_decoded = 1
    return Slot(0, cache=list(tokens[:-1]), task=task, feed=[tokens[-1]])


def test_drafts_follow_the_settings_and_yield_under_load() -> None:
    spec = Speculator(SpecConfig("ngram-simple", size_n=2, n_max=4), WorkerMetrics())
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    slot = _slot_with_task(SamplingParams(temperature=0), tokens)
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64) == {0: [3, 4]}  # K starts at 2
    spec._slots[0].k = 16
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64) == {0: [3, 4, 5, 6]}  # n_max 4
    assert spec.drafts([slot], is_busy=True, n_ctx_seq=100, room=64) == {}  # prompts first
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=2) == {0: [3, 4]}
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=len(tokens) + 3, room=64) == {0: [3, 4]}
    req = SamplingParams(temperature=0, speculative=SpecRequest(n_max=0))
    assert spec.drafts([_slot_with_task(req, tokens)], is_busy=False, n_ctx_seq=100, room=64) == {}
    req = SamplingParams(temperature=0, speculative=SpecRequest(n_min=5))
    assert spec.drafts([_slot_with_task(req, tokens)], is_busy=False, n_ctx_seq=100, room=64) == {}
    req = SamplingParams(temperature=0, max_tokens=3)
    assert spec.drafts([_slot_with_task(req, tokens)], is_busy=False, n_ctx_seq=100, room=64) == {0: [3]}


def _cpu_like(spec: Speculator) -> None:
    """The cost curve measured on the 2-core CPU (SmolLM2 Q4_1): 17.7 ms a step, ~11.5 ms a row."""
    for rows in (1, 2, 3, 5, 9):
        spec.cost.observe(rows, 0.0177 + 0.0115 * (rows - 1))


def test_k_adapts_and_a_failing_slot_pauses() -> None:
    spec = Speculator(SpecConfig("ngram-simple", size_n=1, n_max=16), WorkerMetrics())
    _cpu_like(spec)
    slot = _slot_with_task(SamplingParams(temperature=0), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1])
    spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64)
    state = spec._slots[0]
    assert state.k == 2
    spec._adapt(0, 8, 8)
    assert state.k == 16
    spec._adapt(0, 16, 3)
    assert state.k == 4
    for _ in range(3):
        spec._adapt(0, 4, 0)
    assert state.pause == 4  # three rejected drafts in a row: four steps without drafting
    # 11 of the last 14 drafted tokens held, then three misses: a rate of ~0.67, which pays for
    # one draft token's row on this cost curve (above 0.65), so it drafts again after the pause
    assert 0.65 < state.rate < 0.7
    steps = 0
    while not spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64):
        steps += 1
    assert steps == 4
    # a slot whose drafts nearly all missed waits, past its pause, until its counts have relaxed
    # towards a new task's far enough that one draft token pays
    state.accepted, state.missed, state.pause = 1.0, 3.0, 0
    steps = 0
    while not spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64):
        steps += 1
    assert 60 < steps < 120, steps


def test_a_slot_beside_others_needs_a_higher_acceptance_rate() -> None:
    spec = Speculator(SpecConfig("ngram-simple", size_n=1, n_max=16), WorkerMetrics())
    _cpu_like(spec)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]
    a, b = _slot_with_task(SamplingParams(temperature=0), tokens), _slot_with_task(SamplingParams(), [7, 7])
    b.id = 1
    spec.drafts([a], is_busy=False, n_ctx_seq=100, room=64)
    spec._slots[0].accepted, spec._slots[0].missed = 7.0, 2.0  # rate 0.7
    assert 0 not in spec.drafts([a, b], is_busy=False, n_ctx_seq=100, room=64)  # a row costs 0.79 of a share
    assert 0 in spec.drafts([a], is_busy=False, n_ctx_seq=100, room=64)  # alone: 0.65 of the step


def test_unmeasured_a_slot_drafts_k_to_measure() -> None:
    """Before any step is measured the cost is unknown: a slot drafts K whatever its rate, and
    that verify step is the measurement."""
    spec = Speculator(SpecConfig("ngram-simple", size_n=2, n_max=16), WorkerMetrics())
    slot = _slot_with_task(SamplingParams(temperature=0), [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert slot.task is not None
    spec._slots[0] = _SlotState(slot.task.id, accepted=1.0, missed=9.0)  # rate 0.1
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64) == {0: [3, 4]}
    _cpu_like(spec)
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64) == {}  # 0.1 pays for nothing


def test_drafting_that_measures_slower_stops_but_is_rechecked() -> None:
    """The model said drafting pays; whole steps with drafts emitted fewer tokens a second than
    plain ones at this count of generating slots: the slots stop drafting there, but for one
    step in _RECHECK_EVERY."""
    from worker.engine.speculation import _RECHECK_EVERY, _YIELD_MIN

    spec = Speculator(SpecConfig("ngram-simple", size_n=2, n_max=16), WorkerMetrics())
    slot = _slot_with_task(SamplingParams(temperature=0), [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    for drafted, tok_s in ((True, 80.0), (False, 100.0)):
        for _ in range(_YIELD_MIN):
            spec._step = (1, drafted)
            spec.record_step(1, 1 / tok_s)
    n_drafting = sum(bool(spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64))
                     for _ in range(2 * _RECHECK_EVERY))
    assert n_drafting == 2
    asking = _slot_with_task(SamplingParams(temperature=0, speculative=SpecRequest(n_max=4)),
                             [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert spec.drafts([asking], is_busy=False, n_ctx_seq=100, room=64)  # a request's own n_max drafts anyway
    other = Speculator(SpecConfig("ngram-simple", size_n=2, n_max=16), WorkerMetrics())
    for drafted, tok_s in ((True, 120.0), (False, 100.0)):  # drafting measured faster: it goes on
        for _ in range(_YIELD_MIN):
            other._step = (1, drafted)
            other.record_step(1, 1 / tok_s)
    assert other.drafts([slot], is_busy=False, n_ctx_seq=100, room=64)


def test_when_every_step_drafted_plain_steps_are_measured_next() -> None:
    """The measured check compares steps with and without drafts at one count of generating
    slots; where some slot drafted in every step, the next steps are plain ones until both sides
    are measured, and then the faster side wins."""
    from worker.engine.speculation import _YIELD_MIN

    spec = Speculator(SpecConfig("ngram-simple", size_n=2, n_max=16), WorkerMetrics())
    slot = _slot_with_task(SamplingParams(temperature=0), [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    for _ in range(_YIELD_MIN):
        assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64)  # nothing measured: drafts
        spec.record_step(1, 1 / 100.0)
    for _ in range(_YIELD_MIN):
        assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64) == {}
        spec.record_step(1, 1 / 50.0)  # plain steps measured slower
    assert spec.drafts([slot], is_busy=False, n_ctx_seq=100, room=64)


def test_a_slot_never_drafts_a_length_the_model_says_loses() -> None:
    """Beside 7 other generating slots, with a verify entry in a decode call of its own, on a
    curve where a call costs 1 and a row 0.3: a draft of 16 that always holds pays for its call
    and rows, and one of 2 (K's slow start) does not. The slot drafts the 16 at once (it used to
    draft 2 because 16 would have paid), and nothing once its rate says that 16 loses too."""
    spec = Speculator(SpecConfig("ngram-simple", size_n=1, n_max=16), WorkerMetrics(), verify_apart=True)
    for rows in (1, 2, 4, 8, 17):
        spec.cost.observe(rows, 1.0 + 0.3 * (rows - 1))
    drafting = _slot_with_task(SamplingParams(temperature=0), [*range(1, 30), 1])
    others = [_slot_with_task(SamplingParams(temperature=0), [100 + i, 200 + i]) for i in range(7)]
    for i, other in enumerate(others):
        other.id = i + 1
    assert drafting.task is not None
    spec._slots[0] = _SlotState(drafting.task.id, accepted=1000.0)  # drafts that held, a rate of 0.999
    assert spec._slots[0].k == 2
    assert spec.drafts([drafting, *others], is_busy=False, n_ctx_seq=100, room=64) == {0: list(range(2, 18))}
    spec._slots[0].missed = 100.0  # a rate of 0.91
    assert spec.drafts([drafting, *others], is_busy=False, n_ctx_seq=100, room=64) == {}
