"""Anthropic's Messages API end to end: the official `anthropic` SDK against a real router with
a real tiny-model worker (llama_cpp).

One router serves the module: `tiny` and `thinker` (the same model with a chat template that
opens a `<think>` block, so all it says is reasoning until the end marker) are pinned and
`--models-max 2`, so a request for the fake model `other` is the router's 503 at once (an
`overloaded_error` 529 here); `--api-key` checks
that the SDK's `x-api-key` header is the router's key. The tiny model has random weights, so
tests assert on structure and on what constraints guarantee, never on free text.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import PY, fake_cmd
from tests.util import HTTP, ROOT, free_port, preset_defaults, stop_process, wait_healthy, wait_until

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
KEY = "sk-test"
WEATHER: Any = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
THINK_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
IMAGE: Any = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("anthropic")
    preset = tmp / "preset.toml"
    (tmp / "think.jinja").write_text(THINK_TEMPLATE)
    preset.write_text(f"""
{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"
pin = true
load-on-startup = true

[models.thinker]
model = "{GGUF}"
backend = "llama_cpp"
chat-template = "{tmp / "think.jinja"}"
pin = true
load-on-startup = true

[models.other]
backend = "cmd"
cmd = "{fake_cmd("--model", "other")}"
""")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp / "router.log").open("wb") as log:
        proc = subprocess.Popen([PY, "-m", "router.cli", "--preset", str(preset), "--port", str(port),
                                 "--models-max", "2", "--api-key", KEY, "--data-dir", str(tmp),
                                 "--max-body-size", "100000"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_healthy(proc, url, 30)

        def both_loaded() -> bool:
            data = HTTP.get(f"{url}/v1/models", headers={"x-api-key": KEY}, timeout=10).json()["data"]
            return [m["status"]["value"] for m in data].count("loaded") == 2

        wait_until(both_loaded, 60, what="tiny and thinker to load")  # then `other` finds every slot pinned
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def _raw(base: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        base + path,
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **headers},
        timeout=60,
    )


# --------------------------------------------------------------------------- create and stream


def test_create_has_anthropic_shape(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="tiny", max_tokens=5, system="be brief", metadata={"user_id": "u1"},
                                 messages=[{"role": "user", "content": "hello"}],
                                 extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert (
        msg.type == "message"
        and msg.role == "assistant"
        and msg.id.startswith("msg_")
        and msg.model == "tiny"
    )
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert all(b.type == "text" for b in msg.content)
    assert 0 < msg.usage.output_tokens <= 5 and msg.usage.input_tokens > 0
    assert msg.usage.cache_read_input_tokens is not None and msg.usage.cache_read_input_tokens >= 0


def test_stream_final_message_equals_the_created_one(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "extra_body": {"temperature": 0.0},
                          "messages": [{"role": "user", "content": "tell me a story"}]}
    created = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in created.content]
    assert final.stop_reason == created.stop_reason
    assert final.usage.output_tokens == created.usage.output_tokens
    total = created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == total
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds


def test_stream_on_the_wire_has_ping_and_no_done(base: str) -> None:
    body = {"model": "tiny", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", base + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"] and events[-1] == "message_stop"


def test_count_tokens_is_exact_with_system_and_tools(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "tiny", "system": [{"type": "text", "text": "You are terse."}],
                          "messages": [{"role": "user", "content": "count me"}], "tools": [WEATHER]}
    counted = client.messages.count_tokens(**kw).input_tokens
    msg = client.messages.create(max_tokens=1, **kw)
    assert counted == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    bare = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "count me"}])
    assert bare.input_tokens < counted  # the system prompt is counted


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    """A stop sequence the grammar makes certain: JSON output always has `{"` first."""
    schema: Any = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    msg = client.messages.create(model="tiny", max_tokens=40, stop_sequences=['"answer"'],
                                 messages=[{"role": "user", "content": "json"}],
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == '"answer"'
    assert "".join(b.text for b in msg.content if b.type == "text") == "{"


# --------------------------------------------------------------------------- tools and structured output


def test_forced_tool_call_input_validates(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model="tiny",
        max_tokens=120,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "weather in Paris?"}],
    )
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1, msg.content
    assert calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])


def test_streamed_tool_input_is_partial_json(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model="tiny", max_tokens=120, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(parts) > 1
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads("".join(parts)) == call.input
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_two_turn_tool_loop(client: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "weather in Rome?"}]
    first = client.messages.create(
        model="tiny",
        max_tokens=120,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=messages,
    )
    (call,) = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 20 C"},
                     {"type": "text", "text": "summarize"}]}]
    second = client.messages.create(model="tiny", max_tokens=4, tools=[WEATHER], messages=messages)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    n_prompt = second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert n_prompt > first.usage.input_tokens
    assert (
        client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=messages).input_tokens
        == n_prompt
    )


def test_output_config_json_schema(client: anthropic.Anthropic) -> None:
    schema: Any = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    msg = client.messages.create(model="tiny", max_tokens=120, messages=[{"role": "user", "content": "json"}],
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads("".join(b.text for b in msg.content if b.type == "text")), schema)


# --------------------------------------------------------------------------- thinking


def _thinking(msg: Any) -> str:
    return "".join(b.thinking for b in msg.content if b.type == "thinking")


def test_reasoning_becomes_a_thinking_block_and_the_budget_caps_it(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "thinker", "max_tokens": 40, "extra_body": {"temperature": 0.0},
                          "messages": [{"role": "user", "content": "think"}]}
    free = client.messages.create(**kw)  # never closes its block: all thinking, cut by max_tokens
    assert [b.type for b in free.content] == ["thinking"] and free.stop_reason == "max_tokens"
    capped = client.messages.create(thinking={"type": "enabled", "budget_tokens": 5}, **kw)
    assert capped.content[0].type == "thinking" and capped.content[0].signature == ""
    assert 0 < len(_thinking(capped)) < len(_thinking(free))
    assert _thinking(free).startswith(_thinking(capped))  # what was thought before the cap is kept
    assert [b.type for b in capped.content[1:]] == ["text"]  # then the model answers
    low = client.messages.create(output_config={"effort": "low"}, **kw)  # a quarter of max_tokens
    assert _thinking(free).startswith(_thinking(low)) and len(_thinking(capped)) < len(_thinking(low))
    assert [b.type for b in low.content] == ["thinking", "text"]


def test_chat_thinking_budget_tokens_caps_the_reasoning(base: str) -> None:
    """The worker's own field, which the Messages API's budget becomes (llama.cpp's name)."""
    body = {"model": "thinker", "max_tokens": 40, "temperature": 0.0,
            "messages": [{"role": "user", "content": "think"}]}
    free = _raw(base, "/v1/chat/completions", body).json()["choices"][0]["message"]
    capped = _raw(base, "/v1/chat/completions", {**body, "thinking_budget_tokens": 5})
    capped = capped.json()["choices"][0]["message"]
    assert 0 < len(capped["reasoning_content"]) < len(free["reasoning_content"])
    assert free["reasoning_content"].startswith(capped["reasoning_content"]) and capped["content"]


def test_streamed_thinking_deltas(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "thinker", "max_tokens": 30, "extra_body": {"temperature": 0.0},
                          "thinking": {"type": "enabled", "budget_tokens": 5},
                          "messages": [{"role": "user", "content": "think"}]}
    created = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in created.content]


def test_thinking_blocks_in_history_are_accepted_and_counted(client: anthropic.Anthropic) -> None:
    turn: Any = [{"role": "user", "content": "a"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                   {"type": "text", "text": "b"}]},
                 {"role": "user", "content": "c"}]
    counted = client.messages.count_tokens(model="tiny", messages=turn, thinking={"type": "disabled"})
    msg = client.messages.create(model="tiny", max_tokens=1, messages=turn, thinking={"type": "disabled"})
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


# --------------------------------------------------------------------------- errors


def test_image_on_a_text_only_model_is_a_clear_400(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image") as e:
        content: Any = [IMAGE, {"type": "text", "text": "what is it?"}]
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": content}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_errors_parse_as_sdk_exceptions(base: str, client: anthropic.Anthropic) -> None:
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=2, messages=hi)  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=hi)  # type: ignore[arg-type]
    with pytest.raises(anthropic.OverloadedError) as e:  # every slot is held by the pinned model
        client.messages.create(model="other", max_tokens=2, messages=hi)  # type: ignore[arg-type]
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[])


def test_errors_from_outside_the_routes_are_in_anthropic_envelope(
    base: str, client: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.APIStatusError) as e:  # the body-size limit (--max-body-size 100000)
        client.messages.create(
            model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x" * 200_000}]
        )
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    r = httpx.get(base + "/v1/messages", headers={"x-api-key": KEY}, timeout=10)  # Starlette's 405
    assert (
        r.status_code == 405
        and r.json()["type"] == "error"
        and r.json()["error"]["type"] == "invalid_request_error"
    )


def test_bearer_auth_and_anthropic_version_are_accepted(base: str) -> None:
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(base + "/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}",
                                                              "anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(base + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 401
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API Key"},
    }


BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document'"),
    (
        {"messages": [{"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
        "'redacted_thinking'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]},
        "citations",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}
            ]
        },
        "assistant message",
    ),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'web_search_20250305'"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "input_schema"),
    ({"tool_choice": {"type": "tool", "name": "missing"}, "tools": [WEATHER]}, "missing"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2}}, "budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"output_config": {"effort": "extreme"}}, "effort"),
    ({"thinking": {"type": "adaptive"}, "tool_choice": {"type": "any"}, "tools": [WEATHER]}, "thinking"),
    (
        {
            "thinking": {"type": "enabled", "budget_tokens": 1},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        },
        "output_config.format",
    ),
    ({"thinking": {"type": "disabled"}, "output_config": {"effort": "low"}}, "effort"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config"),
    ({"temperature": 1.5}, "temperature"),
    ({"mcp_servers": []}, "mcp_servers"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD)
def test_unsupported_fields_are_400_naming_them(base: str, extra: dict[str, Any], needle: str) -> None:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = _raw(base, "/v1/messages", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"], err


# --------------------------------------------------------------------------- fuzz


LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3000)
    | st.floats(-2, 2, allow_nan=False)
    | st.text(max_size=6)
)
ANY_JSON = st.recursive(
    LEAF,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6,
)
TEXT = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)})
BLOCK = st.one_of(
    TEXT,
    TEXT,
    st.just(IMAGE),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.text(min_size=1, max_size=4),
            "name": st.sampled_from(["get_weather", "x"]),
            "input": st.dictionaries(st.text(max_size=4), LEAF, max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.text(max_size=4),
            "content": st.text(max_size=8) | st.lists(TEXT, max_size=2),
        },
        optional={"is_error": st.booleans()},
    ),
    st.fixed_dictionaries(
        {"type": st.just("thinking"), "thinking": st.text(max_size=8), "signature": st.just("")}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["document", "server_tool_use", "search_result"])}),
)
ROLE = st.sampled_from(["user", "assistant"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": st.text(max_size=12) | st.lists(BLOCK, max_size=3)})
# Mostly well-formed conversations (a user turn first), so most requests reach the worker.
MESSAGES = st.tuples(st.text(min_size=1, max_size=12), st.lists(MESSAGE, max_size=2)).map(
    lambda t: [{"role": "user", "content": t[0]}, *t[1]])
SCHEMA = st.fixed_dictionaries({"type": st.just("object")}, optional={
    "properties": st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from(
        [{"type": "integer"}, {"type": "string"}, {"enum": [1, 2]}, {"type": "boolean"}]), max_size=2),
    "required": st.just(["a"])}) | ANY_JSON
TOOL_CHOICE = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any"])}, optional={"disable_parallel_tool_use": st.booleans()}
    ),
    st.just({"type": "none"}),
    st.fixed_dictionaries({"type": st.just("tool"), "name": st.sampled_from(["get_weather", "x"])}),
)
REQUEST = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tiny", "thinker", "tiny", "nope"]),
        "max_tokens": st.integers(1, 6),
        "messages": MESSAGES | st.lists(MESSAGE, max_size=2),
    },
    optional={
        "system": st.text(max_size=8) | st.lists(TEXT, max_size=2),
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
        "stream": st.booleans(),
        "tools": st.lists(
            st.just(WEATHER)
            | st.fixed_dictionaries(
                {"name": st.sampled_from(["x", "y", "x", "a b"]), "input_schema": SCHEMA}
            ),
            max_size=2,
        ),
        "tool_choice": TOOL_CHOICE,
        "thinking": st.sampled_from(
            [
                {"type": "adaptive"},
                {"type": "disabled"},
                {"type": "enabled", "budget_tokens": 1},
                {"type": "enabled"},
            ]
        ),
        "output_config": st.fixed_dictionaries(
            {},
            optional={
                "format": st.fixed_dictionaries({"type": st.just("json_schema"), "schema": SCHEMA}),
                "effort": st.sampled_from(["low", "medium", "high", "max", "none"]),
            },
        ),
        "metadata": st.fixed_dictionaries({}, optional={"user_id": st.text(max_size=5)}),
        "temperature": st.floats(-0.5, 1.5, allow_nan=False),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(-1, 50),
        "unknown": ANY_JSON,
    },
)


@st.composite
def _mutated(draw: st.DrawFn) -> dict[str, Any]:
    """A request from the schema, sometimes with one field replaced by any JSON value."""
    body: dict[str, Any] = draw(REQUEST)
    if draw(st.integers(0, 5)) == 5:  # (hypothesis favours 0: the plain request is the common case)
        body[draw(st.sampled_from(sorted(body)))] = draw(ANY_JSON)
    return body


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_mutated(), path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_fuzzed_requests_never_get_a_5xx(base: str, body: dict[str, Any], path: str) -> None:
    if path.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "tool_choice",
                                                       "thinking", "output_config", "unknown")}
    r = _raw(base, path, body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    elif body.get("stream") is True and path == "/v1/messages":
        assert "event: error" not in r.text and r.text.rstrip().endswith('"type": "message_stop"}'), (
            body,
            r.text,
        )
