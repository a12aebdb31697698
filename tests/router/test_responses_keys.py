"""Stored responses and conversations belong to the key that made them (a real router with
`--keys`, the tiny model and the fake `slow` upstream, real HTTP).

The bug: every key shared the Responses API's store, so a user key that knew an id could read,
continue, edit or delete another key's response or conversation. Now another user key gets the
very 404 an id that does not exist gets, on every route; admin keys see all; rows from a store
file written before owners (no `owner` column) are admin-only.

One router serves the module; its data dir starts with such an old store file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.test_keys import keys_toml
from tests.router.test_responses import GGUF, Router
from tests.router.test_responses_translate import OLD_CONV, OLD_RESP, write_old_store
from tests.util import HTTP, stop_process

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")

ANN, BOB, OPS = "sk-ann-1", "sk-bob-2", "sk-ops-3"
TEAM = {"ann": (ANN, "user", []), "bob": (BOB, "user", []), "ops": (OPS, "admin", [])}
NO_RESP, NO_CONV = "resp_nobodyhasthisid", "conv_nobodyhasthisid"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("responses-keys")
    write_old_store(tmp / "data" / "responses.sqlite3")
    (tmp / "keys.toml").write_text(keys_toml(TEAM))
    r = Router(tmp, "--keys", str(tmp / "keys.toml"))
    yield r
    stop_process(r.proc)


def call(r: Router, key: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return HTTP.request(method, r.base + path, json=body, headers={"Authorization": f"Bearer {key}"},
                         timeout=60)


def ok(r: Router, key: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    resp = call(r, key, method, path, body)
    assert resp.status_code == 200, (method, path, resp.text)
    return resp.json()


def ask(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "hi", "max_output_tokens": 2, **fields}


def calls_on(rid: str, cid: str, item_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every route that reads, continues, changes or deletes response `rid` or conversation `cid`."""
    msg = {"type": "message", "role": "user", "content": "sneaked in"}
    return [
        ("GET", f"/v1/responses/{rid}", None),
        ("GET", f"/v1/responses/{rid}?stream=true", None),
        ("GET", f"/v1/responses/{rid}/input_items", None),
        ("POST", f"/v1/responses/{rid}/cancel", None),
        ("POST", "/v1/responses", ask(previous_response_id=rid)),
        ("POST", "/v1/responses", ask(conversation=cid)),
        ("GET", f"/v1/conversations/{cid}", None),
        ("POST", f"/v1/conversations/{cid}", {"metadata": {"owner": "bob"}}),
        ("GET", f"/v1/conversations/{cid}/items", None),
        ("POST", f"/v1/conversations/{cid}/items", {"items": [msg]}),
        ("GET", f"/v1/conversations/{cid}/items/{item_id}", None),
        ("DELETE", f"/v1/conversations/{cid}/items/{item_id}", None),
        ("DELETE", f"/v1/conversations/{cid}", None),
        ("DELETE", f"/v1/responses/{rid}", None),
    ]


def assert_not_there(r: Router, key: str, rid: str, cid: str, item_id: str) -> None:
    """Each call on `rid`/`cid` answers exactly what the same call on ids nobody has answers."""
    real = calls_on(rid, cid, item_id)
    absent = calls_on(NO_RESP, NO_CONV, item_id)
    for (method, path, body), (_, nope_path, nope_body) in zip(real, absent, strict=True):
        got = call(r, key, method, path, body)
        nope = call(r, key, method, nope_path, nope_body)
        expected = json.loads(nope.text.replace(NO_RESP, rid).replace(NO_CONV, cid))
        assert nope.status_code in (400, 404), (method, nope_path, nope.text)
        assert (got.status_code, got.json()) == (nope.status_code, expected), (method, path)


def test_another_user_key_finds_nothing_of_a_keys_responses_and_conversations(router: Router) -> None:
    r = router
    first = ok(r, ANN, "POST", "/v1/responses", ask())
    conv = ok(r, ANN, "POST", "/v1/conversations",
              {"items": [{"type": "message", "role": "user", "content": "mine"}], "metadata": {"k": "v"}})
    item_id = ok(r, ANN, "GET", f"/v1/conversations/{conv['id']}/items")["data"][0]["id"]

    assert_not_there(r, BOB, first["id"], conv["id"], item_id)

    # ann still has all of it, untouched by bob's tries, and can continue both
    assert ok(r, ANN, "GET", f"/v1/responses/{first['id']}")["id"] == first["id"]
    assert len(ok(r, ANN, "GET", f"/v1/responses/{first['id']}/input_items")["data"]) == 1
    assert ok(r, ANN, "GET", f"/v1/conversations/{conv['id']}")["metadata"] == {"k": "v"}
    items = ok(r, ANN, "GET", f"/v1/conversations/{conv['id']}/items")["data"]
    assert [it["id"] for it in items] == [item_id]
    second = ok(r, ANN, "POST", "/v1/responses", ask(previous_response_id=first["id"]))
    ok(r, ANN, "POST", "/v1/responses", ask(conversation=conv["id"]))
    assert len(ok(r, ANN, "GET", f"/v1/conversations/{conv['id']}/items")["data"]) == 3

    # the chain ann made is hers too: bob cannot continue from its newest link either
    nope = call(r, BOB, "POST", "/v1/responses", ask(previous_response_id=second["id"]))
    assert nope.status_code == 404 and nope.json()["error"]["param"] == "previous_response_id"

    # bob's own conversation is his; ann finds nothing of it
    bobs = ok(r, BOB, "POST", "/v1/conversations", {})
    assert ok(r, BOB, "GET", f"/v1/conversations/{bobs['id']}")["id"] == bobs["id"]
    assert call(r, ANN, "GET", f"/v1/conversations/{bobs['id']}").status_code == 404

    # an admin key sees and continues everyone's; its edit does not take the conversation from ann
    assert ok(r, OPS, "GET", f"/v1/responses/{second['id']}")["id"] == second["id"]
    ok(r, OPS, "POST", "/v1/responses", ask(previous_response_id=second["id"]))
    ok(r, OPS, "POST", f"/v1/conversations/{conv['id']}", {"metadata": {"k": "ops"}})
    assert ok(r, ANN, "GET", f"/v1/conversations/{conv['id']}")["metadata"] == {"k": "ops"}
    ok(r, OPS, "DELETE", f"/v1/responses/{first['id']}")
    assert call(r, ANN, "GET", f"/v1/responses/{first['id']}").status_code == 404
    ok(r, OPS, "DELETE", f"/v1/conversations/{conv['id']}")
    assert call(r, ANN, "GET", f"/v1/conversations/{conv['id']}").status_code == 404


def test_another_user_key_finds_nothing_of_a_running_background_response(router: Router) -> None:
    r = router
    live = ok(r, ANN, "POST", "/v1/responses", {"model": "slow", "input": "hi", "background": True})
    assert_not_there(r, BOB, live["id"], NO_CONV, "msg_none")  # neither read, followed, cancelled nor deleted
    assert ok(r, ANN, "GET", f"/v1/responses/{live['id']}")["status"] in ("queued", "in_progress")
    assert ok(r, ANN, "POST", f"/v1/responses/{live['id']}/cancel")["status"] == "cancelled"


def test_rows_of_a_store_file_from_before_owners_are_admin_only(router: Router) -> None:
    r = router
    assert_not_there(r, ANN, OLD_RESP, OLD_CONV, "msg_old")
    assert ok(r, OPS, "GET", f"/v1/responses/{OLD_RESP}")["id"] == OLD_RESP
    assert ok(r, OPS, "GET", f"/v1/responses/{OLD_RESP}/input_items")["data"][0]["id"] == "msg_old"
    assert ok(r, OPS, "GET", f"/v1/conversations/{OLD_CONV}/items")["data"][0]["id"] == "msg_old"
