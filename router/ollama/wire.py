"""Ollama's API at the edge: request models (pydantic), as the `ollama` Python package and
Ollama's api/types.go write them.

Every model forbids unknown fields (worker/protocol/strict.py): an option we do not implement
(`num_gpu`, `mirostat_eta`, ...) is a 400 naming it with its reason (strict.REFUSED), never
accepted and ignored; a sampler option at its off value (`typical_p: 1`, `mirostat: 0`,
`tfs_z: 1`) is dropped as the other APIs drop it (strict.NEUTRAL). Class names carry the
`Ollama` prefix: docs/compatibility.md keys its rows by class name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from worker.protocol.strict import StrictModel

Think = bool | Literal["low", "medium", "high"]
Format = Literal["", "json"] | dict[str, Any]
KeepAlive = float | str


class OllamaOptions(StrictModel):
    """The per-request options that mean something for a model already loaded. Ollama's
    load-time options (`num_gpu`, `num_thread`, `use_mmap`, ...) are a preset's keys here:
    refused by name (strict.REFUSED)."""

    num_ctx: int | None = Field(default=None, ge=1)
    num_predict: int | None = Field(default=None, ge=-2)  # -1: no limit, -2: fill the context
    temperature: float | None = Field(default=None, ge=0)
    top_k: int | None = None
    top_p: float | None = Field(default=None, ge=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(default=None, gt=0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    num_keep: int | None = None  # inert: see strict.INERT

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class OllamaFunctionCall(StrictModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # the call's place in the answer (Ollama >= 0.12 writes it)


class OllamaToolCall(StrictModel):
    function: OllamaFunctionCall
    index: int | None = None  # Open WebUI writes the call's place here (its OpenAI-to-Ollama converter)
    id: str | None = None  # a call id (newer clients send the one they were given back)
    type: Literal["function"] | None = None


class OllamaMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # base64, no data: prefix (the client encodes files and bytes)
    tool_calls: list[OllamaToolCall] | None = None
    thinking: str | None = None  # an assistant's earlier reasoning, sent back
    tool_name: str | None = None  # a tool result's function name
    tool_call_id: str | None = None  # a tool result's call id (when the client kept ours)


class OllamaToolFunction(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(StrictModel):
    type: Literal["function"] = "function"
    function: OllamaToolFunction


class _Generation(StrictModel):
    model: str = Field(min_length=1)
    format: Format | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: bool = False  # each output token's log probability (templated prompts and chat)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # and its most likely alternatives


class OllamaChatRequest(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None
    # Not Ollama's chat fields, but Open WebUI's converter (convert_payload_openai_to_ollama) puts
    # them at the root: its tasks' max_tokens as `num_predict`, an options `system` as `system`.
    # Honoured as it means them (Ollama's server drops them without a word).
    num_predict: int | None = Field(default=None, ge=-2)  # the output limit; options.num_predict wins
    system: str | None = None  # a system message before the others


class OllamaGenerateRequest(_Generation):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class OllamaEmbedRequest(StrictModel):
    model: str = Field(min_length=1)
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaEmbeddingsRequest(StrictModel):
    model: str = Field(min_length=1)
    prompt: str = ""
    input: str | list[str] | None = None  # inert: Open WebUI sends the same text as `prompt` too
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaShowRequest(StrictModel):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool = False  # model_info's large arrays (the vocabulary) are returned only then


class OllamaDeleteRequest(StrictModel):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`


class OllamaCopyRequest(StrictModel):
    source: str
    destination: str


# Go's time.ParseDuration units, as Ollama's keep_alive strings use them ("5m", "1h30m", "-1s")
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


FOREVER_S = 100 * 365 * 86400.0


def keep_alive_seconds(value: KeepAlive) -> float:
    """A `keep_alive` in seconds: a number is seconds, a string a Go duration ("5m", "1h30m")
    or a number of seconds; negative means never unload (returned as -1)."""
    if isinstance(value, bool):
        raise ValueError("keep_alive is a duration ('5m') or a number of seconds, not a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f"keep_alive {value!r} is not a duration ('5m', '1h30m', '300s') or a number of seconds"
                ) from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds != seconds:
        raise ValueError("keep_alive is not a number")
    return -1.0 if seconds < 0 or seconds > FOREVER_S else seconds  # a century or more: never
