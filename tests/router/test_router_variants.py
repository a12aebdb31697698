"""Variants (`variant-of`) through a real router on a tiny GGUF model: one worker serves the base
and its variants; a variant's defaults go into each request under the request's own fields, on
every API (chat completions, text completions, the Responses API through the bridge); the same
prompt through two variants reuses the worker's prompt cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.router.conftest import RouterProc, chat, fake_model, running_router
from tests.router.test_keys import bearer, keys_toml
from tests.util import ROOT, preset_defaults

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
needs_tiny = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")

SYSTEM = "You answer like a pirate, in few words."
PRESET = f"""{preset_defaults(512)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"
parallel = 1
temp = 1.5
seed = 7

[models.pirate]
variant-of = "tiny"
temp = 0
n-predict = 12
system-prompt = "{SYSTEM}"

[models.pirate-wide]
variant-of = "tiny"
top-k = 5
temp = 0
n-predict = 12
system-prompt = "{SYSTEM}"
"""
USER = [{"role": "user", "content": "Where is the treasure?"}]


def post(r: RouterProc, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with r.client(timeout=120) as c:
        resp = c.post(path, json=body)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out


def text(out: dict[str, Any]) -> str:
    return str(out["choices"][0]["message"]["content"])


@needs_tiny
def test_a_variant_answers_with_its_own_defaults_from_its_base_worker(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    cards = r.models()
    assert cards["pirate"]["variant_of"] == "tiny" and cards["pirate"]["defaults"] == {
        "temperature": 0.0,
        "n_predict": 12,
        "system_prompt": SYSTEM,
    }
    assert [m for m in cards if m.startswith("pirate")] == ["pirate", "pirate-wide"]

    variant = post(r, "/v1/chat/completions", {"model": "pirate", "messages": USER})
    assert variant["model"] == "pirate"  # the name the client asked for
    # KV reuse across variants (one worker, one slot here): the same prompt through the other
    # variant finds it cached, as much as the same variant's own repeat does
    wide = post(r, "/v1/chat/completions", {"model": "pirate-wide", "messages": USER})
    again = post(r, "/v1/chat/completions", {"model": "pirate", "messages": USER})
    cached = wide["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > variant["usage"]["prompt_tokens"] // 2
    assert cached == again["usage"]["prompt_tokens_details"]["cached_tokens"]

    same_through_base = post(
        r,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "system", "content": SYSTEM}, *USER],
            "temperature": 0,
            "max_tokens": 12,
            "cache_prompt": False,  # computed afresh, as `variant` (the first request) was: the same sums
        },
    )
    assert text(variant) == text(same_through_base)  # exactly what its defaults mean
    without = post(
        r,
        "/v1/chat/completions",
        {"model": "tiny", "messages": USER, "temperature": 0, "max_tokens": 12, "cache_prompt": False},
    )
    assert text(without) != text(variant)  # the system prompt changed the answer
    assert variant["usage"]["prompt_tokens"] == same_through_base["usage"]["prompt_tokens"]
    assert variant["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]

    # the request's own fields win over the variant's
    short = post(r, "/v1/chat/completions", {"model": "pirate", "messages": USER, "max_tokens": 2})
    assert short["usage"]["completion_tokens"] <= 2
    own_system = post(
        r,
        "/v1/chat/completions",
        {"model": "pirate", "messages": [{"role": "system", "content": "Be terse."}, *USER]},
    )
    assert own_system["usage"]["prompt_tokens"] != variant["usage"]["prompt_tokens"]

    # text completions take the sampling defaults; the Responses API goes through the bridge
    completion = post(r, "/v1/completions", {"model": "pirate", "prompt": "Once upon a time"})
    assert completion["usage"]["completion_tokens"] <= 12
    reply = post(r, "/v1/responses", {"model": "pirate", "input": "Where is the treasure?"})
    assert reply["status"] == "incomplete"  # its n-predict (12 tokens) ended it
    assert reply["usage"]["input_tokens"] == variant["usage"]["prompt_tokens"]  # its system prompt too

    assert len(r.workers()) == 1  # base and both variants: one process, loaded once
    assert r.log().count("model tiny: spawning") == 1
    for name in ("tiny", "pirate", "pirate-wide"):
        assert cards[name]["status"]["value"] == "unloaded"  # (the cards were read before the first load)


def test_a_key_sees_and_uses_a_variant_it_may_use_and_no_other(tmp_path: Path) -> None:
    """keys (router.keys): a variant is there for a key that may use its name or its base's."""
    preset = (fake_model("a") + fake_model("b") + '[models.a-precise]\nvariant-of = "a"\ntemp = 0\n'
              + '[models.b-precise]\nvariant-of = "b"\ntemp = 0\n')
    base_key, variant_key = "sk-base-1", "sk-variant-2"
    (tmp_path / "keys.toml").write_text(keys_toml({"base": (base_key, "user", ["a"]),
                                                   "variant": (variant_key, "user", ["b-precise"])}))
    with running_router(tmp_path, preset, "--keys", str(tmp_path / "keys.toml")) as r, r.client() as c:
        def ids(key: str) -> list[str]:
            return [m["id"] for m in c.get("/v1/models", headers=bearer(key)).json()["data"]]

        def status(key: str, model: str) -> int:
            return c.post("/v1/chat/completions", json=chat(model), headers=bearer(key)).status_code

        assert ids(base_key) == ["a", "a-precise"] and ids(variant_key) == ["b-precise"]
        assert [status(base_key, m) for m in ("a", "a-precise", "b", "b-precise")] == [200, 200, 404, 404]
        assert [status(variant_key, m) for m in ("b-precise", "b", "a-precise")] == [200, 404, 404]
