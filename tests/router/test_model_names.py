"""Strict model names (issue 47, item 5): `"<model>:<suffix>"` routes to `<model>` only when the
suffix is one of its LoRA adapters (or `latest`, Ollama's naming); anything else is a 404 on every
route, for our own workers and for `cmd` upstreams alike. Before the fix any suffix reached the
model: `llama3:70b` reached the `llama3` upstream, and embeddings or tokenize on our workers served
the base model under a name it does not have."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from router.http.front import PROXY_GET, PROXY_POST
from tests.router.conftest import RouterProc, fake_model
from tests.util import ROOT

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
Factory = Callable[..., RouterProc]
# Routes the router serves itself (not in the proxy tables) that take a `model`.
OWN_POST = ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses")


def _body(path: str, model: str) -> dict[str, object]:
    if path == "/v1/messages/count_tokens":
        return {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/messages":
        return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    if path.startswith("/v1/responses"):
        return {"model": model, "input": "hi"}
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
            "content": "hi", "tokens": [1], "query": "q", "documents": ["d"]}


def test_an_unknown_suffix_is_a_404_on_every_route(router_factory: Factory) -> None:
    r = router_factory(f'[models.tiny]\nmodel = "{GGUF}"\nctx-size = 512\nthreads = 1\n'
                       + fake_model("llama3"))
    bad: list[str] = []
    with r.client(timeout=30) as c:
        for model in ("tiny:unknown", "llama3:70b", "nope", "nope:latest"):
            for path in (*PROXY_POST, *OWN_POST):
                resp = c.post(path, json=_body(path, model))
                error = resp.json().get("error") if resp.headers.get("content-type", "").startswith(
                    "application/json") else None
                if resp.status_code != 404 or not isinstance(error, dict) or "not_found" not in str(
                        error.get("type")):
                    bad.append(f"POST {path} {model}: {resp.status_code} {resp.text[:120]}")
            for path in PROXY_GET:
                resp = c.get(path, params={"model": model})
                if resp.status_code != 404:
                    bad.append(f"GET {path}?model={model}: {resp.status_code} {resp.text[:120]}")
            resp = c.post("/slots/0", params={"action": "erase", "model": model}, json={})
            if resp.status_code != 404:
                bad.append(f"POST /slots/0 {model}: {resp.status_code}")
    assert not bad, "\n".join(bad)
    assert r.status("tiny") == "unloaded" and r.status("llama3") == "unloaded"  # nothing was loaded


def test_name_latest_is_the_model_itself(router_factory: Factory) -> None:
    r = router_factory(f'[models.tiny]\nmodel = "{GGUF}"\nctx-size = 512\nthreads = 1\n')
    with r.client(timeout=60) as c:
        chat = c.post("/v1/chat/completions", json={"model": "tiny:latest", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text  # the worker got "tiny", not an adapter "latest"
        tokens = c.post("/tokenize", json={"model": "tiny:latest", "content": "hello"})
        assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text
    card = httpx.get(f"{r.base}/v1/models/tiny:latest", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == "tiny"
