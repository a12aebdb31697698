"""Anthropic's Messages API at the edge: request models (pydantic) and the 400s they raise.

Field names follow the `anthropic` SDK's `MessageCreateParams`. Every model forbids unknown
fields, so a field we do not implement is a 400 naming it, never accepted and ignored; an
unsupported content block or tool type is refused by name before pydantic sees it.

`cache_control` is accepted on blocks, tools and the system prompt: it marks a prompt-cache
breakpoint, and our workers cache every prompt prefix anyway (reads show up as
`cache_read_input_tokens`), so honouring it needs nothing more.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator

from worker.protocol.errors import APIError, parse_json
from worker.protocol.strict import StrictModel, unknown_fields_message

BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking")
RESULT_BLOCK_TYPES = ("text", "image")


class _Model(StrictModel):
    """Unknown fields are a 400 naming them (the one rule, worker/protocol/strict.py)."""


class CacheControl(_Model):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# --------------------------------------------------------------------------- content blocks


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # Citations need document blocks, which we do not serve: only an empty list is accepted.
    citations: list[None] | None = Field(default=None, max_length=0)


class Base64Source(_Model):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Model):
    type: Literal["url"]
    url: str


class ImageBlock(_Model):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        s = self.source
        return s.url if isinstance(s, URLSource) else f"data:{s.media_type};base64,{s.data}"


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _only_types(blocks: Any, allowed: tuple[str, ...], what: str) -> Any:
    """Refuse a block type we do not serve by name (pydantic's union error would list every branch)."""
    if isinstance(blocks, list):
        for i, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind not in allowed:
                raise ValueError(f"{what} block type {kind!r} (block {i}) is not supported "
                                 f"(supported: {', '.join(allowed)})")
    return blocks


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _types(cls, v: Any) -> Any:
        return _only_types(v, RESULT_BLOCK_TYPES, "tool_result content")


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # ours are empty: nothing is encrypted or verified


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _types(cls, v: Any) -> Any:
        return _only_types(v, BLOCK_TYPES, "content")


# --------------------------------------------------------------------------- tools and options


class Tool(_Model):
    type: Literal["custom"] | None = None  # a client tool; Anthropic's server tools are refused by name
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema with \"type\": \"object\"")
        return v


class ToolChoiceAuto(_Model):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Model):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Model):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Model):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(_Model):
    type: Literal["enabled"]
    # Anthropic's floor is 1024; a local model's context may be smaller than that, so any is taken.
    budget_tokens: int = Field(ge=0)


class ThinkingDisabled(_Model):
    type: Literal["disabled"]


class ThinkingAdaptive(_Model):
    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class JSONSchemaFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: JSONSchemaFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class Metadata(_Model):
    user_id: str | None = Field(default=None, max_length=256)


def _server_tools(tools: Any) -> Any:
    if isinstance(tools, list):
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tool type {kind!r} (tool {i}) is not supported: the router serves client "
                                 "tools (name, description, input_schema) only")
    return tools


# --------------------------------------------------------------------------- requests


class CountTokensRequest(_Model):
    """`POST /v1/messages/count_tokens`: what the model would be fed."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: what our prefix cache always does

    _no_server_tools = field_validator("tools", mode="before")(_server_tools)

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> CountTokensRequest:
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceTool) and choice.name not in {t.name for t in self.tools or []}:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in 'tools'")
        if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not self.tools:
            raise ValueError(f"tool_choice type {choice.type!r} needs 'tools'")
        return self

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system) if self.system else None
        return self.system or None


class CreateMessage(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    stream: bool = False
    # Older clients and llama-server send these; the current SDK only through extra_body.
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> CreateMessage:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    @model_validator(mode="after")
    def _thinking_and_grammars(self) -> CreateMessage:
        """Our forced tool calls and output formats are grammars from the first output token, so
        the model cannot think first: refused rather than silently not thinking (Anthropic
        refuses thinking with a forced tool_choice too). Effort only sets the thinking budget
        here, so a lowered effort without thinking would change nothing."""
        is_thinking = isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive)
        if is_thinking and isinstance(self.tool_choice, ToolChoiceAny | ToolChoiceTool):
            raise ValueError(
                "thinking cannot be combined with a tool_choice that forces a tool call (any, tool)"
            )
        if is_thinking and self.output_config is not None and self.output_config.format is not None:
            raise ValueError(
                "thinking cannot be combined with output_config.format here: the format's grammar "
                "applies from the first output token"
            )
        effort = self.output_config.effort if self.output_config is not None else None
        if isinstance(self.thinking, ThinkingDisabled) and effort in ("low", "medium"):
            raise ValueError(
                "output_config.effort sets the thinking budget here; with thinking disabled it has "
                "nothing to lower"
            )
        return self


R = TypeVar("R", bound=CountTokensRequest)
_UNION_TAGS = frozenset({"str", "list[...]", "function-after[...]"})


def parse_request(cls: type[R], raw: bytes) -> R:
    """The request, or a 400 naming the field. Of pydantic's errors the deepest one is named:
    for `content: str | list[Block]`, the bad block, not "Input should be a valid string"."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise APIError("Request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        unknown = [".".join(str(p) for p in x.get("loc", ()) if not (isinstance(p, str) and p in _UNION_TAGS))
                   for x in e.errors() if x.get("type") == "extra_forbidden"]
        if unknown:
            raise APIError(unknown_fields_message(list(dict.fromkeys(unknown))), param=unknown[0]) from None
        err = max(e.errors(), key=lambda x: len(x.get("loc", ())))
        loc = ".".join(
            str(p)
            for p in err.get("loc", ())
            if not (isinstance(p, str) and (p in _UNION_TAGS or not p.isidentifier()))
        )
        msg = err.get("msg", "invalid value")
        raise APIError(f"Invalid value for '{loc}': {msg}" if loc else msg, param=loc or None) from None
