"""The pure parts of Ollama's API (router/ollama/) and the generic tool prompt
(worker/text/generic_tools.py): table tests, no I/O."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from router.ollama.catalog import NEVER, iso, parameter_size
from router.ollama.translate import Answer, chat_body, chat_messages, generate_body, sampling
from router.ollama.wire import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    keep_alive_seconds,
)
from worker.protocol.errors import APIError, parse_model
from worker.text.generic_tools import tool_prompt, with_generic_tools
from worker.text.tool_calls import ToolFormat, parse_tool_calls

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\0" * 16).decode()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (0, 0.0),
        (-1, -1.0),
        (1.5, 1.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300s", 300.0),
        ("300ms", 0.3),
        ("-1s", -1.0),
        ("-1m", -1.0),
        ("0", 0.0),
        ("120", 120.0),
        ("2h", 7200.0),
        (1e300, -1.0),  # a century or more is forever
        (float("inf"), -1.0),
        ("9999999999h", -1.0),
    ],
)
def test_keep_alive_is_seconds(value: float | str, seconds: float) -> None:
    assert keep_alive_seconds(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5 m", "m5", "", "5x", float("nan")])
def test_keep_alive_that_is_not_a_duration_is_refused(value: str | float) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds(value)


def test_messages_images_tool_calls_and_results() -> None:
    msgs = [
        OllamaMessage.model_validate(m)
        for m in [
            {"role": "user", "content": "look", "images": [PNG, JPEG]},
            {
                "role": "assistant",
                "content": "",
                "thinking": "hmm",
                "tool_calls": [
                    {"function": {"name": "a", "arguments": {"x": 1}}},
                    {"function": {"name": "b", "arguments": {}}, "id": "call_given"},
                ],
            },
            {"role": "tool", "content": "from b", "tool_name": "b"},
            {"role": "tool", "content": "from a"},
            {"role": "tool", "content": "again", "tool_call_id": "call_given"},
        ]
    ]
    out = chat_messages(msgs)
    parts = out[0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[1]["image_url"]["url"].startswith("data:image/jpeg;base64,") and parts[2]["text"] == "look"
    calls = out[1]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_0", "call_given"] and out[1]["reasoning_content"] == "hmm"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}  # an object becomes OpenAI's JSON string
    assert out[2]["tool_call_id"] == "call_given"  # matched by tool_name
    assert out[3]["tool_call_id"] == "call_0"  # the oldest unanswered call
    assert out[4]["tool_call_id"] == "call_given"  # as the client kept it


def test_options_become_sampling_fields_and_others_are_refused() -> None:
    o = OllamaOptions(
        num_predict=5,
        temperature=0.2,
        top_k=3,
        top_p=0.5,
        min_p=0.1,
        seed=1,
        stop=["x"],
        repeat_penalty=1.1,
        repeat_last_n=8,
        presence_penalty=0.1,
        frequency_penalty=0.2,
    )
    assert sampling(o) == {
        "max_tokens": 5,
        "temperature": 0.2,
        "top_k": 3,
        "top_p": 0.5,
        "min_p": 0.1,
        "seed": 1,
        "stop": ["x"],
        "repeat_penalty": 1.1,
        "repeat_last_n": 8,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
    }
    assert "max_tokens" not in sampling(OllamaOptions(num_predict=-1))  # no limit: the context's
    assert OllamaOptions.model_validate({"stop": "END"}).stop == ["END"]
    for option in ("num_gpu", "num_thread", "use_mmap", "mirostat_eta", "penalize_newline"):
        with pytest.raises(APIError, match=option):
            parse_model(OllamaChatRequest, {"model": "m", "options": {option: 1}})
    with pytest.raises(APIError, match="typical_p"):  # only its off value is taken
        parse_model(OllamaChatRequest, {"model": "m", "options": {"typical_p": 0.5}})
    assert parse_model(OllamaChatRequest, {"model": "m", "options": {"typical_p": 1, "mirostat": 0}}).options


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("json", {"type": "json_object"}),
        (
            {"type": "object"},
            {
                "type": "json_schema",
                "json_schema": {"name": "format", "schema": {"type": "object"}, "strict": True},
            },
        ),
    ],
)
def test_format_is_response_format(fmt: Any, expected: dict[str, Any]) -> None:
    body = chat_body(OllamaChatRequest(model="m", messages=[], format=fmt, think=False), "m")
    assert body["response_format"] == expected and body["reasoning_effort"] == "none"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_open_webuis_root_num_predict_and_system_on_chat() -> None:
    req = parse_model(
        OllamaChatRequest,
        {"model": "m", "num_predict": 7, "system": "S", "messages": [{"role": "user", "content": "u"}]},
    )
    body = chat_body(req, "m")
    assert body["max_tokens"] == 7 and body["messages"][0] == {"role": "system", "content": "S"}
    req = parse_model(OllamaChatRequest, {"model": "m", "num_predict": 7, "options": {"num_predict": 3}})
    assert chat_body(req, "m")["max_tokens"] == 3  # the option wins


def test_generate_goes_to_chat_completions_or_infill() -> None:
    path, body = generate_body(OllamaGenerateRequest(model="m", prompt="p", system="s", think=True), "m")
    assert path == "/v1/chat/completions" and body["reasoning_effort"] == "medium"
    assert body["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    path, body = generate_body(OllamaGenerateRequest(model="m", prompt="p", raw=True), "m")
    assert path == "/v1/completions" and body["prompt"] == "p"
    path, body = generate_body(
        OllamaGenerateRequest(model="m", prompt="a", suffix="b", options=OllamaOptions(num_predict=3)), "m"
    )
    assert (
        path == "/infill"
        and body["input_prefix"] == "a"
        and body["input_suffix"] == "b"
        and body["n_predict"] == 3
    )
    with pytest.raises(APIError, match="raw"):
        generate_body(OllamaGenerateRequest(model="m", prompt="p", raw=True, system="s"), "m")


def test_answer_folds_chunks_with_tool_calls_into_ollamas_objects() -> None:
    a = Answer("m:latest", is_chat=True, started=0.0, admitted=0.0)
    out = a.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]})
    assert out[0]["message"] == {"role": "assistant", "content": "Hi"} and out[0]["done"] is False
    a.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "call_x", "function": {"name": "get", "arguments": '{"ci'}}
                        ]
                    },
                }
            ]
        }
    )
    out = a.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]},
                    "finish_reason": "tool_calls",
                }
            ],
            "timings": {"prompt_ms": 2.0, "predicted_ms": 3.0},
        }
    )
    assert out[0]["message"]["tool_calls"] == [
        {"id": "call_x", "function": {"index": 0, "name": "get", "arguments": {"city": 1}}}
    ]
    a.feed({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})
    done = a.final(whole=True)
    assert done["done"] is True and done["done_reason"] == "stop" and done["message"]["content"] == "Hi"
    assert (done["prompt_eval_count"], done["eval_count"]) == (7, 4)
    assert (done["prompt_eval_duration"], done["eval_duration"]) == (2_000_000, 3_000_000)


def test_answer_reads_llama_servers_native_chunks() -> None:
    a = Answer("m", is_chat=False, started=0.0)
    assert a.feed({"content": "x = 1", "stop": False})[0]["response"] == "x = 1"
    a.feed(
        {
            "content": "",
            "stop": True,
            "stop_type": "limit",
            "tokens_evaluated": 9,
            "tokens_predicted": 3,
            "timings": {"prompt_ms": 1.0, "predicted_ms": 1.0},
        }
    )
    done = a.final()
    assert done["done_reason"] == "length" and done["eval_count"] == 3 and done["prompt_eval_count"] == 9


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_generic_tool_prompt_shows_the_tools_and_writes_history_as_text() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    out = with_generic_tools(msgs, [WEATHER], renders_calls=False)
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name":"get_weather"' in out[0]["content"]
    assert (
        out[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert msgs[2]["tool_calls"]  # the caller's messages are left as they were
    # the calls it teaches parse back with the Hermes parser (a template that names no format)
    _, calls = parse_tool_calls(ToolFormat.HERMES, out[2]["content"])
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    added = with_generic_tools([{"role": "user", "content": "x"}], [WEATHER], renders_calls=True)
    assert added[0] == {"role": "system", "content": tool_prompt([WEATHER])}


@pytest.mark.parametrize(("ts", "text"), [(0.0, "1970-01-01T00:00:00Z"), (None, NEVER), (1e300, NEVER)])
def test_expires_at_never_overflows(ts: float | None, text: str) -> None:
    assert iso(ts) == text  # a keep_alive of 1e300 s is forever, not a 500 from /api/ps


@pytest.mark.parametrize(
    ("n", "label", "text"),
    [(134_515_008, "", "134.52M"), (7_615_616_512, "", "7.62B"), (None, "135M", "135M"), (0, "", "")],
)
def test_parameter_size_as_ollama_writes_it(n: int | None, label: str, text: str) -> None:
    assert parameter_size(n, label) == text


def test_answer_carries_logprobs_per_chunk_and_whole() -> None:
    a = Answer("m", is_chat=True, started=0.0)
    lp = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
            }
        ]
    }
    out = a.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": lp}]})
    expected = [{"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}]
    assert out[0]["logprobs"] == expected and a.final(whole=True)["logprobs"] == expected
    body = chat_body(OllamaChatRequest(model="m", logprobs=True, top_logprobs=3), "m")
    assert body["logprobs"] is True and body["top_logprobs"] == 3
