"""Structured output and forced tool calls on the real model: grammars over its 49k-token
vocabulary (llguidance builds the token masks from the GGUF's vocabulary on llama.cpp and from
the twin's tokenizer.json on torch)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.realmodel.conftest import BACKENDS, LLAMA, REPORT, RealRouter

pytestmark = pytest.mark.slow

# {"country", "capital"} makes this model write "JAPAN" for both (llama-server's grammar too):
# the 4-bit 135M model, not the grammar. {"answer"} it fills with "Tokyo".
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("model", BACKENDS)
def test_a_json_schema_answer_is_valid_and_on_topic(real_router: RealRouter, model: str) -> None:
    out = real_router.chat(model, "What is the capital of Japan?", max_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER}})
    choice = out["choices"][0]
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, ANSWER)
    assert choice["finish_reason"] == "stop"
    assert "tokyo" in answer["answer"].lower(), answer


def test_a_forced_get_weather_call_is_valid(real_router: RealRouter) -> None:
    # One call: with parallel calls allowed this model, after a valid first call, opens a second
    # one and runs into max_tokens.
    out = real_router.chat(LLAMA, "What's the weather in Paris?", max_tokens=40, tools=[WEATHER_TOOL],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           parallel_tool_calls=False)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    REPORT.append(f"forced get_weather for 'What's the weather in Paris?' on {LLAMA}: arguments {args} "
                  f"(city is Paris: {args['city'].strip().lower() == 'paris'})")
