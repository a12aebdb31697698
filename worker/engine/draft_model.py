"""A draft model for speculative decoding (`--spec-type draft-simple`, `--spec-draft-model`).

A second backend (llama.cpp or torch, whichever fits the file) loaded in the same worker, with
a KV stream per slot (sequence id = slot id). Before each step `draft` brings every drafting
slot's draft sequence up to the slot's tokens (it keeps the longest common prefix and decodes
the rest: the prompt once, then the tokens accepted since the last step), then drafts greedily
one token per draft decode, all drafting slots in one batch, while the draft's top probability
is at least `p_min` (llama-server's `--spec-draft-p-min`). The target verifies the drafts as it
does n-gram drafts (worker/engine/speculation.py): a greedy draft is a point mass, so the
target's output distribution is unchanged.

The vocabularies must be the same (size and every token's text): a draft of another
vocabulary is refused at load with the first token that differs.
"""

from __future__ import annotations

import math

from worker.backends.base import Backend, BatchEntry, DecodeStatus, SampleItem
from worker.protocol.sampling import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, logprobs=True)


def check_vocab(draft: Backend, target: Backend) -> None:
    """Refuse a draft model whose vocabulary is not the target's (ValueError naming why)."""
    n_d, n_t = draft.meta.n_vocab, target.meta.n_vocab
    if n_d != n_t:
        raise ValueError(f"the draft model's vocabulary has {n_d} tokens, the model's {n_t}: "
                         "a draft model must share the model's vocabulary")
    for t in range(n_t):
        a, b = draft.token_to_piece(t, True), target.token_to_piece(t, True)
        if a != b:
            raise ValueError(f"the draft model's token {t} is {a!r}, the model's {b!r}: "
                             "a draft model must share the model's vocabulary")


class DraftModel:
    """Engine thread only."""

    def __init__(self, backend: Backend, target: Backend, p_min: float = 0.0) -> None:
        check_vocab(backend, target)
        self.backend = backend
        self.p_min = p_min
        self._cache: dict[int, list[int]] = {}
        self._sampler = backend.new_sampler(_GREEDY, 0)

    def forget(self) -> None:
        """The draft's KV is gone (sleep) or stale: start every sequence over."""
        if not self.backend.is_sleeping:
            for seq in self._cache:
                self.backend.seq_rm(seq, 0)
        self._cache.clear()

    def draft(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """slot id -> (its tokens, the last one fed to the target this step; the most to draft)
        => slot id -> draft (possibly empty)."""
        b = self.backend
        out: dict[int, list[int]] = {s: [] for s in wants}
        live: dict[int, int] = {}  # slot -> position of the token whose logits come next
        pending: list[BatchEntry] = []
        for seq, (tokens, k) in wants.items():
            if k <= 0 or len(tokens) + k >= b.n_ctx_seq:
                continue
            cache = self._cache.setdefault(seq, [])
            n = 0
            for x, y in zip(cache, tokens, strict=False):
                if x != y:
                    break
                n += 1
            n = min(n, len(tokens) - 1)  # the last token is decoded again: its logits are wanted
            b.seq_rm(seq, n)
            del cache[n:]
            rest = tokens[n:]
            while len(rest) > b.n_batch:  # a long catch-up (the prompt) in pieces of its own
                if b.decode([BatchEntry(seq, rest[: b.n_batch], len(cache), False)]) is not DecodeStatus.OK:
                    self._drop(seq)
                    break
                cache.extend(rest[: b.n_batch])
                rest = rest[b.n_batch :]
            else:
                pending.append(BatchEntry(seq, rest, len(cache), True))
                live[seq] = k
        while pending:
            if sum(len(e.tokens) for e in pending) > b.n_batch or b.decode(pending) is not DecodeStatus.OK:
                for e in pending:
                    self._drop(e.seq_id)
                break
            items = [SampleItem(self._sampler, i) for i in range(len(pending))]
            samples = b.sample(items, [_GREEDY] * len(pending))
            nxt: list[BatchEntry] = []
            for e, s in zip(pending, samples, strict=True):
                seq = e.seq_id
                self._cache[seq].extend(e.tokens)
                p = math.exp(s.logprob) if s.logprob is not None else 1.0
                if p < self.p_min:
                    continue
                out[seq].append(s.token)
                if len(out[seq]) < live[seq]:
                    nxt.append(BatchEntry(seq, [s.token], len(self._cache[seq]), True))
            pending = nxt
        return out

    def _drop(self, seq: int) -> None:
        self.backend.seq_rm(seq, 0)
        self._cache[seq] = []
