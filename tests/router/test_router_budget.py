"""End to end: memory budgets and preset reload, with real `omni-worker` processes on the tiny GGUF."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from router.lifecycle.estimate import compute
from router.presets import ModelPreset
from tests.router.conftest import HeldStream, RouterProc, chat
from tests.util import ROOT, wait_until

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")

# One slot with the whole context, on the CPU: a long stream really is long, and all of it is RAM.
SETTINGS = "threads = 1\nparallel = 1\nctx-size = 4096\nn-gpu-layers = 0\nstop-timeout = 5\n"
ESTIMATE = compute(
    ModelPreset("x", backend="llama_cpp", model=GGUF, ctx_size=4096, parallel=1, n_gpu_layers=0),
    has_gpu=False,
).ram_bytes


def model(name: str, extra: str = "") -> str:
    return f'[models.{name}]\nmodel = "{GGUF}"\nbackend = "llama_cpp"\n{SETTINGS}{extra}\n'


def ask(r: RouterProc, name: str) -> int:
    with r.client(timeout=60) as c:
        return c.post("/v1/chat/completions", json=chat(name, max_tokens=2)).status_code


def statuses(r: RouterProc) -> dict[str, str]:
    return {name: m["status"]["value"] for name, m in r.models().items()}


def completed(events: list[str]) -> bool:
    """Ended by its length, with no error event (the text itself may say "error": parsed, not grepped)."""
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return events[-1] == "[DONE]" and finish[-1] == "length" and not any("error" in c for c in chunks)


def test_a_ram_budget_for_two_evicts_the_lru_never_a_busy_model_and_refuses_a_model_too_big(
        router_factory: Factory) -> None:
    budget = int(ESTIMATE * 2.2)  # two fit (charged the estimate each), a third never does
    preset = model("a") + model("b") + model("c") + model("huge", 'memory = "10GiB"')
    r = router_factory(preset, "--ram-budget", str(budget), "--models-max", "0")
    wait_until(
        lambda: all(m["memory"]["estimated_bytes"] for m in r.models().values()), 10, what="the estimates"
    )
    assert {name: m["memory"]["estimated_bytes"] for name, m in r.models().items()} == {
        "a": ESTIMATE, "b": ESTIMATE, "c": ESTIMATE, "huge": 10 << 30}

    assert ask(r, "a") == 200 and ask(r, "b") == 200
    cards = r.models()
    for name in ("a", "b"):  # measured while loaded: the worker tree's USS and RSS; no GPU here
        mem = cards[name]["memory"]
        assert 1 << 20 < mem["ram_bytes"] <= mem["rss_bytes"], mem
    assert cards["c"]["memory"]["ram_bytes"] is None
    assert ask(r, "c") == 200
    assert statuses(r)["a"] == "unloaded" and statuses(r)["b"] == statuses(r)["c"] == "loaded"  # a was LRU
    assert len(r.workers()) == 2

    # b mid-stream, then c used: b is the least recently used, but busy, so loading a evicts c.
    with HeldStream(r, "b") as held:  # in flight until finish(), however fast the machine
        assert ask(r, "c") == 200 and ask(r, "a") == 200
        cards = r.models()
        assert cards["b"]["in_flight"] == 1  # b was busy from before c's use until after a loaded
        assert {name: card["status"]["value"] for name, card in cards.items()} == {
            "a": "loaded", "b": "loaded", "c": "unloaded", "huge": "unloaded"}
        assert completed(held.finish())  # and its stream was not cut

    t0 = time.monotonic()
    with r.client(timeout=60) as c:
        resp = c.post("/v1/chat/completions", json=chat("huge", max_tokens=2))
    assert resp.status_code == 503 and time.monotonic() - t0 < 30  # at once: never queued for a load
    err = resp.json()["error"]
    assert err["type"] == "unavailable_error" and "needs ~10.0 GiB of RAM, budget" in err["message"], err
    assert "pinned 0 B" in err["message"]
    st = r.models()["huge"]["status"]
    assert st["value"] == "unloaded" and "failed" not in st
    assert statuses(r)["a"] == statuses(r)["b"] == "loaded"  # nothing evicted for a load that cannot fit


def test_reload_during_a_stream_adds_restarts_once_idle_and_a_broken_preset_changes_nothing(
        router_factory: Factory, tmp_path: Path) -> None:
    r = router_factory(model("a"))
    path = tmp_path / "preset0.toml"
    assert ask(r, "a") == 200
    (worker,) = r.workers()

    held = HeldStream(r, "a")  # in flight until finish(), however fast the machine
    path.write_text(model("a", "ctx-size = 2048").replace("ctx-size = 4096\n", "") + model("b"))
    with held, r.client(timeout=60) as c:
        resp = c.post("/models/reload")
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"success": True, "added": ["b"], "removed": [], "changed": ["a"]}
        assert set(r.models()) == {"a", "b"} and r.status("b") == "unloaded"
        assert r.models()["a"]["in_flight"] == 1 and [w.pid for w in r.workers()] == [worker.pid]  # not yet
        assert completed(held.finish())  # the stream was not cut by the restart
        r.wait_status("a", "unloaded", timeout=30)  # restarted once idle...
        assert c.post("/v1/chat/completions", json=chat("a", max_tokens=2)).status_code == 200
        assert worker.pid not in [w.pid for w in r.workers()]
        assert (
            r.models()["a"]["status"]["args"][r.models()["a"]["status"]["args"].index("--ctx-size") + 1]
            == "2048"
        )
        assert c.post("/v1/chat/completions", json=chat("b", max_tokens=2)).status_code == 200

        good = path.read_text()
        path.write_text(good + "[models.c]\ncolour = 'red'\n")
        for resp in (c.post("/models/reload"), c.get("/models", params={"reload": "1"})):
            assert resp.status_code == 400
            err = resp.json()["error"]
            assert "running config unchanged" in err["message"] and "unknown key 'colour'" in err["message"]
        assert set(r.models()) == {"a", "b"} and statuses(r) == {"a": "loaded", "b": "loaded"}
        assert "preset reload rejected" in r.log()

        path.write_text(model("a", "ctx-size = 2048").replace("ctx-size = 4096\n", "") + model("c"))
        os.kill(r.proc.pid, signal.SIGHUP)  # b removed (idle: stopped at once), c added
        wait_until(lambda: set(r.models()) == {"a", "c"}, 10, what="the SIGHUP reload")
        assert statuses(r) == {"a": "loaded", "c": "unloaded"}  # a unchanged: not restarted
        resp = c.post("/v1/chat/completions", json=chat("b", max_tokens=2))
        assert resp.status_code == 404
        wait_until(lambda: len(r.workers()) == 1, 10, what="b's worker to stop")
