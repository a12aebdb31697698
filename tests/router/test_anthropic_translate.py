"""The Messages API's pure parts: request -> chat body (router/anthropic/translate.py) and chat
chunks -> message and events (router/anthropic/builder.py). Table tests, no I/O."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.anthropic import routes
from router.anthropic.builder import MessageBuilder
from router.anthropic.translate import chat_body, count_body
from router.anthropic.wire import CountTokensRequest, CreateMessage, parse_request
from worker.protocol.errors import APIError

TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def create(**fields: Any) -> CreateMessage:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(CreateMessage, json.dumps(body).encode())


# --------------------------------------------------------------------------- request -> chat


def test_conversation_with_tools_thinking_and_results() -> None:
    req = create(
        system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "oops", "is_error": True},
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    )
    assert chat_body(req, "m")["messages"] == [
        {"role": "system", "content": "S1\nS2"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Error: oops"},
        {"role": "user", "content": "go on"},
    ]


def test_image_blocks_become_image_url_parts() -> None:
    req = create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}])
    assert chat_body(req, "m")["messages"][0]["content"] == [
        {"type": "text", "text": "what?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, {"tool_choice": "auto"}),
        ({"type": "auto"}, {"tool_choice": "auto"}),
        (
            {"type": "any", "disable_parallel_tool_use": True},
            {"tool_choice": "required", "parallel_tool_calls": False},
        ),
        ({"type": "tool", "name": "f"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ({"type": "none"}, {"tool_choice": "none"}),
    ],
)
def test_tool_choice(choice: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    body = chat_body(create(tools=[TOOL], **({"tool_choice": choice} if choice else {})), "m")
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": TOOL["input_schema"]}}
    ]
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == expected


@pytest.mark.parametrize(
    ("fields", "budget", "kwargs"),
    [
        ({}, None, None),
        ({"thinking": {"type": "disabled"}}, None, {"enable_thinking": False}),
        ({"thinking": {"type": "adaptive"}}, None, {"enable_thinking": True}),
        ({"thinking": {"type": "enabled", "budget_tokens": 30}}, 30, {"enable_thinking": True}),
        ({"output_config": {"effort": "low"}}, 25, None),
        (
            {"output_config": {"effort": "medium"}, "thinking": {"type": "enabled", "budget_tokens": 30}},
            30,
            {"enable_thinking": True},
        ),
        ({"output_config": {"effort": "high"}}, None, None),
        (
            {"output_config": {"effort": "high"}, "thinking": {"type": "disabled"}},
            None,
            {"enable_thinking": False},
        ),
    ],
)
def test_thinking_and_effort(
    fields: dict[str, Any], budget: int | None, kwargs: dict[str, Any] | None
) -> None:
    body = chat_body(create(**fields), "m")
    assert body.get("thinking_budget_tokens") == budget and body.get("chat_template_kwargs") == kwargs


def test_sampling_stop_format_and_user() -> None:
    schema = {"type": "object"}
    body = chat_body(create(stop_sequences=["END"], temperature=0.2, top_k=5, metadata={"user_id": "u"},
                            output_config={"format": {"type": "json_schema", "schema": schema}}), "m")
    assert (
        body["stop"] == ["END"] and body["temperature"] == 0.2 and body["top_k"] == 5 and body["user"] == "u"
    )
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}
    assert (
        body["stream"] is True
        and body["stream_options"] == {"include_usage": True}
        and body["max_tokens"] == 100
    )


def test_count_body_renders_what_the_chat_request_renders() -> None:
    raw = {"model": "m", "system": "S", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    body = count_body(parse_request(CountTokensRequest, json.dumps(raw).encode()), "m")
    assert body["messages"][0] == {"role": "system", "content": "S"} and len(body["tools"]) == 1
    none = count_body(
        parse_request(CountTokensRequest, json.dumps({**raw, "tool_choice": {"type": "none"}}).encode()), "m"
    )
    assert "tools" not in none  # tool_choice none: the worker does not render them


@pytest.mark.parametrize(("messages", "needle"), [
    ([{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}], "assistant message"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}], "user message"),
])
def test_blocks_in_the_wrong_turn_are_400s(messages: list[Any], needle: str) -> None:
    with pytest.raises(APIError, match=needle):
        chat_body(create(messages=messages), "m")


# --------------------------------------------------------------------------- chat chunks -> message


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"choices": [choice], **extra} if delta is not None or finish else {"choices": [], **extra}


def fold(
    chunks: list[dict[str, Any]], stop: tuple[str, ...] = ()
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    b = MessageBuilder("m", stop)
    events = b.start()
    for c in chunks:
        events += b.feed(c)
    events += b.finish()
    return b.snapshot(), events


def test_blocks_in_order_with_paired_start_and_stop() -> None:
    msg, events = fold(
        [
            chunk({"role": "assistant", "content": None}),
            chunk({"reasoning_content": "th"}),
            chunk({"reasoning_content": "ink"}),
            chunk({"content": "hi"}),
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        }
                    ]
                }
            ),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
            chunk(finish="tool_calls"),
            chunk(
                usage={
                    "prompt_tokens": 10,
                    "completion_tokens": 7,
                    "prompt_tokens_details": {"cached_tokens": 4},
                }
            ),
        ]
    )
    assert msg["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                              {"type": "text", "text": "hi"},
                              {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]
    assert msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
    assert msg["usage"] == {"input_tokens": 6, "output_tokens": 7, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4}
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [("message_start", None),
                     ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
                     ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
                     ("content_block_stop", 2), ("message_delta", None), ("message_stop", None)]
    assert [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            and e["delta"]["type"] == "input_json_delta"] == ['{"a": ', "1}"]
    assert events[8]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert events[-2]["usage"] == msg["usage"]


@pytest.mark.parametrize(("finish", "stop_word", "stop", "reason", "sequence"), [
    ("stop", None, ("X",), "end_turn", None),
    ("stop", "X", ("X",), "stop_sequence", "X"),
    ("stop", "Y", ("X",), "end_turn", None),  # not one of ours (cannot happen with our workers)
    ("length", None, (), "max_tokens", None),
    ("tool_calls", None, (), "tool_use", None),
])
def test_stop_reasons(finish: str, stop_word: str | None, stop: tuple[str, ...], reason: str,
                      sequence: str | None) -> None:
    c = chunk({"content": "a"})
    c["choices"][0].update(finish_reason=finish, stop_reason=stop_word)
    msg, _ = fold([c], stop)
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, sequence)


# --------------------------------------------------------------------------- the SSE stream


class _Upstream:
    """Chat chunks handed out one per `release()`: the upstream is silent in between."""

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.chunks = chunks
        self.gate = asyncio.Semaphore(0)

    def release(self) -> None:
        self.gate.release()

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        for c in self.chunks:
            await self.gate.acquire()
            yield c


def _event_type(frame: bytes) -> str:
    return frame.decode().split("\n", 1)[0].removeprefix("event: ")


async def _drive(chunks: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stream `chunks`, releasing the next one only after the stream has sent a ping while waiting."""
    monkeypatch.setattr(routes, "PING_INTERVAL_S", 0.001)
    upstream = _Upstream(chunks)
    closed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def stack_ctx() -> AsyncIterator[None]:
        yield
        closed.set()

    stack = contextlib.AsyncExitStack()
    await stack.enter_async_context(stack_ctx())
    r = routes.MessagesRoutes(None, None, None)  # type: ignore[arg-type]  # _stream needs none of them
    events = []
    async for frame in r._stream(MessageBuilder("m"), stack, upstream.__aiter__()):
        events.append(_event_type(frame))
        if events[-1] == "ping":  # (the first comes right after message_start)
            upstream.release()
    assert closed.is_set()  # the upstream stream was closed
    return events


def test_silence_gets_pings_and_the_stream_ends_normally(monkeypatch: pytest.MonkeyPatch) -> None:
    events = asyncio.run(
        _drive([chunk({"content": "a"}), chunk({"content": "b"}), chunk(finish="stop")], monkeypatch)
    )
    assert events[:2] == ["message_start", "ping"] and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_delta") == 2 and events.count("ping") >= 3


def test_an_upstream_dying_mid_stream_ends_with_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    events = asyncio.run(_drive([chunk({"content": "a"}), {"error": {"message": "cut"}}], monkeypatch))
    assert events[-1] == "error" and "message_stop" not in events
