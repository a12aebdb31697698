"""The engine's own sampling parameters: a plain frozen dataclass, built by the wire types.

A leaf value type: the wire types build it, the engine, backends and sampler read it. The
compiled grammar it may carry is typed by what the engine asks of it (`CompiledGrammar`), so
this module imports nothing of the worker's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import llguidance


class CompiledGrammar(Protocol):
    """A compiled constraint (worker/engine/grammar.py's `Grammar`): one fresh matcher per task."""

    def matcher(self) -> llguidance.LLMatcher: ...


class BudgetTracker(Protocol):
    """One task's reasoning count (worker/engine/reasoning_budget.py's `BudgetTracker`)."""

    def next_token(self, sampled: int) -> int: ...

    def observe(self, text: str) -> None: ...


class ReasoningCap(Protocol):
    """A cap on reasoning (worker/engine/reasoning_budget.py's `ReasoningBudget`): one fresh
    tracker per task."""

    def tracker(self) -> BudgetTracker: ...


@dataclass(frozen=True, slots=True)
class SpecRequest:
    """A request's speculative-decoding settings (worker/engine/speculation.py): OVMS's
    num_assistant_tokens / max_ngram_size, llama-server's speculative.n_max / n_min. A request
    that sets any of them speculates (prompt lookup) even on a worker started without
    --spec-type; None: the worker's setting; n_max 0 turns speculation off for the request."""

    n_max: int | None = None
    n_min: int | None = None
    size_n: int | None = None


# The LoRA adapters a request runs with: (adapter id, scale) pairs, ids ascending, no zero scale
# (an adapter at scale 0 adds nothing, so it is the base model: worker/backends/lora.py). The
# empty tuple is the base model. Equal keys compute equal KV rows; nothing else may share them.
LoraKey = tuple[tuple[int, float], ...]


def lora_key(scales: dict[int, float]) -> LoraKey:
    """The key of {adapter id: scale}: sorted, zero scales dropped."""
    return tuple((i, float(s)) for i, s in sorted(scales.items()) if s != 0.0)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping settings (llama-server's defaults).

    temperature <= 0 means greedy (exact argmax). top_k <= 0, top_p >= 1 and min_p <= 0
    disable their samplers. repeat_last_n: 0 disables penalties, -1 means the whole context.
    seed None means a random seed per request. max_tokens None means until EOS or a full context.
    grammar: the constraint every token must keep to (worker/engine/grammar.py), or None.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # Beam search (worker/engine/beam.py): the width (0: off, the request samples), and the score's
    # length penalty (score = cumulative log-probability / length ** length_penalty).
    beam_width: int = 0
    length_penalty: float = 1.0
    cache_prompt: bool = True
    id_slot: int = -1
    post_sampling_probs: bool = (
        False  # with logprobs: report the sampler chain's probabilities (llama-server's)
    )
    return_progress: bool = False  # stream ProgressEvents while the prompt is computed
    grammar: CompiledGrammar | None = None
    reasoning_budget: ReasoningCap | None = None  # thinking_budget_tokens
    speculative: SpecRequest | None = None  # the request's speculative-decoding settings
    # The sampler chain's stages in the order they run (llama-server's `samplers`; those left
    # out are off: worker/protocol/sampler_order.py). The default is llama-server's.
    order: tuple[str, ...] = ("penalties", "top_k", "top_p", "min_p", "temperature")
    # A stream's keep-alive comment after this many silent seconds (llama-server's
    # sse_ping_interval; <= 0: none); None: the worker's own (worker/server/sse.py).
    sse_ping_interval: float | None = None
    lora: LoraKey = ()  # the LoRA adapters and scales (worker/backends/lora.py); () the base model

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
