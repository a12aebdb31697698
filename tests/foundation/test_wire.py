"""Wire types: requests become SamplingParams; bad bodies become 400 envelopes, never 500."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from worker.protocol.errors import APIError, api_error_handler, http_exception_handler, parse_model
from worker.protocol.sampling import SamplingParams
from worker.protocol.wire import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, SamplingParams()),
        ({"temperature": 0}, SamplingParams(temperature=0.0)),
        ({"max_tokens": 5, "stop": "x"}, SamplingParams(max_tokens=5, stop=("x",))),
        ({"max_completion_tokens": 7}, SamplingParams(max_tokens=7)),
        ({"n_predict": 9}, SamplingParams(max_tokens=9)),
        ({"n_predict": -1}, SamplingParams()),
        ({"stop": ["a", "", "b"]}, SamplingParams(stop=("a", "b"))),
        ({"nvext": {"ignore_eos": True, "top_k": 3, "repetition_penalty": 1.2}},
         SamplingParams(ignore_eos=True, top_k=3, repeat_penalty=1.2)),
        ({"nvext": {"greedy_sampling": True}, "temperature": 0.9}, SamplingParams(temperature=0.0)),
        ({"ignore_eos": True, "repeat_penalty": 1.1}, SamplingParams(ignore_eos=True, repeat_penalty=1.1)),
        ({"logit_bias": {"12": -100, "7": 5}}, SamplingParams(logit_bias={12: -100.0, 7: 5.0})),
        ({"logprobs": True, "top_logprobs": 3}, SamplingParams(logprobs=True, top_logprobs=3)),
        ({"seed": 42, "n": 3, "cache_prompt": False, "id_slot": 1},
         SamplingParams(seed=42, n=3, cache_prompt=False, id_slot=1)),
        ({"mirostat": 0, "typical_p": 1.0, "best_of": 1}, SamplingParams()),  # a feature's "off" value
        ({"response_format": {"type": "text"}}, SamplingParams()),
        ({"top_p": 0.5, "min_p": 0.1, "top_k": 7, "presence_penalty": 0.5, "frequency_penalty": -0.5,
          "repeat_last_n": 32, "repetition_penalty": 1.3},
         SamplingParams(top_p=0.5, min_p=0.1, top_k=7, presence_penalty=0.5, frequency_penalty=-0.5,
                        repeat_last_n=32, repeat_penalty=1.3)),
        ({"greedy_sampling": True}, SamplingParams(temperature=0.0)),
        ({"n_probs": 4}, SamplingParams(logprobs=True, top_logprobs=4)),
        ({"n_probs": 2, "post_sampling_probs": True, "return_progress": True, "stream": True},
         SamplingParams(logprobs=True, top_logprobs=2, post_sampling_probs=True, return_progress=True)),
    ],
)
def test_chat_request_to_sampling_params(body: dict[str, Any], expected: SamplingParams) -> None:
    req = parse_model(ChatCompletionRequest, {"messages": MSG, **body})
    assert req.to_sampling_params() == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompts(prompt: Any, expected: list[Any]) -> None:
    assert parse_model(CompletionRequest, {"prompt": prompt}).prompts() == expected


def test_completion_logprobs_is_a_count() -> None:
    p = parse_model(CompletionRequest, {"prompt": "x", "logprobs": 2}).to_sampling_params()
    assert p.logprobs and p.top_logprobs == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG, "max_tokens": -2}, "max_tokens"),
        ({"messages": MSG, "top_p": 1.5}, "top_p"),
        ({"messages": MSG, "n": 0}, "n"),
        ({"messages": MSG, "temperature": -0.1}, "temperature"),
        ({"messages": MSG, "temperature": "hot"}, "temperature"),
        ({"messages": MSG, "logit_bias": {"12": "high"}}, "logit_bias"),
        ({"messages": MSG, "stop": 5}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({}, "messages"),
        ({"messages": MSG, "response_format": "json"}, "response_format"),
        ({"messages": MSG, "grammar": 5}, "grammar"),
    ],
)
def test_bad_chat_bodies_name_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as exc:
        parse_model(ChatCompletionRequest, body)
    assert exc.value.status_code == 400
    assert exc.value.param == param
    assert exc.value.type == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"[1,2]", b'"str"', b"\xff\xfe", b""])
def test_bad_json_is_400(raw: bytes) -> None:
    with pytest.raises(APIError) as exc:
        parse_model(ChatCompletionRequest, raw)
    assert exc.value.status_code == 400


def _app() -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        req = parse_model(ChatCompletionRequest, await request.body())
        return JSONResponse({"n": req.n})

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"])],
        exception_handlers={APIError: api_error_handler, HTTPException: http_exception_handler},
    )


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("POST", "/v1/chat/completions", b"{oops", 400),
        ("POST", "/v1/chat/completions", b'{"messages": "x"}', 400),
        ("GET", "/v1/chat/completions", b"", 405),
        ("GET", "/nope", b"", 404),
    ],
)
def test_error_envelope_over_http(method: str, path: str, content: bytes, status: int) -> None:
    with TestClient(_app()) as client:
        r = client.request(method, path, content=content)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]


@pytest.mark.parametrize(
    ("body", "param"), [({"prompt": []}, "prompt"), ({"prompt": "x", "suffix": "y"}, "suffix")]
)
def test_bad_completion_bodies_name_the_param(body: dict[str, Any], param: str) -> None:
    # suffix (fill-in-the-middle) used to be accepted and ignored.
    with pytest.raises(APIError) as exc:
        parse_model(CompletionRequest, body)
    assert exc.value.status_code == 400 and exc.value.param == param
