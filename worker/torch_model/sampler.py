"""Vectorised sampling over a batch of logits rows, in llama.cpp's sampler-chain order.

Per row: mask (False = forbidden) -> logit_bias (+ EOG bans for ignore_eos) -> penalties (repeat /
presence / frequency over the last `repeat_last_n` accepted tokens) -> greedy argmax when
temperature <= 0, else top_k -> top_p -> min_p -> temperature -> draw (those four in the order of
the request's `samplers`, if it gives one; penalties always first). Each stage is one tensor op
over all rows; the only per-row Python work is gathering sparse bias/penalty entries and drawing one
uniform per row from that request's own `torch.Generator` (so a seed reproduces the same tokens
whatever else shares the batch). Logprobs come from the raw logits (log-softmax before any stage).

Penalty arithmetic is llama.cpp's: logit <= 0 ? logit * repeat : logit / repeat, then
- count * frequency - (count > 0) * presence.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from worker.protocol.sampling import SamplingParams


@dataclass(slots=True)
class SamplerState:
    """One request's sampling state: its RNG and the window of accepted tokens."""

    params: SamplingParams
    generator: torch.Generator
    history: deque[int] = field(default_factory=deque)
    bias: dict[int, float] = field(default_factory=dict)  # logit_bias plus EOG bans (ignore_eos)

    def accept(self, tokens: Iterable[int]) -> None:
        if self.params.has_penalties:
            self.history.extend(tokens)


def new_state(params: SamplingParams, seed: int, n_ctx: int, eog: Iterable[int] = ()) -> SamplerState:
    """`eog`: end-of-generation tokens, banned when params.ignore_eos (as the llama.cpp path does)."""
    window = n_ctx if params.repeat_last_n < 0 else params.repeat_last_n
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    bias = dict(params.logit_bias)
    if params.ignore_eos:
        bias.update({t: float("-inf") for t in eog})
    return SamplerState(params=params, generator=gen, history=deque(maxlen=max(window, 1)), bias=bias)


@dataclass(slots=True)
class Drawn:
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    prob: float | None = None  # params.post_sampling_probs: after top_k/top_p/min_p/temperature
    top_probs: list[tuple[int, float]] = field(default_factory=list)


def _apply_masks(x: Tensor, masks: Sequence[np.ndarray | None]) -> None:
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    n_vocab = x.shape[1]
    allowed = np.zeros((len(rows), n_vocab), dtype=bool)
    for j, i in enumerate(rows):
        m = np.asarray(masks[i], dtype=bool)[:n_vocab]
        allowed[j, : len(m)] = m
    sel = torch.tensor(rows, device=x.device)
    x[sel] = x[sel].masked_fill(~torch.from_numpy(allowed).to(x.device), float("-inf"))


def _apply_bias(x: Tensor, states: Sequence[SamplerState]) -> None:
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    n_vocab = x.shape[1]
    for i, s in enumerate(states):
        for tok, bias in s.bias.items():
            if 0 <= tok < n_vocab:
                rows.append(i)
                toks.append(tok)
                vals.append(bias)
    if rows:
        r = torch.tensor(rows, device=x.device)
        t = torch.tensor(toks, device=x.device)
        x.index_put_((r, t), torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)


def _apply_penalties(x: Tensor, states: Sequence[SamplerState], params: Sequence[SamplingParams]) -> None:
    rows: list[int] = []
    toks: list[int] = []
    counts: list[int] = []
    n_vocab = x.shape[1]
    for i, (s, p) in enumerate(zip(states, params, strict=True)):
        if not p.has_penalties or not s.history:
            continue
        for tok, n in Counter(s.history).items():
            if 0 <= tok < n_vocab:
                rows.append(i)
                toks.append(tok)
                counts.append(n)
    if not rows:
        return
    dev = x.device
    r = torch.tensor(rows, device=dev)
    t = torch.tensor(toks, device=dev)
    c = torch.tensor(counts, dtype=x.dtype, device=dev)
    rep = torch.tensor([params[i].repeat_penalty for i in rows], dtype=x.dtype, device=dev)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=x.dtype, device=dev)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=x.dtype, device=dev)
    v = x[r, t]
    v = torch.where(v <= 0, v * rep, v / rep) - c * freq - pres
    x[r, t] = v


def _draw(
    x: Tensor, states: Sequence[SamplerState], params: Sequence[SamplingParams], order: tuple[str, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """The truncations and temperature in `order` (the rows' common chain: default top_k -> top_p
    -> min_p -> temperature), then one draw per row; returns (token ids [S], the final
    probabilities [S, K] of the candidates [S, K], most likely first). Each truncation keeps a
    prefix of the sorted candidates; top_p and min_p see the temperature only when it comes first."""
    n_vocab = x.shape[1]
    dev = x.device
    top_k = [p.top_k if 0 < p.top_k < n_vocab else n_vocab for p in params]
    stages = [s for s in order if s != "penalties"]
    # the top k_max candidates suffice when top_k runs first; after another stage, all of them
    k_max = max(top_k) if stages[:1] == ["top_k"] else n_vocab
    vals, idx = torch.topk(x, k_max, dim=-1) if k_max < n_vocab else torch.sort(x, dim=-1, descending=True)
    cols = torch.arange(k_max, device=dev)
    divisor = torch.ones(len(params), dtype=x.dtype, device=dev)  # the temperatures applied so far
    for stage in stages:
        if stage == "top_k":
            vals = vals.masked_fill(cols[None, :] >= torch.tensor(top_k, device=dev)[:, None], float("-inf"))
        elif stage == "top_p":
            top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=dev)
            if bool((top_p < 1.0).any()):
                probs = torch.softmax(vals / divisor[:, None], dim=-1)
                before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each candidate
                drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
                drop[:, 0] = False  # llama.cpp always keeps the first candidate
                vals = vals.masked_fill(drop, float("-inf"))
        elif stage == "min_p":
            min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
            if bool((min_p > 0.0).any()):
                floor = vals[:, :1] + torch.log(min_p.clamp_min(1e-38))[:, None] * divisor[:, None]
                vals = vals.masked_fill((vals < floor) & (min_p[:, None] > 0.0), float("-inf"))
        elif stage == "temperature":
            divisor = divisor * torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)

    probs = torch.nan_to_num(torch.softmax(vals / divisor[:, None], dim=-1), nan=0.0)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.cat([torch.rand(1, generator=s.generator) for s in states]).to(device=dev, dtype=cdf.dtype)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(k_max - 1)
    return idx.gather(1, choice).squeeze(1), probs, idx


def sample_rows(
    logits: Tensor,
    states: Sequence[SamplerState],
    params: Sequence[SamplingParams],
    masks: Sequence[np.ndarray | None],
) -> list[Drawn]:
    """Sample one token per row of `logits` [B, V] (float32; not modified) and accept it."""
    n_rows = logits.shape[0]
    if n_rows == 0:
        return []
    x = logits.clone()
    _apply_masks(x, masks)
    _apply_bias(x, states)
    _apply_penalties(x, states, params)

    tokens = x.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    post: dict[int, list[tuple[int, float]]] = {}
    groups: dict[tuple[str, ...], list[int]] = {}  # rows by their chain (one group, but for `samplers`)
    for i in sampled:
        groups.setdefault(params[i].order, []).append(i)
    for order, rows in groups.items():
        sel = torch.tensor(rows, device=x.device)
        drawn, probs, idx = _draw(x[sel], [states[i] for i in rows], [params[i] for i in rows], order)
        tokens = tokens.index_copy(0, sel, drawn)
        for j, i in enumerate(rows):
            if params[i].logprobs and params[i].post_sampling_probs:
                pairs = zip(idx[j].tolist(), probs[j].tolist(), strict=True)
                post[i] = [(t, q) for t, q in pairs if q > 0]
    token_list: list[int] = tokens.tolist()

    logprob: list[float | None] = [None] * n_rows
    tops: list[list[tuple[int, float]]] = [[] for _ in range(n_rows)]
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        sel = torch.tensor(want, device=logits.device)
        lp = torch.log_softmax(logits[sel], dim=-1)
        chosen = lp.gather(1, tokens[sel][:, None]).squeeze(1).tolist()
        n_top = max(params[i].top_logprobs for i in want)
        top_v, top_i = (lp.topk(n_top, dim=-1) if n_top > 0 else (lp[:, :0], lp[:, :0].long()))
        top_v_list, top_i_list = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            logprob[i] = chosen[j]
            k = params[i].top_logprobs
            tops[i] = list(zip(top_i_list[j][:k], top_v_list[j][:k], strict=True))

    for s, tok in zip(states, token_list, strict=True):
        s.accept((tok,))
    out = [Drawn(token_list[i], logprob[i], tops[i]) for i in range(n_rows)]
    for i, p in enumerate(params):
        if p.logprobs and p.post_sampling_probs:
            top = post.get(i, [(token_list[i], 1.0)])  # greedy: all the mass on the argmax
            out[i].prob = next((q for t, q in top if t == token_list[i]), 0.0)
            out[i].top_probs = top[: p.top_logprobs]
    return out
