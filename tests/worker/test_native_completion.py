"""llama-server's native /completion (and /completions): its shape, prompts as text, token ids or
both mixed, `n_probs` in streams, `return_tokens`, and a stream with no `[DONE]`.

One worker for the module (F32 GGUF, greedy requests: the same prompt gives the same text).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.util import run_worker
from tests.worker.conftest import EXACT_GGUF_ARGS
from worker.testing.tiny_models import ModelPaths

BASE = {"temperature": 0, "ignore_eos": True, "n_predict": 4}


@pytest.fixture(scope="module")
def url(tiny_models: ModelPaths) -> Iterator[str]:
    with run_worker(tiny_models.gguf_f32, "--parallel", "2", "--ctx-size", "512", "--alias", "tiny",
                    *EXACT_GGUF_ARGS) as u:
        yield u


def _post(url: str, path: str = "/completion", **body: Any) -> Any:
    r = httpx.post(url + path, json={**BASE, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, **body: Any) -> list[str]:
    with httpx.stream("POST", f"{url}/completion", json={**BASE, "stream": True, **body}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _tokenize(url: str, text: str, add_special: bool) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": add_special}, timeout=10)
    tokens: list[int] = r.json()["tokens"]
    return tokens


def test_native_body_shape(url: str) -> None:
    out = _post(url, prompt="hello world", return_tokens=True)
    assert out["stop"] is True and out["stop_type"] == "limit" and out["model"] == "tiny"
    assert out["tokens_predicted"] == 4 and len(out["tokens"]) == 4 and isinstance(out["content"], str)
    assert out["generation_settings"]["n_predict"] == 4 and out["generation_settings"]["temperature"] == 0
    assert out["timings"]["predicted_n"] == 4 and "completion_probabilities" not in out
    assert _post(url, prompt="hello world")["tokens"] == []  # only with return_tokens
    assert _post(url, "/completions", prompt="hello world")["content"] == out["content"]  # native too


def test_stream_with_n_probs_has_no_done(url: str) -> None:
    events = _stream(url, prompt="hello world", n_probs=3)
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    partials, final = chunks[:-1], chunks[-1]
    assert final["stop"] is True and final["content"] == "" and final["tokens_predicted"] == 4
    assert len(partials) == 4
    for c in partials:
        (probs,) = c["completion_probabilities"]
        assert probs["id"] >= 0 and probs["logprob"] <= 0 and len(probs["top_logprobs"]) == 3
        assert probs["top_logprobs"][0]["logprob"] >= probs["top_logprobs"][-1]["logprob"]
    assert "".join(c["content"] for c in partials) == _post(url, prompt="hello world")["content"]


def test_token_and_mixed_prompts(url: str) -> None:
    ids = _tokenize(url, "hello", True) + _tokenize(url, " world", False)
    by_ids = _post(url, prompt=ids)
    mixed = _post(url, prompt=["hello", *_tokenize(url, " world", False)])
    assert by_ids["content"] == mixed["content"] and by_ids["tokens_evaluated"] == len(ids)
    assert (
        _post(url, prompt=_tokenize(url, "hello world", True))["content"]
        == _post(url, prompt="hello world")["content"]
    )


def test_several_prompts_give_an_array(url: str) -> None:
    out = _post(url, prompt=["hello", "world"])
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1]
    assert out[0]["content"] == _post(url, prompt="hello")["content"]


def test_bad_prompts_are_400(url: str) -> None:
    r = httpx.post(f"{url}/completion", json={**BASE, "prompt": [10**9]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/completion", json={**BASE, "prompt": [{"x": 1}]}, timeout=10)
    assert r.status_code == 400


def test_response_fields_reduce_the_final_object(url: str) -> None:
    """llama-server's response_fields (its test_completion_response_fields): the final object
    has the listed fields only, a nested one under its path, a missing path left out; in a
    stream the last object is reduced the same way, the token objects are not."""
    fields = ["content", "generation_settings/n_predict", "prompt", "timings/no_such_key"]
    whole = _post(url, prompt="hello world", n_predict=6)
    body = _post(url, prompt="hello world", n_predict=6, response_fields=fields)
    assert body == {"content": whole["content"], "generation_settings/n_predict": 6,
                    "prompt": whole["prompt"]}
    streamed = _stream(url, prompt="hello world", n_predict=3, response_fields=["stop"])
    events = [json.loads(e) for e in streamed]
    assert events[-1] == {"stop": True}
    assert all("content" in e for e in events[:-1])
    assert _post(url, prompt="hello world", response_fields=[])["generation_settings"]
    bad = {**BASE, "prompt": "x", "response_fields": "content"}
    r = httpx.post(url + "/completion", json=bad, timeout=30)
    assert r.status_code == 400 and "response_fields" in r.text
