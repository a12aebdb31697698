"""The vectorised sampler chain: greedy, truncation, seeds, bias, mask, penalties, logprobs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from worker.protocol.sampling import SamplingParams
from worker.torch_model.sampler import new_state, sample_rows

V = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def draw(
    x: torch.Tensor, params: list[SamplingParams], seed: int = 7, masks: list[np.ndarray | None] | None = None
) -> list[int]:
    states = [new_state(p, seed + i, n_ctx=128) for i, p in enumerate(params)]
    return [d.token for d in sample_rows(x, states, params, masks or [None] * len(params))]


GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def test_greedy_is_exact_argmax() -> None:
    x = logits(6)
    assert draw(x, [GREEDY] * 6) == x.argmax(-1).tolist()


def test_top_k_one_is_greedy() -> None:
    x = logits(6)
    assert draw(x, [replace(SAMPLED, top_k=1, temperature=2.0)] * 6) == x.argmax(-1).tolist()


def test_tiny_top_p_and_strict_min_p_are_greedy() -> None:
    x = logits(4)
    assert draw(x, [replace(SAMPLED, top_p=1e-6)] * 4) == x.argmax(-1).tolist()
    assert draw(x, [replace(SAMPLED, min_p=1.0)] * 4) == x.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    x = logits(1, seed=3).repeat(3, 1)
    params = [SAMPLED] * 3
    first = [draw(x, params, seed=11)[0] for _ in range(2)]
    states = [new_state(SAMPLED, 11, 128)] + [new_state(SAMPLED, s, 128) for s in (1, 2)]
    seq_a = [sample_rows(x, states, params, [None] * 3)[0].token for _ in range(20)]
    solo = new_state(SAMPLED, 11, 128)
    seq_b = [sample_rows(x[:1], [solo], [SAMPLED], [None])[0].token for _ in range(20)]
    assert first[0] == first[1]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1  # actually sampling


def test_sampling_follows_the_softmax_distribution() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0] + [-1e9] * (V - 3)])
    state = new_state(SAMPLED, 5, 128)
    counts = np.bincount(
        [sample_rows(x, [state], [SAMPLED], [None])[0].token for _ in range(3000)], minlength=3
    )
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0).numpy()
    assert np.allclose(counts[:3] / 3000, expected, atol=0.03)


def test_top_k_restricts_to_the_k_best() -> None:
    x = logits(1, seed=4)
    best = set(x[0].topk(3).indices.tolist())
    state = new_state(replace(SAMPLED, top_k=3), 1, 128)
    seen = {sample_rows(x, [state], [replace(SAMPLED, top_k=3)], [None])[0].token for _ in range(200)}
    assert seen <= best and len(seen) > 1


def test_logit_bias_minus_inf_bans_a_token() -> None:
    x = logits(2)
    top = x.argmax(-1).tolist()
    params = [replace(GREEDY, logit_bias={top[0]: float("-inf")}), replace(GREEDY, logit_bias={5: 1e9})]
    got = draw(x, params)
    assert got[0] != top[0] and got[0] == x[0].topk(2).indices[1].item()
    assert got[1] == 5


def test_ignore_eos_bans_end_of_generation_tokens() -> None:
    x = torch.zeros(1, V)
    x[0, 2] = 10.0
    params = replace(GREEDY, ignore_eos=True)
    state = new_state(params, 0, 128, eog=[2])
    assert sample_rows(x, [state], [params], [None])[0].token != 2
    assert sample_rows(x, [new_state(GREEDY, 0, 128, eog=[2])], [GREEDY], [None])[0].token == 2


def test_mask_forbids_tokens_for_its_row_only() -> None:
    x = logits(2)
    allowed = np.zeros(V, dtype=bool)
    allowed[[7, 9]] = True
    got = draw(x, [SAMPLED, GREEDY], masks=[allowed, None])
    assert got[0] in (7, 9)
    assert got[1] == x[1].argmax().item()


def test_logits_are_not_modified() -> None:
    x = logits(2)
    before = x.clone()
    draw(x, [replace(GREEDY, logit_bias={1: 5.0}), SAMPLED], masks=[np.ones(V, dtype=bool), None])
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # llama.cpp: positive logit / repeat, negative logit * repeat
        (SamplingParams(temperature=0, repeat_penalty=2.0), {3: 2.0, 4: -4.0}),
        # frequency: - count * f ; presence: - f once
        (SamplingParams(temperature=0, frequency_penalty=0.5), {3: 4.0 - 1.0, 4: -2.0 - 0.5}),
        (SamplingParams(temperature=0, presence_penalty=0.5), {3: 3.5, 4: -2.5}),
    ],
)
def test_penalties_match_llama_cpp_arithmetic(params: SamplingParams, expected: dict[int, float]) -> None:
    from worker.torch_model.sampler import _apply_penalties

    x = torch.zeros(1, V)
    x[0, 3], x[0, 4] = 4.0, -2.0
    state = new_state(params, 0, 128)
    state.accept([3, 3, 4])
    _apply_penalties(x, [state], [params])
    for tok, val in expected.items():
        assert x[0, tok].item() == pytest.approx(val)
    assert x[0, 5].item() == 0.0


def test_penalty_window_is_repeat_last_n() -> None:
    params = SamplingParams(temperature=0, repeat_penalty=100.0, repeat_last_n=2)
    x = torch.zeros(1, V)
    x[0, 1], x[0, 2] = 10.0, 9.0
    state = new_state(params, 0, 128)
    state.accept([1, 5, 6])  # 1 fell out of the window
    assert sample_rows(x, [state], [params], [None])[0].token == 1
    state.accept([1])
    assert sample_rows(x, [state], [params], [None])[0].token == 2


def test_logprobs_come_from_raw_logits() -> None:
    x = logits(2)
    params = [replace(SAMPLED, logprobs=True, top_logprobs=3, temperature=0.3, logit_bias={0: 5.0}), GREEDY]
    states = [new_state(p, 1, 128) for p in params]
    got = sample_rows(x, states, params, [None, None])
    lp = torch.log_softmax(x[0], -1)
    assert got[0].logprob == pytest.approx(lp[got[0].token].item(), abs=1e-5)
    assert [t for t, _ in got[0].top_logprobs] == lp.topk(3).indices.tolist()
    assert got[1].logprob is None and got[1].top_logprobs == []
