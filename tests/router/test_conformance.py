"""Issue 26's list, one regression test per item, over real HTTP: a router with a real tiny-model
worker (llama_cpp) and a fake `cmd` upstream, as a new user would hit it.

Each item was a 200 that silently dropped a field, a 400 for a shape other servers accept, or a
wrong behaviour; docs/compatibility.md lists every field and names these tests. The router runs
with `--responses-ttl 0` (no expiry: an item itself) and a 2 ms SSE keep-alive interval for its
workers (the keep-alive item; every other stream in the module shows comments do not disturb a
client). The tiny model has random weights: the tests assert on structure, never on text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.router.conftest import PY, fake_cmd
from tests.util import ROOT, free_port, preset_defaults, stop_process, wait_healthy, wait_until

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}
MSG = [{"role": "user", "content": "hi"}]


class Router:
    def __init__(self, tmp: Path) -> None:
        self.event_log = tmp / "events.log"
        slow = fake_cmd("--model", "slow", "--tokens", "2000", "--token-delay", "0.02",
                        "--event-log", str(self.event_log))
        preset = tmp / "preset.toml"
        preset.write_text(f'{preset_defaults(1024)}\n[models.tiny]\nmodel = "{GGUF}"\n'
                          f'backend = "llama_cpp"\n\n[models.slow]\nbackend = "cmd"\ncmd = "{slow}"\n')
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log = tmp / "router.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMNI_SSE_KEEPALIVE_S": "0.002"}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [PY, "-m", "router.cli", "--preset", str(preset), "--port", str(port),
                 "--data-dir", str(tmp / "data"), "--responses-ttl", "0"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_healthy(self.proc, self.base, 30)

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return httpx.post(self.base + path, json=body, timeout=60, **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base + path, timeout=60)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = Router(tmp_path_factory.mktemp("conformance"))
    yield r
    stop_process(r.proc)


@pytest.fixture(scope="module")
def client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.base}/v1", api_key="unused", max_retries=0, timeout=60)


def refused(resp: httpx.Response, *fields: str, reason: str = "") -> str:
    """A 400 naming every one of `fields` (and `reason`, when given); its message."""
    assert resp.status_code == 400, resp.text
    msg = str(resp.json()["error"]["message"])
    for f in fields:
        assert f"'{f}'" in msg, msg
    assert reason in msg, msg
    return msg


# --------------------------------------------------------------------------- silently ignored -> 400


@pytest.mark.parametrize(("extra", "reason"), [
    ({"images": ["data:image/png;base64,AAAA"]}, "model 'tiny' does not accept images"),  # issue 30
    ({"audios": ["a.wav"]}, "not implemented yet"),
    ({"videos": ["data:video/mp4;base64,AAAA"]}, "model 'tiny' does not accept video"),  # issue 41
    ({"use_audio_in_video": True}, "audio track is not used"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "has no voice paired"),  # issue 41: test_speech.py
    ({"stage_sampling": {"0": {"temperature": 0}}}, "one stage"),
    ({"stage_params": {"0": {}}}, "one stage"),
    ({"modalities": ["text", "audio"]}, "text only"),
])
def test_chat_sglang_omni_media_and_stage_fields_are_400s_naming_them(
        router: Router, extra: dict[str, Any], reason: str) -> None:
    # Reproduces: each was a 200 with the field dropped.
    resp = router.post("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 2, **extra})
    field = next(iter(extra))
    refused(resp, *([] if field in ("modalities", "images", "videos") else [field]), reason=reason)


def test_chat_unknown_fields_are_all_named_in_one_400(router: Router) -> None:
    resp = router.post("/v1/chat/completions", {"model": "tiny", "messages": MSG, "frobnicate": 1,
                                                "audios": [], "typical_p": 0.5})
    refused(resp, "frobnicate", "audios", "typical_p")
    # a feature's "off" value is what a server implementing it would return: accepted
    ok = router.post("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 2,
                                              "typical_p": 1.0, "best_of": 1, "modalities": ["text"]})
    assert ok.status_code == 200, ok.text


def test_chat_request_id_body_field_is_the_response_id(router: Router) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2, "request_id": "my-req-42"}
    assert router.post("/v1/chat/completions", body).json()["id"] == "my-req-42"
    with httpx.stream("POST", router.base + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
    assert ids == {"my-req-42"}
    comp = router.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                           "request_id": "c-1"})
    assert comp.json()["id"] == "c-1"


def test_nvext_annotations_is_a_400_naming_it(router: Router) -> None:
    resp = router.post("/v1/chat/completions", {"model": "tiny", "messages": MSG,
                                                "nvext": {"annotations": ["formatted_prompt"]}})
    refused(resp, "nvext.annotations", reason="annotation")


@pytest.mark.parametrize(("extra", "field", "reason"), [
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "stop string"),
    ({"num_assistant_tokens": 4}, "num_assistant_tokens", "speculative"),
    ({"assistant_confidence_threshold": 0.4}, "assistant_confidence_threshold", "speculative"),
    ({"max_ngram_size": 3}, "max_ngram_size", "speculative"),
])
def test_responses_unsupported_fields_are_400s_with_a_reason(
        router: Router, extra: dict[str, Any], field: str, reason: str) -> None:
    refused(router.post("/v1/responses", {"model": "tiny", "input": "hi", **extra}), field, reason=reason)


@pytest.mark.parametrize(("extra", "param"), [
    ({"best_of": 3}, "best_of"),  # a beam width over the tiny worker's 2 slots
    ({"length_penalty": 0.5}, "length_penalty"),  # without beam search it would do nothing
])
def test_responses_beam_search_fields_reach_the_worker_and_its_400s(
        router: Router, extra: dict[str, Any], param: str) -> None:
    # Beam search (issue 42) moved these fields from refused to honoured; the worker still
    # answers what it cannot do with a 400 naming the field, and the router passes it on.
    resp = router.post("/v1/responses", {"model": "tiny", "input": "hi", **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert "beam search" in resp.json()["error"]["message"]


def test_responses_off_values_of_refused_fields_are_accepted(router: Router) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "n": 1, "best_of": 1,
            "length_penalty": 1.0, "include_stop_str_in_output": False}
    assert router.post("/v1/responses", body).status_code == 200


def test_responses_penalties_reach_the_model(client: openai.OpenAI) -> None:
    # Reproduces: frequency_penalty / presence_penalty were dropped by the translation. Greedy
    # output of a random model repeats tokens; a strong penalty must change it.
    def text(**kw: Any) -> str:
        return client.responses.create(model="tiny", input="repeat", max_output_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True, **kw}).output_text
    plain = text()
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain


def test_responses_logprobs_bool_gives_logprobs(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    assert not plain.output[0].content[0].logprobs  # type: ignore[union-attr]  # output[0] is a message
    resp = client.responses.create(model="tiny", input="hi", max_output_tokens=4,
                                   extra_body={"logprobs": True})
    assert resp.output[0].content[0].logprobs  # type: ignore[union-attr]  # output[0] is a message


def test_responses_response_format_is_text_format(router: Router) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = router.post("/v1/responses", {"model": "tiny", "input": "json", "max_output_tokens": 40,
                                         "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "t", "schema": schema}}})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["text"]["format"]["type"] == "json_schema"
    assert isinstance(json.loads(data["output_text"])["ok"], bool)
    both = router.post("/v1/responses", {"model": "tiny", "input": "json",
                                         "response_format": {"type": "json_object"},
                                         "text": {"format": {"type": "json_object"}}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/audio/transcriptions", "/v1/audio/translations",
                                  "/v1/images/generations"])
def test_audio_and_image_routes_on_our_worker_are_a_clear_400(router: Router, path: str) -> None:
    # Reproduces: /v1/audio/speech was a bare 404 "Not Found" from the worker.
    body = {"model": "tiny", "input": "hello", "voice": "alloy", "prompt": "a cat"}
    resp = router.post(path, body) if "speech" in path or "images" in path else httpx.post(
        router.base + path, data={"model": "tiny"}, files={"file": ("a.wav", b"RIFF")}, timeout=60)
    assert resp.status_code == 400 and "text model" in resp.json()["error"]["message"], resp.text


# --------------------------------------------------------------------------- refused -> accepted


def test_responses_nested_tool_and_tool_choice_forms(client: openai.OpenAI) -> None:
    nested = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    resp = client.responses.create(model="tiny", input="weather in Paris?", tools=[nested],  # type: ignore[list-item]  # a plain dict for the SDK's TypedDict
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},  # type: ignore[arg-type]  # Chat's form, not in the SDK's types
                                   parallel_tool_calls=False, max_output_tokens=60)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", resp.output
    assert resp.tools[0].name == "get_weather"  # type: ignore[union-attr]  # echoed in the Responses form


def test_responses_chat_style_text_parts(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", max_output_tokens=2, input=[  # type: ignore[arg-type]  # Chat's form, not in the SDK's types
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "text", "text": "again"}]}])
    assert resp.status in ("completed", "incomplete")


def test_responses_max_tool_calls_above_one_is_a_soft_cap(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="weather?", tools=[TOOL], tool_choice="required",  # type: ignore[list-item]  # a plain dict for the SDK's TypedDict
                                   max_tool_calls=2, max_output_tokens=120)
    assert resp.max_tool_calls == 2
    assert 1 <= len([o for o in resp.output if o.type == "function_call"]) <= 2, resp.output


def test_responses_ttl_zero_keeps_responses(client: openai.OpenAI) -> None:
    # Reproduces: `--responses-ttl 0` was refused at startup (min 1); it means no expiry.
    resp = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert client.responses.retrieve(resp.id).id == resp.id


def test_start_profile_takes_sglang_omnis_documented_body(router: Router) -> None:
    # Reproduces: event_dir was required and enable_torch defaulted to off.
    resp = router.post("/start_profile", {"run_id": "omni-doc-example", "enable_torch": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["events"].endswith(".jsonl") and "omni-doc-example" in resp.json()["events"]
    stop = router.post("/stop_profile", {"run_id": "omni-doc-example"})
    assert stop.status_code == 200 and stop.json()["stopped"] == ["omni-doc-example"]


# --------------------------------------------------------------------------- wrong behaviour


def test_non_streaming_response_is_cancelled_when_its_client_leaves(router: Router) -> None:
    # Reproduces: all tokens were generated and the request logged as 200 after the client left.
    before = router.event_log.read_text().count("cancelled") if router.event_log.exists() else 0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.base + "/v1/responses", json={"model": "slow", "input": "hi"}, timeout=1.5)
    wait_until(lambda: router.event_log.exists() and router.event_log.read_text().count("cancelled") > before,
               20, what="the upstream to see its stream closed")


def test_responses_take_and_return_x_request_id(router: Router) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    resp = router.post("/v1/responses", body, headers={"X-Request-Id": "client-rid-7"})
    assert resp.headers["x-request-id"] == "client-rid-7"
    with httpx.stream("POST", router.base + "/v1/responses", json={**body, "stream": True},
                      headers={"X-Request-Id": "client-rid-8"}, timeout=60) as r:
        assert r.headers["x-request-id"] == "client-rid-8"
    assert router.post("/v1/responses", body).headers["x-request-id"]  # a new one when none is given


def test_forced_tool_call_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    # Reproduces: a `completed` function_call with invalid JSON arguments, plus a message with the
    # raw <tool_call> text.
    resp = client.responses.create(model="tiny", input="weather?", tools=[TOOL], tool_choice="required",  # type: ignore[list-item]  # a plain dict for the SDK's TypedDict
                                   max_output_tokens=5)
    assert resp.status == "incomplete"
    for item in resp.output:
        assert item.type != "message", resp.output
        if item.type == "function_call" and item.status == "completed":
            json.loads(item.arguments)


def test_streamed_function_call_argument_events_carry_call_id(router: Router) -> None:
    body = {"model": "tiny", "input": "weather?", "tools": [TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 60, "stream": True}
    with httpx.stream("POST", router.base + "/v1/responses", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    (call,) = [e["item"] for e in events if e["type"] == "response.output_item.done"
               and e["item"]["type"] == "function_call"]
    args = [e for e in events if e["type"].startswith("response.function_call_arguments.")]
    assert args and all(e["call_id"] == call["call_id"] for e in args), args


@pytest.mark.parametrize(("nvext", "param"), [
    ({"repetition_penalty": 3.0}, "nvext.repetition_penalty"),
    ({"repetition_penalty": 0}, "nvext.repetition_penalty"),
    ({"top_k": -5}, "nvext.top_k"),
])
def test_nvext_bounds_are_dynamos(router: Router, nvext: dict[str, Any], param: str) -> None:
    resp = router.post("/v1/chat/completions", {"model": "tiny", "messages": MSG, "nvext": nvext})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    ok = router.post("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 2,
                                              "nvext": {"repetition_penalty": 2.0, "top_k": -1}})
    assert ok.status_code == 200, ok.text


def test_completion_streams_send_sse_keep_alives(router: Router) -> None:
    # The module's workers send a keep-alive after 2 ms without an event (a prefill takes longer).
    body = {"model": "tiny", "prompt": "a b c " * 150, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", router.base + "/v1/completions", json=body, timeout=60) as r:
        raw = r.read()
    assert b": keep-alive\n\n" in raw and raw.rstrip().endswith(b"data: [DONE]")
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert all(e == b": keep-alive" or e.startswith(b"data: ") for e in events)  # never inside an event


# --------------------------------------------------------------------------- missing routes


def test_dynamo_list_models(router: Router) -> None:
    data = router.get("/dynamo/alpha/list-models").json()
    assert {"tiny", "slow"} <= set(data["chat_completion_models"]) and data["completion_models"]


def test_llama_server_tools_route(router: Router) -> None:
    assert router.get("/tools").json() == []
    assert router.get("/tools?model=tiny").json() == []  # the worker's own


# --------------------------------------------------------------------------- n > 1


def test_chat_n_choices_share_the_prompt_prefill(router: Router) -> None:
    """N samples of one prompt cost one prefill (the scheduler shares the prompt's KV rows):
    the worker's count of prompt tokens computed grows by about one prompt, not N."""
    def computed() -> float:
        text = router.get("/metrics?model=tiny").text
        return float(re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]  # the worker always has it

    prompt = " ".join(f"w{i}" for i in range(60)) + f" {os.urandom(4).hex()}"  # not cached anywhere
    before = computed()
    resp = router.post("/v1/completions", {"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 3
    n_prompt = resp.json()["usage"]["prompt_tokens"]
    assert computed() - before < 1.5 * n_prompt


def _prompt_tokens_computed(router: Router) -> float:
    text = router.get("/metrics?model=tiny").text
    return float(re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]  # the worker always has it


def _message_texts(resp: Any) -> list[str]:
    return [o.content[0].text for o in resp.output if o.type == "message"]


def test_responses_n_samples_share_the_prompt_prefill(router: Router, client: openai.OpenAI) -> None:
    """`n` on /v1/responses (was a 400): one upstream request, so N samples cost one prefill.
    Greedy samples are the same text, each its own message item; `output_text` is what the
    SDK makes of it: every sample's text joined; usage counts every sample's tokens."""
    prompt = " ".join(f"w{i}" for i in range(60)) + f" {os.urandom(4).hex()}"  # not cached anywhere
    before = _prompt_tokens_computed(router)
    resp = client.responses.create(model="tiny", input=prompt, max_output_tokens=4, temperature=0,
                                   extra_body={"n": 3, "ignore_eos": True})
    assert resp.usage is not None
    assert _prompt_tokens_computed(router) - before < 1.5 * resp.usage.input_tokens
    texts = _message_texts(resp)
    assert len(texts) == 3 and len(set(texts)) == 1 and texts[0], resp.output
    assert len({o.id for o in resp.output}) == 3
    assert resp.output_text == "".join(texts)
    assert resp.usage.output_tokens == 12
    assert resp.status == "incomplete" and resp.incomplete_details is not None  # every sample was cut


def test_responses_n_with_a_seed_is_n_reproducible_samples(client: openai.OpenAI) -> None:
    def texts() -> list[str]:
        resp = client.responses.create(model="tiny", input="say", max_output_tokens=8, temperature=1.0,
                                       extra_body={"n": 3, "seed": 7, "ignore_eos": True})
        return _message_texts(resp)
    first = texts()
    assert len(first) == 3 and len(set(first)) > 1, first  # each sample has its own seed
    assert texts() == first


def test_responses_n_streams_each_sample_in_order(client: openai.OpenAI) -> None:
    """The upstream's choices interleave; the events do not: sample k's items come after
    sample k-1's, each item's events between its added and done, with its own index and id."""
    events = list(client.responses.create(model="tiny", input="say", max_output_tokens=6, temperature=1.0,
                                          stream=True, extra_body={"n": 3, "seed": 3, "ignore_eos": True}))
    final = events[-1].response  # type: ignore[union-attr]  # the last event is a lifecycle one
    assert final.status == "incomplete" and len(final.output) == 3
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1, 2]
    assert [e.item.id for e in added] == [o.id for o in final.output]
    open_index = None
    texts = ["", "", ""]
    for e in events:
        if e.type == "response.output_item.added":
            assert open_index is None
            open_index = e.output_index
        elif e.type == "response.output_item.done":
            assert e.output_index == open_index
            open_index = None
        elif e.type == "response.output_text.delta":
            assert e.output_index == open_index and e.item_id == final.output[open_index].id
            texts[open_index] += e.delta
    assert texts == _message_texts(final) and final.usage is not None and final.usage.output_tokens == 18


def test_responses_n_with_a_forced_tool_and_a_json_schema(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="weather?", tools=[TOOL], tool_choice="required",  # type: ignore[call-overload]  # a plain dict for the SDK's TypedDict
                                   parallel_tool_calls=False, max_output_tokens=60, temperature=1.0,
                                   extra_body={"n": 2})
    calls = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and len(calls) == 2, resp.output
    assert len({c.id for c in calls}) == len({c.call_id for c in calls}) == 2
    assert all("city" in json.loads(c.arguments) for c in calls)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = client.responses.create(model="tiny", input="json", max_output_tokens=40, extra_body={"n": 2},
                                   text={"format": {"type": "json_schema", "name": "t", "schema": schema}})
    texts = _message_texts(resp)
    assert resp.status == "completed" and len(texts) == 2
    assert all(json.loads(t)["ok"] in (True, False) for t in texts)


def test_responses_n_does_not_continue_a_conversation(router: Router, client: openai.OpenAI) -> None:
    """Which sample continues is the client's choice: `previous_response_id` naming an n > 1
    response, and n > 1 with `conversation`, are 400s that say so; a chosen sample's items as
    input continue it."""
    resp = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                   extra_body={"n": 2, "ignore_eos": True})
    body = {"model": "tiny", "input": "more", "max_output_tokens": 2}
    refused(router.post("/v1/responses", {**body, "previous_response_id": resp.id}), reason="n > 1 samples")
    conv = client.conversations.create()
    with_conv = {**body, "n": 2, "conversation": conv.id}
    refused(router.post("/v1/responses", with_conv), "n", reason="conversation")
    chosen = [o.model_dump(exclude_none=True) for o in resp.output[1:]]  # sample 1's message
    turn = [{"role": "user", "content": "hi"}, *chosen, {"role": "user", "content": "more"}]
    again = client.responses.create(model="tiny", input=turn,  # type: ignore[arg-type]  # the SDK's TypedDicts
                                    max_output_tokens=2)
    assert again.status in ("completed", "incomplete")


# --------------------------------------------------------------------------- fields that had no test


def test_completion_echo_prepends_the_prompt(router: Router) -> None:
    body = {"model": "tiny", "prompt": "echo me", "max_tokens": 3}
    plain = router.post("/v1/completions", body).json()["choices"][0]["text"]
    echoed = router.post("/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed.startswith("echo me") and not plain.startswith("echo me")


def test_nvext_use_raw_prompt_skips_the_chat_template(router: Router) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "plain words"}], "max_tokens": 1}
    templated = router.post("/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    raw = router.post("/v1/chat/completions", {**body, "nvext": {"use_raw_prompt": True}}).json()
    bare = router.post("/tokenize", {"model": "tiny", "content": "plain words", "add_special": True}).json()
    assert raw["usage"]["prompt_tokens"] == len(bare["tokens"]) < templated



def test_responses_input_tokens_count_the_instructions(router: Router) -> None:
    def count(**kw: Any) -> int:
        resp = router.post("/v1/responses/input_tokens", {"model": "tiny", "input": "hi", **kw})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["input_tokens"])
    plain = count()
    assert count(instructions="be brief and kind") > plain


def test_model_admin_bodies_refuse_unknown_fields(router: Router) -> None:
    refused(router.post("/models/load", {"model": "tiny", "force": True}), "force")


def test_llama_cpp_web_ui_request_bodies_are_served(router: Router) -> None:
    """llama.cpp's own web UI (tools/ui of the pinned sources) through the router: its chat body
    with every sampler knob, `samplers`, `backend_sampling: false`, `max_tokens: -1`; and the
    same with a `samplers` string the UI may keep in its settings. Reproduces: each was a 400
    "Unrecognized request argument" after the conformance pass (issue 38)."""
    from tests.worker.test_sampler_order import WEBUI_BODY

    for samplers in (WEBUI_BODY["samplers"], "kypmt"):
        body = {**WEBUI_BODY, "model": "tiny", "samplers": samplers, "max_tokens": 4}
        with httpx.stream("POST", router.base + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2
