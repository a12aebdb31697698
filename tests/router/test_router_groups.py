"""Preset groups through a real router (router/lifecycle/swap.py rule 4): a swap group never has
two members up, a persistent model stays loaded through a storm of another group's requests
(tiny GGUF models), and an exclusive load unloads other groups' idle models and waits for their
busy ones (fake workers with slow streams, so that "busy" lasts as long as the test needs).

The states come from /models/sse, every change in order, so no poll can miss an overlap.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx
import pytest

from tests.router.conftest import RouterProc, chat, fake_model, stream_chat
from tests.util import ROOT, preset_defaults, wait_until

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
UP = {"loaded", "sleeping", "stopping"}  # a process that holds its slot


class Watch:
    """Every model's status as /models/sse tells it, and every snapshot after each change."""

    def __init__(self) -> None:
        self.now: dict[str, str] = {}
        self.history: list[dict[str, str]] = []
        self.ready = threading.Event()
        self.lock = threading.Lock()

    def saw(self, model: str, value: str) -> bool:
        with self.lock:
            return any(s.get(model) == value for s in self.history)

    def seen(self, model: str, value: str) -> None:
        with self.lock:
            self.now[model] = value
            self.history.append(dict(self.now))


@contextmanager
def watching(r: RouterProc) -> Iterator[Watch]:
    w = Watch()
    stop = threading.Event()
    client = r.client(timeout=None)
    sock: list[socket.socket] = []

    def listen() -> None:
        try:
            with client.stream("GET", "/models/sse") as resp:
                sock.append(resp.extensions["network_stream"].get_extra_info("socket"))
                for line in resp.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: "):
                        data = json.loads(line[6:])
                        w.seen(data["model"], data["status"]["value"])
                        w.ready.set()
        except (httpx.HTTPError, RuntimeError):
            if not stop.is_set():  # (the router stopping at teardown ends the stream)
                raise

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert w.ready.wait(10)
    try:
        yield w
    finally:
        stop.set()
        # Ends the stream now, so the router's shutdown does not wait for it. Not client.close():
        # a close() from this thread leaves the listener blocked in recv() and the connection
        # open (the join then waited 5 s, and the router's stop its 3 s graceful bound); a
        # shutdown() wakes the recv and sends the FIN.
        with suppress(OSError):  # the router may have closed it already
            sock[0].shutdown(socket.SHUT_RDWR)
        t.join(5)
        client.close()
        assert not t.is_alive(), "the /models/sse listener did not end"


def complete(r: RouterProc, model: str, **extra: Any) -> None:
    with r.client(timeout=120) as c:
        resp = c.post("/v1/chat/completions", json=chat(model, max_tokens=2, **extra))
        assert resp.status_code == 200, resp.text


@pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
def test_a_swap_group_never_has_two_members_up_and_a_persistent_model_stays_through_the_storm(
    router_factory: Factory,
) -> None:
    tiny = f'model = "{GGUF}"\nbackend = "llama_cpp"\nparallel = 1\n'
    preset = (
        f"{preset_defaults(256)}[models.a]\n{tiny}[models.b]\n{tiny}[models.keep]\n{tiny}"
        '[groups.pair]\nmembers = ["a", "b"]\n'
        '[groups.resident]\nmembers = ["keep"]\nswap = false\nexclusive = false\npersistent = true\n'
    )
    r = router_factory(preset, "--models-max", "2")
    complete(r, "keep")
    keep_pid = [w.pid for w in r.workers()]
    with watching(r) as w:
        threads = [
            threading.Thread(target=lambda m=m: complete(r, m))  # type: ignore[misc]
            for m in ("a", "b", "a", "b", "keep")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        complete(r, "keep")
        # The events reach the watcher after the answers reach us: wait for the ones asserted below.
        wait_until(lambda: w.saw("a", "loaded") and w.saw("b", "loaded"), 10, what="a, b loaded events")
    both = [s for s in w.history if s.get("a") in UP and s.get("b") in UP]
    assert not both, both[:3]
    assert {s.get("a") for s in w.history} >= {"loaded"} and {s.get("b") for s in w.history} >= {"loaded"}
    assert all(s.get("keep", "loaded") == "loaded" for s in w.history)  # never unloaded for the pair
    assert keep_pid[0] in [p.pid for p in r.workers()]  # the same process all along


SLOW = ("--tokens", "20", "--token-delay", "0.1")  # a 2 s stream: busy while it runs


def test_an_exclusive_load_unloads_other_groups_idle_models_and_waits_for_busy_ones(
    router_factory: Factory,
) -> None:
    preset = (
        fake_model("x")
        + fake_model("busy", *SLOW)
        + fake_model("idle")
        + fake_model("free")
        + '[groups.first]\nmembers = ["x"]\n[groups.second]\nmembers = ["busy", "idle"]\nswap = false\n'
    )
    r = router_factory(preset, "--models-max", "0")
    for m in ("idle", "free", "busy"):
        complete(r, m, stream=False)
    assert {m: r.status(m) for m in ("idle", "free", "busy")} == dict.fromkeys(
        ("idle", "free", "busy"), "loaded"
    )
    out: dict[str, Any] = {}
    with watching(r) as w:
        streaming = threading.Thread(target=lambda: out.update(chunks=stream_chat(r, "busy")))
        streaming.start()
        wait_until(lambda: r.models()["busy"]["in_flight"] == 1, 10, what="busy's stream to start")
        complete(r, "x")  # returns once x is loaded: busy's stream has ended by then
        streaming.join(30)
        wait_until(lambda: w.saw("x", "loaded"), 10, what="x loaded on /models/sse")  # (it trails the answer)
    assert out["chunks"][-1] == "[DONE]" and len(out["chunks"]) > 20  # never cut for the exclusive load
    x_loaded = next(i for i, s in enumerate(w.history) if s.get("x") == "loaded")
    busy_gone = next(i for i, s in enumerate(w.history) if s.get("busy") == "unloaded")
    assert busy_gone < x_loaded  # waited for the busy one, then unloaded it
    assert r.status("idle") == "unloaded" and r.status("free") == "loaded"  # a model in no group stays
