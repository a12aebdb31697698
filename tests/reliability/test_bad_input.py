"""Bad input on the public routes, through the router to a real worker on the tiny model: each
case is a 4xx in the one error envelope, never a 500, a hang or a dropped connection; the
router (and its worker) still serve a good request afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.conftest import RouterProc

DEADLINE_S = 60.0  # per request: a hang fails the case, it never blocks the suite


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


def raw_chat(fields: str) -> bytes:
    return b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' + fields.encode() + b"}"


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
DEEP = b"[" * 100_000 + b"]" * 100_000

# (case id, route, body: a JSON value or raw bytes, expected status)
CASES: list[tuple[str, str, Any, int]] = [
    ("invalid-json", "/v1/chat/completions", b"{nope", 400),
    ("invalid-json-responses", "/v1/responses", b"{nope", 400),
    ("invalid-json-load", "/models/load", b"{nope", 400),
    ("body-not-object", "/v1/chat/completions", [1, 2], 400),
    ("model-wrong-type", "/v1/chat/completions", chat(model=5), 400),
    ("max-tokens-wrong-type", "/v1/chat/completions", chat(max_tokens="many"), 400),
    ("messages-wrong-type", "/v1/chat/completions", chat(messages="hi"), 400),
    ("messages-empty", "/v1/chat/completions", chat(messages=[]), 400),
    ("role-unknown", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400),
    ("stop-wrong-type", "/v1/chat/completions", chat(stop=5), 400),
    ("max-tokens-negative", "/v1/chat/completions", chat(max_tokens=-5), 400),
    ("temperature-negative", "/v1/chat/completions", chat(temperature=-1), 400),
    ("top-p-over-1", "/v1/chat/completions", chat(top_p=5), 400),
    ("n-over-limit", "/v1/chat/completions", chat(n=1000), 400),
    ("top-logprobs-huge", "/v1/chat/completions", chat(logprobs=True, top_logprobs=10**6), 400),
    ("temperature-nan", "/v1/chat/completions", raw_chat('"temperature": NaN'), 400),
    ("max-tokens-nan", "/v1/chat/completions", raw_chat('"max_tokens": NaN'), 400),
    ("top-k-infinity", "/v1/chat/completions", raw_chat('"top_k": Infinity'), 400),
    ("invalid-utf8", "/v1/chat/completions", raw_chat('"x": "\xff"').replace(b"\xc3\xbf", b"\xff"), 400),
    ("lone-surrogate", "/v1/chat/completions", raw_chat('"stop": "\\ud800"'), 400),
    (
        "lone-surrogate-in-prompt",
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
        400,
    ),
    ("deeply-nested", "/v1/chat/completions", DEEP, 400),
    ("deeply-nested-field", "/v1/chat/completions", raw_chat('"x": ').rstrip(b"}") + DEEP + b"}", 400),
    ("deeply-nested-responses", "/v1/responses", DEEP, 400),
    ("deeply-nested-load", "/models/load", DEEP, 400),
    ("unknown-model", "/v1/chat/completions", chat(model="nope"), 404),
    ("unknown-model-load", "/models/load", {"model": "nope"}, 404),
    ("model-is-a-path", "/models/load", {"model": "/etc/passwd"}, 404),
    (
        "prompt-over-context",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "hello " * 2000}]),
        400,
    ),
    ("prompt-over-context-completions", "/v1/completions", {"model": "tiny", "prompt": "hello " * 2000}, 400),
    (
        "tool-choice-unknown-name",
        "/v1/chat/completions",
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
    ),
    ("tool-choice-without-tools", "/v1/chat/completions", chat(tool_choice="required"), 400),
    (
        "response-format-bad-schema",
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}),
        400,
    ),
    ("tokenize-wrong-type", "/tokenize", {"model": "tiny", "content": 5}, 400),
    ("detokenize-id-out-of-range", "/detokenize", {"model": "tiny", "tokens": [10**12]}, 400),
    ("detokenize-negative-id", "/detokenize", {"model": "tiny", "tokens": [-1]}, 400),
    ("n-probs-huge", "/completion", {"model": "tiny", "prompt": "hi", "n_predict": 2, "n_probs": 10**9}, 400),
    ("responses-input-wrong-type", "/v1/responses", {"model": "tiny", "input": 5}, 400),
    (
        "responses-negative-max",
        "/v1/responses",
        {"model": "tiny", "input": "hi", "max_output_tokens": -3},
        400,
    ),
    (
        "responses-unknown-previous",
        "/v1/responses",
        {"model": "tiny", "input": "hi", "previous_response_id": "resp_x"},
        404,
    ),
    ("conversation-items-wrong-type", "/v1/conversations", {"items": 5}, 400),
    ("profile-bad-body", "/start_profile", {"event_dir": 5}, 400),
    (
        "embeddings-on-a-chat-model",
        "/v1/embeddings",
        {"model": "tiny", "input": "x"},
        501,
    ),  # llama-server: not_supported_error
]


def send(c: httpx.Client, route: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return c.post(route, content=body, headers={"content-type": "application/json"})
    return c.post(route, json=body)


def assert_envelope(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text[:500]
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    return dict(err)


@pytest.mark.parametrize(("route", "body", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_envelope(tiny_router: RouterProc, route: str, body: Any, status: int) -> None:
    with tiny_router.client(timeout=DEADLINE_S) as c:
        assert_envelope(send(c, route, body), status)
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200  # nothing wedged


def test_huge_body_is_a_413_with_or_without_content_length(tiny_router: RouterProc) -> None:
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 2_000_000}])).encode()

    def chunked() -> Any:
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    with tiny_router.client(timeout=DEADLINE_S) as c:
        for route in ("/v1/chat/completions", "/v1/responses", "/models/load"):
            err = assert_envelope(send(c, route, big), 413)
            assert err["code"] == "request_too_large"
            assert_envelope(
                c.post(route, content=chunked(), headers={"content-type": "application/json"}), 413
            )
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200


def test_huge_max_tokens_and_n_over_the_slot_count_finish_without_a_hang(tiny_router: RouterProc) -> None:
    """Not errors: max_tokens is clamped to the context, n above the slots (2) queues its choices."""
    with tiny_router.client(timeout=DEADLINE_S) as c:
        resp = c.post("/v1/chat/completions", json=chat(max_tokens=10**12, ignore_eos=True))
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
        resp = c.post("/v1/chat/completions", json=chat(n=5))
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 5


@pytest.mark.parametrize("prompt", [[[1], 2], [True], [[True]]], ids=["nested-list", "bool", "nested-bool"])
def test_native_completion_prompt_of_the_wrong_shape_is_a_400_bug_it_was_a_500(tiny_router: RouterProc,
                                                                                 prompt: Any) -> None:
    """Found by schemathesis: `[[1], 2]` reached a comparison of an int with a list (a 500),
    and `[true]` passed as token id 1."""
    with tiny_router.client(timeout=DEADLINE_S) as c:
        assert_envelope(c.post("/completion", json={"model": "tiny", "prompt": prompt, "n_predict": 2}), 400)


def test_a_huge_repeat_last_n_is_clamped_to_the_context_bug_it_was_an_oom_kill(
    tiny_router: RouterProc,
) -> None:
    """Found by schemathesis: `repeat_last_n: 75184836908212` with a penalty on made llama.cpp
    allocate its penalty window up front (gigabytes per sampler): the kernel OOM-killed the
    worker. 10**8 would be 400 MB unclamped, enough to see and safe to run."""
    body = chat(max_tokens=4, frequency_penalty=0.5, repeat_last_n=10**8)
    with tiny_router.client(timeout=DEADLINE_S) as c:
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200
        (worker,) = tiny_router.workers()
        peak_before = peak_rss(worker.pid)
        for _ in range(2):
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert peak_rss(worker.pid) - peak_before < 100 * 2**20


def peak_rss(pid: int) -> int:
    """The process's RSS high-water mark (VmHWM): a window freed after the request still shows."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
