"""A Responses request -> the upstream's chat-completions body (pure; table-tested).

`chat_messages()` turns history and input items into chat messages, `chat_body()` the rest of
the request into chat fields, `echo()` the request fields a response object repeats, and
`drop_oldest()` is `truncation: auto`'s step.
"""

from __future__ import annotations

from typing import Any

from router.responses.wire import (
    CreateResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    Item,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
)

# --------------------------------------------------------------------------- request -> chat

Content = InputText | OutputText | InputImage | Refusal


def _part_text(p: Content) -> str | None:
    if isinstance(p, InputText | OutputText):
        return p.text
    if isinstance(p, Refusal):
        return p.refusal
    return None


def _text_of(content: str | list[Content]) -> str | None:
    """The content as one string when it is text only (templates like strings best)."""
    if isinstance(content, str):
        return content
    texts = [_part_text(p) for p in content]
    return None if any(t is None for t in texts) else "".join(t or "" for t in texts)


def _chat_content(content: str | list[Content]) -> str | list[dict[str, Any]]:
    text = _text_of(content)
    if text is not None or isinstance(content, str):
        return text or ""
    parts: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, InputImage):  # passed on: a text-only upstream answers its own 400
            parts.append(
                {
                    "type": "image_url",
                    "image_url": {"url": p.image_url or p.file_id or "", "detail": p.detail},
                }
            )
        else:
            parts.append({"type": "text", "text": _part_text(p) or ""})
    return parts


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """History and input items -> chat messages. Calls join the assistant turn before them;
    a reasoning item goes to the next assistant turn's `reasoning_content`."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = "".join(p.text for p in (item.content or item.summary))
        elif isinstance(item, MessageItem):
            msg: dict[str, Any] = {"role": "system" if item.role == "developer" else item.role,
                                   "content": _chat_content(item.content)}
            if item.role == "assistant" and reasoning:
                msg["reasoning_content"] = reasoning
                reasoning = None
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                    reasoning = None
                out.append(msg)
        elif isinstance(item, FunctionCallOutputItem):
            content = item.output if isinstance(item.output, str) else (_text_of(item.output) or "")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    return out


def reasoning_kwargs(req: CreateResponse) -> dict[str, Any] | None:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = req.reasoning.effort not in ("none", "minimal")
    return kwargs or None


def is_whole(req: CreateResponse) -> bool:
    """A beam search with n > 1 that the client does not stream: the worker answers it in one
    body (it streams a beam search with n = 1 only, as OVMS), and the bridge replays that body
    as chunks (router/responses/bridge.py)."""
    is_beam = bool(req.use_beam_search) or (req.best_of or 1) > 1
    return is_beam and req.n > 1 and not req.stream


def chat_body(req: CreateResponse, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The upstream's chat-completions request (streamed with usage, unless `is_whole`)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    if is_whole(req):
        body = {"model": model, "messages": messages, "stream": False}
    tools = req.function_tools()
    if tools and req.max_tool_calls != 0:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in tools]
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}}
                               if isinstance(choice, dict) else choice)
        body["parallel_tool_calls"] = req.parallel_tool_calls and req.max_tool_calls != 1
    fmt = req.text.format
    if fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.top_logprobs or req.logprobs or "message.output_text.logprobs" in (req.include or []):
        body["logprobs"] = True
    if req.top_logprobs:
        body["top_logprobs"] = req.top_logprobs
    kwargs = reasoning_kwargs(req)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    plain = {
        "n": req.n if req.n > 1 else None,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop,
        "seed": req.seed,
        "top_k": req.top_k,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "best_of": req.best_of,
        "use_beam_search": req.use_beam_search,
        "length_penalty": req.length_penalty,
    }
    body.update({k: v for k, v in plain.items() if v is not None})
    return body


def drop_oldest(messages: list[dict[str, Any]], fraction: float) -> list[dict[str, Any]] | None:
    """`truncation: auto`: drop about `fraction` of the non-system messages, oldest first (at
    least one; never the last), and any tool results left without their call. None: nothing left to drop."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(head):]
    if len(rest) <= 1:
        return None
    n = min(len(rest) - 1, max(1, round(len(rest) * fraction)))
    rest = rest[n:]
    while len(rest) > 1 and rest[0]["role"] == "tool":
        rest = rest[1:]
    return head + rest


# --------------------------------------------------------------------------- request echo


def is_call_forced(req: CreateResponse) -> bool:
    """The upstream's grammar makes the output a call: any text in it is call markup."""
    return bool(req.tools) and req.max_tool_calls != 0 and (
        req.tool_choice == "required" or isinstance(req.tool_choice, dict))


def echo(req: CreateResponse, model: str) -> dict[str, Any]:
    """The request fields a response object repeats."""
    fmt = req.text.format.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {
        "model": model,
        "instructions": req.instructions,
        "tools": req.tools,
        "tool_choice": req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tool_calls": req.max_tool_calls,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "n": req.n,
        "text": {"format": fmt},
        "reasoning": {"effort": req.reasoning.effort,
                      "summary": req.reasoning.summary or req.reasoning.generate_summary}
        if req.reasoning
        else {"effort": None, "summary": None},
        "metadata": req.metadata or {},
        "store": req.store,
        "background": req.background,
        "previous_response_id": req.previous_response_id,
        "conversation": {"id": req.conversation_id} if req.conversation_id else None,
        "truncation": req.truncation,
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "service_tier": req.service_tier or "auto",
    }
