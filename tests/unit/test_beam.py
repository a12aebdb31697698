"""The pure parts of beam search (worker/engine/beam.py): the next-token distribution, the
candidates a step keeps, and the score."""

from __future__ import annotations

import math

import numpy as np
import pytest

from worker.engine.beam import NextToken, best_candidates, score


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + math.log(float(np.exp(x - x.max()).sum())))


def test_next_token_logprobs_are_a_float64_log_softmax_to_1e7() -> None:
    row = (np.random.default_rng(0).standard_normal(49152) * 4).astype(np.float32)
    dist = NextToken.of(row, {})
    want = _log_softmax(row)
    for t in (0, 7, int(row.argmax()), 49151):
        assert dist.logprob(t) == pytest.approx(want[t], abs=1e-7)


@pytest.mark.parametrize("k", [1, 3, 8, 9, 20, 24])
def test_top_is_most_likely_first_lower_id_on_a_tie_and_leaves_the_row_as_it_was(k: int) -> None:
    row = np.array([0.5, 2.0, 2.0, -1.0, 3.0, 2.0, 0.0, -math.inf] * 3, dtype=np.float32)
    before = row.copy()
    got = NextToken.of(row, {}).top(k)
    want = sorted((t for t in range(len(row)) if row[t] > -math.inf), key=lambda t: (-row[t], t))[:k]
    assert got == want
    assert np.array_equal(row, before)


def test_a_bias_of_minus_inf_leaves_a_token_out_and_the_others_sum_to_one() -> None:
    row = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    dist = NextToken.of(row, {3: -math.inf, 0: 1.0})
    assert dist.logprob(3) == -math.inf
    assert sum(math.exp(dist.logprob(t)) for t in range(3)) == pytest.approx(1.0)
    cands = best_candidates([(0.0, dist)], width=4)
    assert [c.token for c in cands] == [2, 0, 1]  # 3.0, then 1.0 + 1.0 (lower id) and 2.0


def test_the_step_keeps_the_width_best_of_all_beams() -> None:
    a = NextToken.of(np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32)), {})
    b = NextToken.of(np.log(np.array([0.1, 0.1, 0.8], dtype=np.float32)), {})
    cands = best_candidates([(math.log(0.5), a), (math.log(0.5), b)], width=3)
    assert [(c.beam, c.token) for c in cands] == [(1, 2), (0, 0), (0, 1)]


@pytest.mark.parametrize(("logprob", "length", "penalty", "want"),
                         [(-4.0, 4, 1.0, -1.0), (-4.0, 4, 0.0, -4.0), (-4.0, 4, 0.5, -2.0),
                          (-3.0, 1, 2.0, -3.0)])
def test_score_is_sum_over_length_to_the_penalty(logprob: float, length: int, penalty: float,
                                                 want: float) -> None:
    assert score(logprob, length, penalty) == pytest.approx(want)
