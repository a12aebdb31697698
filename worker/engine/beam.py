"""Beam search: OVMS's `best_of` (the beam width), vLLM's `use_beam_search`, `length_penalty`.

A request of width W runs on W slots of the engine; each live beam is one KV sequence, and all
beams of all requests advance in the engine's shared batch, one decode row each per step. The
search is vLLM's (`LLM.beam_search`), with OVMS's and vLLM's score:

    score(h) = sum of h's token log-probabilities / len(h) ** length_penalty

where len(h) counts h's generated tokens, its end-of-generation token included. One step:

1. Every live beam b (cumulative log-probability s_b) proposes its W most likely next tokens t,
   as candidates of cumulative log-probability s_b + log p(t | b). Log-probabilities are the
   log-softmax of the raw logits plus the request's `logit_bias` (`NextToken`); a token of
   probability 0 (a bias of -inf) is never a candidate.
2. The W best candidates of all beams are kept (by cumulative log-probability: at one step
   every candidate has the same length, so that is also the order of their scores; ties go to
   the lower beam, then the lower token id). A kept candidate that ends (end of generation,
   unless `ignore_eos`; a stop string; `max_tokens`; a full context) is a finished hypothesis;
   the others are the next step's live beams, so that the live beams thin out as beams end.
3. The search ends when no beam is live. The answer is the `n` best finished hypotheses by score.

So a search whose width covers every candidate at every step prunes nothing and returns the
exhaustive top n; width 1 is greedy decoding.

KV (copy on write). The prompt is computed once, in the first slot; its logits start the
search, and each further beam gets the prompt's rows with `KvBook.copy` (the torch backend
shares the cells; llama.cpp copies the sequence's own cells). After a step, a beam's first
kept child stays in its parent's slot and decodes on; every further child takes the slot of a
beam that had no kept child and copies its parent's sequence there. A width-W request holds
W slots from admission (which counts them, worker/engine/scheduler.py) to its end: fewer live
beams at one step may be W again at the next.

Output. Each finished hypothesis keeps its own detokenizer and stop-string matcher (forked
from its parent's), so its text and stop word are exactly what a sampled sequence of the same
tokens would give. The engine emits the n best at the end, choice by choice (token events, then
the finish event): with beam search nothing can be streamed before the search ends.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.engine.slot import Slot
from worker.engine.task import Event, FinishEvent, FinishReason, Task, TaskStats, TextOutput, TokenEvent
from worker.protocol.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class _Token:
    """One generated token of a hypothesis, as a node of the tree of beams (parent first)."""

    parent: _Token | None
    token: int
    logprob: float
    text: str  # what it adds to the output (empty for the end-of-generation token)
    top: tuple[tuple[int, float], ...]
    is_shown: bool  # an end-of-generation token is counted, never shown


@dataclass(slots=True)
class Beam:
    """A live beam: its last token (None before the first), cumulative log-probability, length,
    text output and the slot whose sequence holds its tokens."""

    last: _Token | None
    logprob: float
    length: int
    output: TextOutput
    slot: Slot


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    last: _Token | None
    logprob: float
    length: int
    output: TextOutput
    reason: FinishReason
    stop_word: str | None
    score: float

    def tokens(self) -> list[_Token]:
        out: list[_Token] = []
        node = self.last
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass(frozen=True, slots=True)
class Candidate:
    """Beam `beam` (an index of the live beams) extended by `token`."""

    beam: int
    token: int
    logprob: float  # cumulative
    token_logprob: float


def score(logprob: float, length: int, length_penalty: float) -> float:
    """OVMS's and vLLM's beam score: cumulative log-probability / length ** length_penalty."""
    return logprob / float(max(length, 1) ** length_penalty)


@dataclass(frozen=True, slots=True)
class NextToken:
    """One beam's next-token distribution: log p(t) = x[t] - lse, where x is the logits row with
    the bias added (float32, as the backend gives it) and lse its log-sum-exp (float32
    exponentials summed in float64: within ~1e-7 of a float64 log-softmax, at a tenth of its
    cost on a 49k vocabulary)."""

    x: np.ndarray
    lse: float

    @staticmethod
    def of(row: np.ndarray, bias: dict[int, float]) -> NextToken:
        x = np.asarray(row, dtype=np.float32)
        if bias:
            x = x.copy()
            ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            x[ids] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        m = float(x.max())
        return NextToken(x, m + math.log(float(np.exp(x - m).sum(dtype=np.float64))))

    def logprob(self, token: int) -> float:
        return float(self.x[token]) - self.lse

    def top(self, k: int) -> list[int]:
        """The k most likely tokens of probability > 0, most likely first (ties: the lower id)."""
        x = self.x
        k = min(k, x.shape[0])
        if k <= 8:  # a few argmax passes beat a partition of the whole vocabulary
            out: list[int] = []
            saved: list[float] = []
            for _ in range(k):
                t = int(x.argmax())
                if x[t] == -math.inf:
                    break
                out.append(t)
                saved.append(float(x[t]))
                x[t] = -math.inf
            for t, v in zip(out, saved, strict=True):
                x[t] = v
            return out
        kth = x[np.argpartition(-x, k - 1)[k - 1]]
        ids = np.flatnonzero((x >= kth) & (x > -math.inf))  # every tie of the k-th value
        return [int(t) for t in ids[np.lexsort((ids, -x[ids]))][:k]]


def best_candidates(beams: Sequence[tuple[float, NextToken]], width: int) -> list[Candidate]:
    """The `width` best extensions of the live beams ((cumulative log-probability, next-token
    distribution) each): step 1 and 2 of the module doc."""
    cands: list[Candidate] = []
    for b, (base, dist) in enumerate(beams):
        for t in dist.top(width):
            v = dist.logprob(t)
            if v != -math.inf:
                cands.append(Candidate(b, t, base + v, v))
    cands.sort(key=lambda c: (-c.logprob, c.beam, c.token))
    return cands[:width]


def top_logprobs(dist: NextToken, k: int) -> tuple[tuple[int, float], ...]:
    return tuple((t, dist.logprob(t)) for t in dist.top(k)) if k > 0 else ()


@dataclass(slots=True)
class Step:
    """What one step decided: the live beams' new slots to fill and the KV copies that do it."""

    copies: list[tuple[Slot, Slot, int]] = field(default_factory=list)  # (from, to, rows)


class BeamSearch:
    """One request's search (engine thread). `slots`: the W slots admission gave it, the first
    holding the prompt."""

    def __init__(self, params: SamplingParams, slots: list[Slot], n_ctx_seq: int,
                 is_eog: Callable[[int], bool], piece: Callable[[int], bytes]) -> None:
        self.params = params
        self.width = params.beam_width
        self.n_ctx_seq = n_ctx_seq
        self._is_eog = is_eog
        self._piece = piece
        self.spare = slots[1:]  # slots no live beam holds
        self.live = [Beam(None, 0.0, 0, TextOutput(params.stop), slots[0])]
        self.done: list[Hypothesis] = []

    @property
    def is_done(self) -> bool:
        return not self.live

    def slots(self) -> list[Slot]:
        return [b.slot for b in self.live] + self.spare

    def step(self, rows: dict[int, np.ndarray]) -> Step:
        """Advance by one token: `rows` holds each live beam's logits, by slot id."""
        p = self.params
        lps = [NextToken.of(rows[b.slot.id], p.logit_bias) for b in self.live]
        chosen = best_candidates([(b.logprob, lp) for b, lp in zip(self.live, lps, strict=True)], self.width)
        step = Step()
        parents = self.live
        kept: list[tuple[Candidate, Beam]] = []
        left = Counter(c.beam for c in chosen)  # children of each parent still to come
        tops: dict[int, tuple[tuple[int, float], ...]] = {}  # each parent's top_logprobs, once
        for c in chosen:
            parent = parents[c.beam]
            left[c.beam] -= 1  # the last child takes the parent's output, the others a copy of it
            output = parent.output if left[c.beam] == 0 else copy.deepcopy(parent.output)
            is_eog = not p.ignore_eos and self._is_eog(c.token)
            text, stop_word = ("", None) if is_eog else output.push(self._piece(c.token))
            if p.logprobs and c.beam not in tops:
                tops[c.beam] = top_logprobs(lps[c.beam], p.top_logprobs)
            top = tops.get(c.beam, ())
            node = _Token(parent.last, c.token, c.token_logprob, text, top, not is_eog)
            length = parent.length + 1
            reason: FinishReason | None = "stop" if is_eog or stop_word is not None else None
            if reason is None and (
                (p.max_tokens is not None and length >= p.max_tokens)
                or len(parent.slot.cache) + 1 >= self.n_ctx_seq
            ):
                reason = "length"
            if reason is not None:
                self.done.append(Hypothesis(node, c.logprob, length, output, reason, stop_word,
                                            score(c.logprob, length, p.length_penalty)))
            else:
                kept.append((c, Beam(node, c.logprob, length, output, parent.slot)))
        self.live = self._place(kept, step)
        return step

    def _place(self, kept: list[tuple[Candidate, Beam]], step: Step) -> list[Beam]:
        """Give each kept beam a slot: its parent's for the first child, a free one (and a copy
        of the parent's sequence) for the others."""
        parent_slots = [b.slot for b in self.live]
        has_child = {c.beam for c, _ in kept}
        free = [s for i, s in enumerate(parent_slots) if i not in has_child] + self.spare
        placed: set[int] = set()
        out: list[Beam] = []
        for c, beam in kept:
            if c.beam not in placed:
                placed.add(c.beam)
            else:
                dst = free.pop(0)
                step.copies.append((beam.slot, dst, len(beam.slot.cache)))
                beam.slot = dst
            out.append(beam)
        self.spare = free  # held: a later step may keep more live beams than this one
        return out

    def best(self) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (stable: the earlier finished on a tie)."""
        return sorted(self.done, key=lambda h: -h.score)[: self.params.n]


def emit_results(task: Task, search: BeamSearch, emits: Sequence[Callable[[Event], None]]) -> int:
    """Send the n best hypotheses to the request's choices: token events, then the finish event.
    Returns the tokens generated, all hypotheses' end tokens counted."""
    want_lp = search.params.logprobs
    n_total = 0
    for emit, hyp in zip(emits, search.best(), strict=False):
        for node in hyp.tokens():
            if node.is_shown:
                lp = node.logprob if want_lp else None
                emit(TokenEvent(node.text, node.token, lp, list(node.top)))
        stats: TaskStats = dataclasses.replace(task.stats, n_decoded=hyp.length)
        emit(FinishEvent(hyp.reason, hyp.output.finish(), hyp.stop_word, stats, hyp.score))
        n_total += hyp.length
    for emit in emits[len(search.best()):]:  # fewer answers than n (a logit_bias left too few tokens)
        emit(FinishEvent("stop", "", None, dataclasses.replace(task.stats, n_decoded=0)))
    return n_total
