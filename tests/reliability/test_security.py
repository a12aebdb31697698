"""Security: `--api-key` guards every route the app serves (enumerated from its own route table,
so a new route is covered by itself) but /health and the web UI's files; keys are compared in
constant time and never logged; static files cannot escape webui/; no route writes the presets
or the data dir; the default bind is 127.0.0.1; CORS is off unless configured."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from router.http import app as app_module
from router.http.app import PROXY_GET, RouterApp
from router.lifecycle.pool import Pool, PoolConfig
from router.presets import load_presets
from tests.router.conftest import RouterProc, chat, fake_model
from tests.util import wait_until
from worker.protocol import front

Factory = Callable[..., RouterProc]
KEY = "sk-reliability-secret-7f3a"
WRONG = "sk-wrong-guess-91c2"
PRESET = fake_model("a") + fake_model("b")
PUBLIC = ("/health", "/", "/index.html", "/favicon.ico", "/static/{file}", "/assets/{file}")


def route_table(tmp_path: Path, preset: str = PRESET) -> list[tuple[str, str]]:
    """What the router serves, from the app itself (no server needed: nothing is started)."""
    path = tmp_path / "table.toml"
    path.write_text(preset)
    app = RouterApp(Pool(load_presets(path), PoolConfig()), api_keys=[KEY],
                    responses=app_module.ResponsesConfig(tmp_path / "table-data"))
    try:
        return app.route_table()
    finally:
        app.store.close()


def concrete(path: str) -> str:
    return path.replace("{file}", "app.js").replace("{", "").replace("}", "")


def call(c: httpx.Client, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    url = concrete(path) + ("?model=a" if method == "GET" and path in PROXY_GET else "")
    body = chat("a") if method == "POST" else None
    return c.request(method, url, json=body, headers=headers)


def test_the_route_table_lists_every_kind_of_route(tmp_path: Path) -> None:
    table = route_table(tmp_path)
    for route in (
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/models/load"),
        ("GET", "/metrics"),
        ("GET", "/logs"),
        ("POST", "/start_profile"),
        ("POST", "/v1/responses"),
        ("DELETE", "/v1/responses/{rid}"),
        ("GET", "/openapi.json"),
        ("GET", "/static/{file}"),
    ):
        assert route in table


def test_every_route_but_health_and_static_files_needs_the_key(
    router_factory: Factory, tmp_path: Path
) -> None:
    r = router_factory(PRESET, "--api-key", KEY)
    table = route_table(tmp_path)
    checked = 0
    with r.client(timeout=30) as c:
        for method, path in table:
            for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"x-api-key": WRONG},
                            {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
                resp = call(c, method, path, headers)
                if path in PUBLIC:
                    assert resp.status_code != 401, (method, path)
                else:
                    assert resp.status_code == 401, (method, path, headers, resp.text[:200])
                    err = resp.json()["error"]
                    if path.startswith("/api/"):  # Ollama's routes answer {"error": "..."} (router/ollama/)
                        assert isinstance(err, str) and "key" in err.lower()
                    else:
                        assert err["type"] == "authentication_error"
                checked += 1
        for method, path in table:  # and the key opens every one of them
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
                if path not in ("/logs/stream", "/models/sse"):  # endless streams
                    assert call(c, method, path, headers).status_code != 401, (method, path)
    assert checked == 5 * len(table) and len(table) > 60


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker's key check (worker.protocol.front); the router's is router.keys' (compared by
    # hash against every key: tests/unit/test_keys.py).
    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    guard = front.RequireAPIKey(app, ("k1", "k2", "k3"))
    calls: list[tuple[bytes, bytes]] = []
    real = front.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(front.hmac, "compare_digest", counting)
    for token, ok in ((b"k1", True), (b"k3", True), (b"nope", False), (b"", False)):
        calls.clear()
        assert guard._is_authorized({b"authorization": b"Bearer " + token}) is ok
        assert len(calls) == 3  # no early exit on a match: the time does not say which key matched


def test_keys_are_never_logged_nor_passed_to_workers(router_factory: Factory) -> None:
    r = router_factory(PRESET, "--api-key", KEY, "--log-level", "debug")
    auth = {"Authorization": f"Bearer {KEY}"}
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a"), headers=auth).status_code == 200
        assert c.post("/v1/chat/completions", json=chat("a"),
                      headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
        assert c.get("/v1/models", headers={"x-api-key": WRONG}).status_code == 401
        logs = c.get("/logs", headers=auth).text + c.get("/logs", params={"model": "a"}, headers=auth).text
    for worker in r.workers():
        assert KEY not in " ".join(worker.cmdline()) and KEY not in str(worker.environ())
    for text in (r.log(), logs):
        assert KEY not in text and WRONG not in text


TRAVERSALS = [
    "/static/..%2f..%2fpyproject.toml",
    "/static/%2e%2e/%2e%2e/pyproject.toml",
    "/static/..%2F..%2Frouter%2Fapp.py",
    "/assets/..%2f..%2fpyproject.toml",
    "/static/%2fetc%2fpasswd",
    "/static/..%5c..%5cpyproject.toml",
    "/static/....//....//pyproject.toml",
    "/..%2fpyproject.toml",
    "/static/../../pyproject.toml",
    "/static//etc/passwd",
    "/favicon.ico/../pyproject.toml",
    # not traversal, but were 500s (found by schemathesis): a name too long, a NUL byte
    "/static/" + "a" * 300,
    "/static/" + "%C3%A8" * 200,
    "/static/a%00b",
    "/assets/" + "b/" * 3000,
]


def test_static_files_refuse_path_traversal(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    host, port = r.base.removeprefix("http://").split(":")
    for path in TRAVERSALS:
        # A raw request: an HTTP client would normalize the dots away before sending them.
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        status = int(data.split(b" ", 2)[1])
        assert status in (400, 404), (path, data[:300])
        assert b"[build-system]" not in data and b"root:" not in data and b"RouterApp" not in data


def _snapshot(paths: list[Path]) -> dict[str, str]:
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            if "sqlite3" not in f.name:  # the Responses API's store: written by its own routes
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def test_no_route_writes_the_presets_or_the_data_dir(router_factory: Factory, tmp_path: Path) -> None:
    data = tmp_path / "state"
    r = router_factory(PRESET, "--data-dir", str(data))
    preset = next(tmp_path.glob("preset*.toml"))
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    before = _snapshot([preset, data])
    payloads: list[dict[str, Any]] = [
        {
            "model": "a",
            "preset": str(preset),
            "models_preset": str(preset),
            "data_dir": str(tmp_path / "evil"),
            "path": str(preset),
            "file": str(preset),
            "content": "[models.x]",
            "models_dir": str(tmp_path),
        },
        {"event_dir": str(data), "run_id": "x"},
        {"event_dir": str(tmp_path), "trace_path_template": str(preset), "enable_torch": True},
        {"event_dir": str(tmp_path / "p"), "trace_path_template": "{event_dir}/../preset0.toml"},
        {"event_dir": str(tmp_path / "p"), "trace_path_template": "{event_dir.parent}/x.json"},
    ]
    with r.client(timeout=30) as c:
        for method, path in route_table(tmp_path):
            if path in ("/logs/stream", "/models/sse") or method == "DELETE":
                continue  # endless streams; DELETE removes only what a client stored itself
            for body in payloads:
                resp = c.request(method, concrete(path), json=body if method != "GET" else None,
                                 params=body if method == "GET" else None)
                assert resp.status_code < 500, (method, path, body, resp.text[:300])
        c.post("/stop_profile", json={})
    assert _snapshot([preset, data]) == before
    assert not (tmp_path / "evil").exists()
    assert not list(tmp_path.glob("events_*")) and not list(data.rglob("events_*"))


def test_default_bind_is_loopback_and_cors_is_off_unless_configured(router_factory: Factory) -> None:
    r = router_factory(PRESET)

    def listening() -> list[str]:
        conns = psutil.Process(r.proc.pid).net_connections(kind="inet")
        return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]

    assert wait_until(listening, 10) == ["127.0.0.1"]
    origin = {"Origin": "http://evil.example"}
    with r.client() as c:
        for resp in (
            c.get("/v1/models", headers=origin),
            c.post("/v1/chat/completions", json=chat("a"), headers=origin),
            c.options("/v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST"}),
        ):
            assert not [h for h in resp.headers if h.lower().startswith("access-control-")], resp.headers
