"""The contract between the slot engine and an inference backend (llama.cpp or torch).

The engine thread is the only caller of a backend. One engine step is:

    status = backend.decode(entries)          # one shared batch: decode tokens + prompt chunks
    samples = backend.sample(sample_items)    # one token for every entry that asked for logits

A *sequence* is a slot: `seq_id` in [0, n_seq_max). Each sequence owns KV positions
0..n-1 in a unified KV cache of `n_ctx` cells shared by all sequences (a slot may use up to
the whole context). The engine keeps the bookkeeping of how many cells each sequence holds and
calls `seq_rm` to drop a tail (prefix reuse) or a whole sequence (eviction, preemption).

Sampling state (penalty history, RNG seeded per request, logit bias) lives in a `Sampler`
made by `new_sampler`; `sample` also *accepts* the chosen token into that state. The optional
per-item `mask` is the seam for grammar-constrained decoding: a boolean array of n_vocab where
False forbids a token; it is applied before any other sampler.

Logprobs are computed from the raw logits (log-softmax before temperature/penalties), as
OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np

from worker.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class BatchEntry:
    """A run of tokens of one sequence at positions pos .. pos+len(tokens)-1.

    If `logits` is true, the logits of the entry's last token are kept for sampling; the
    n-th such entry in the batch (0-based, batch order) is `logits_index` n for `sample`.
    """

    seq_id: int
    tokens: list[int]
    pos: int
    logits: bool


class DecodeStatus(Enum):
    OK = 0
    NO_KV_SPACE = 1  # nothing was written; the engine shrinks the batch or preempts


@dataclass(slots=True)
class SampleItem:
    sampler: Any  # what new_sampler returned
    logits_index: int
    mask: np.ndarray | None = None  # bool[n_vocab], False = forbidden


@dataclass(slots=True)
class Sample:
    token: int
    logprob: float | None = None  # log-softmax of the raw logits, when params.logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelMeta:
    """What the HTTP layer reports about the loaded model (/props, /v1/models)."""

    path: str
    n_vocab: int
    n_ctx_train: int
    n_params: int
    size_bytes: int
    bos_token: str
    eos_token: str
    bos_token_id: int
    eos_token_id: int
    add_bos: bool
    chat_template: str | None


class Backend(Protocol):
    """One loaded model with a unified KV cache of `n_ctx` cells and `n_seq_max` sequences."""

    n_ctx: int
    n_seq_max: int
    n_batch: int  # the largest batch `decode` accepts, in tokens
    supports_seq_state: bool  # seq_state_get/set work (the engine then keeps a prompt cache)

    @property
    def meta(self) -> ModelMeta: ...

    @property
    def is_sleeping(self) -> bool: ...

    # -- tokenizer (thread-safe; may be called from HTTP handlers) ----------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_to_piece(self, token: int) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 character)."""
        ...

    def is_eog(self, token: int) -> bool: ...

    # -- engine thread only ---------------------------------------------------------------
    def decode(self, entries: Sequence[BatchEntry]) -> DecodeStatus: ...

    def seq_rm(self, seq_id: int, p0: int) -> None:
        """Forget positions >= p0 of `seq_id` (p0 = 0: the whole sequence)."""
        ...

    def seq_state_get(self, seq_id: int) -> bytearray | None:
        """A copy of `seq_id`'s KV state (for worker/engine/prompt_cache.py); None if there is none."""
        ...

    def seq_state_set(self, seq_id: int, state: bytearray) -> bool:
        """Load a state from `seq_state_get` into the (empty) `seq_id`; False if it did not fit."""
        ...

    def new_sampler(self, params: SamplingParams, seed: int) -> Any: ...

    def free_sampler(self, sampler: Any) -> None: ...

    def sample(self, items: Sequence[SampleItem], params: Sequence[SamplingParams]) -> list[Sample]: ...

    def sleep(self) -> None:
        """Free weights and KV cache; keep tokenizer and metadata. Engine thread only."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...
