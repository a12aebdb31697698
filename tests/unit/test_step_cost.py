"""The measured step-cost curve and the draft length it pays for (worker/engine/step_cost.py):
synthetic curves stand in for the hardware, so the policy is checked on any machine."""

from __future__ import annotations

import pytest

from worker.engine.step_cost import StepCost, draft_length, expected_tokens


def curve(base: float, per_row: float, rows: tuple[int, ...] = (1, 2, 3, 5, 9, 17)) -> StepCost:
    cost = StepCost()
    for r in rows:
        for _ in range(3):
            cost.observe(r, base + per_row * (r - 1))
    return cost


def test_the_fit_recovers_the_curve_and_ignores_prompt_sized_steps() -> None:
    cost = curve(0.0012, 0.00006)  # a GPU-like step: 1.2 ms, 0.06 ms a row
    cost.observe(512, 0.003)  # a long prompt piece: not a draft's cost
    fit = cost.fit()
    assert fit is not None
    assert fit[0] == pytest.approx(0.0012, rel=1e-6) and fit[1] == pytest.approx(0.00006, rel=1e-6)
    assert cost.row_ratio(1) == pytest.approx(0.05, rel=1e-6)
    assert StepCost().row_ratio(1) is None  # nothing measured
    one = StepCost()
    one.observe(1, 0.01)
    assert one.fit() is None  # one row count is no curve


def test_expected_tokens() -> None:
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("rate", [0.97, 0.99, 1.0])
@pytest.mark.parametrize("per_row", [0.0, 0.05, 0.10])
def test_cheap_rows_draft_up_to_n_max(per_row: float, rate: float) -> None:
    """An extra row at <= 10% of a step, drafts that hold: the whole cap, as llama-server drafts."""
    cost = curve(1.0, per_row)
    ratio = cost.row_ratio(1)
    assert ratio is not None
    assert draft_length(rate, ratio, 16) == 16


@pytest.mark.parametrize("per_row", [0.60, 0.65, 0.9])
def test_dear_rows_keep_drafts_short(per_row: float) -> None:
    """An extra row at >= 60% of a step: a few tokens at most even when nearly all are accepted,
    none at a middling rate."""
    cost = curve(1.0, per_row)
    ratio = cost.row_ratio(1)
    assert ratio is not None
    assert 1 <= draft_length(0.95, ratio, 16) <= 4
    assert draft_length(0.6, ratio, 16) == 0


def test_beside_other_generating_slots_a_row_costs_more_of_a_share() -> None:
    cost = curve(1.0, 0.65)
    alone, eight = cost.row_ratio(1), cost.row_ratio(8)
    assert alone is not None and eight is not None
    assert alone == pytest.approx(0.65) and eight > 0.9
    assert draft_length(0.9, alone, 16) > 0 and draft_length(0.9, eight, 16) == 0


def test_an_extra_decode_call_beside_others_is_counted() -> None:
    """llama.cpp runs a verify entry in a decode call of its own beside one-row entries: beside
    7 others on a CPU-like curve that call alone costs more than a plain step's share."""
    cost = curve(1.0, 0.65)
    eight_rows, eight_call = cost.row_ratio(8), cost.call_ratio(8)
    assert eight_rows is not None and eight_call is not None
    assert eight_call > 1.0
    assert draft_length(0.99, eight_rows, 16, eight_call) == 0
    gpu = curve(1.0, 0.02)  # rows nearly free, a call is not
    rows, call = gpu.row_ratio(8), gpu.call_ratio(8)
    assert rows is not None and call is not None
    assert draft_length(0.97, rows, 16, 0.0) == 16  # one forward pass for all (torch)
    # a whole extra call: only a long draft that nearly always holds pays for it
    assert [draft_length(a, rows, 16, call) for a in (0.5, 0.8, 0.9, 0.97)] == [0, 0, 0, 16]
