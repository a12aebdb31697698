"""The router out of descriptors (issue 39), on a real router with a small RLIMIT_NOFILE and idle
client sockets holding its descriptors:

- past its connection budget it answers a new connection 503 in OpenAI's envelope with
  `Retry-After`, and the stream it was already serving finishes;
- a spawn that fails with EMFILE (every descriptor held by clients) leaves the model retryable,
  and once the clients let go the same request is served, with no load asked by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.router.conftest import HeldStream, RouterProc
from tests.util import ROOT, metric, wait_until

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
Factory = Callable[..., RouterProc]
PRESET = f"""
[models.tiny]
model = "{GGUF}"
ctx-size = 1024
parallel = 1
threads = 1
stop-timeout = 5
"""


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}}


def _n_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def _sockets_until(r: RouterProc, n_fds: int) -> Iterator[list[socket.socket]]:
    """Idle sockets opened one by one until the router holds `n_fds` descriptors (counted after
    each is accepted, so that one of its own that closes meanwhile is made up for); closed at the
    end, and waited for until the router has let them go."""
    host, port = r.base.removeprefix("http://").split(":")
    held: list[socket.socket] = []
    before = _n_fds(r.proc.pid)
    deadline = time.monotonic() + 60
    try:
        while (count := _n_fds(r.proc.pid)) < n_fds:
            assert time.monotonic() < deadline, f"the router holds {count} descriptors, not {n_fds}"
            held.append(socket.create_connection((host, int(port)), timeout=10))
            accepted = time.monotonic() + 1.0
            while _n_fds(r.proc.pid) <= count and time.monotonic() < accepted:
                time.sleep(0.002)  # polled: the accept happens on the router's loop
        yield held
    finally:
        for s in held:
            s.close()
    # The router closes its ends on its loop, a moment later: until then a new connection finds
    # no descriptor and is reset.
    wait_until(lambda: _n_fds(r.proc.pid) <= before + 5, 30, what="the router to let the sockets go")


def test_past_the_connection_budget_a_new_connection_gets_503_and_the_running_stream_finishes(
    router_factory: Factory,
) -> None:
    budget = 12
    r = router_factory(PRESET, "--max-connections", str(budget))
    assert f"connection budget: {budget} client connections" in r.log()
    httpx.post(f"{r.base}/v1/chat/completions", json=_body(2, False), timeout=120).raise_for_status()
    # In flight until finish(), however fast the machine (900 tokens: within the slot's 1024).
    body = {k: v for k, v in _body(900, True).items() if k != "model"}
    with HeldStream(r, "tiny", **body) as held:
        with _sockets_until(r, _n_fds(r.proc.pid) + budget - 1):  # + the stream's connection = the budget
            refused = httpx.post(f"{r.base}/v1/chat/completions", json=_body(2, False), timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            err = refused.json()["error"]
            assert err["code"] == "connection_budget" and "--max-connections" in err["message"]
            assert set(err) == {"message", "type", "param", "code"}
        assert metric(r.base, "omni_router:connections_refused_total") >= 1
        events = held.finish()
    usage = [json.loads(e)["usage"] for e in events if e != "[DONE]" and json.loads(e).get("usage")]
    assert usage[-1]["completion_tokens"] == 900  # the running stream kept its connection and finished
    ok = httpx.post(f"{r.base}/v1/chat/completions", json=_body(2, False), timeout=60)
    assert ok.status_code == 200, ok.text


def _answer_past_resets(r: RouterProc) -> httpx.Response:
    """A chat completion, asked again while its connection is reset: with one descriptor left,
    the router may be using it at that instant itself (a /proc read, a log write), and a
    connection it cannot accept is closed at once (router/http/connection_budget.py)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.post(f"{r.base}/v1/chat/completions", json=_body(2, False), timeout=60)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
            assert time.monotonic() < deadline, "every connection was reset for 60 s"
            time.sleep(0.05)


def test_emfile_at_spawn_leaves_the_model_retryable_and_it_is_served_once_descriptors_are_free(
    router_factory: Factory,
) -> None:
    limit = 160
    # budget above the limit: nothing stops the clients from taking every descriptor
    r = router_factory(PRESET, "--max-connections", str(10 * limit), nofile=limit)
    with _sockets_until(r, limit - 1):  # one left: the request's own connection
        first = _answer_past_resets(r)
        assert first.status_code == 503, first.text
        message = first.json()["error"]["message"]
        assert "EMFILE" in message or "Too many open files" in message, message
        assert "transient" in message, message
    card = r.models()["tiny"]
    assert "not retried" not in json.dumps(card), card  # transient: not the permanent failure

    def served() -> bool:
        resp = httpx.post(f"{r.base}/v1/chat/completions", json=_body(2, False), timeout=60)
        return resp.status_code == 200

    wait_until(served, 60, what="the model to be served after the descriptors were freed")
