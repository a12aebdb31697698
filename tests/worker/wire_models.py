"""The worker's OpenAI response shapes, as pydantic models: the tests validate every answer
against them (the worker writes its answers as plain dicts, worker/server/openai_format.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from worker.protocol.wire import FinishReason, OpenAIBaseModel, now


class Usage(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class Timings(OpenAIBaseModel):
    """llama-server's `timings` object."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    prompt_per_token_ms: float = 0.0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    predicted_per_token_ms: float = 0.0
    predicted_per_second: float = 0.0
    draft_n: int | None = None  # only when speculation drafted (as llama-server)
    draft_n_accepted: int | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    timings: Timings | None = None


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    timings: Timings | None = None


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    timings: Timings | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "omni-router"


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
