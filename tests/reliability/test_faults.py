"""Faults: a worker killed mid-stream, hanging at start, ignoring SIGTERM, crashing in a loop;
clients leaving mid-stream and mid-queue; the router killed with SIGKILL or restarted.
Each test says what it measures; `[reliability]` lines (pytest -s) feed docs/reliability.md."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.reliability.conftest import GGUF, TINY_PRESET
from tests.router.conftest import RouterProc, chat, fake_model
from tests.util import wait_until

Factory = Callable[..., RouterProc]
needs_tiny = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")


def report(line: str) -> None:
    print(f"\n[reliability] {line}")


def gauge(r: RouterProc, name: str, model: str) -> float:
    for line in httpx.get(f"{r.base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{model="{model}"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def health_ms(r: RouterProc) -> float:
    t0 = time.monotonic()
    assert httpx.get(f"{r.base}/health", timeout=5).status_code == 200
    return (time.monotonic() - t0) * 1000


def stream_events(
    r: RouterProc, model: str, on_chunk: Callable[[int], object] | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with r.client(timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=chat(model, True)) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                if on_chunk:
                    on_chunk(len(out))
    return out


def test_kill_9_mid_stream_gives_every_client_an_error_event_then_respawns(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--tokens", "400", "--token-delay", "0.02"))
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    (worker,) = r.workers()
    n_clients = 4
    started = threading.Barrier(n_clients + 1)

    def client(_: int) -> list[dict[str, Any]]:
        return stream_events(r, "a", lambda n: started.wait(30) if n == 2 else None)

    with ThreadPoolExecutor(n_clients) as ex:
        futures = [ex.submit(client, i) for i in range(n_clients)]
        started.wait(30)  # every client is mid-stream
        os.kill(worker.pid, signal.SIGKILL)
        results = [f.result(timeout=30) for f in futures]
    for events in results:
        assert (
            events[-1]["error"]["type"] == "server_error" and "mid-stream" in events[-1]["error"]["message"]
        )
    r.wait_status("a", "failed")
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200  # respawned
    assert r.status("a") == "loaded" and r.models()["a"]["meta"]["pid"] != worker.pid
    report(
        f"kill -9 mid-stream: {n_clients} streams, {n_clients} SSE error events, 0 hung; "
        "next request respawned"
    )


def test_a_worker_hanging_at_start_fails_its_waiters_with_503_without_wedging(
    router_factory: Factory,
) -> None:
    r = router_factory(fake_model("a", "--load-time", "3600", extra="load-timeout = 2") + fake_model("b"))
    n_waiters = 5
    t0 = time.monotonic()
    with ThreadPoolExecutor(n_waiters) as ex:
        futures = [
            ex.submit(lambda: r.client().post("/v1/chat/completions", json=chat("a")))
            for _ in range(n_waiters)
        ]
        wait_until(lambda: r.workers(), 10, what="the hanging worker")
        hung = r.workers()[0]
        latencies = [health_ms(r) for _ in range(10)]  # the router answers while the load hangs
        with r.client() as c:
            assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200
        results = [f.result(timeout=30) for f in futures]
    elapsed = time.monotonic() - t0
    assert [x.status_code for x in results] == [503] * n_waiters
    assert all(x.json()["error"]["type"] == "unavailable_error" for x in results)
    card = r.wait_status("a", "failed")
    assert card["status"]["failed"] is True
    wait_until(
        lambda: not hung.is_running() or hung.status() == psutil.STATUS_ZOMBIE, 10, what="hung worker stopped"
    )
    assert elapsed < 20 and max(latencies) < 2000  # generous: the box is shared
    report(f"hang at start (load-timeout 2 s): {n_waiters} waiters got 503 after {elapsed:.1f}s; "
           f"/health max {max(latencies):.0f} ms meanwhile; other model served")


def test_a_worker_ignoring_sigterm_is_killed_after_stop_timeout_when_the_router_stops(
    router_factory: Factory,
) -> None:
    r = router_factory(fake_model("a", "--ignore-sigterm", extra="stop-timeout = 1"))
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    (worker,) = r.workers()
    t0 = time.monotonic()
    os.kill(r.proc.pid, signal.SIGTERM)
    r.proc.wait(15)
    wait_until(lambda: not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE, 10)
    elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 10
    report(
        f"worker ignoring SIGTERM: router stopped, worker SIGKILLed {elapsed:.1f}s "
        "after the router's SIGTERM (stop-timeout 1 s)"
    )


def test_a_worker_exiting_at_once_in_a_loop_backs_off_and_the_router_stays_responsive(
        router_factory: Factory, tmp_path: Path) -> None:
    spawns = tmp_path / "spawns.txt"
    r = router_factory(
        fake_model("a", "--fail-load", "--load-time", "0", "--spawn-log", str(spawns)) + fake_model("b")
    )
    statuses, latencies = [], []
    t0 = time.monotonic()
    with r.client(timeout=30) as c:
        while time.monotonic() - t0 < 4:
            t1 = time.monotonic()
            resp = c.post("/v1/chat/completions", json=chat("a"))
            latencies.append(time.monotonic() - t1)
            statuses.append(resp.status_code)
            assert resp.status_code == 503 and resp.headers["retry-after"].isdigit()
            assert resp.json()["error"]["type"] == "unavailable_error"
            latencies.append(health_ms(r) / 1000)
        assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200
    n_spawns = len(spawns.read_text().split())
    card = r.models()["a"]
    assert card["status"]["value"] == "failed" and card["status"]["exit_code"] == 1
    assert n_spawns <= 5 < len(statuses)  # backoff: most requests are refused without a spawn
    assert max(latencies) < 5
    report(f"exit-at-once loop: {len(statuses)} requests in 4 s, all 503 + Retry-After, {n_spawns} spawns "
           f"(backoff), max latency {max(latencies) * 1000:.0f} ms, `failed` shown, other model served")


def test_a_request_that_kills_its_worker_kills_it_once_and_gets_a_502(router_factory: Factory,
                                                                       tmp_path: Path) -> None:
    """Regression (issue 47, item 4): a request whose body reached the worker, which then died, was
    requeued and replayed on each respawn (three crashes, each failing every other request). Only
    a request whose connection was refused is requeued; this one gets a 502 its SDK does not retry,
    and the next request is served by one respawned worker."""
    spawns = tmp_path / "spawns.txt"
    r = router_factory(fake_model("a", "--crash-on", "POISON", "--spawn-log", str(spawns)))
    with r.client(timeout=60) as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        assert len(spawns.read_text().split()) == 1
        resp = c.post("/v1/chat/completions", json={**chat("a"), "messages": [
            {"role": "user", "content": "POISON"}]})
        assert resp.status_code == 502, resp.text
        error = resp.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "worker_died", error
        assert resp.headers["x-should-retry"] == "false"
        assert len(spawns.read_text().split()) == 1  # killed once, never replayed
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200  # respawned for it
    assert len(spawns.read_text().split()) == 2
    report("a request that kills its worker: one crash, 502 with x-should-retry false, then served again")


@needs_tiny
def test_client_leaving_mid_stream_frees_its_slot(router_factory: Factory) -> None:
    r = router_factory(TINY_PRESET.replace("[models.tiny]", "[models.tiny]\n"))
    body = {"model": "tiny", "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    with r.client(timeout=60) as c:
        for _ in range(2):  # one stream per slot, both cut short
            with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                for i, _line in enumerate(resp.iter_lines()):
                    if i == 6:
                        break

        def slots_idle() -> bool:
            slots = c.get("/slots", params={"model": "tiny"}).json()
            return len(slots) == 2 and not any(s["is_processing"] for s in slots)

        wait_until(slots_idle, 10, what="both slots idle")
        wait_until(lambda: gauge(r, "omni_router:requests_in_flight", "tiny") == 0, 10, what="in-flight 0")
        resp = c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    report(
        "client left mid-stream (x2): /slots shows both slots idle, /metrics in_flight 0, next request served"
    )


def test_client_leaving_mid_queue_frees_its_queue_entry(router_factory: Factory) -> None:
    r = router_factory(fake_model("a", "--tokens", "2000", "--token-delay", "0.02") + fake_model("b"),
                       "--models-max", "1")
    stop = threading.Event()
    started = threading.Event()

    def hold() -> None:
        with r.client() as c, c.stream("POST", "/v1/chat/completions", json=chat("a", True)) as resp:
            for _line in resp.iter_lines():
                started.set()
                if stop.is_set():
                    return

    t = threading.Thread(target=hold)
    t.start()
    assert started.wait(30)
    queued: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not queued:
            if gauge(r, "omni_router:requests_queued", "b") >= 3:
                queued.append(gauge(r, "omni_router:requests_queued", "b"))

    w = threading.Thread(target=watch)
    w.start()

    def leave_after_1s(_: int) -> str:
        with r.client(timeout=1.5) as c:
            try:
                c.post("/v1/chat/completions", json=chat("b"))
            except httpx.ReadTimeout:
                return "left"
        return "answered"

    with ThreadPoolExecutor(3) as ex:
        assert list(ex.map(leave_after_1s, range(3))) == ["left"] * 3
    w.join()
    assert queued == [3.0]
    wait_until(lambda: gauge(r, "omni_router:requests_queued", "b") == 0, 10, what="queue empty")
    assert r.status("b") == "unloaded"  # nobody waits for it: it is not loaded for nobody
    stop.set()
    t.join(30)
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("b")).status_code == 200
    report("3 clients left mid-queue: /metrics requests_queued 3 -> 0, model not loaded for nobody")


@needs_tiny
def test_router_sigkill_workers_exit_by_themselves_within_5s(router_factory: Factory) -> None:
    preset = TINY_PRESET + f'\n[models.tiny2]\nmodel = "{GGUF}"\nbackend = "llama_cpp"\n'
    r = router_factory(preset)
    with r.client(timeout=60) as c:
        for m in ("tiny", "tiny2"):
            assert c.post("/v1/chat/completions", json={**chat(m), "max_tokens": 2}).status_code == 200
    workers = r.workers()
    assert len(workers) == 2
    os.kill(r.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    r.proc.wait(5)

    def gone() -> bool:
        return all(not w.is_running() or w.status() == psutil.STATUS_ZOMBIE for w in workers)

    wait_until(gone, 5, 0.02, what="workers to exit after their router's SIGKILL")
    elapsed = time.monotonic() - t0
    report(f"router SIGKILL: its 2 real workers exited by themselves in {elapsed:.2f}s")


def test_a_router_restart_keeps_stored_responses(router_factory: Factory, tmp_path: Path) -> None:
    data = tmp_path / "state"
    r = router_factory(fake_model("a"), "--data-dir", str(data))
    ids = []
    with r.client() as c:
        for i in range(3):
            resp = c.post("/v1/responses", json={"model": "a", "input": f"hello {i}",
                                                 **({"previous_response_id": ids[-1]} if ids else {})})
            assert resp.status_code == 200, resp.text
            ids.append(resp.json()["id"])
        before = [c.get(f"/v1/responses/{rid}").json() for rid in ids]
    os.kill(r.proc.pid, signal.SIGKILL)  # the harshest stop: nothing is flushed on the way out
    r.proc.wait(5)
    r2 = router_factory(fake_model("a"), "--data-dir", str(data))
    with r2.client() as c:
        after = [c.get(f"/v1/responses/{rid}").json() for rid in ids]
        resp = c.post("/v1/responses", json={"model": "a", "input": "more", "previous_response_id": ids[-1]})
        assert resp.status_code == 200  # the chain continues across the restart
    assert after == before
    report(f"router SIGKILL + restart on the same --data-dir: {len(ids)}/{len(ids)} stored responses kept, "
           "chain continued")
