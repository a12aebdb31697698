"""The router forwards to a worker no more than it can run, and keeps the rest queued through a
crash (issue 39): our worker on the tiny model with one slot takes at most 1 + FORWARD_MARGIN
requests at once; a SIGKILL fails the requests it was running, and the ones still queued in
the router are served by the respawned worker."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from router.lifecycle.request_queue import FORWARD_MARGIN
from tests.router.conftest import RouterProc
from tests.util import ROOT, wait_until

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
Factory = Callable[..., RouterProc]
N_REQUESTS = 8
PRESET = f"""
[models.tiny]
model = "{GGUF}"
ctx-size = 2048
parallel = 1
threads = 1
stop-timeout = 5
"""


def _stream(r: RouterProc, max_tokens: int) -> tuple[int, int, str | None]:
    """(status, completion tokens by the final usage, the error event's type if the stream ended
    with one)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    tokens, error = 0, None
    with httpx.stream("POST", f"{r.base}/v1/chat/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return resp.status_code, 0, None
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event: dict[str, Any] = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["type"]
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return 200, tokens, error


def _in_flight(r: RouterProc) -> int:
    return int(r.models()["tiny"]["in_flight"])


def test_at_most_slots_plus_margin_are_forwarded(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    assert _stream(r, 2)[0] == 200  # loaded
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _in_flight(r))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(N_REQUESTS) as ex:
            results = list(ex.map(lambda _: _stream(r, 400), range(N_REQUESTS)))
    finally:
        done.set()
        watcher.join()
    assert all(status == 200 and error is None for status, _, error in results), results
    assert peak == 1 + FORWARD_MARGIN, peak  # reached, never passed


def test_a_crash_fails_what_it_ran_and_the_queue_is_served_after_the_respawn(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    assert _stream(r, 2)[0] == 200
    (worker,) = r.workers()
    with ThreadPoolExecutor(N_REQUESTS) as ex:
        # long requests: the router's queue still holds the rest when the worker is killed
        futures = [ex.submit(_stream, r, 1000) for _ in range(N_REQUESTS)]
        wait_until(lambda: _in_flight(r) == 1 + FORWARD_MARGIN, 30, what="the worker's share forwarded")
        os.kill(worker.pid, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    failed = [x for x in results if x[2] is not None or x[0] != 200]
    served = [x for x in results if x[0] == 200 and x[2] is None]
    assert len(failed) <= 1 + FORWARD_MARGIN, results  # only what the killed worker was running
    assert len(served) >= N_REQUESTS - 1 - FORWARD_MARGIN and all(n == 1000 for _, n, _ in served), results
    assert r.status("tiny") == "loaded" and r.workers()[0].pid != worker.pid


def test_calls_that_occupy_no_slot_pass_a_full_bound(router_factory: Factory) -> None:
    """Regression (issue 47, item 2): /metrics?model=, /props, /slots, /lora-adapters, /tokenize,
    /detokenize and token counts waited in the router's queue behind generations whenever every
    slot and the margin were busy. They answer while the forwarded streams still run and more
    wait in the queue (before the fix they came after at least two whole 1,500-token streams)."""
    r = router_factory(PRESET)
    assert _stream(r, 2)[0] == 200
    n = 1 + FORWARD_MARGIN + 2  # the bound, and two more waiting in the router's queue
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}]}
    with ThreadPoolExecutor(n) as ex, r.client(timeout=120) as c:
        streams = [ex.submit(_stream, r, 1500) for _ in range(n)]
        wait_until(lambda: _in_flight(r) == 1 + FORWARD_MARGIN, 30, what="the bound full")
        answers = {
            "GET /metrics": c.get("/metrics", params={"model": "tiny"}).status_code,
            "GET /props": c.get("/props", params={"model": "tiny"}).status_code,
            "GET /slots": c.get("/slots", params={"model": "tiny"}).status_code,
            "GET /lora-adapters": c.get("/lora-adapters", params={"model": "tiny"}).status_code,
            "POST /tokenize": c.post("/tokenize", json={"model": "tiny", "content": "hello"}).status_code,
            "POST /detokenize": c.post("/detokenize", json={"model": "tiny", "tokens": [1, 2]}).status_code,
            "POST /v1/chat/completions/input_tokens": c.post(
                "/v1/chat/completions/input_tokens", json=chat_body).status_code,
            "POST /v1/messages/count_tokens": c.post(
                "/v1/messages/count_tokens", json=chat_body).status_code,
        }
        still_running = sum(not f.done() for f in streams)
        results = [f.result(timeout=300) for f in streams]
    assert all(status in (200, 501) for status in answers.values()), answers  # 501: --metrics off
    assert still_running == n, f"{n - still_running} streams ended before the cheap calls answered"
    assert all(status == 200 and error is None for status, _, error in results), results
