"""A Messages request -> the upstream's chat-completions body (pure; table-tested).

`chat_messages()` turns `system` and `messages` into chat messages, `chat_body()` the rest of
the request into chat fields, `count_body()` the worker's token-count body: the same
messages, tools and template arguments the chat request renders, so the count is exact.
"""

from __future__ import annotations

import json
from typing import Any

from router.anthropic.wire import (
    CountTokensRequest,
    CreateMessage,
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from worker.protocol.errors import APIError

ERROR_PREFIX = "Error: "  # a tool_result with is_error: the chat format has no flag for it
# output_config.effort -> the share of max_tokens that thinking may use (None: no cap but max_tokens)
EFFORT_SHARE: dict[str, float | None] = {"low": 0.25, "medium": 0.5, "high": None, "max": None}


def _image_part(b: ImageBlock) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": b.url()}}


def _parts(blocks: list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    """Text only: one string (templates like strings best); with images, chat content parts."""
    if all(isinstance(b, TextBlock) for b in blocks):
        return "".join(b.text for b in blocks if isinstance(b, TextBlock))
    return [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else _image_part(b) for b in blocks]


def _tool_message(b: ToolResultBlock) -> dict[str, Any]:
    content = b.content if isinstance(b.content, str) else _parts(list(b.content))
    if b.is_error:
        if isinstance(content, str):
            content = ERROR_PREFIX + content
        else:
            content = [{"type": "text", "text": ERROR_PREFIX}, *content]
    return {"role": "tool", "tool_call_id": b.tool_use_id, "content": content}


def _user(i: int, m: Message) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    pending: list[TextBlock | ImageBlock] = []
    for j, b in enumerate(m.content):
        if isinstance(b, ToolResultBlock):
            if pending:
                out.append({"role": "user", "content": _parts(pending)})
                pending = []
            out.append(_tool_message(b))
        elif isinstance(b, TextBlock | ImageBlock):
            pending.append(b)
        else:
            raise APIError(
                f"a {b.type} block can only be in an assistant message (messages[{i}].content[{j}])",
                param=f"messages[{i}].content[{j}].type",
            )
    if pending or not out:
        out.append({"role": "user", "content": _parts(pending)})
    return out


def _assistant(i: int, m: Message) -> dict[str, Any]:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thinking.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        else:
            raise APIError(f"a {b.type} block can only be in a user message (messages[{i}].content[{j}])",
                           param=f"messages[{i}].content[{j}].type")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = req.system_text()
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if m.role == "user":
            out += _user(i, m)
        else:
            out.append(_assistant(i, m))
    return out


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls in the chat request's terms."""
    if not req.tools:
        return {}
    out: dict[str, Any] = {"tools": [
        {"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                          **({"description": t.description} if t.description else {})}}
        for t in req.tools]}
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceNone):
        out["tool_choice"] = "none"
        return out
    if isinstance(choice, ToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else "auto"
    if choice is not None and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    """`thinking` -> the chat template's `enable_thinking` (Qwen3 and others read it); without
    `thinking` the model's own default holds."""
    if req.thinking is None:
        return None
    return {"enable_thinking": not isinstance(req.thinking, ThinkingDisabled)}


def thinking_budget(req: CreateMessage) -> int | None:
    """The worker's `thinking_budget_tokens` (llama.cpp's): `thinking.budget_tokens`, or the
    share of max_tokens that `output_config.effort` allows, the smaller if both; None: no cap."""
    if isinstance(req.thinking, ThinkingDisabled):
        return None
    caps = []
    if isinstance(req.thinking, ThinkingEnabled):
        caps.append(req.thinking.budget_tokens)
    effort = req.output_config.effort if req.output_config is not None else None
    share = EFFORT_SHARE[effort] if effort is not None else None
    if share is not None:
        caps.append(int(req.max_tokens * share))
    return min(caps) if caps else None


def chat_body(req: CreateMessage, model: str) -> dict[str, Any]:
    """The upstream's chat-completions request (always streamed, usage included)."""
    body: dict[str, Any] = {"model": model, "messages": chat_messages(req), "stream": True,
                            "stream_options": {"include_usage": True}, "max_tokens": req.max_tokens,
                            **_tools(req)}
    kwargs = template_kwargs(req)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}
    budget = thinking_budget(req)
    if budget is not None:
        body["thinking_budget_tokens"] = budget
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    user = req.metadata.user_id if req.metadata is not None else None  # OpenAI's end-user id
    plain = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "user": user}
    body.update({k: v for k, v in plain.items() if v is not None})
    return body


def count_body(req: CountTokensRequest, model: str) -> dict[str, Any]:
    """The worker's `/v1/chat/completions/input_tokens` body for what `chat_body` would render:
    tools are rendered unless tool_choice is none (as the worker's chat path does)."""
    body: dict[str, Any] = {"model": model, "messages": chat_messages(req)}
    tools = _tools(req)
    if tools and tools.get("tool_choice") != "none":
        body["tools"] = tools["tools"]
    kwargs = template_kwargs(req)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body
