"""The request types of the API the worker serves and the router proxies (no torch, no llama_cpp here).

Pydantic lives at the edge only: a request body is parsed into one of the request models
below, converts itself into the engine's plain `SamplingParams` with `to_sampling_params()`,
and nothing but plain types travels inward. The router builds its OpenAPI document from these
models, so they are a public contract: a change here changes the router's schema. (The response
shapes, which only the tests parse, are in tests/worker/wire_models.py.)

Errors are `worker.protocol.errors.APIError` (the envelope shared with the router).

Why one file of over 500 lines: it is one document, the router's OpenAPI contract for every
body the worker takes, and its request models share `_SamplingRequest`'s fields and their one
conversion into `SamplingParams`; split by route, that shared half would be read in pieces.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from worker.protocol import sampler_order
from worker.protocol.errors import APIError
from worker.protocol.sampling import SamplingParams, SpecRequest
from worker.protocol.strict import StrictModel

# --------------------------------------------------------------------------- requests


Tokenize = Callable[[str], list[int]]  # text -> token ids, no specials (a logit_bias string key)


def resolve_logit_bias(raw: dict[str, float | bool | None] | list[list[Any]] | None,
                       tokenize: Tokenize | None) -> dict[int, float]:
    """{token id: bias} from OpenAI's or llama-server's logit_bias; false/null is -inf (never).
    A key that is not a number is text: every one of its tokens gets the bias."""
    pairs: list[tuple[int | str, Any]] = (
        list(raw.items()) if isinstance(raw, dict) else [(p[0], p[1]) for p in raw or []]
    )
    out: dict[int, float] = {}
    for key, bias in pairs:
        value = -math.inf if bias is None or bias is False else float(bias)
        if isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit()):
            out[int(key)] = value
        elif tokenize is None:
            raise ValueError(f"logit_bias key {key!r} is not a token id")
        else:
            for t in tokenize(str(key)):
                out[t] = value
    return out


class OpenAIBaseModel(BaseModel):
    """A response model: the worker builds its JSON by hand, these models are its contract (the
    tests validate every response against them). Request models are `StrictModel`s instead:
    an unknown request field is a 400 naming it (worker/protocol/strict.py)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(StrictModel):
    include_usage: bool = False


class NvExt(StrictModel):
    """Dynamo's `nvext` extension object; the same fields are also accepted top-level. Dynamo's
    bounds: repetition_penalty in (0, 2], top_k >= -1."""

    ignore_eos: bool | None = None
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    greedy_sampling: bool | None = None
    use_raw_prompt: bool | None = None


class LoraScale(StrictModel):
    """One adapter of llama-server's per-request `lora` list: its id (GET /lora-adapters) and scale."""

    id: int = Field(ge=0)
    scale: float = Field(allow_inf_nan=False)


class LoadLoraRequest(StrictModel):
    """vLLM's POST /v1/load_lora_adapter (omni-worker --lora-runtime): load an adapter by path."""

    lora_name: str = Field(min_length=1, pattern=r"^[^:\s]+$")  # `model` reaches it as "<model>:<lora_name>"
    lora_path: str = Field(min_length=1)
    scale: float = Field(default=1.0, allow_inf_nan=False)  # its global scale (POST /lora-adapters)


class UnloadLoraRequest(StrictModel):
    """vLLM's POST /v1/unload_lora_adapter: by name (or id: lora_int_id)."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class _SamplingRequest(StrictModel):
    """Fields common to chat completions and completions (OpenAI + llama-server extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=-1)  # -1: unlimited (llama-server's, its web UI sends it)
    n_predict: int | None = None  # llama-server alias; -1 = unlimited
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, gt=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    # OpenAI's {token id: bias}, or llama-server's forms: a string key (its tokens all get the bias),
    # [[token or string, bias], ...], and a bias of false or null for "never" (resolve_logit_bias).
    logit_bias: dict[str, float | bool | None] | list[list[Any]] | None = None
    n_probs: int | None = Field(default=None, ge=0, le=20)
    ignore_eos: bool | None = None
    greedy_sampling: bool | None = None
    cache_prompt: bool = True
    id_slot: int = -1
    # llama-server: the LoRA adapters of this request; an adapter not listed runs at scale 0
    # (None: the global scales of POST /lora-adapters). Resolved by worker/server/prepare.py.
    lora: list[LoraScale] | None = None
    verbose: bool = False  # llama-server: add `__verbose` (the prompt as the model saw it) to the response
    return_progress: bool = False  # llama-server: stream `prompt_progress` while the prompt is computed
    post_sampling_probs: bool = False  # llama-server: n_probs as probabilities after the sampler chain
    timings_per_token: bool = False  # llama-server: progress (and final) chunks carry `timings`
    # llama-server: the sampler chain's order and members (worker/protocol/sampler_order.py)
    samplers: str | list[str] | None = None
    # llama-server: seconds of silence before a stream's keep-alive comment, -1 none (its web UI sends 1)
    sse_ping_interval: int | None = Field(default=None, ge=-1)
    # Settings of samplers that can only be off here (their switch is in strict.NEUTRAL): inert.
    dynatemp_exponent: float | None = None
    xtc_threshold: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    reasoning_control: bool | None = None  # llama.cpp's web UI sends true: see strict.INERT
    nvext: NvExt | None = None
    user: str | None = None
    # Constrained output (worker/server/structured.py): at most one of these.
    response_format: dict[str, Any] | None = None
    json_schema: Any = None  # llama-server: a JSON schema
    grammar: str | None = None  # llama-server: a GBNF grammar
    # Speculative decoding (worker/engine/speculation.py), with --spec-type ngram-simple: OVMS's
    # num_assistant_tokens / max_ngram_size and llama-server's speculative.n_max / n_min. A
    # draft model's settings (assistant_confidence_threshold, speculative.p_min) are refused.
    num_assistant_tokens: int | None = Field(default=None, ge=0, le=1024)
    max_ngram_size: int | None = Field(default=None, ge=1, le=1024)
    assistant_confidence_threshold: float | None = None
    speculative_n_max: int | None = Field(default=None, ge=0, le=1024, alias="speculative.n_max")
    speculative_n_min: int | None = Field(default=None, ge=0, le=1024, alias="speculative.n_min")
    speculative_p_min: float | None = Field(default=None, alias="speculative.p_min")
    # Beam search (worker/engine/beam.py): OVMS's `best_of` (the width; beam search when > 1,
    # n <= best_of) and vLLM's `use_beam_search` (width `best_of`, else `n`); `length_penalty`:
    # score = cumulative log-probability / length ** length_penalty. Deterministic: a
    # temperature > 0 is refused, and the server's default temperature does not apply.
    best_of: int | None = Field(default=None, ge=1, le=128)
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _beam_search(self) -> _SamplingRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(f"best_of ({self.best_of}) must be at least n ({self.n}): the n best of best_of "
                           "beams are returned", param="best_of")
        if not self.is_beam_search:
            if self.length_penalty != 1.0:
                raise APIError("length_penalty scores beam search only: set best_of > 1 or use_beam_search",
                               param="length_penalty")
            return self
        if self.temperature is not None and self.temperature > 0 and not self.greedy_sampling:
            raise APIError("beam search is deterministic: temperature must be 0 or left out (sampling "
                           "beams is not implemented)", param="temperature")
        if self.stream and self.n > 1:
            raise APIError("streaming beam search supports only n = 1 (as OpenVINO Model Server): the "
                           "beams are known only at the end", param="n")
        return self

    @property
    def is_beam_search(self) -> bool:
        return self.use_beam_search or (self.best_of or 1) > 1

    def _beam_width(self) -> int:
        return (self.best_of or self.n) if self.is_beam_search else 0

    @field_validator("assistant_confidence_threshold", "speculative_p_min")
    @classmethod
    def _no_draft_model(cls, v: float | None) -> float | None:
        if v is not None:
            raise ValueError("a draft model's setting: this server speculates without a draft model "
                             "(prompt lookup: num_assistant_tokens, max_ngram_size)")
        return v

    def _speculative(self) -> SpecRequest | None:
        n_max = self.speculative_n_max if self.speculative_n_max is not None else self.num_assistant_tokens
        if n_max is None and self.speculative_n_min is None and self.max_ngram_size is None:
            return None
        return SpecRequest(n_max=n_max, n_min=self.speculative_n_min, size_n=self.max_ngram_size)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_not_zero(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("max_tokens must be at least 1 (or -1: unlimited)")
        return v

    @field_validator("samplers")
    @classmethod
    def _known_samplers(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None:
            sampler_order.parse(v)  # a ValueError names what is wrong
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(not isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_pairs(cls, v: Any) -> Any:
        if isinstance(v, list):
            for pair in v:
                if (
                    len(pair) != 2
                    or not isinstance(pair[0], int | str)
                    or not isinstance(pair[1], int | float | None)
                ):
                    raise ValueError("logit_bias entries must be [token id or string, bias or false]")
        return v

    def _max_new_tokens(self, default: int | None) -> int | None:
        """max_tokens, else n_predict (-1: unlimited), else the server's `-n` (llama-server's
        n_predict_max: the request's own value wins)."""
        if self.max_tokens is not None:
            return self.max_tokens if self.max_tokens >= 0 else None
        if self.n_predict is not None:
            return self.n_predict if self.n_predict >= 0 else None
        return default

    def _common_params(
        self, defaults: SamplingParams | None, *, logprobs: bool, top_logprobs: int, max_tokens: int | None,
        tokenize: Tokenize | None,
    ) -> SamplingParams:
        """`defaults`: the server's (omni-worker --temp, --top-k, ..., -n, --seed); a field the
        request leaves out takes its value from there."""
        d = defaults or SamplingParams()
        nv = self.nvext or NvExt()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        greedy = bool(self.greedy_sampling or nv.greedy_sampling)
        rep = self.repeat_penalty or self.repetition_penalty or nv.repetition_penalty
        params = SamplingParams(
            temperature=0.0 if greedy or self.is_beam_search else (
                d.temperature if self.temperature is None else self.temperature),
            top_k=nv.top_k if nv.top_k is not None else (d.top_k if self.top_k is None else self.top_k),
            top_p=d.top_p if self.top_p is None else self.top_p,
            min_p=d.min_p if self.min_p is None else self.min_p,
            repeat_penalty=d.repeat_penalty if rep is None else rep,
            repeat_last_n=d.repeat_last_n if self.repeat_last_n is None else self.repeat_last_n,
            presence_penalty=d.presence_penalty if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=d.frequency_penalty
            if self.frequency_penalty is None
            else self.frequency_penalty,
            seed=d.seed if self.seed is None or self.seed < 0 else self.seed,
            logit_bias=resolve_logit_bias(self.logit_bias, tokenize),
            max_tokens=max_tokens,
            stop=tuple(s for s in stop if s),
            ignore_eos=bool(self.ignore_eos or nv.ignore_eos),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=self.n,
            beam_width=self._beam_width(),
            length_penalty=self.length_penalty,
            cache_prompt=self.cache_prompt,
            id_slot=self.id_slot,
            return_progress=self.return_progress and self.stream,  # progress only ever goes out in a stream
            post_sampling_probs=self.post_sampling_probs,
            speculative=self._speculative(),
            sse_ping_interval=None if self.sse_ping_interval is None else float(self.sse_ping_interval),
        )
        if self.samplers is None:
            return params
        order = sampler_order.parse(self.samplers)
        off: dict[str, Any] = {}  # a stage left out of the chain is not applied
        if "penalties" not in order:
            off |= {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
        if "top_k" not in order:
            off["top_k"] = 0
        if "top_p" not in order:
            off["top_p"] = 1.0
        if "min_p" not in order:
            off["min_p"] = 0.0
        if "temperature" not in order:
            off["temperature"] = 1.0
        return dataclasses.replace(params, order=order, **off)


ContentPart = dict[str, Any]


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """Content flattened to text (text parts joined; other parts are rejected upstream)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    reasoning_format: str | None = None
    thinking_budget_tokens: int | None = Field(default=None, ge=-1)  # llama.cpp's; -1: no cap
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool | None = None
    images: list[str] | None = None  # sglang-omni's: image URLs for the last user message
    # sglang-omni's: video URLs for the last user message (after `images`), and how they are sampled
    videos: list[str] | None = None
    video_fps: float | None = Field(default=None, gt=0, le=60)
    video_max_frames: int | None = Field(default=None, ge=1)
    video_min_pixels: int | None = Field(default=None, ge=1)
    video_max_pixels: int | None = Field(default=None, ge=1)
    video_total_pixels: int | None = Field(default=None, ge=1)
    # OpenAI's: "none"/"minimal" turn the template's thinking off, others on (as Responses' reasoning.effort)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    modalities: list[str] | None = None  # only ["text"]: spoken answers are the router's (router/speech/)
    verbosity: Literal["medium"] | None = None  # no model here is tuned for verbosity levels
    request_id: str | None = Field(default=None, min_length=1, max_length=200)  # sglang's: the response's id
    # accepted and inert (docs/compatibility.md): the prompt cache is keyed by tokens, by itself;
    # there is no per-user policy and one service tier
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(m != "text" for m in v):
            raise ValueError("this model produces text only (no audio output): modalities must be ['text']")
        return v

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort as `enable_thinking` unless they set it."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = self.reasoning_effort not in ("none", "minimal")
        return kwargs or None

    def to_sampling_params(
        self, defaults: SamplingParams | None = None, tokenize: Tokenize | None = None
    ) -> SamplingParams:
        d = defaults or SamplingParams()
        max_tokens: int | None
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        else:
            max_tokens = self._max_new_tokens(d.max_tokens)
        top = self.top_logprobs if self.top_logprobs is not None else (self.n_probs or 0)
        return self._common_params(d, logprobs=self.logprobs or bool(self.n_probs), top_logprobs=top,
                                   max_tokens=max_tokens, tokenize=tokenize)


def _non_empty(v: Any) -> Any:
    if isinstance(v, list) and len(v) == 0:
        raise ValueError("prompt must not be empty")
    return v


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=200)  # sglang's: the response's id

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        # Fill-in-the-middle needs the model's FIM tokens; llama-server's /infill is not built yet.
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return v

    _prompt_not_empty = field_validator("prompt")(_non_empty)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (a string or a token-id list each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]  # all() above narrowed it to ints; mypy cannot see that
        return list(p)  # type: ignore[arg-type]  # the validator admits only str or int-list items here

    def to_sampling_params(
        self, defaults: SamplingParams | None = None, tokenize: Tokenize | None = None
    ) -> SamplingParams:
        n_lp = self.logprobs if self.logprobs is not None else (self.n_probs or 0)
        use_lp = self.logprobs is not None or bool(self.n_probs)
        d = defaults or SamplingParams()
        # Like llama-server (not OpenAI's 16): no max_tokens means until EOS or the context is full.
        return self._common_params(
            d,
            logprobs=use_lp,
            top_logprobs=n_lp,
            max_tokens=self._max_new_tokens(d.max_tokens),
            tokenize=tokenize,
        )


NativePrompt = str | list[int] | list[str | int]  # one prompt: text, token ids, or both mixed


def _is_prompt_part(x: object) -> bool:
    """A string or a token id (JSON `true` is a bool, not token 1)."""
    return isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))


def _json_prompt(obj: dict[str, Any]) -> str:
    """llama-server's JSON prompt object: its `prompt_string`; `multimodal_data` needs a vision model."""
    if obj.get("multimodal_data"):
        raise ValueError("multimodal_data is not supported on this endpoint: send images as chat "
                         "image_url parts (/v1/chat/completions)")
    text = obj.get("prompt_string")
    if not isinstance(text, str):
        raise ValueError("a JSON prompt needs a prompt_string")
    return text


class _NativeSamplingRequest(_SamplingRequest):
    """llama-server's native endpoints: `n_probs` top log-probabilities per token;
    `response_fields`: the final object reduced to these fields, `a/b` a nested one (its key is
    the path), a path that is not there left out."""

    response_fields: list[str] = Field(default_factory=list)

    def to_sampling_params(
        self, defaults: SamplingParams | None = None, tokenize: Tokenize | None = None
    ) -> SamplingParams:
        d = defaults or SamplingParams()
        n = self.n_probs or 0
        return self._common_params(
            d,
            logprobs=n > 0,
            top_logprobs=n,
            max_tokens=self._max_new_tokens(d.max_tokens),
            tokenize=tokenize,
        )


class NativeCompletionRequest(_NativeSamplingRequest):
    """llama-server's native /completion: `prompt` is text, token ids, text and ids mixed (one
    prompt), or a list of those (several prompts); `n_probs` top log-probabilities per token."""

    prompt: str | list[Any] | dict[str, Any]
    return_tokens: bool = False

    _prompt_not_empty = field_validator("prompt")(_non_empty)

    def prompts(self) -> list[NativePrompt]:
        """As llama-server's tokenize_input_prompts: a list holding any number is one prompt; a
        JSON object `{"prompt_string": ..., "multimodal_data": [...]}` is one (text only here)."""
        p = self.prompt
        if isinstance(p, dict):
            return [_json_prompt(p)]
        if isinstance(p, str):
            return [p]
        if any(_is_prompt_part(x) and not isinstance(x, str) for x in p):
            if not all(_is_prompt_part(x) for x in p):  # e.g. [[1], 2]: not one prompt, not several
                raise ValueError("a prompt with token ids holds only token ids and strings")
            return [p]
        out: list[NativePrompt] = []
        for x in p:
            is_mixed = isinstance(x, list) and all(_is_prompt_part(y) for y in x)
            if isinstance(x, dict):
                out.append(_json_prompt(x))
            elif isinstance(x, str) or is_mixed:
                out.append(x)
            else:
                raise ValueError(
                    "each prompt must be a string, a list of token ids, a list of both, or a JSON prompt"
                )
        return out


class InfillChunk(StrictModel):
    """One other file for /infill's context."""

    text: str
    filename: str = "tmp"


class InfillRequest(_NativeSamplingRequest):
    """llama-server's /infill: the code before and after the gap, the start of the middle
    (`prompt`), other files (`input_extra`); sampling fields as /completion's."""

    input_prefix: str | list[str | int]
    input_suffix: str | list[str | int]
    input_extra: list[InfillChunk] = Field(default_factory=list)
    prompt: str = ""
    return_tokens: bool = False


class TokenizeRequest(StrictModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None


class DetokenizeRequest(StrictModel):
    tokens: list[int]
    model: str | None = None


class ApplyTemplateRequest(StrictModel):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None


class ResponsesInputTokensRequest(StrictModel):
    """OpenAI's /v1/responses/input_tokens: what a Responses request would feed the model."""

    input: str | list[ChatMessage] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Any] | None = None
    model: str | None = None

    def chat_messages(self) -> list[ChatMessage]:
        items = (
            [ChatMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else list(self.input)
        )
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        return system + items


class AnthropicCountTokensRequest(StrictModel):
    """Anthropic's /v1/messages/count_tokens: `messages` with `system` apart."""

    messages: list[ChatMessage] = Field(min_length=1)
    system: str | list[ContentPart] | None = None
    tools: list[Any] | None = None
    model: str | None = None

    def chat_messages(self) -> list[ChatMessage]:
        system = [ChatMessage(role="system", content=self.system)] if self.system else []
        return system + self.messages


# --------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
