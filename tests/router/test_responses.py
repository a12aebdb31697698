"""The Responses API end to end: the official `openai` SDK against a real router with a real
tiny-model worker (llama_cpp) and a fake `cmd` upstream that only speaks chat completions.

One router serves the whole module (a restart test at the end restarts it on the same data
dir); the tiny model has random weights, so tests assert on structure, never on text.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.router.conftest import PY, fake_cmd
from tests.util import ROOT, free_port, preset_defaults, stop_process, wait_healthy, wait_until

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def preset(event_log: Path) -> str:
    slow = fake_cmd(
        "--model", "slow", "--tokens", "400", "--token-delay", "0.02", "--event-log", str(event_log)
    )
    crash = fake_cmd("--model", "crash", "--tokens", "50", "--crash-after", "3")
    return f"""
{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"

[models.slow]
backend = "cmd"
cmd = "{slow}"

[models.crash]
backend = "cmd"
cmd = "{crash}"
"""


class Router:
    """A router subprocess that can be restarted on the same port and data dir."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.tmp = tmp
        self.args = args
        self.port = free_port()
        self.event_log = tmp / "events.log"
        self.preset = tmp / "preset.toml"
        self.preset.write_text(preset(self.event_log))
        self.data_dir = tmp / "data"
        self.num_starts = 0
        self.proc = self._start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"router{self.num_starts}.log").open("wb")
        self.num_starts += 1
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [
                PY,
                "-m",
                "router.cli",
                "--preset",
                str(self.preset),
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                *self.args,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        wait_healthy(proc, self.base, 30)
        return proc

    def restart(self) -> None:
        stop_process(self.proc)
        self.proc = self._start()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = Router(tmp_path_factory.mktemp("responses"))
    yield r
    stop_process(r.proc)


@pytest.fixture(scope="module")
def client(router: Router) -> openai.OpenAI:
    return router.client()


def _raw(router: Router, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, router.base + path, timeout=60, **kw)


# --------------------------------------------------------------------------- create


def test_text_response_has_openai_shape(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model="tiny",
        input="hello",
        instructions="be brief",
        max_output_tokens=4,
        metadata={"k": "v"},
        service_tier="default",
        temperature=0.5,
        top_logprobs=2,
        extra_body={"repetition_penalty": 1.1, "top_k": 5},
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete") and resp.completed_at is not None
    assert resp.model == "tiny" and resp.metadata == {"k": "v"} and resp.instructions == "be brief"
    assert resp.service_tier == "default" and resp.temperature == 0.5 and resp.store is True
    (msg,) = [o for o in resp.output if o.type == "message"]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    assert resp.output_text == msg.content[0].text
    logprobs = msg.content[0].logprobs or []  # type: ignore[union-attr]
    # (a first token that ends mid-character comes before the message opens: its logprob is not kept)
    assert 0 < len(logprobs) <= resp.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)  # type: ignore[union-attr]
    assert resp.usage is not None and resp.usage.output_tokens <= 4
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens >= 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_gives_incomplete(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model="tiny", input="hello", max_output_tokens=3, extra_body={"ignore_eos": True}
    )
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 3


def test_stream_events_in_order_with_sequence_numbers(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="hello", max_output_tokens=5,
                                 extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]  # get_final_response() wants response.completed
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas and final.status == "incomplete"


def test_stream_ends_with_done_on_the_wire(router: Router) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", router.base + "/v1/responses", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[-1] == "data: [DONE]"


def test_function_call_round_trip_with_a_forced_tool(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="weather in Paris?", tools=[TOOL],  # type: ignore[list-item]
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    parallel_tool_calls=False, max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and "city" in json.loads(call.arguments)
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=[TOOL],  # type: ignore[list-item]
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temp": 20}'}], max_output_tokens=4)
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")


def test_streamed_function_call_arguments(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="weather?", tools=[TOOL], tool_choice="required",  # type: ignore[list-item]
                                 parallel_tool_calls=False, max_output_tokens=60) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas and "city" in json.loads(deltas)


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    resp = client.responses.create(model="tiny", input="json please", max_output_tokens=60,
                                   text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                                    "strict": True}})
    assert resp.status == "completed" and resp.text is not None and resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_previous_response_id_replays_input_and_output(client: openai.OpenAI, router: Router) -> None:
    first = client.responses.create(model="tiny", input="one", instructions="SYS", max_output_tokens=3)
    second = client.responses.create(
        model="tiny", input="two", previous_response_id=first.id, max_output_tokens=3
    )
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "two"  # type: ignore[union-attr]


def test_conversation_chains_items(client: openai.OpenAI) -> None:
    conv = client.conversations.create(metadata={"topic": "t"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "t"}
    a = client.responses.create(model="tiny", input="one", conversation=conv.id, max_output_tokens=3)
    b = client.responses.create(model="tiny", input="two", conversation={"id": conv.id}, max_output_tokens=3)
    assert a.conversation is not None and a.conversation.id == conv.id
    assert b.usage is not None and a.usage is not None and b.usage.input_tokens > a.usage.input_tokens
    items = client.conversations.items.list(conv.id, order="asc")
    roles = [getattr(i, "role", None) for i in items.data]
    assert roles == ["user", "assistant", "user", "assistant"]
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "x"}]
    )
    assert len(added.data) == 1
    page = client.conversations.items.list(conv.id, limit=2)
    assert len(page.data) == 2 and page.has_more and page.data[0].id == added.data[0].id
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_retrieve_delete_and_store_false(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text and got.status == resp.status
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_background_poll_and_cancel_closes_the_upstream_stream(client: openai.OpenAI, router: Router) -> None:
    done = client.responses.create(model="tiny", input="hi", max_output_tokens=2, background=True)
    assert done.status == "queued" and done.background is True
    final = wait_until(
        lambda: (r := client.responses.retrieve(done.id)).status not in ("queued", "in_progress") and r,
        30,
        what="background response to finish",
    )
    assert final.status in ("completed", "incomplete") and final.output

    slow = client.responses.create(model="slow", input="hi", background=True)
    wait_until(
        lambda: client.responses.retrieve(slow.id).output_text, 30, what="output from the slow upstream"
    )
    with client.responses.retrieve(slow.id, stream=True, starting_after=2) as stream:  # resume, then cancel
        it = iter(stream)
        assert [next(it).sequence_number for _ in range(3)] == [3, 4, 5]
        cancelled = client.responses.cancel(slow.id)
        rest = list(it)  # the stream ends
    assert cancelled.status == "cancelled" and all(e.type == "response.output_text.delta" for e in rest)
    assert client.responses.retrieve(slow.id).status == "cancelled"
    wait_until(lambda: router.event_log.exists() and "cancelled" in router.event_log.read_text(), 10,
               what="the upstream to see its stream closed")
    assert client.responses.cancel(done.id).status == final.status  # finished: unchanged
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model="tiny", input="x", max_output_tokens=1).id)


def test_background_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="slow", input="hi", background=True, stream=True,
                                          max_output_tokens=5))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "t0 t1 t2 t3 t4 "
    assert client.responses.retrieve(events[0].response.id).status == "incomplete"


def test_cmd_upstream_and_path_aliases(router: Router) -> None:
    for prefix in ("/v1", "", "/v3"):
        r = _raw(
            router,
            "POST",
            f"{prefix}/responses",
            json={"model": "slow", "input": "hi", "max_output_tokens": 3},
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_text"] == "t0 t1 t2 " and r.json()["status"] == "incomplete"
        assert _raw(router, "GET", f"{prefix}/responses/{r.json()['id']}").status_code == 200


def test_client_leaving_a_stream_closes_the_upstream_stream(router: Router) -> None:
    before = router.event_log.read_text().count("cancelled") if router.event_log.exists() else 0
    body = {"model": "slow", "input": "hi", "stream": True}
    with httpx.stream("POST", router.base + "/v1/responses", json=body, timeout=60) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
    wait_until(lambda: router.event_log.read_text().count("cancelled") > before, 10,
               what="the upstream to see its stream closed")


def test_upstream_dying_mid_stream_fails_the_response(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="crash", input="hi")
    assert resp.status == "failed" and resp.error is not None and "mid-stream" in resp.error.message
    assert resp.output_text == "t0 t1 t2 "
    assert client.responses.retrieve(resp.id).status == "failed"


def test_truncation_auto_drops_the_oldest_items(client: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "word " * 700}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "short"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=long, max_output_tokens=2)  # type: ignore[arg-type]
    assert e.value.code is None or "context" in str(e.value)
    resp = client.responses.create(model="tiny", input=long, max_output_tokens=2, truncation="auto")  # type: ignore[arg-type]
    assert resp.status in ("completed", "incomplete") and resp.truncation == "auto"


# --------------------------------------------------------------------------- 400s


BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"previous_response_id": "resp_x", "conversation": "conv_x"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"truncation": "middle"}, "truncation"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "message", "role": "user"}]}, "input.0.message.content"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"background": True, "store": False}, "background"),
    ({"temperature": 3}, "temperature"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
    ({"n": 0}, "n"),
    ({"n": 2, "conversation": "conv_x"}, "n"),
    ({"images": ["x"], "best_of": 2}, "images"),  # unknown fields: a 400 naming them (protocol/strict.py)
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_requests_are_400_naming_the_field(router: Router, extra: dict[str, Any], param: str) -> None:
    r = _raw(router, "POST", "/v1/responses", json={"model": "tiny", "input": "hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_not_found_and_upstream_errors(client: openai.OpenAI, router: Router) -> None:
    with pytest.raises(openai.NotFoundError, match="Previous response with id 'resp_nope' not found"):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi", conversation="conv_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    image = [
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
    ]
    with pytest.raises(openai.BadRequestError):  # the text-only worker's own 400 comes back
        client.responses.create(model="tiny", input=image, max_output_tokens=2)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- durability (restarts the router)


def test_store_survives_a_router_restart(client: openai.OpenAI, router: Router) -> None:
    resp = client.responses.create(model="tiny", input="remember", max_output_tokens=2)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "x"}])
    router.restart()
    again = router.client()
    assert again.responses.retrieve(resp.id).output_text == resp.output_text
    assert len(again.conversations.items.list(conv.id).data) == 1
    chained = again.responses.create(
        model="tiny", input="more", previous_response_id=resp.id, max_output_tokens=2
    )
    assert chained.status in ("completed", "incomplete")


def test_disabled_store_gives_clear_400s(tmp_path: Path) -> None:
    r = Router(tmp_path, "--responses-max-entries", "0")
    try:
        c = r.client()
        resp = c.responses.create(model="slow", input="hi", max_output_tokens=2)
        assert resp.status == "incomplete" and resp.store is False
        for call in (lambda: c.responses.retrieve(resp.id),
                     lambda: c.responses.create(model="slow", input="x", previous_response_id=resp.id),
                     lambda: c.responses.create(model="slow", input="x", background=True),
                     lambda: c.conversations.create()):
            with pytest.raises(openai.BadRequestError, match="store is disabled"):
                call()
        assert not (r.data_dir / "responses.sqlite3").exists()
    finally:
        stop_process(r.proc)


# --------------------------------------------------------------------------- beam search


def test_responses_beam_search_returns_the_n_best_beams(router: Router) -> None:
    """best_of / use_beam_search / length_penalty reach the worker's beam search: the n answers
    are the chat route's, in order; n > 1 without streaming is one upstream body replayed."""
    beam = {"best_of": 2, "length_penalty": 0.8}
    chat = _raw(router, "POST", "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "n": 2, **beam})
    assert chat.status_code == 200, chat.text
    want = [c["message"]["content"] for c in chat.json()["choices"]]
    r = _raw(router, "POST", "/v1/responses", json={"model": "tiny", "input": "hello", "max_output_tokens": 6,
                                                     "n": 2, **beam})
    assert r.status_code == 200, r.text
    got = [o["content"][0]["text"] for o in r.json()["output"] if o["type"] == "message"]
    assert got == want


def test_responses_beam_search_streams_only_one_answer(router: Router) -> None:
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 6, "use_beam_search": True}
    whole = _raw(router, "POST", "/v1/responses", json=body).json()
    text = ""
    with httpx.stream("POST", router.base + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                text += ev.get("delta", "") if ev["type"] == "response.output_text.delta" else ""
    assert text == whole["output"][0]["content"][0]["text"]
    r2 = _raw(router, "POST", "/v1/responses", json={**body, "n": 2, "best_of": 2, "stream": True})
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "n"
