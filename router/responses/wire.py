"""The Responses API at the edge: request and item models, and the 400s they raise.

Field names follow the OpenAI SDK's `responses` types. Items keep the shape they have on the
wire (they are stored and echoed as they are); everything else is converted into plain values
by `router.responses.translate`.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from worker.protocol.errors import APIError, parse_model
from worker.protocol.strict import StrictModel

MAX_METADATA = 16


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class _Model(StrictModel):
    """Request bodies and the items in them: an unknown field is a 400 naming it
    (worker/protocol/strict.py)."""


# --------------------------------------------------------------------------- content parts


class InputText(_Model):
    type: Literal["input_text"]
    text: str


class OutputText(_Model):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class InputImage(_Model):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str = "auto"


class Refusal(_Model):
    type: Literal["refusal"]
    refusal: str


class ReasoningText(_Model):
    type: Literal["reasoning_text", "summary_text"]
    text: str


Part = Annotated[InputText | OutputText | InputImage | Refusal, Field(discriminator="type")]


# --------------------------------------------------------------------------- items


class MessageItem(_Model):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_text_parts(cls, data: Any) -> Any:
        """Chat-style `{"type": "text"}` parts (OVMS accepts them): input_text, or output_text
        in an assistant message."""
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            return data
        kind = "output_text" if data.get("role") == "assistant" else "input_text"
        parts = [{**p, "type": kind} if isinstance(p, dict) and p.get("type") == "text" else p
                 for p in data["content"]]
        return {**data, "content": parts}


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[Part]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return str(kind)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def with_id(item: Item) -> Item:
    """Items get an id when stored, and a message's string content becomes one text part, as
    OpenAI stores them."""
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part: InputText | OutputText = (
            OutputText(type="output_text", text=item.content)
            if item.role == "assistant"
            else InputText(type="input_text", text=item.content)
        )
        item = item.model_copy(update={"content": [part]})
    if item.id is None:
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[
            item.type
        ]
        item = item.model_copy(update={"id": new_id(prefix)})
    return item


def dump_item(item: Item) -> dict[str, Any]:
    return item.model_dump(mode="json", exclude_none=True)


class _Items(BaseModel):
    items: list[Item]


def parse_items(raw: list[Any], param: str) -> list[Item]:
    """Validate a list of items (stored or from a request) or raise a 400 naming `param[i]`."""
    for i, v in enumerate(raw):
        kind = _item_kind(v)
        if kind not in ITEM_TYPES:
            raise APIError(f"Input item type {kind!r} is not supported (supported: {', '.join(ITEM_TYPES)})",
                           param=f"{param}[{i}].type")
    try:
        return parse_model(_Items, {"items": raw}).items
    except APIError as e:
        if e.param and e.param.startswith("items"):
            e.param = param + e.param[len("items"):]
            e.message = e.message.replace("'items", f"'{param}", 1)
        raise


# --------------------------------------------------------------------------- request


class FunctionTool(_Model):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Model):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_needed(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("json_schema format needs 'name' and 'schema'")
        return self


class TextConfig(_Model):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    # No model we serve is tuned for verbosity levels: only the default is honest.
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # We do not summarize reasoning: a summary ("auto": the server's choice, or "detailed") is the
    # reasoning text itself, sent as `summary_text` and `response.reasoning_summary_*` events
    # beside the `reasoning_text` ones. "concise" would need a real summary: refused.
    summary: Literal["auto", "detailed"] | None = None
    generate_summary: Literal["auto", "detailed"] | None = None  # the older name of `summary`

    @property
    def wants_summary(self) -> bool:
        return (self.summary or self.generate_summary) is not None


class ConversationRef(_Model):
    id: str


def _check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    if v is not None and len(v) > MAX_METADATA:
        raise ValueError(f"at most {MAX_METADATA} entries")
    return v


class CreateResponse(_Model):
    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    # 0: no tools; 1: no parallel calls; N: calls past the N-th of a turn are dropped (a soft cap:
    # the model may have generated them, the response does not hold them).
    max_tool_calls: int | None = Field(default=None, ge=0)
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # OVMS's: the output tokens' logprobs (as include: ["message.output_text.logprobs"])
    logprobs: bool | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    # Chat's form of text.format (OVMS accepts it); it becomes text.format, so it is echoed there
    response_format: dict[str, Any] | None = None
    # n samples of one prompt (one upstream request: they share the prompt's KV), their items
    # in choice order in `output` (router/responses/builder.py); not with `conversation`
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    user: str | None = None
    safety_identifier: str | None = None
    # Output logprobs are the only extra output we can include (as `logprobs: true`).
    include: list[Literal["message.output_text.logprobs"]] | None = None
    prompt: None = None  # OpenAI's stored prompt templates: none exist here
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # extensions, as OpenVINO Model Server accepts them
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    # beam search (OVMS's best_of and length_penalty, vLLM's use_beam_search), done by the worker
    # (worker/engine/beam.py), which also refuses what does not combine with it
    best_of: int | None = Field(default=None, ge=1, le=128)
    use_beam_search: bool | None = None
    length_penalty: float | None = Field(default=None, allow_inf_nan=False)
    chat_template_kwargs: dict[str, Any] | None = None

    _metadata_size = field_validator("metadata")(_check_metadata)

    @field_validator("tools", mode="before")
    @classmethod
    def _flat_tools(cls, v: Any) -> Any:
        """Chat's nested form `{"type": "function", "function": {...}}` -> the Responses form."""
        if not isinstance(v, list):
            return v
        return [{"type": "function", **t["function"]} if isinstance(t, dict) and t.get("type") == "function"
                and isinstance(t.get("function"), dict) and "name" not in t and set(t) <= {"type", "function"}
                else t for t in v]

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _flat_tool_choice(cls, v: Any) -> Any:
        """Chat's `{"type": "function", "function": {"name"}}` -> `{"type": "function", "name"}`."""
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and "name" not in v and set(v) <= {"type", "function"}:
            return {"type": "function", "name": v["function"].get("name")}
        return v

    @model_validator(mode="after")
    def _response_format(self) -> CreateResponse:
        """Chat's `response_format` -> text.format (both at once is a conflict)."""
        rf = self.response_format
        if rf is None:
            return self
        if self.text.format.type != "text":
            raise APIError("give the output format once: text.format or response_format, not both",
                           param="response_format")
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise APIError("response_format json_schema needs a 'json_schema' object",
                               param="response_format")
            try:
                fmt = TextFormat.model_validate({"type": "json_schema", **js})
            except ValueError as e:
                raise APIError(f"Invalid value for 'response_format.json_schema': {e}",
                               param="response_format.json_schema") from None
        elif kind in ("json_object", "text"):
            fmt = TextFormat(type=kind)
        else:
            raise APIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                           param="response_format.type")
        self.text = self.text.model_copy(update={"format": fmt})
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(v, str) and v not in ("auto", "none", "required"):
            raise ValueError("expected 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")
        if isinstance(v, dict) and (v.get("type") != "function" or not isinstance(v.get("name"), str)):
            raise ValueError(f"tool choice type {v.get('type')!r} is not supported (only function tools)")
        return v

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for i, t in enumerate(self.tools):
            kind = t.get("type")
            if kind != "function":
                raise APIError(f"Tool type {kind!r} is not supported: the router serves function tools only",
                               param=f"tools[{i}].type")
            try:
                out.append(FunctionTool.model_validate(t))
            except Exception as e:
                raise APIError(f"Invalid function tool: {e}", param=f"tools[{i}]") from None
        return out

    def input_items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return parse_items(self.input, "input")

    def check(self) -> None:
        """Cross-field rules pydantic does not express on one field."""
        if self.conversation is not None and self.previous_response_id is not None:
            raise APIError("'previous_response_id' and 'conversation' cannot be used together",
                           param="conversation")
        if self.n > 1 and self.conversation is not None:
            raise APIError("'n' > 1 cannot be used with 'conversation': which sample continues it is the "
                           "client's choice (add that sample's items to the conversation yourself)",
                           param="n")
        if self.background and not self.store:
            raise APIError("background responses need store=true", param="background")
        if isinstance(self.tool_choice, dict):
            names = {t.get("name") for t in self.tools}
            if self.tool_choice["name"] not in names:
                raise APIError(f"tool_choice names {self.tool_choice['name']!r}, which is not in 'tools'",
                               param="tool_choice")


class CreateConversation(_Model):
    items: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None = None

    _metadata_size = field_validator("metadata")(_check_metadata)


class AddItems(_Model):
    items: list[Any] = Field(min_length=1)
