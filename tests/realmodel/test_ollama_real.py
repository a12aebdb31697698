"""Ollama's API on the real demo model (SmolLM2-135M-Instruct, llama.cpp), through the official
`ollama` client: greedy output equals the OpenAI route's, and tools on a model whose chat
template cannot render them (SmolLM2's) go through the generic tool prompt
(worker/text/generic_tools.py), whose calls parse back.

What the 135M model does with the tool prompt, measured here: it reads the tools (the prompt
grows by their schemas) but answers in prose rather than calling one, greedy, for the questions
tried; the grammar-forced call (`tool_choice: required`, on the OpenAI route: Ollama's API has no
tool choice) shows the call format the prompt teaches parses back into a call.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama

from tests.realmodel.conftest import LLAMA, REPORT, RealRouter

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_greedy_api_chat_equals_chat_completions(real_router: RealRouter) -> None:
    client = ollama.Client(host=real_router.base, timeout=300)
    messages = [{"role": "user", "content": "Name three fruits."}]
    ours = client.chat(model=LLAMA, messages=messages, options={"temperature": 0, "num_predict": 24})
    theirs = real_router.chat(LLAMA, "Name three fruits.", max_tokens=24)
    assert ours.message.content == theirs["choices"][0]["message"]["content"] and ours.message.content
    assert ours.eval_count == theirs["usage"]["completion_tokens"]
    streamed = client.chat(model=f"{LLAMA}:latest", messages=messages, stream=True,
                           options={"temperature": 0, "num_predict": 24})
    assert "".join(p.message.content or "" for p in streamed) == ours.message.content


def test_tools_on_smollm2_go_through_the_generic_tool_prompt(real_router: RealRouter) -> None:
    client = ollama.Client(host=real_router.base, timeout=300)
    assert "tools" not in (client.show(LLAMA).capabilities or [])  # its template cannot render them
    logs = httpx.get(f"{real_router.base}/logs", params={"model": LLAMA}, timeout=10).text
    assert "cannot render tools" in logs  # said at load

    plain = client.chat(model=LLAMA, messages=QUESTION, options={"temperature": 0, "num_predict": 48})
    with_tools = client.chat(model=LLAMA, messages=QUESTION, tools=[WEATHER],
                             options={"temperature": 0, "num_predict": 48})
    # the tools reach the model: the prompt carries their schema (dropped, it stayed the same)
    assert (with_tools.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) + 40
    REPORT.append(f"smollm2 + generic tool prompt (greedy, {QUESTION[0]['content']!r}): "
                  f"tool_calls={[c.function.name for c in with_tools.message.tool_calls or []]}, "
                  f"content={(with_tools.message.content or '')[:80]!r}")

    # the call format the prompt teaches parses back (the grammar forces one call here)
    with real_router.client() as c:
        forced = c.post("/v1/chat/completions", json={
            "model": LLAMA, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 96}).json()
    calls = forced["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)

    # and a call the model made, with its result, goes back in the history as text it can read
    history = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"}]
    answer = client.chat(model=LLAMA, messages=history, tools=[WEATHER],
                         options={"temperature": 0, "num_predict": 32})
    assert answer.done and (answer.prompt_eval_count or 0) > (with_tools.prompt_eval_count or 0)
