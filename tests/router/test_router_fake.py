"""The router with fake workers (real subprocesses speaking the worker contract): lifecycle edge
cases that need a slow start, a crash, a worker that ignores SIGTERM, or a long stream."""

from __future__ import annotations

import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.router.conftest import (
    FAKE,
    HeldStream,
    RouterProc,
    chat,
    fake_model,
    kill_router_and_expect_no_workers,
    sse_events,
    stream_chat,
)
from tests.util import HTTP, free_port, stop_process, wait_until

Factory = Callable[..., RouterProc]


def test_autoload_and_ten_concurrent_requests_spawn_one_worker(
    router_factory: Factory, tmp_path: Path
) -> None:
    spawns = tmp_path / "spawns.txt"
    r = router_factory(fake_model("a", "--load-time", "1.0", "--spawn-log", str(spawns)) + fake_model("b"))
    with r.client() as c:
        resp = c.post("/v1/chat/completions?autoload=false", json=chat("a"))
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"
        assert r.status("a") == "unloaded"

        def one(_: int) -> int:
            with r.client() as cc:
                return cc.post("/v1/chat/completions", json=chat("a")).status_code

        with ThreadPoolExecutor(10) as ex:
            futures = [ex.submit(one, i) for i in range(10)]
            # Load progress is visible while the ten wait.
            seen = wait_until(lambda: r.models()["a"]["status"].get("progress", {}).get("phase") == "weights",
                              10, 0.02, what="load progress")
            assert seen
            assert [f.result() for f in futures] == [200] * 10
        assert spawns.read_text().split() and len(spawns.read_text().split()) == 1
        assert len(r.workers()) == 1
        card = r.wait_status("a", "loaded")
        assert card["meta"]["fake"] is True and card["backend"] == "cmd"


def test_no_autoload_requires_explicit_load(router_factory: Factory) -> None:
    r = router_factory(fake_model("a"), "--no-models-autoload")
    with r.client() as c:
        resp = c.post("/v1/chat/completions", json=chat("a"))
        assert resp.status_code == 400
        assert resp.json()["error"]["message"].startswith("model 'a' is not loaded")
        assert c.post("/models/load", json={"model": "a"}).json() == {"success": True}
        r.wait_status("a", "loaded")
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        assert c.post("/models/unload", json={"model": "a"}).json() == {"success": True}
        assert r.status("a") == "unloaded" and r.workers() == []
        resp = c.post("/models/unload", json={"model": "a"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_loaded"


def test_models_max_1_alternating_never_aborts_a_running_stream(router_factory: Factory) -> None:
    r = router_factory(fake_model("a") + fake_model("b"), "--models-max", "1")
    for first, second in (("a", "b"), ("b", "a"), ("a", "b")):
        # first is in flight until finish(); the fake answers max_tokens chunks (~750 KB: past the buffers)
        with HeldStream(r, first, max_tokens=5000) as held:
            result: dict[str, Any] = {}

            def ask_second(model: str = second, out: dict[str, Any] = result) -> None:
                with r.client() as c:
                    out["resp"] = c.post("/v1/chat/completions", json=chat(model))  # needs `first` evicted

            t = threading.Thread(target=ask_second)
            t.start()
            r.wait_status(second, "loading", timeout=30)  # waits for the only slot, which first holds
            assert t.is_alive() and r.models()[first]["in_flight"] == 1  # it waits instead of aborting
            events = held.finish()
        t.join(30)
        assert result["resp"].status_code == 200, result["resp"].text
        assert events[-1] == "[DONE]" and len(events) == 5002, events[-3:]  # not cut
        assert not any("error" in json.loads(e) for e in events[:-1])
        assert r.status(second) == "loaded" and r.status(first) == "unloaded"


def test_lru_picks_the_least_recently_used_idle_model(router_factory: Factory) -> None:
    r = router_factory(fake_model("a") + fake_model("b") + fake_model("c"), "--models-max", "2")
    with r.client() as c:
        for name in ("a", "b", "a"):
            assert c.post("/v1/chat/completions", json=chat(name)).status_code == 200
        assert c.post("/v1/chat/completions", json=chat("c")).status_code == 200
    states = {name: m["status"]["value"] for name, m in r.models().items()}
    assert states == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert len(r.workers()) == 2


def test_queue_full_is_503_and_a_client_leaving_the_queue_is_forgotten(router_factory: Factory) -> None:
    r = router_factory(fake_model("a") + fake_model("b"), "--models-max", "1", "--max-queue", "1")
    # a is in flight until its client leaves, however fast the machine (5000 chunks, ~750 KB)
    held = HeldStream(r, "a", max_tokens=5000)
    with r.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json=chat("b"))  # queued, then the client gives up
    r.wait_status("b", "unloaded", timeout=5)  # it left the queue; b is not loaded for nobody

    waiting: dict[str, int] = {}
    t2 = threading.Thread(target=lambda: waiting.update(
        code=r.client().post("/v1/chat/completions", json=chat("b")).status_code))
    t2.start()
    wait_until(lambda: r.models()["b"]["status"].get("progress", {}).get("phase") == "queued", 10)
    with r.client() as c:
        resp = c.post("/v1/chat/completions", json=chat("b"))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "unavailable_error"
    assert r.models()["a"]["in_flight"] == 1 and t2.is_alive()  # still queued behind the held stream
    assert b'"error"' not in held.body  # what the stream's client got so far
    held.close()  # the stream's client leaves; its slot goes to the queued b
    t2.join(30)
    assert waiting["code"] == 200


def test_idle_sleep_then_transparent_wake_keeps_the_process(router_factory: Factory) -> None:
    r = router_factory(fake_model("a") + fake_model("b", extra="ttl = 0"), "--sleep-idle-seconds", "0.5")
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        pid = r.models()["a"]["meta"]["pid"]
        r.wait_status("a", "sleeping", timeout=10)
        assert r.status("b") == "loaded"  # its ttl = 0 overrides --sleep-idle-seconds: never sleeps
        resp = c.post("/v1/chat/completions", json=chat("a"))
        assert resp.status_code == 200 and resp.json()["pid"] == pid
        assert r.status("a") == "loaded"


def test_worker_killed_mid_stream_gives_an_error_event_then_recovers(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--tokens", "200", "--token-delay", "0.02"))
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    (worker,) = r.workers()
    def kill_at_third(n: int) -> None:
        if n == 3:
            os.kill(worker.pid, signal.SIGKILL)

    events = stream_chat(r, "a", on_chunk=kill_at_third)
    last = json.loads(events[-1])
    assert last["error"]["type"] == "server_error" and "mid-stream" in last["error"]["message"]
    card = r.wait_status("a", "failed")
    assert card["status"]["failed"] is True and card["status"]["exit_code"] == -9
    assert any("fake worker a" in line for line in card["status"]["log_tail"])
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200  # respawned
    assert r.status("a") == "loaded"


def test_a_killed_model_nobody_asks_for_is_unloaded_again_and_a_kept_one_comes_back(
    router_factory: Factory,
) -> None:
    """Issue 39: after a SIGKILL with nobody waiting, a model went `failed` and stayed so. Now it
    is shown failed for FAILED_SHOWN_S, then unloaded with the failure on its card; a
    load-on-startup model is loaded again after its backoff."""
    r = router_factory(fake_model("a") + fake_model("b", extra="load-on-startup = true"))
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    r.wait_status("b", "loaded")
    pids = {w.pid for w in r.workers()}
    for w in r.workers():
        os.kill(w.pid, signal.SIGKILL)
    assert r.wait_status("a", "failed")["status"]["exit_code"] == -9
    came_back = r.wait_status("b", "loaded")  # by itself: its preset keeps it up
    assert {w.pid for w in r.workers()} - pids, "b was respawned"
    assert "last_failure" not in came_back["status"]
    card = r.wait_status("a", "unloaded", timeout=30)
    assert card["status"]["last_failure"]["exit_code"] == -9 and "failed" not in card["status"]
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    assert "last_failure" not in r.models()["a"]["status"]


def test_failed_load_reports_exit_code_and_backs_off(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--fail-load", "--load-time", "0.3"))
    with r.client() as c:
        resp = c.post("/v1/chat/completions", json=chat("a"))
        assert resp.status_code == 503
        assert "failed to load" in resp.json()["error"]["message"]
        card = r.models()["a"]
        st = card["status"]
        assert (st["value"], st["failed"], st["exit_code"]) == ("failed", True, 1)
        assert "--fail-load" in st["args"] and any("fake worker a" in line for line in st["log_tail"])
        resp = c.post("/v1/chat/completions", json=chat("a"))  # second crash in a row...
        assert resp.status_code == 503
        resp = c.post("/v1/chat/completions", json=chat("a"))  # ...so now it waits before a respawn
        assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1
        assert "keeps crashing" in resp.json()["error"]["message"]


def test_unload_kills_a_worker_that_ignores_sigterm(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--ignore-sigterm", extra="stop-timeout = 0.5"))
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        (worker,) = r.workers()
        t0 = time.monotonic()
        assert c.post("/models/unload", json={"model": "a"}).json() == {"success": True}
        assert 0.4 < time.monotonic() - t0 < 5
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
    assert r.status("a") == "unloaded"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_router_exit_leaves_no_worker(router_factory: Factory, sig: signal.Signals) -> None:
    r = router_factory(fake_model("a") + fake_model("b"))
    with r.client() as c:
        for name in ("a", "b"):
            assert c.post("/v1/chat/completions", json=chat(name)).status_code == 200
    kill_router_and_expect_no_workers(r, sig, n_workers=2, timeout=5)


def test_a_stop_ends_the_event_streams_bug_an_open_web_ui_held_it_3_s_and_logged_an_error(
    router_factory: Factory,
) -> None:
    """/models/sse and /logs/stream never end by themselves: uvicorn's graceful shutdown waited out
    its whole bound (3 s) for them, then cancelled them mid-body with an ERROR traceback in the
    log. Reproduced by stopping a router while both are open (the web UI keeps /models/sse open)."""
    r = router_factory(fake_model("a"))
    with (
        httpx.stream("GET", f"{r.base}/models/sse", timeout=30) as models,
        httpx.stream("GET", f"{r.base}/logs/stream", timeout=30) as logs,
    ):
        models_lines, logs_lines = models.iter_lines(), logs.iter_lines()
        assert next(line for line in models_lines if line.startswith("data: "))  # a's snapshot
        assert next(logs_lines) == ": connected"
        r.proc.send_signal(signal.SIGTERM)
        # Each body ends whole (a cancelled one is an incomplete chunked read: RemoteProtocolError).
        list(models_lines)
        list(logs_lines)
        r.proc.wait(30)
    assert "graceful shutdown exceeded" not in r.log()
    assert "Exception in ASGI application" not in r.log()


def test_api_key_cors_and_error_envelopes(router_factory: Factory) -> None:
    r = router_factory(fake_model("a") + fake_model("b"), "--api-key", "k1", "--api-key", "k2",
                       "--cors-origin", "http://ui.example")
    with r.client() as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "k"}):
            resp = c.get("/v1/models", headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "k1"}).status_code == 200

        pre = c.options("/v1/chat/completions", headers={"Origin": "http://ui.example",
                                                          "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
        # llama-server's preflight (the worker's rules, worker/protocol/front.py): 200, the origin echoed
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
        assert pre.headers["access-control-allow-headers"] == "*"
        assert pre.headers["access-control-allow-credentials"] == "true"
        other = c.options("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers

        auth = {"Authorization": "Bearer k1", "Origin": "http://ui.example"}
        resp = c.post("/v1/chat/completions", json=chat("a"), headers=auth)
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://ui.example"
        assert c.get("/v1/models", headers=auth).headers["access-control-allow-origin"] == "http://ui.example"

        for body, status, code in ((chat("nope"), 404, "model_not_found"), ({"messages": []}, 400, None)):
            resp = c.post("/v1/chat/completions", json=body, headers=auth)
            assert resp.status_code == status and resp.json()["error"]["code"] == code
        resp = c.post("/v1/chat/completions", content=b"{not json", headers=auth)
        assert resp.status_code == 400 and "Invalid JSON" in resp.json()["error"]["message"]
        resp = c.get("/nope", headers=auth)
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
        resp = c.get("/v1/models/nope", headers=auth)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_models_sse_props_and_openai_sdk(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--load-time", "0.3", extra='alias = ["x"]'))
    events: list[tuple[str, dict[str, Any]]] = []
    subscribed = threading.Event()

    def listen() -> None:
        with r.client() as c, c.stream("GET", "/models/sse") as resp:
            name = ""
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[6:])))
                    subscribed.set()
                    if name == "status_change" and events[-1][1]["status"]["value"] == "loaded":
                        return

    t = threading.Thread(target=listen)
    t.start()
    assert subscribed.wait(10)
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="unused")
    out = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "t0 t1 t2 t3 t4"
    chunks = list(client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "t0 t1 t2 t3 t4 "
    t.join(10)
    assert events[0] == ("model_status", {"model": "a", "status": {"value": "unloaded"}})
    values = [e[1]["status"]["value"] for e in events if e[0] == "status_change"]
    assert values[0] == "loading" and values[-1] == "loaded"
    assert any(e[1]["status"].get("progress", {}).get("phase") == "weights" for e in events)

    with r.client() as c:
        props = c.get("/props").json()
        assert props["role"] == "router" and props["models"][0]["id"] == "a"
        assert c.get("/props", params={"model": "x"}).json()["role"] == "worker"
    assert sse_events(iter(["data: 1", "event: x"])) == ["1"]


def test_client_disconnect_cancels_the_upstream_stream(router_factory: Factory, tmp_path: Path) -> None:
    events = tmp_path / "events.txt"
    r = router_factory(
        fake_model("a", "--tokens", "500", "--token-delay", "0.02", "--event-log", str(events))
    )
    with r.client() as c, c.stream("POST", "/v1/chat/completions", json=chat("a", stream=True)) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 4:
                break  # leaving the block closes the connection mid-stream
    wait_until(lambda: events.exists() and "cancelled" in events.read_text(), 10, what="upstream cancel")
    wait_until(lambda: r.models()["a"]["in_flight"] == 0, 5, what="in_flight back to 0")


def test_remote_upstream_is_proxied_without_a_process(router_factory: Factory) -> None:
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), "--model", "far"],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: HTTP.get(f"http://127.0.0.1:{port}/health").status_code == 200, 20)
        r = router_factory(f'[models.far]\nbackend = "remote"\nupstream = "http://127.0.0.1:{port}"\n')
        assert r.status("far") == "loaded"
        with r.client() as c:
            assert c.post("/v1/chat/completions", json=chat("far")).json()["pid"] == fake.pid
            events = [
                e
                for e in c.post("/v1/chat/completions", json=chat("far", stream=True)).text.split("\n\n")
                if e
            ]
            assert events[-1] == "data: [DONE]"
            assert c.post("/models/unload", json={"model": "far"}).status_code == 400
        assert r.workers() == []
    finally:
        stop_process(fake)


def test_a_command_that_cannot_start_fails_cleanly_and_frees_its_slot(router_factory: Factory) -> None:
    r = router_factory('[models.ghost]\nbackend = "cmd"\ncmd = "/nonexistent/server --port ${PORT}"\n'
                       + fake_model("a"), "--models-max", "1")
    with r.client() as c:
        resp = c.post("/v1/chat/completions", json=chat("ghost"))
        assert resp.status_code == 500 and "No such file" in resp.json()["error"]["message"]  # permanent
        assert resp.headers["x-should-retry"] == "false"
        assert r.models()["ghost"]["status"]["failed"] is True
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200  # the slot was released


def test_pinned_models_holding_every_slot_fail_a_load_fast(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", extra="pin = true\nload-on-startup = true") + fake_model("b"),
                       "--models-max", "1")
    r.wait_status("a", "loaded")
    with r.client() as c:
        resp = c.post("/v1/chat/completions", json=chat("b"), timeout=10)
        assert resp.status_code == 503
        assert "held by pinned models" in resp.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200


def test_a_busy_model_is_drained_so_a_queued_model_does_not_starve(router_factory: Factory) -> None:
    r = router_factory(
        fake_model("a", "--tokens", "10", "--token-delay", "0.05") + fake_model("b"), "--models-max", "1",
        "--swap-max-wait", "1",  # drained once `b` has waited this long (router/lifecycle/swap.py)
    )
    stop = threading.Event()
    outcomes: list[str] = []

    def hammer() -> None:  # overlapping streams keep `a` busy at all times
        with r.client() as c:
            while not stop.is_set():
                with c.stream("POST", "/v1/chat/completions", json=chat("a", stream=True)) as resp:
                    outcomes.append([line for line in resp.iter_lines() if line][-1])

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.1)  # staggered, so their gaps do not line up
    with r.client(timeout=20) as c:
        assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200  # gets its turn
    stop.set()
    for t in threads:
        t.join(30)
    assert outcomes and all(o == "data: [DONE]" for o in outcomes)  # no stream of `a` was cut


def test_unload_during_load_fails_the_waiters_and_stops_the_worker(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--load-time", "30"))
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(resp=r.client().post("/v1/chat/completions", json=chat("a")))
    )
    t.start()
    wait_until(lambda: r.models()["a"]["status"].get("progress", {}).get("phase") == "weights", 10)
    with r.client() as c:
        assert c.post("/models/unload", json={"model": "a"}).json() == {"success": True}
    t.join(10)
    assert result["resp"].status_code == 503 and "was unloaded" in result["resp"].json()["error"]["message"]
    assert r.status("a") == "unloaded" and r.workers() == []


class _OneShotKeepAliveHandler(socketserver.StreamRequestHandler):
    """Answers the first request on a connection (keep-alive), then closes the connection when
    the second one arrives without answering it: the race where a worker closes an idle
    keep-alive connection just as the router reuses it."""

    def handle(self) -> None:
        for n in range(2):
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                byte = self.rfile.read(1)
                if not byte:
                    return
                head += byte
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), b"0"))
            self.rfile.read(length)
            if n == 1:
                return  # close without a response
            body = b'{"ok": true}'
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.wfile.flush()


def test_a_keep_alive_connection_closed_on_reuse_is_retried_not_dropped(router_factory: Factory) -> None:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _OneShotKeepAliveHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        r = router_factory(f'[models.up]\nbackend = "remote"\nupstream = "http://127.0.0.1:{port}"\n')
        with r.client() as c:
            codes = [c.post("/v1/chat/completions", json=chat("up")).status_code for _ in range(20)]
        assert codes == [200] * 20
    finally:
        server.shutdown()
        server.server_close()


def test_the_httpx_upstream_path_used_for_https_remotes_proxies_too(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--tokens", "200", "--token-delay", "0.01"),
                       env={"OMNI_PROXY_CLIENT": "httpx"})
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a", max_tokens=3)).json()["choices"][0]["message"][
            "content"] == "t0 t1 t2"
    (worker,) = r.workers()

    def kill_at_third(n: int) -> None:
        if n == 3:
            os.kill(worker.pid, signal.SIGKILL)

    events = stream_chat(r, "a", on_chunk=kill_at_third)
    assert "mid-stream" in json.loads(events[-1])["error"]["message"]


def test_max_queue_0_blocks_no_load_bug_load_on_startup_and_models_load_did_nothing(
    router_factory: Factory,
) -> None:
    """Bug: the `--max-queue` bound was checked for loads too. With `--max-queue 0` a
    load-on-startup model never loaded, `POST /models/load` answered success and did nothing,
    and every request got 503. The bound must limit waiting requests, never loads."""
    r = router_factory(fake_model("a", extra="load-on-startup = true") + fake_model("b") + fake_model("c"),
                       "--max-queue", "0")
    r.wait_status("a", "loaded", timeout=10)
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200  # ready: never queued
        assert c.post("/models/load", json={"model": "b"}).json() == {"success": True}
        r.wait_status("b", "loaded", timeout=10)
        assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200
        resp = c.post("/v1/chat/completions", json=chat("c"))  # it would have to wait: refused...
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        r.wait_status("c", "loaded", timeout=10)  # ...but its load goes on, so the retry is served
        assert c.post("/v1/chat/completions", json=chat("c")).status_code == 200
    assert r.models()["a"]["in_flight"] == 0 and r.models()["b"]["in_flight"] == 0


def test_pinned_models_holding_every_slot_is_a_503_bug_it_was_a_crash_with_backoff(
    router_factory: Factory,
) -> None:
    """Bug: `SlotsFull` was raised inside the load, so the refused model turned `failed`, its
    failure count rose and backoff applied: the third request read "keeps crashing (exit code
    None)" for a worker that never started. Reproduced by asking three times for a model while
    a pinned one holds the only slot, then freeing the slot."""
    r = router_factory(fake_model("a", extra="pin = true\nload-on-startup = true") + fake_model("b"),
                       "--models-max", "1")
    r.wait_status("a", "loaded")
    with r.client() as c:
        for _ in range(3):
            resp = c.post("/v1/chat/completions", json=chat("b"), timeout=10)
            assert resp.status_code == 503 and resp.json()["error"]["type"] == "unavailable_error"
            message = resp.json()["error"]["message"]
            assert "held by pinned models" in message and "crashing" not in message, message
            status = r.models()["b"]["status"]
            assert status["value"] == "unloaded" and "failed" not in status, status
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        assert c.post("/models/unload", json={"model": "a"}).json() == {"success": True}
        assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200  # no backoff to sit out


def test_idle_cmd_server_without_sleep_is_stopped_bug_a_request_during_its_sleep_failed_it(
        router_factory: Factory, tmp_path: Path) -> None:
    """Bug: an idle `cmd` server was put to SLEEPING and sent `POST /sleep`; a request arriving
    while that was in flight woke it with `POST /wake`, which a server without the sleep
    contract (llama-server) answers 404, and that was taken for a failed load: the model turned
    `failed` and the request got 503. Reproduced with a fake that has no sleep contract and
    answers /sleep only after 2 s: the request comes right after the model left `loaded`."""
    spawns = tmp_path / "spawns.txt"
    r = router_factory(fake_model("a", "--no-sleep", "--sleep-time", "2", "--spawn-log", str(spawns)),
                       "--sleep-idle-seconds", "0.3")
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        wait_until(lambda: r.status("a") != "loaded", 10, 0.01, what="a to go idle")
        resp = c.post("/v1/chat/completions", json=chat("a"))
        assert resp.status_code == 200, resp.text
        r.wait_status("a", "unloaded", timeout=10)  # idle again: stopped, never `sleeping`
    assert len(spawns.read_text().split()) == 2
    assert "model a: sleeping" not in r.log() and "model a: failed" not in r.log()


def test_models_report_the_worker_tree_memory_while_loading_and_loaded(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--load-time", "1.5") + fake_model("b"), "--no-models-autoload")
    none = {"estimated_bytes": None, "ram_bytes": None, "rss_bytes": None, "vram_bytes": None}
    assert r.models()["a"]["memory"] == none  # not running: nothing measured
    with r.client() as c:
        assert c.post("/models/load", json={"model": "a"}).json() == {"success": True}
        loading = wait_until(lambda: (m := r.models()["a"])["status"]["value"] == "loading"
                             and m["memory"]["ram_bytes"] and m, 10, 0.02, what="a sample while loading")
        mem = loading["memory"]
        assert 1 << 20 < mem["ram_bytes"] <= mem["rss_bytes"] and mem["vram_bytes"] is None
        card = r.wait_status("a", "loaded")
        assert card["memory"]["ram_bytes"] > 1 << 20
        assert c.post("/models/unload", json={"model": "a"}).json() == {"success": True}
    assert r.models()["b"]["memory"] == none
    after = r.models()["a"]["memory"]  # not running: nothing measured; the peak is the next estimate
    assert (
        after == {**none, "estimated_bytes": after["estimated_bytes"]} and after["estimated_bytes"] > 1 << 20
    )
