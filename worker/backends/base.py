"""The contract between the slot engine and an inference backend (llama.cpp or torch).

The engine thread is the only caller of a backend. One engine step is:

    status = backend.decode(entries)          # decode tokens + prompt pieces of one step
    samples = backend.sample(sample_items)    # one token for every entry that asked for logits

Sequences. `seq_id` in [0, n_seq_max): one per slot, plus the last one, the *staging*
sequence, where the engine prefills a waiting request's prompt while every slot is busy.
Each sequence holds KV positions 0..n-1, at most `n_ctx_seq` of them. With `kv_unified` off
(the default, as in llama-server) every sequence has a KV stream of its own; with it on, all
sequences share one pool of `n_ctx` cells and may each fill it. The engine keeps the
bookkeeping of what each sequence holds and calls `seq_rm` to drop a tail (prefix reuse) or
a whole sequence, `seq_cp` to give a sequence another one's prefix (prefix sharing), and
`seq_state_get/set` to move a sequence to host RAM and back (the prompt cache).

Determinism. A row's numbers must depend only on its sequence's tokens, never on what else is
in the batch. Backends whose kernels are batch invariant say so with `RowRecipe.exact()`.
llama.cpp's are not: its kernels change with the number of a sequence's rows in one ubatch.
Such a backend states the rules under which its results are reproducible (`RowRecipe`: which
prompt pieces it accepts and which cached rows may stand in for which), the engine plans by
them, and `decode` runs every prompt piece the way the recipe promises.

Sampling state (penalty history, RNG seeded per request, logit bias) lives in a `Sampler`
made by `new_sampler`; `sample` also *accepts* the chosen token into that state. An item
samples either a row of the last decode (`logits_index`) or a row saved earlier (`logits`,
from `logits_row`: a prompt whose KV was all cached needs no decode). The optional per-item
`mask` is a grammar's (worker/engine/grammar.py): a boolean array of n_vocab where False
forbids a token; it is applied before any other sampler.

Logprobs are computed from the raw logits (log-softmax before temperature/penalties), as
OpenAI reports them.

Embedding models (`pooling` not None, llama-server's `--embedding`): `decode` keeps, for every
entry that asks for logits, the final-normed hidden states of its sequence pooled as `pooling`
says, read with `embedding(n)` (the n-th such entry of the last decode), and nothing is sampled.
With mean, cls or none pooling the entry must hold the whole prompt (they read every row of it)
and the scheduler plans such prompts as one piece; last and (causal) rank read the last row of
the last piece, so those prompts go in pieces like any other (`pools_in_pieces`, llama-server's
`can_split`). Pooling as llama.cpp's: none = every row, mean, cls = the first
row, last = the last row, rank = the last row (causal models) through the classifier head when
the model has one; without a head (a llama-family GGUF) llama.cpp's score is that row's first
element, and the torch backend computes exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

import numpy as np

from worker.backends.media import Vision
from worker.protocol.sampling import LoraKey, SamplingParams
from worker.text.fim import FimTokens

Pooling = Literal["none", "mean", "cls", "last", "rank"]
POOLINGS: tuple[Pooling, ...] = ("none", "mean", "cls", "last", "rank")


@dataclass(slots=True)
class BatchEntry:
    """A run of tokens of one sequence at positions pos .. pos+len(tokens)-1.

    If `logits` is true, the logits of the entry's last `n_outputs` tokens are kept for
    sampling; the n-th such row in the batch (0-based, batch order, an entry's rows in position
    order) is `logits_index` n for `sample`. More than one output row is a speculative verify
    entry (worker/engine/speculation.py): the last sampled token and the drafted ones.
    `embd`: the entry is rows of an image chunk (`tokens` are their media ids, see
    worker/backends/media.py), fed as these embeddings (float32[len(tokens), n_embd]).
    """

    seq_id: int
    tokens: list[int]
    pos: int
    logits: bool
    _: KW_ONLY  # the two extensions by name: a positional 5th argument was once the other one
    n_outputs: int = 1
    embd: np.ndarray | None = None

    @property
    def is_output_rows(self) -> bool:
        """Every row gives logits (a generating slot's token, a verify entry): not a prompt piece
        (whose rows cost less each) nor media rows; what the step-cost fit learns from."""
        return self.logits and self.n_outputs == len(self.tokens) and self.embd is None


class DecodeStatus(Enum):
    OK = 0
    NO_KV_SPACE = 1  # nothing was written; the engine shrinks the batch or preempts


@dataclass(frozen=True, slots=True)
class RowRecipe:
    """How a backend's results depend on batching, so that the engine can keep them reproducible.

    Rows come in classes: two rows at the same position of the same tokens are bitwise equal
    when they are of the same class. The rows of an n-token prompt are of `prompt_class(n)`
    provided it is computed in *pieces* (one sequence's consecutive rows in one decode) of at
    least `min_piece(n)` and at most `n_ubatch` rows. A one-row piece (a generated token, or a
    one-token prompt) is a decode row, of `decode_class`. A cached row may stand in for a row
    of the same class only.

    - `exact()`: batch-invariant kernels, every row is of one class: anything goes.
    - Otherwise a piece has at least 2 rows (a one-row batch runs other matmul kernels), and
      with `short_prompt` > 0 a prompt shorter than that is a class of its own (llama.cpp's
      flash attention runs its per-row kernel below 64 rows of one sequence in a ubatch, and
      that kernel gives a row the same bits in any piece of 2+ rows: measured on F32, F16 and
      Q4_1 weights), while a longer one is cut in pieces of at least `short_prompt` rows (the
      tiled kernel from 64 rows).
    """

    exact_rows: bool = False
    short_prompt: int = 0

    DECODE = 3

    @staticmethod
    def exact() -> RowRecipe:
        return RowRecipe(exact_rows=True)

    @property
    def decode_class(self) -> int:
        return 0 if self.exact_rows else self.DECODE

    def prompt_class(self, n_prompt: int) -> int:
        if self.exact_rows:
            return 0
        if n_prompt <= 1:
            return self.DECODE
        return 1 if n_prompt < self.short_prompt else 2

    def min_piece(self, n_prompt: int) -> int:
        """The fewest rows a piece of an `n_prompt`-token prompt may have."""
        if self.exact_rows or n_prompt <= 1:
            return 1
        if n_prompt < self.short_prompt:
            return 2  # the per-row kernel, in pieces of any size but one row
        return max(self.short_prompt, 2)


@dataclass(slots=True)
class SampleItem:
    sampler: Any  # what new_sampler returned
    logits_index: int = -1  # the n-th logits row of the last decode, or
    logits: np.ndarray | None = None  # a row saved with `logits_row` (float32[n_vocab])
    mask: np.ndarray | None = None  # bool[n_vocab], False = forbidden


@dataclass(slots=True)
class Sample:
    token: int
    logprob: float | None = None  # log-softmax of the raw logits, when params.logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # params.post_sampling_probs: the chosen token's probability after the sampler chain (top-k, top-p,
    # min-p, temperature), and the most likely of that distribution's candidates (at most top_logprobs)
    prob: float | None = None
    top_probs: list[tuple[int, float]] = field(default_factory=list)


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
    fim: FimTokens = field(default_factory=FimTokens)
    # what llama-server's rerank prompt needs (format_prompt_rerank)
    add_eos: bool = False
    add_sep: bool = False
    sep_token_id: int = -1
    rerank_template: str | None = None  # the model's "rerank" chat template: {query} and {document}


class Vocab(Protocol):
    """What the HTTP side (worker/server/) may touch of a loaded model: thread-safe reads of its
    vocabulary, shape and status. Handlers get this type only, so mypy keeps them off the
    engine-only methods of `Backend` (decode, KV, sampling, sleep), which only the engine thread calls."""

    n_ctx_seq: int  # the most cells one sequence may hold
    n_batch: int  # the largest batch `decode` accepts, in tokens
    n_ubatch: int  # the largest prompt piece the recipe's promise holds for
    pooling: Pooling | None  # an embedding model (see module doc); None: a generating one
    pools_in_pieces: bool  # its pooling reads the last row only (last, causal rank): prompts may be cut
    vision: Vision | None  # the model's mmproj (image input), thread-safe; None: text only

    @property
    def meta(self) -> ModelMeta: ...

    @property
    def is_sleeping(self) -> bool: ...

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 character). `special`: a control token
        as its text (llama-server's /detokenize does so); without it llama.cpp gives nothing."""
        ...

    def is_eog(self, token: int) -> bool: ...

    def grammar_tokenizer(self) -> Any:
        """The vocabulary as llguidance sees it (an `LLTokenizer`, end-of-generation tokens as its
        EOS), for worker/engine/grammar.py. Built at the first call (up to ~1 s), then cached."""
        ...


class Backend(Vocab, Protocol):
    """One loaded model with `n_seq_max` KV sequences of up to `n_ctx_seq` cells each. Beyond its
    `Vocab`, every method is the engine thread's alone."""

    n_ctx: int  # KV cells in all (streams or the shared pool)
    n_seq_max: int  # slots + 1: the last sequence is the staging one
    kv_unified: bool  # one pool shared by all sequences (else a stream per sequence)
    # a decode costs a pass over the weights per run of consecutive sequence ids in it (llama.cpp's
    # per-sequence KV streams): the scheduler keeps busy slots packed (policy.pick_slot)
    runs_by_seq_id: bool
    supports_seq_state: bool  # seq_state_get/set work (the engine then keeps a prompt cache)
    recipe: RowRecipe

    # -- engine thread only ---------------------------------------------------------------
    def decode(self, entries: Sequence[BatchEntry]) -> DecodeStatus: ...

    def seq_rm(self, seq_id: int, p0: int) -> None:
        """Forget positions >= p0 of `seq_id` (p0 = 0: the whole sequence)."""
        ...

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        """Make `dst` hold exactly `src`'s positions [0, n) (whatever dst held is dropped).

        Shared without a copy where the KV layout allows (a unified pool), copied otherwise."""
        ...

    def embedding(self, index: int) -> np.ndarray:
        """Embedding models: the pooled output of the n-th entry of the last decode that asked for
        logits, float32[rows, n]: one row when pooled, one per prompt token with pooling none."""
        ...

    def logits_row(self, logits_index: int) -> np.ndarray:
        """A copy of the n-th logits row of the last decode (to sample it again later)."""
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

    def is_row_independent(self, sampler: Any) -> bool:
        """A row's token does not depend on the tokens this sampler accepted before it (greedy, no
        penalty window, no RNG): several rows of one sequence may then be sampled in one call,
        and accepting a row that is later rejected changes nothing."""
        ...

    def load_lora(self, path: str) -> tuple[str, str]:
        """Load a LoRA adapter (worker/backends/lora.py) as the next id (0, 1, ...); returns its
        (task_name, prompt_prefix). Raises LoraError, saying why, when it does not fit the model."""
        ...

    def unload_lora(self, lora_id: int) -> None:
        """Free an adapter; its id is not given again."""
        ...

    def set_lora(self, key: LoraKey) -> None:
        """The adapters and scales the next decodes run with (() the base model). The engine sets
        it before each decode: a step's rows all run with one set (worker/engine/scheduler.py)."""
        ...

    def sleep(self) -> None:
        """Free weights and KV cache; keep tokenizer and metadata. Engine thread only."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...
