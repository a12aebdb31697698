"""Keys for a team (router.keys) against a real router on fake workers: the route table walked
with no key, a user key, a user key limited to one model and an admin key; what each key sees of
the models; the audit line; reloading the keys file (POST /models/reload and SIGHUP) without
cutting a running stream; `omni-router keys add` writing no plain key."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.http.app import PROXY_GET, PROXY_POST, ResponsesConfig, RouterApp
from router.keys.access import Access, classify
from router.keys.keyfile import hash_key, load_keys
from router.lifecycle.pool import Pool, PoolConfig
from router.presets import load_presets
from tests.router.conftest import PY, HeldStream, RouterProc, chat, fake_model, running_router
from tests.util import ROOT, wait_until

Factory = Callable[..., RouterProc]
ADMIN, USER, ONE = "sk-admin-1", "sk-user-2", "sk-one-3"
PRESET = fake_model("a") + fake_model("b", extra='alias = ["bee"]')
ENDLESS = ("/logs/stream", "/models/sse")


def keys_toml(entries: dict[str, tuple[str, str, list[str]]]) -> str:
    """name -> (plain key, role, models) as a keys file (hashes only)."""
    out = []
    for name, (plain, role, models) in entries.items():
        out.append(
            f'[keys.{name}]\nsha256 = "{hash_key(plain)}"\nrole = "{role}"\n'
            + (f"models = {json.dumps(models)}\n" if models else "")
        )
    return "\n".join(out)


TEAM = {"root": (ADMIN, "admin", []), "user": (USER, "user", []), "one": (ONE, "user", ["a"])}


def route_table(tmp_path: Path) -> list[tuple[str, str]]:
    path = tmp_path / "table.toml"
    path.write_text(PRESET)
    app = RouterApp(
        Pool(load_presets(path), PoolConfig()),
        api_keys=["x"],
        responses=ResponsesConfig(tmp_path / "table-data"),
    )
    try:
        return app.route_table()
    finally:
        app.store.close()


def test_every_route_in_the_route_table_is_classified(tmp_path: Path) -> None:
    table = route_table(tmp_path)
    unclassified = [f"{m} {p}" for m, p in table if classify(m, p) is None]
    assert not unclassified, f"add these routes to router/keys/access.py's RULES: {unclassified}"
    assert len(table) > 60


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """One router for the tests that only read or load: `--keys` with TEAM, models a and b."""
    tmp = tmp_path_factory.mktemp("keys-team")
    (tmp / "keys.toml").write_text(keys_toml(TEAM))
    with running_router(tmp, PRESET, "--keys", str(tmp / "keys.toml"), headers=bearer(ADMIN)) as r:
        yield r


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def concrete(path: str) -> str:
    return path.replace("{file}", "app.js").replace("{", "").replace("}", "")


def call(c: httpx.Client, method: str, path: str, headers: dict[str, str]) -> int:
    url = concrete(path) + ("?model=a" if method == "GET" and path in PROXY_GET else "")
    if path in ENDLESS:
        with c.stream(method, url, headers=headers) as resp:
            return resp.status_code
    return c.request(method, url, json=chat("a") if method == "POST" else None, headers=headers).status_code


def test_the_route_table_walked_with_each_kind_of_key(team: RouterProc, tmp_path: Path) -> None:
    r = team
    table = route_table(tmp_path)
    with r.client() as c:
        for method, path in table:
            access = classify(method, path)
            for who, headers in (
                ("none", {}),
                ("user", bearer(USER)),
                ("one", bearer(ONE)),
                ("admin", bearer(ADMIN)),
                ("admin", {"x-api-key": ADMIN}),
            ):
                status = call(c, method, path, headers)
                if access is Access.PUBLIC or who == "admin":
                    expected: tuple[int, ...] = ()
                elif who == "none":
                    expected = (401,)
                else:
                    expected = (403,) if access is Access.ADMIN else ()
                if expected:
                    assert status in expected, (who, method, path, status)
                else:
                    assert status not in (401, 403), (who, method, path, status)
        # no key, an unknown key, a key in the wrong scheme: 401 in the route's API's envelope
        for headers in ({}, bearer("sk-nobody"), {"Authorization": f"Basic {USER}"}):
            resp = c.post("/v1/chat/completions", json=chat("a"), headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        resp = c.get("/api/tags")
        assert resp.status_code == 401 and isinstance(resp.json()["error"], str)  # Ollama's envelope
        resp = c.post("/v1/messages", json={}, headers=bearer("sk-nobody"))
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "authentication_error"
        resp = c.post("/models/unload", json={"model": "a"}, headers=bearer(USER))
        err = resp.json()["error"]
        assert resp.status_code == 403 and err["type"] == "permission_error"
        assert "'user' has role user" in err["message"] and "needs role admin" in err["message"]
        assert c.get("/models?reload=1", headers=bearer(USER)).status_code == 403  # a reload by query
        assert c.get("/models", headers=bearer(USER)).status_code == 200


def test_a_model_outside_a_keys_list_is_not_there_on_every_api(team: RouterProc) -> None:
    r = team
    msgs = [{"role": "user", "content": "hi"}]
    with r.client() as c:
        for name in ("b", "bee", "b:adapter"):
            for path in PROXY_POST:
                if classify("POST", path) is Access.USER:
                    resp = c.post(path, json=chat(name), headers=bearer(ONE))
                    assert resp.status_code == 404, (path, resp.text)
            for path, body in (
                ("/v1/responses", {"model": name, "input": "hi"}),
                ("/responses", {"model": name, "input": "hi"}),
                ("/v1/messages", {"model": name, "max_tokens": 4, "messages": msgs}),
                ("/v1/messages/count_tokens", {"model": name, "messages": msgs}),
                ("/api/chat", {"model": name, "messages": msgs}),
                ("/api/generate", {"model": name, "prompt": "hi"}),
                ("/api/embed", {"model": name, "input": "hi"}),
                ("/api/embeddings", {"model": name, "prompt": "hi"}),
                ("/api/show", {"model": name}),
            ):
                resp = c.post(path, json=body, headers=bearer(ONE))
                assert resp.status_code == 404, (path, resp.text)
            for path in (f"/v1/models/{name}", f"/props?model={name}", f"/tools?model={name}"):
                assert c.get(path, headers=bearer(ONE)).status_code == 404, path
        assert c.post("/v1/chat/completions", json=chat("b"), headers=bearer(USER)).status_code == 200
        assert c.post("/v1/chat/completions", json=chat("a"), headers=bearer(ONE)).status_code == 200

        def ids(key: str, path: str = "/v1/models") -> list[str]:
            return [m["id"] for m in c.get(path, headers=bearer(key)).json()["data"]]

        assert ids(ONE) == ["a"] and ids(ONE, "/models") == ["a"] and ids(USER) == ["a", "b"]
        tags = c.get("/api/tags", headers=bearer(ONE)).json()["models"]
        assert [m["name"] for m in tags] == ["a:latest"]
        assert [m["id"] for m in c.get("/props", headers=bearer(ONE)).json()["models"]] == ["a"]
        assert c.get("/dynamo/alpha/list-models", headers=bearer(ONE)).json()["chat_completion_models"] == [
            "a"
        ]
        with c.stream("GET", "/models/sse", headers=bearer(ONE)) as resp:
            first = next(line for line in resp.iter_lines() if line.startswith("data:"))
            assert json.loads(first[5:])["model"] == "a"


def test_model_cards_show_a_user_key_no_internals(team: RouterProc) -> None:
    r = team
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a"), headers=bearer(USER)).status_code == 200
        admin = {m["id"]: m for m in c.get("/v1/models", headers=bearer(ADMIN)).json()["data"]}["a"]
        user = {m["id"]: m for m in c.get("/v1/models", headers=bearer(USER)).json()["data"]}["a"]
        assert "args" in admin["status"] and "--parent-pid" in " ".join(admin["status"]["args"])
        assert user["status"]["value"] == "loaded" and "args" not in user["status"]
        assert str(os.getpid()) not in json.dumps(user) and str(ROOT) not in json.dumps(user)
        single = c.get("/v1/models/a", headers=bearer(USER)).json()
        props = c.get("/props", headers=bearer(USER)).json()["models"][0]
        for card in (single, props):
            assert "args" not in card["status"] and "path" not in card and "prompt_cache_disk" not in card


def test_admin_actions_leave_an_audit_line_naming_the_key(team: RouterProc) -> None:
    r = team
    with r.client() as c:
        assert c.post("/models/load", json={"model": "b"}, headers=bearer(ADMIN)).status_code == 200
        assert c.post("/models/unload", json={"model": "b"}, headers=bearer(USER)).status_code == 403
    wait_until(
        lambda: "audit: key 'root' (admin) POST /models/load -> 200" in r.log(), 10, what="the audit line"
    )
    assert "audit: key 'user'" not in r.log()  # refused: no action taken, nothing to audit
    assert ADMIN not in r.log() and USER not in r.log()


def test_reloading_the_keys_file_takes_effect_and_a_running_stream_goes_on(
    router_factory: Factory, tmp_path: Path
) -> None:
    preset = fake_model("a") + fake_model("b")
    keys = tmp_path / "keys.toml"
    keys.write_text(keys_toml({**TEAM, "temp": ("sk-temp-4", "user", [])}))
    r = router_factory(preset, "--keys", str(keys))
    # In flight until finish(), however fast the machine (the fake answers max_tokens chunks, ~750 KB).
    held = HeldStream(r, "a", headers=bearer("sk-temp-4"), max_tokens=5000)
    keys.write_text(
        keys_toml(
            {"root": (ADMIN, "admin", []), "user": (USER, "user", ["b"]), "carol": ("sk-carol-5", "user", [])}
        )
    )
    with held, r.client() as c:
        resp = c.post("/models/reload", headers=bearer(ADMIN))
        assert resp.status_code == 200, resp.text
        cards = {m["id"]: m for m in c.get("/v1/models", headers=bearer(ADMIN)).json()["data"]}
        assert cards["a"]["in_flight"] == 1  # the stream was still running when the keys changed
        assert c.post("/v1/chat/completions", json=chat("b"), headers=bearer("sk-temp-4")).status_code == 401
        assert c.post("/v1/chat/completions", json=chat("a"), headers=bearer(USER)).status_code == 404
        assert [m["id"] for m in c.get("/v1/models", headers=bearer(USER)).json()["data"]] == ["b"]
        assert c.post("/v1/chat/completions", json=chat("b"), headers=bearer("sk-carol-5")).status_code == 200
        chunks = held.finish()
        assert chunks[-1] == "[DONE]" and len(chunks) == 5002  # 5000 tokens, the finish, [DONE]: not cut

        keys.write_text("[keys.root\n")  # broken: a 400 that says why, and nothing changes
        resp = c.post("/models/reload", headers=bearer(ADMIN))
        assert resp.status_code == 400 and "keys file reload rejected" in resp.json()["error"]["message"]
        assert c.get("/v1/models", headers=bearer("sk-carol-5")).status_code == 200

        keys.write_text(keys_toml({"root": (ADMIN, "admin", []), "dave": ("sk-dave-6", "user", [])}))
        os.kill(r.proc.pid, signal.SIGHUP)
        wait_until(
            lambda: c.get("/v1/models", headers=bearer("sk-dave-6")).status_code == 200,
            10,
            what="SIGHUP to load dave's key",
        )
        assert c.get("/v1/models", headers=bearer("sk-carol-5")).status_code == 401


def omni_router(*args: str) -> subprocess.CompletedProcess[str]:
    """`omni-router ARGS` run to its end, its output captured."""
    return subprocess.run([PY, "-m", "router.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)


def test_keys_add_prints_a_key_once_and_the_file_holds_only_its_hash(
    router_factory: Factory, tmp_path: Path
) -> None:
    keys = tmp_path / "team.toml"

    def add(*args: str) -> str:
        out = omni_router("keys", "add", *args, "--file", str(keys))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    admin = add("ops", "--role", "admin")
    user = add("ann", "--models", "a", "--rpm", "100", "--concurrency", "2")
    text = keys.read_text()
    assert admin not in text and user not in text and hash_key(user) in text
    assert [(k.name, k.role.value, k.models, k.rpm) for k in load_keys(keys)] == [
        ("ops", "admin", (), None),
        ("ann", "user", ("a",), 100),
    ]
    bad = omni_router("keys", "add", "ann", "--file", str(keys))
    assert bad.returncode == 2 and "already there" in bad.stderr
    r = router_factory(PRESET, "--keys", str(keys))
    with r.client() as c:
        assert [m["id"] for m in c.get("/v1/models", headers=bearer(user)).json()["data"]] == ["a"]
        assert c.get("/keys/usage", headers=bearer(admin)).status_code == 200
        assert c.get("/keys/usage", headers=bearer(user)).status_code == 403


def test_a_bad_keys_file_stops_the_router_with_one_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.a]\nkey = "sk-plain"\n')
    preset = tmp_path / "p.toml"
    preset.write_text(PRESET)
    out = omni_router("--preset", str(preset), "--keys", str(keys))
    assert out.returncode == 2 and "keys.a.key: the file holds no plain keys" in out.stderr


def test_api_key_alone_is_one_admin_key(router_factory: Factory) -> None:
    r = router_factory(PRESET, "--api-key", "sk-solo")
    with r.client() as c:
        assert c.post("/models/load", json={"model": "a"}, headers=bearer("sk-solo")).status_code == 200
        assert c.get("/keys/usage", headers={"x-api-key": "sk-solo"}).json()["data"][0]["key"] == "api-key"
        assert c.get("/v1/models").status_code == 401


def test_without_keys_every_route_is_open_and_cards_are_whole(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    with r.client() as c:
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
        assert "args" in c.get("/v1/models/a").json()["status"]
        assert c.get("/keys/usage").json() == {"object": "list", "data": []}


def test_a_keys_line_is_bounded_and_a_client_that_leaves_it_gives_up_its_place(
    router_factory: Factory, tmp_path: Path
) -> None:
    preset = fake_model("a", "--tokens", "100", "--token-delay", "0.06")  # 6 s: outlasts the steps below
    keys = tmp_path / "keys.toml"
    keys.write_text(
        keys_toml(TEAM) + f'\n[keys.solo]\nsha256 = "{hash_key("sk-solo")}"\nconcurrency = 1\nqueue = 1\n'
    )
    r = router_factory(preset, "--keys", str(keys))
    solo = bearer("sk-solo")
    statuses: dict[str, int] = {}
    first = threading.Event()

    def stream(name: str) -> None:
        with (
            httpx.Client(base_url=r.base, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=chat("a", True), headers=solo) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    first.set()
            statuses[name] = resp.status_code

    def line() -> dict[str, Any]:
        data = httpx.get(f"{r.base}/keys/usage", headers=bearer(ADMIN), timeout=10).json()["data"]
        return {u["key"]: u for u in data}["solo"]

    running = threading.Thread(target=stream, args=("running",))
    running.start()
    assert first.wait(20)

    def leave() -> None:  # waits in line, then gives up
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{r.base}/v1/chat/completions", json=chat("a"), headers=solo, timeout=1.0)

    leaver = threading.Thread(target=leave)
    leaver.start()
    wait_until(lambda: line()["waiting"] == 1, 10, what="the request to wait in line")
    leaver.join(10)
    wait_until(lambda: line()["waiting"] == 0, 10, what="the client that left to give up its place")
    assert line()["active"] == 1  # the first stream still runs

    def wait_then_run() -> None:  # a quick answer, once the stream ahead of it is done
        resp = httpx.post(
            f"{r.base}/v1/chat/completions", json=chat("a", max_tokens=1), headers=solo, timeout=30
        )
        statuses["queued"] = resp.status_code

    queued = threading.Thread(target=wait_then_run)
    queued.start()
    wait_until(lambda: line()["waiting"] == 1, 10, what="the next request to wait in line")
    resp = httpx.post(f"{r.base}/v1/chat/completions", json=chat("a"), headers=solo, timeout=10)
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert resp.headers["retry-after"] == "1"
    running.join(30)
    queued.join(30)
    assert statuses == {"running": 200, "queued": 200}
    assert line()["models"]["a"]["requests"] == 2  # the one that left never ran
