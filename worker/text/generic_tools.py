"""Tools for a model whose chat template cannot render them (SmolLM2's, many small models').

Such a template drops `tools` without a word: the model never learns they exist, and a client
that sends tools with every chat (Open WebUI sends 12) silently gets none called. A refusal
would break those clients on every such model, so the worker renders them itself, the way
llama.cpp's generic tool format does: the tools go in a system message as JSON with one
instruction, and the model answers with the Hermes shape

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which worker/text/tool_calls.py parses back (a template that names no format is HERMES) and the
tool grammar constrains. Earlier turns are written the same way: an assistant's calls as those
blocks in its text, a tool's result as a user message `<tool_response>...</tool_response>` when
the template cannot render them either. The worker logs at load that its template cannot render
tools; GET /v1/models and Ollama's /api/show leave `tools` out of its capabilities.
"""

from __future__ import annotations

import json
from typing import Any

INSTRUCTION = (
    "Functions you may call (JSON schemas):\n<tools>\n{tools}\n</tools>\n"
    "To call one, reply with one block per call and nothing else:\n"
    "<tool_call>\n{{\"name\": <name>, \"arguments\": <JSON object>}}\n</tool_call>"
)


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that shows `tools` (OpenAI's tool objects) to the model."""
    compact = (",", ":")  # a small model's context is small: no spaces in the schemas
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False, separators=compact) for t in tools)
    return INSTRUCTION.format(tools=lines)


def with_generic_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], renders_calls: bool
) -> list[dict[str, Any]]:
    """`messages` (chat dicts) with the tool prompt in the first system message (one is added
    when there is none); when the template cannot render calls (`renders_calls` false), earlier
    calls and results are written as text."""
    out = [dict(m) for m in messages]
    prompt = tool_prompt(tools)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    if renders_calls:
        return out
    for m in out:
        calls = m.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            blocks = [_block(c) for c in calls]
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            m["content"] = "\n".join([*([text] if text else []), *blocks])
        elif m.get("role") == "tool":
            m.pop("tool_call_id", None)
            m["role"] = "user"
            m["content"] = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
    return out


def _block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            pass
    return (
        "<tool_call>\n"
        + json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
