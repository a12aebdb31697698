"""The HTTP surface: error envelopes, the official openai SDK, and the llama-server extras."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.worker.conftest import CTX, N_SLOTS, Worker

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": -2}, "max_tokens"),
        (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
        (CHAT, {"messages": MSG, "n": 0}, "n"),
        (CHAT, {"messages": MSG, "temperature": -0.5}, "temperature"),
        (CHAT, {"messages": MSG, "max_tokens": "many"}, "max_tokens"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        (CHAT, {"messages": MSG, "stop": [1, 2]}, "stop"),
        (
            CHAT,
            {"messages": MSG, "logit_bias": [[1]]},
            "logit_bias",
        ),  # a text key is tokenized (llama-server)
        (COMPLETIONS, {"prompt": "x", "max_tokens": -3}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "top_p": 2}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "n": -1}, "n"),
        (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 2, 10**9]}, "prompt"),
        (COMPLETIONS, {}, "prompt"),
    ],
)
def test_bad_input_is_a_400_envelope(worker: Worker, path: str, body: dict[str, Any], param: str) -> None:
    r = worker.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] in ("invalid_request_error", "not_supported_error")
    assert str(err["param"]).startswith(param)


def test_an_image_for_a_text_model_names_what_this_backend_needs(worker: Worker) -> None:
    """A text-only model refuses an image with the way to serve one on its own backend: llama.cpp
    takes a projector (--mmproj), torch reads images for an Idefics3 folder only."""
    content = [{"type": "text", "text": "hi"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    r = worker.post(CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "not_supported_error" and err["param"] == "messages"
    hint, other = ("--mmproj", "Idefics3") if worker.backend == "llama_cpp" else ("Idefics3", "--mmproj")
    assert hint in err["message"] and other not in err["message"], err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_malformed_body_is_a_400(worker: Worker, raw: bytes) -> None:
    import httpx

    r = httpx.post(worker.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_longer_than_a_slots_context(worker: Worker) -> None:
    n_ctx_slot = CTX // N_SLOTS  # a KV stream per slot, as llama-server
    r = worker.post(COMPLETIONS, {"prompt": [5] * (n_ctx_slot + 10)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == n_ctx_slot + 10 and err["n_ctx"] == n_ctx_slot


def test_unknown_route_and_method(worker: Worker) -> None:
    assert worker.get("/v2/nothing").json()["error"]["type"] == "not_found_error"
    r = worker.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_openai_sdk(worker: Worker) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == comp.choices[0].text
    models = client.models.list()
    assert len(models.data) == 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=3)


def test_health_props_models_slots(worker: Worker) -> None:
    assert worker.get("/health").json() == {"status": "ok", "is_sleeping": False}
    props = worker.get("/props").json()
    assert props["total_slots"] == N_SLOTS and props["default_generation_settings"]["n_ctx"] == CTX // N_SLOTS
    assert "<|im_start|>" in props["chat_template"]
    slots = worker.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(N_SLOTS))
    assert {"n_ctx", "is_processing", "id_task", "n_decoded"} <= set(slots[0]) and "params" not in slots[
        0
    ]  # idle
    assert worker.get("/v1/models").json()["data"][0]["object"] == "model"


def test_tokenize_detokenize_apply_template(worker: Worker) -> None:
    tokens = worker.post("/tokenize", {"content": "hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert worker.post("/detokenize", {"tokens": tokens}).json()["content"] == "hello world"
    pieces = worker.post("/tokenize", {"content": "hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    prompt = worker.post("/apply-template", {"messages": MSG}).json()["prompt"]
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert worker.post("/detokenize", {"tokens": [-1]}).status_code == 400


def test_detokenize_writes_control_tokens_as_llama_server_does(worker: Worker) -> None:
    """Regression: the llama.cpp backend's /detokenize dropped control tokens ("a user" for the ids
    of "a <|im_start|>user"); llama-server and the torch backend write them (found on SmolLM2)."""
    text = "a <|im_start|>user\n x"
    tokens = worker.post("/tokenize", {"content": text, "parse_special": True}).json()["tokens"]
    assert worker.post("/detokenize", {"tokens": tokens}).json()["content"] == text


def test_metrics(worker: Worker) -> None:
    worker.post(COMPLETIONS, {"prompt": "metrics", "max_tokens": 2})
    text = worker.get("/metrics").text
    for name in (
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:prompt_seconds_total",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:n_busy_slots_per_decode",
    ):
        assert name in text
