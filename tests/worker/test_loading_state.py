"""The HTTP surface while the model is still loading (or failed to), in process: the engine is
real but never finishes loading here, which a subprocess on a 1 MB model cannot hold still."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.util import wait_until
from worker.backends.base import Backend
from worker.engine.engine import Engine, Progress
from worker.engine.metrics import WorkerMetrics
from worker.server.routes import build_app
from worker.server.state import WorkerState


@pytest.fixture
def loading_app() -> Iterator[tuple[TestClient, threading.Event]]:
    release = threading.Event()

    def slow_factory(progress: Progress) -> Backend:
        progress("loading weights", 0.25)
        release.wait(10)
        raise RuntimeError("no such model")

    engine = Engine(slow_factory, 2, WorkerMetrics())
    engine.start()
    state = WorkerState(engine, WorkerMetrics(), "m", "m.gguf", "llama_cpp")
    with TestClient(build_app(state)) as client:
        yield client, release
    release.set()
    engine.stop()


def test_health_is_503_with_progress_while_loading(loading_app: tuple[TestClient, threading.Event]) -> None:
    client, _ = loading_app
    r = wait_until(
        lambda: (r := client.get("/health")).json()["error"]["progress"]["phase"] == "loading weights" and r,
        timeout=5,
        what="the loading phase",
    )
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["message"] == "Loading model" and err["type"] == "unavailable_error" and err["code"] == 503
    assert err["progress"] == {"phase": "loading weights", "fraction": 0.25}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_health_is_500_after_a_failed_load(loading_app: tuple[TestClient, threading.Event]) -> None:
    client, release = loading_app
    release.set()
    r = wait_until(lambda: (r := client.get("/health")).status_code == 500 and r, timeout=5, what="a 500")
    assert "no such model" in r.json()["error"]["message"]
