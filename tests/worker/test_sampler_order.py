"""llama-server's `samplers` (worker/protocol/sampler_order.py) and llama.cpp's web UI's request
bodies: the order and membership of the sampler chain, on both backends."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.util import run_worker
from tests.worker.conftest import Worker
from worker.protocol.sampler_order import DEFAULT_ORDER, parse
from worker.protocol.wire import ChatCompletionRequest
from worker.testing.tiny_models import ModelPaths

# What llama.cpp's web UI (tools/ui of the pinned sources, chat.service.ts) sends with its default
# settings: every sampler knob, `samplers` as a list, backend_sampling false, max_tokens -1.
WEBUI_BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_progress": True,
    "reasoning_format": "auto", "reasoning_control": True, "temperature": 0.8, "max_tokens": -1,
    "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
    "xtc_probability": 0, "xtc_threshold": 0.1, "typ_p": 1, "repeat_last_n": 64, "repeat_penalty": 1,
    "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
    "dry_allowed_length": 2, "dry_penalty_last_n": -1,
    "samplers": ["top_k", "typ_p", "top_p", "min_p", "temperature"], "backend_sampling": False,
    "timings_per_token": True, "sse_ping_interval": 1,
}


@pytest.mark.parametrize(
    ("raw", "order"),
    [
        ("edskypmxt", DEFAULT_ORDER),  # llama-server's default chain, as letters
        ("kpmt", ("top_k", "top_p", "min_p", "temperature")),
        (["top_k", "typ_p", "top_p", "min_p", "temperature"], ("top_k", "top_p", "min_p", "temperature")),
        (["Top-K", "nucleus", "TEMP", "minp"], ("top_k", "top_p", "temperature", "min_p")),
        ("tm", ("temperature", "min_p")),
        ([], ()),
    ],
)
def test_parse(raw: str | list[str], order: tuple[str, ...]) -> None:
    assert parse(raw) == order


@pytest.mark.parametrize(("raw", "words"), [("kq", "'q'"), (["top_k", "mirostat"], "'mirostat'"),
                                            ("ki", "infill"), (["adaptive_p"], "adaptive-p")])
def test_parse_refuses(raw: str | list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse(raw)


def test_a_sampler_left_out_is_off() -> None:
    base = {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "top_k": 5, "top_p": 0.5,
            "min_p": 0.2, "repeat_penalty": 1.3}
    p = ChatCompletionRequest.model_validate({**base, "samplers": ["min_p"]}).to_sampling_params()
    assert (p.top_k, p.top_p, p.min_p, p.temperature, p.repeat_penalty) == (0, 1.0, 0.2, 1.0, 1.0)
    assert not p.is_greedy  # temperature is not in the chain: llama-server samples at 1
    assert ChatCompletionRequest.model_validate(base).to_sampling_params().order == DEFAULT_ORDER


def _post_probs(w: Worker, **body: Any) -> list[float]:
    req = {"prompt": "the quick brown fox", "n_predict": 1, "n_probs": 20, "post_sampling_probs": True,
           "top_k": 0, "top_p": 1.0, "seed": 1, **body}
    r = w.post("/completion", req)
    assert r.status_code == 200, r.text
    return [t["prob"] for t in r.json()["completion_probabilities"][0]["top_probs"] if t["prob"] > 0]


def test_samplers_set_the_chain_on_both_backends(worker: Worker) -> None:
    """min_p at temperature 1 then a sharp temperature keeps two candidates here; the temperature
    first sharpens the row so that min_p keeps one. Left out, temperature 0 is not greedy."""
    knobs = {"min_p": 0.5, "temperature": 0.3}
    min_p_first = _post_probs(worker, samplers=["min_p", "temperature"], **knobs)
    temp_first = _post_probs(worker, samplers="tm", **knobs)
    assert len(min_p_first) == 2 and temp_first == [1.0]
    assert _post_probs(worker, **knobs) == min_p_first  # the default chain: min_p before temperature
    assert _post_probs(worker, temperature=0) == [1.0]
    assert len(_post_probs(worker, temperature=0, min_p=0.5, samplers=["min_p"])) == 2


def test_refusals(worker: Worker) -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = worker.post("/v1/chat/completions", {**chat, "samplers": ["top_k", "mirostat"]})
    assert r.status_code == 400 and "mirostat" in r.json()["error"]["message"]
    r = worker.post("/v1/chat/completions", {**chat, "backend_sampling": True})
    assert r.status_code == 400 and "backend_sampling" in r.json()["error"]["message"]
    # penalties after a stage that is on: llama.cpp's chain runs it, the torch sampler cannot
    late = {**chat, "samplers": ["temperature", "penalties"], "repeat_penalty": 1.3, "temperature": 0.7}
    r = worker.post("/v1/chat/completions", late)
    if worker.backend == "torch":
        assert r.status_code == 400 and r.json()["error"]["param"] == "samplers"
    else:
        assert r.status_code == 200, r.text


def test_the_web_uis_request_body_is_served(worker: Worker) -> None:
    with httpx.stream("POST", worker.url + "/v1/chat/completions", json={**WEBUI_BODY, "max_tokens": 4},
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    with httpx.stream("POST", worker.url + "/v1/chat/completions", json=WEBUI_BODY, timeout=60) as r:
        assert r.status_code == 200  # max_tokens -1: until EOS or a full context


def test_sse_ping_interval_sets_the_keep_alive(tiny_models: ModelPaths,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's sse_ping_interval (its web UI sends 1): a stream's keep-alive comment after
    that many silent seconds, -1 for none. Here the worker's own interval is 1 ms, so its
    comments come between tokens unless the request says otherwise."""
    monkeypatch.setenv("OMNI_SSE_KEEPALIVE_S", "0.001")

    def comments(url: str, **extra: Any) -> int:
        body = {"prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, **extra}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            return sum(1 for line in r.iter_lines() if line.startswith(": keep-alive"))

    with run_worker(tiny_models.gguf_f32, "--parallel", "1", "--ctx-size", "256", "--threads", "1") as url:
        assert comments(url) > 0
        assert comments(url, sse_ping_interval=-1) == 0
        assert comments(url, sse_ping_interval=3600) == 0
