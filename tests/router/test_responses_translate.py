"""The Responses API's pure parts (request -> chat body, chat chunks -> events, paging) as
tables, and the SQLite store on a temp file."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from router.responses.builder import ResponseBuilder
from router.responses.store import ANYONE, ChainBroken, Owner, Store, page
from router.responses.translate import chat_body, chat_messages, drop_oldest
from router.responses.wire import CreateResponse, parse_items
from worker.protocol.errors import APIError


def _messages(items: list[dict[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    return chat_messages(instructions, parse_items(items, "input"))


CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

MESSAGES: list[tuple[str, list[dict[str, Any]], str | None, list[dict[str, Any]]]] = [
    ("a plain user turn", [{"role": "user", "content": "hi"}], None, [{"role": "user", "content": "hi"}]),
    (
        "instructions are a system message",
        [{"role": "user", "content": "hi"}],
        "SYS",
        [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}],
    ),
    (
        "developer is system, text parts join",
        [
            {
                "role": "developer",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            }
        ],
        None,
        [{"role": "system", "content": "ab"}],
    ),
    (
        "an image part becomes image_url",
        [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "u"}],
            }
        ],
        None,
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": "u", "detail": "auto"}},
                ],
            }
        ],
    ),
    (
        "an image by file id, with its detail",
        [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1", "detail": "low"}]}],
        None,
        [{"role": "user",
          "content": [{"type": "image_url", "image_url": {"url": "file_1", "detail": "low"}}]}],
    ),
    (
        "a refusal is the assistant's text",
        [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}],
        None,
        [{"role": "assistant", "content": "no"}],
    ),
    (
        "a call joins the assistant turn before it",
        [
            {"role": "assistant", "content": "ok"},
            CALL,
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        None,
        [
            {"role": "assistant", "content": "ok", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
    ),
    (
        "a call alone is an assistant turn",
        [{"role": "user", "content": "q"}, CALL],
        None,
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}],
    ),
    (
        "reasoning goes to the next assistant turn",
        [
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
        ],
        None,
        [{"role": "assistant", "content": "A", "reasoning_content": "hmm"}],
    ),
]


@pytest.mark.parametrize(("why", "items", "instructions", "expected"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_chat_messages(why: str, items: list[dict[str, Any]], instructions: str | None,
                       expected: list[dict[str, Any]]) -> None:
    assert _messages(items, instructions) == expected


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
BODIES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"max_output_tokens": 5, "temperature": 0.1, "top_k": 3, "seed": 1},
     {"max_tokens": 5, "temperature": 0.1, "top_k": 3, "seed": 1}),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False},
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False}),
    ({"tools": [TOOL], "max_tool_calls": 1}, {"tool_choice": "auto", "parallel_tool_calls": False}),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                  "strict": True}}}),
    ({"reasoning": {"effort": "none"}}, {"chat_template_kwargs": {"enable_thinking": False}}),
    ({"reasoning": {"effort": "high"}, "chat_template_kwargs": {"x": 1}},
     {"chat_template_kwargs": {"x": 1, "enable_thinking": True}}),
    ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),
    ({"logprobs": True}, {"logprobs": True}),
    ({"include": ["message.output_text.logprobs"]}, {"logprobs": True}),
    ({"top_p": 0.5, "stop": ["x"], "repetition_penalty": 1.2, "ignore_eos": True, "frequency_penalty": 0.5,
      "presence_penalty": -0.5},
     {"top_p": 0.5, "stop": ["x"], "repetition_penalty": 1.2, "ignore_eos": True, "frequency_penalty": 0.5,
      "presence_penalty": -0.5}),
    ({"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_object"}}),
    ({"n": 3}, {"n": 3}),  # one upstream request for the n samples: they share the prompt's prefill
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "d"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     {"tools": [{"type": "function", "function": {"name": "f", "description": "d"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}),
]


@pytest.mark.parametrize(("fields", "expected"), BODIES)
def test_chat_body(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    body = chat_body(
        CreateResponse.model_validate({"model": "m", **fields}), "m", [{"role": "user", "content": "x"}]
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert {k: body[k] for k in expected} == expected


def test_tool_types_other_than_function_are_rejected_by_name() -> None:
    with pytest.raises(APIError) as e:
        CreateResponse.model_validate({"tools": [TOOL, {"type": "file_search"}]}).function_tools()
    assert e.value.param == "tools[1].type" and "file_search" in e.value.message


def _msgs(*roles: str) -> list[dict[str, Any]]:
    return [{"role": r, "content": str(i)} for i, r in enumerate(roles)]


@pytest.mark.parametrize(("messages", "fraction", "expected"), [
    (_msgs("system", "user", "assistant", "user"), 0.1, ["0", "2", "3"]),
    (_msgs("user", "assistant", "user", "assistant", "user"), 0.5, ["2", "3", "4"]),
    (_msgs("user", "assistant", "tool", "user"), 0.5, ["3"]),  # no tool result without its call
    (_msgs("system", "user"), 0.9, None),  # nothing left to drop
])
def test_drop_oldest(messages: list[dict[str, Any]], fraction: float, expected: list[str] | None) -> None:
    out = drop_oldest(messages, fraction)
    assert (None if out is None else [m["content"] for m in out]) == expected


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"choices": choices, **extra}


def test_builder_events_pair_up_in_order() -> None:
    b = ResponseBuilder("resp_1", {"model": "m"}, status="in_progress")
    events = b.start()
    for c in [
        _chunk({"reasoning_content": "th"}),
        _chunk({"reasoning_content": "ink"}),
        _chunk({"content": "Hi"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "[]"}}]}),
        _chunk({}, "tool_calls"),
        _chunk(
            None,
            usage={
                "prompt_tokens": 3,
                "completion_tokens": 4,
                "total_tokens": 7,
                "completion_tokens_details": {"reasoning_tokens": 2},
            },
        ),
    ]:
        events += b.feed(c)
    events += b.finish()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    snap = events[-1]["response"]
    assert snap["status"] == "completed" and snap["output_text"] == "Hi"
    assert [o["type"] for o in snap["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert snap["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert [(o["call_id"], o["name"], o["arguments"]) for o in snap["output"][2:]] == [("call_a", "f", "{}"),
                                                                                      ("call_b", "g", "[]")]
    assert snap["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 7,
    }


@pytest.mark.parametrize(("finish", "status", "reason"), [("stop", "completed", None),
                                                         ("length", "incomplete", "max_output_tokens")])
def test_builder_final_status(finish: str, status: str, reason: str | None) -> None:
    b = ResponseBuilder("resp_1", {})
    b.start()
    b.feed(_chunk({"content": "x"}, finish))
    last = b.finish()[-1]
    assert last["type"] == f"response.{status}" and last["response"]["status"] == status
    assert last["response"]["incomplete_details"] == (reason and {"reason": reason})
    assert last["response"]["output"][0]["status"] == status


def _of(index: int, delta: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}]}


def test_builder_puts_interleaved_choices_in_choice_order() -> None:
    """n = 3: the upstream interleaves its choices; the output holds them one after the other,
    sample 0's events at once and each later sample's when the ones before it are done. The
    per-sample state starts afresh: sample 1's text after its call is held (and dropped when
    it is cut), sample 2's text is not."""
    b = ResponseBuilder("resp_1", {}, num_choices=3)
    b.start()
    call = {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": "{"}}
    fed = [b.feed(c) for c in [
        _of(1, {"tool_calls": [call]}), _of(2, {"content": "C"}), _of(0, {"content": "A"}),
        _of(1, {"content": "<tool"}, "length"), _of(2, {}, "stop"), _of(0, {"content": "a"}),
        _of(0, {}, "stop"),
    ]]
    assert [len(f) for f in fed[:2]] == [0, 0]  # later samples wait
    assert [e["type"] for e in fed[2]] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.delta"]
    events = [e for f in fed for e in f] + b.finish()
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == [0, 1, 2]
    assert all(events.index(a) > events.index(d) for a, d in zip(added[1:], done, strict=False))
    snap = events[-1]["response"]
    assert [(o["type"], o["status"]) for o in snap["output"]] == [
        ("message", "completed"), ("function_call", "incomplete"), ("message", "completed")]
    assert snap["output_text"] == "AaC" and snap["status"] == "incomplete"
    assert snap["output"][1]["arguments"] == "{"


ITEMS = [{"id": f"i{n}"} for n in range(5)]


@pytest.mark.parametrize(("limit", "order", "after", "ids", "has_more"), [
    (2, "asc", None, ["i0", "i1"], True),
    (2, "desc", None, ["i4", "i3"], True),
    (10, "asc", "i2", ["i3", "i4"], False),
    (2, "desc", "i1", ["i0"], False),
    (2, "asc", "gone", [], False),
])
def test_page(limit: int, order: str, after: str | None, ids: list[str], has_more: bool) -> None:
    p = page(ITEMS, limit=limit, order=order, after=after)
    assert [d["id"] for d in p["data"]] == ids and p["has_more"] is has_more
    assert p["first_id"] == (ids[0] if ids else None) and p["last_id"] == (ids[-1] if ids else None)


def _response(
    rid: str, prev: str | None = None, status: str = "completed", age_s: float = 0
) -> dict[str, Any]:
    return {"id": rid, "created_at": int(time.time() - age_s), "status": status, "previous_response_id": prev,
            "output": [{"id": f"out-{rid}"}]}


def test_store_chain_bounds_and_restart(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite3", max_entries=3, ttl_s=100)
    try:
        store.open()
        store.put_response(_response("a"), [{"id": "in-a"}], ANYONE)
        store.put_response(_response("b", "a"), [{"id": "in-b"}], ANYONE)
        assert [i["id"] for i in store.chain("b", ANYONE)] == ["in-a", "out-a", "in-b", "out-b"]
        store.put_response(_response("old", age_s=200), [], ANYONE)  # past the TTL: pruned at once
        assert store.get_response("old", ANYONE) is None
        for rid in ("c", "d"):
            store.put_response(_response(rid), [], ANYONE)
        # 3 kept, oldest gone
        assert store.get_response("a", ANYONE) is None and store.get_response("d", ANYONE) is not None
        with pytest.raises(ChainBroken):
            store.chain("b", ANYONE)
        store.put_response(_response("bg", status="in_progress"), [], ANYONE)
    finally:
        store.close()
    again = Store(tmp_path / "s.sqlite3", max_entries=3, ttl_s=100)
    try:
        assert again.open() == 1
        found = again.get_response("bg", ANYONE)
        assert found is not None and found[0]["status"] == "failed"
    finally:
        again.close()


# the store's schema before owners, as an older router wrote it
OLD_SCHEMA = """
CREATE TABLE responses (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    previous_response_id TEXT, body TEXT NOT NULL, input TEXT NOT NULL);
CREATE INDEX responses_created ON responses (created_at);
CREATE TABLE conversations (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, metadata TEXT NOT NULL);
CREATE INDEX conversations_created ON conversations (created_at);
CREATE TABLE conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id TEXT NOT NULL, item_id TEXT NOT NULL,
    item TEXT NOT NULL);
CREATE INDEX conversation_items_conv ON conversation_items (conversation_id, seq);
"""
OLD_RESP, OLD_CONV = "resp_fromanolderrouter", "conv_fromanolderrouter"


def write_old_store(path: Path) -> None:
    """A store file as a router from before owners left it: one response, one conversation."""
    now = int(time.time())
    body = {"id": OLD_RESP, "object": "response", "created_at": now, "status": "completed", "n": 1,
            "model": "tiny", "output": [], "previous_response_id": None}
    item = {"id": "msg_old", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x"}]}
    path.parent.mkdir(parents=True)
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
               (OLD_RESP, now, "completed", None, json.dumps(body), json.dumps([item])))
    db.execute("INSERT INTO conversations VALUES (?, ?, ?)", (OLD_CONV, now, "{}"))
    db.execute("INSERT INTO conversation_items (conversation_id, item_id, item) VALUES (?, ?, ?)",
               (OLD_CONV, "msg_old", json.dumps(item)))
    db.commit()
    db.close()


ANN, BOB, OPS = Owner("ann", sees_all=False), Owner("bob", sees_all=False), Owner("ops", sees_all=True)


def test_store_rows_belong_to_their_owner_and_rows_from_before_owners_to_admins(tmp_path: Path) -> None:
    """Each row is its creator's; another user's calls find nothing, admins (and ANYONE, a router
    without keys) find all; a file from before the `owner` column opens, its rows owned by nobody."""
    path = tmp_path / "data" / "responses.sqlite3"
    write_old_store(path)
    store = Store(path, max_entries=10, ttl_s=100)
    try:
        store.open()
        store.put_response(_response("a"), [{"id": "in-a"}], ANN)
        store.put_response(_response("b", "a"), [{"id": "in-b"}], ANN)
        store.put_conversation("c", int(time.time()), {"k": "v"}, ANN)
        everything = {"a", "b", "c", OLD_RESP, OLD_CONV}
        for who, expected in ((ANN, {"a", "b", "c"}), (BOB, set()), (OPS, everything), (ANYONE, everything)):
            seen = {rid for rid in ("a", "b", OLD_RESP) if store.get_response(rid, who) is not None}
            seen |= {cid for cid in ("c", OLD_CONV) if store.get_conversation(cid, who) is not None}
            assert seen == expected, who
        with pytest.raises(ChainBroken):
            store.chain("b", BOB)
        assert len(store.chain("b", OPS)) == 4
        assert not store.delete_response("a", BOB) and not store.delete_conversation("c", BOB)
        assert not store.set_metadata("c", {"k": "bob"}, BOB)
        assert store.set_metadata("c", {"k": "ops"}, OPS)
        conv = store.get_conversation("c", ANN)  # an admin's edit leaves it ann's
        assert conv is not None and conv["metadata"] == {"k": "ops"}
        assert store.delete_response("a", ANN) and store.delete_conversation(OLD_CONV, OPS)
    finally:
        store.close()
    again = Store(path, max_entries=10, ttl_s=100)  # the column is there now: opens as it is
    try:
        again.open()
        assert again.get_response(OLD_RESP, BOB) is None and again.get_response(OLD_RESP, OPS) is not None
        assert again.get_response("b", ANN) is not None
    finally:
        again.close()


@pytest.mark.parametrize("reasoning", [{"summary": "auto"}, {"summary": "detailed"},
                                       {"generate_summary": "auto"}])
def test_a_requested_summary_gets_reasoning_summary_events(reasoning: dict[str, Any]) -> None:
    """OVMS clients listen for `response.reasoning_summary_*`: with `reasoning.summary` asked
    for, the reasoning text also goes out as the item's summary (we do not summarize)."""
    req = CreateResponse.model_validate({"model": "m", "input": "x", "reasoning": reasoning})
    assert req.reasoning is not None and req.reasoning.wants_summary
    b = ResponseBuilder("resp_1", {"model": "m"}, status="in_progress", wants_summary=True)
    events = b.start() + b.feed(_chunk({"reasoning_content": "th"}))
    events += b.feed(_chunk({"reasoning_content": "ink"}))
    events += b.feed(_chunk({"content": "A"}, "stop")) + b.finish()
    kinds = [e["type"] for e in events]
    assert kinds[2:11] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_summary_part.added",
        "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
    ]
    assert kinds[11:14] == ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                            "response.output_item.done"]
    item = events[-1]["response"]["output"][0]
    assert item["summary"] == [{"type": "summary_text", "text": "think"}]
    assert item["content"] == [{"type": "reasoning_text", "text": "think"}]
    plain = ResponseBuilder("resp_2", {"model": "m"}, status="in_progress")
    plain_events = plain.start() + plain.feed(_chunk({"reasoning_content": "t"})) + plain.finish()
    plain_kinds = [e["type"] for e in plain_events]
    assert not any("summary" in k for k in plain_kinds)
