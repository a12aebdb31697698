"""Structured outputs, tool calls and reasoning through the HTTP API and the openai SDK.

The tiny models have random weights: whatever they would say, a grammar forces valid output, so
every assertion here is about the constraint and the parsing, never about the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.worker.conftest import Worker, worker_args, worker_process
from worker.testing.tiny_models import ModelPaths
from worker.text.tool_calls import ToolFormat, parse_tool_calls

MSG = [{"role": "user", "content": "Give me the data."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


def chat(worker: Worker, **body: Any) -> dict[str, Any]:
    r = worker.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 200, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def stream_chat(url: str, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The chunks' deltas of choice 0, and the usage chunk."""
    deltas: list[dict[str, Any]] = []
    usage = None
    payload = {
        "messages": MSG,
        "max_tokens": 200,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj["choices"]:
                deltas.append({**c["delta"], "finish_reason": c.get("finish_reason")})
    return deltas, usage


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Stream deltas -> (content, reasoning, calls, finish_reason), as an SDK client folds them."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in tc:
                assert not call["id"], "a call's id comes once, in its first delta"
                call["id"] = tc["id"]
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments") or ""
        finish = d["finish_reason"] or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# --------------------------------------------------------------------------- response_format


@pytest.mark.parametrize("form", ["openai", "llama-server"])
def test_json_schema_output_validates_for_many_seeds(worker: Worker, form: str) -> None:
    field: dict[str, Any] = (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            }
        }
        if form == "openai"
        else {"json_schema": PERSON}
    )
    for seed in range(20 if form == "openai" else 5):
        body = chat(worker, temperature=1.0, seed=seed, max_tokens=300, **field)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", (seed, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_is_an_object(worker: Worker) -> None:
    for seed in range(3):
        body = chat(
            worker, temperature=1.0, seed=seed, max_tokens=300, response_format={"type": "json_object"}
        )
        content = body["choices"][0]["message"]["content"]
        if body["choices"][0]["finish_reason"] == "stop":  # an object's strings may run past max_tokens
            assert isinstance(json.loads(content), dict)
        assert content.startswith("{")


def test_completions_take_json_schema_and_grammar(worker: Worker) -> None:
    r = worker.post(
        "/v1/completions", {"prompt": "Answer:", "max_tokens": 20, "json_schema": {"enum": ["yes", "no"]}}
    )
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["text"]) in ("yes", "no")
    r = worker.post(
        "/v1/completions", {"prompt": "Answer:", "max_tokens": 20, "grammar": 'root ::= "a"{5,5}'}
    )
    assert r.json()["choices"][0]["text"] == "aaaaa"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    metrics = {line.split()[0]: float(line.split()[1]) for line in worker.get("/metrics").text.splitlines()
               if line.startswith("omni:grammar")}
    assert metrics["omni:grammar_masks_total"] >= 5 and metrics["omni:grammar_mask_seconds_total"] > 0


def test_grammar_completes_before_max_tokens_with_ignore_eos(worker: Worker) -> None:
    # The grammar is done after 3 characters: the task stops there, ignore_eos or not.
    r = worker.post(
        "/v1/completions", {"prompt": "x", "max_tokens": 30, "ignore_eos": True, "grammar": 'root ::= "abc"'}
    )
    assert r.json()["choices"][0]["text"] == "abc"


def test_streamed_constrained_output_equals_non_streamed(worker: Worker) -> None:
    body = {"temperature": 0.0, "json_schema": PERSON, "max_tokens": 300}
    whole = chat(worker, **body)["choices"][0]["message"]["content"]
    deltas, _ = stream_chat(worker.url, **body)
    assert assemble(deltas)["content"] == whole


def test_constrained_and_free_requests_together(worker: Worker) -> None:
    # A constrained request beside unconstrained ones: masks go to the right slots only.
    import concurrent.futures

    def free(seed: int) -> str:
        r = worker.post(
            "/v1/completions", {"prompt": "Hello", "max_tokens": 16, "seed": seed, "temperature": 0}
        )
        return str(r.json()["choices"][0]["text"])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        free_before = free(1)
        futures = [pool.submit(free, 1), pool.submit(free, 1)]
        constrained = pool.submit(chat, worker, temperature=1.0, seed=3, max_tokens=300, json_schema=PERSON)
        jsonschema.validate(json.loads(constrained.result()["choices"][0]["message"]["content"]), PERSON)
        assert [f.result() for f in futures] == [free_before, free_before]


# --------------------------------------------------------------------------- tools


def eos_bias(worker: Worker) -> dict[str, Any]:
    """End-of-generation wherever the grammar allows it. Random weights all but never choose it
    over the tokens that start another parallel call (real models do), so without this a
    parallel-call grammar runs on to max_tokens."""
    eos = worker.get("/props").json()["eos_token"]
    (token,) = worker.post("/tokenize", {"content": eos, "parse_special": True}).json()["tokens"]
    return {"logit_bias": {str(token): 100.0}}


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call_is_schema_valid(worker: Worker, choice: Any, parallel: bool) -> None:
    for seed in range(5):
        body = chat(worker, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=seed,
                    parallel_tool_calls=parallel, **eos_bias(worker))
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = c["message"]["tool_calls"]
        assert calls and all(tc["id"].startswith("call_") and tc["type"] == "function" for tc in calls)
        for tc in calls:
            check_call(tc["function"]["name"], tc["function"]["arguments"])
        if isinstance(choice, dict):
            assert {tc["function"]["name"] for tc in calls} == {"get_time"}


def test_parallel_tool_calls_allow_several_calls_or_one(worker: Worker) -> None:
    for seed in range(3):
        body = chat(worker, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                    temperature=1.0, seed=seed)
        assert len(body["choices"][0]["message"]["tool_calls"]) == 1
    # Barred from ending (the bias against end-of-generation), random weights chain calls until
    # max_tokens cuts one (the output is then content: a cut call is not a call); every complete
    # one before it is valid.
    never_end = {"logit_bias": {t: -100.0 for t in eos_bias(worker)["logit_bias"]}}
    body = chat(worker, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=0,
                max_tokens=120, **never_end)
    c = body["choices"][0]
    assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")
    text = c["message"]["content"]
    end = text.rindex("</tool_call>") + len("</tool_call>")
    _, calls = parse_tool_calls(ToolFormat.HERMES, text[:end])
    assert len(calls) >= 2
    for call in calls:
        check_call(call.name, call.arguments)


def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(worker: Worker) -> None:
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0.0, **eos_bias(worker)}
    whole = chat(worker, **body)["choices"][0]
    deltas, _ = stream_chat(worker.url, **body)
    got = assemble(deltas)
    assert got["finish"] == "tool_calls"
    want = [(tc["function"]["name"], tc["function"]["arguments"]) for tc in whole["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == want
    assert all(c["id"].startswith("call_") for c in got["calls"])
    # index, id and name come first, then argument fragments
    first = next(d for d in deltas if d.get("tool_calls"))
    assert (
        first["tool_calls"][0]["function"]["name"] and first["tool_calls"][0]["function"]["arguments"] == ""
    )


def test_tool_choice_none_and_auto_answer_text(worker: Worker) -> None:
    for choice in ("none", "auto"):
        c = chat(worker, tools=[WEATHER], tool_choice=choice, temperature=0.0, max_tokens=8)["choices"][0]
        assert c["finish_reason"] in ("stop", "length")
        assert "tool_calls" not in c["message"] or not c["message"]["tool_calls"]


def test_tool_result_messages_render(worker: Worker) -> None:
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
    ]
    r = worker.post("/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_openai_sdk_tool_call_and_json_schema(worker: Worker) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", timeout=120)
    resp = client.chat.completions.create(
        model="m",
        messages=MSG,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        temperature=1.0,
        seed=7,  # type: ignore[arg-type,list-item]
        parallel_tool_calls=False,
    )
    call = resp.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert resp.choices[0].finish_reason == "tool_calls"
    check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    resp = client.chat.completions.create(
        model="m", messages=MSG, max_tokens=300, temperature=1.0, seed=1,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), PERSON)
    # streamed, folded by the SDK's own helper
    with client.chat.completions.stream(
        model="m", messages=MSG, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0.0,  # type: ignore[arg-type,list-item]
        parallel_tool_calls=False,
    ) as stream:
        final = stream.get_final_completion()
    fn = final.choices[0].message.tool_calls[0].function  # type: ignore[index,union-attr]
    check_call(fn.name, fn.arguments)


# --------------------------------------------------------------------------- reasoning

THINKING = 'root ::= "<think>" [a-z ]{3,12} "</think>" [a-z]{1,8}'


def test_reasoning_is_split_from_content(worker: Worker) -> None:
    body = chat(worker, grammar=THINKING, temperature=1.0, seed=2, max_tokens=60)
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] and "<think>" not in msg["content"]
    assert msg["content"].isalpha()
    assert (
        0
        < body["usage"]["completion_tokens_details"]["reasoning_tokens"]
        <= body["usage"]["completion_tokens"]
    )
    deltas, usage = stream_chat(worker.url, grammar=THINKING, temperature=1.0, seed=2, max_tokens=60)
    got = assemble(deltas)
    assert (got["reasoning"], got["content"]) == (msg["reasoning_content"], msg["content"])
    assert (
        usage is not None and usage["completion_tokens_details"] == body["usage"]["completion_tokens_details"]
    )


def test_reasoning_format_none_keeps_think_in_content(worker: Worker) -> None:
    msg = chat(worker, grammar=THINKING, temperature=1.0, seed=2, max_tokens=60, reasoning_format="none")[
        "choices"
    ][0]["message"]
    assert msg["content"].startswith("<think>") and not msg.get("reasoning_content")


# --------------------------------------------------------------------------- bad input

BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "hiccup"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
    ({"response_format": {"type": "sound"}}, "response_format.type"),
    ({"json_schema": {"type": 123}}, "json_schema"),
    ({"grammar": "root ::= this is (not valid GBNF"}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "json_schema": {"type": "string"}}, "json_schema"),
    ({"reasoning_format": "loud"}, "reasoning_format"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_constraints_are_400_naming_the_field(worker: Worker, extra: dict[str, Any], param: str) -> None:
    r = worker.post("/v1/chat/completions", {"messages": MSG, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_completions_bad_grammar_is_400(worker: Worker) -> None:
    r = worker.post("/v1/completions", {"prompt": "x", "max_tokens": 4, "json_schema": {"type": "hiccup"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema"


# --------------------------------------------------------------------------- template families


@pytest.fixture(scope="module", params=["chatml", "llama3", "mistral-v7"])
def family_worker(request: pytest.FixtureRequest, tiny_models: ModelPaths) -> Iterator[Worker]:
    model, extra = worker_args("llama_cpp", tiny_models)
    with worker_process(
        model, "--parallel", "2", "--ctx-size", "2048", "--chat-template", request.param, *extra
    ) as (_, url):
        yield Worker(url, "llama_cpp")


def test_forced_calls_parse_in_every_template_family(family_worker: Worker) -> None:
    for seed in range(3):
        body = chat(family_worker, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed,
                    **eos_bias(family_worker))
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        for tc in c["message"]["tool_calls"]:
            check_call(tc["function"]["name"], tc["function"]["arguments"])
        deltas, _ = stream_chat(
            family_worker.url,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            **eos_bias(family_worker),
        )
        got = assemble(deltas)
        assert [(x["name"], x["arguments"]) for x in got["calls"]] == [
            (tc["function"]["name"], tc["function"]["arguments"]) for tc in c["message"]["tool_calls"]]
