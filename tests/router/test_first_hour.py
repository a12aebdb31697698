"""Issue 25, "a new user's first hour", over real processes: a real router, real workers on the
tiny GGUF, and the openai SDK with its default retries where retries were the problem."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.router.conftest import RouterProc, chat
from tests.util import ROOT, preset_defaults, wait_until

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
Factory = Callable[..., RouterProc]


def _counting_client(base: str) -> tuple[openai.OpenAI, list[int]]:
    """The openai SDK with its default retries (2), counting every HTTP attempt it makes."""
    attempts: list[int] = []
    http = httpx.Client(event_hooks={"response": [lambda r: attempts.append(r.status_code)]}, timeout=60)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", http_client=http), attempts


def _spawns(r: RouterProc, name: str) -> int:
    return r.log().count(f"model {name}: spawned pid")


def test_a_file_that_is_not_a_gguf_is_one_spawn_for_one_sdk_call_bug_it_was_three(router_factory: Factory,
                                                                                  tmp_path: Path) -> None:
    """Bug: the failed load answered 503 with Retry-After: 1, the openai SDK retried it twice,
    and each retry spawned the worker again (3 spawns, 8 s). Reproduced with the SDK's default
    retries on a file that is not a GGUF: one attempt, one spawn, a 500 that says so in one line."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    r = router_factory(f'{preset_defaults(256)}[models.bad]\nmodel = "{bad}"\n'
                       f'[models.good]\nmodel = "{GGUF}"\n')
    client, attempts = _counting_client(r.base)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(
                model="bad", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert e.value.response.headers.get("x-should-retry") == "false"
        assert "retry-after" not in e.value.response.headers
        err = e.value.response.json()["error"]
        assert err["code"] == "model_load_failed" and "invalid magic characters" in err["message"]
        assert "\n" not in err["message"] and " | " not in err["message"] and err["log_tail"]
    assert attempts == [500, 500]  # one attempt per call: the SDK did not retry
    assert _spawns(r, "bad") == 1  # the second call was answered from the failure, no respawn
    status = r.models()["bad"]["status"]
    assert (status["value"], status["permanent"], status["exit_code"]) == ("failed", True, 1)
    assert status["error"] == "invalid magic characters: 'not ', expected 'GGUF'"
    assert any("bad.gguf" in line for line in status["log_tail"])
    assert client.chat.completions.create(
        model="good", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )

    # An explicit load tries again; so does a request once the file has changed.
    with r.client() as c:
        assert c.post("/models/load", json={"model": "bad"}).status_code == 200
    wait_until(
        lambda: _spawns(r, "bad") == 2 and r.status("bad") == "failed", 60, what="explicit reload failed"
    )
    bad.write_bytes(GGUF.read_bytes())
    client.chat.completions.create(model="bad", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert _spawns(r, "bad") == 3 and r.status("bad") == "loaded"


def test_embeddings_on_a_chat_model_are_one_501_the_sdk_does_not_retry_bug_it_was_counted_twice(
        router_factory: Factory) -> None:
    """Bug: the 501 was retried by the openai SDK (2 calls reached the worker 4 times)."""
    r = router_factory(f'{preset_defaults(256)}[models.chat]\nmodel = "{GGUF}"\n')
    client, attempts = _counting_client(r.base)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as e:
            client.embeddings.create(model="chat", input="hello")
        assert e.value.status_code == 501 and e.value.response.headers.get("x-should-retry") == "false"
    assert attempts == [501, 501]


def test_the_load_shows_its_phases_and_the_router_logs_the_load_time(router_factory: Factory) -> None:
    """/models/sse shows estimating memory -> spawning -> starting -> the worker's own phases
    (loading weights with a fraction) -> loaded; the router logs "loaded in X s" at INFO."""
    r = router_factory(f'{preset_defaults(256)}[models.a]\nmodel = "{GGUF}"\n')
    phases: list[str] = []
    with httpx.stream("GET", f"{r.base}/models/sse", timeout=60) as events, r.client() as c:
        assert c.post("/models/load", json={"model": "a"}).status_code == 200
        for line in events.iter_lines():
            if not line.startswith("data:"):
                continue
            data = json.loads(line[5:])
            st = data.get("status") if isinstance(data, dict) else None
            if not isinstance(st, dict) or data.get("model") != "a":
                continue
            phase = (st.get("progress") or {}).get("phase") or st["value"]
            if not phases or phases[-1] != phase:
                phases.append(phase)
            if st["value"] == "loaded":
                break
    assert phases[:4] == ["unloaded", "estimating memory", "spawning", "starting"], (
        phases
    )  # (the tiny model's
    # own phases pass between two polls of /health; bench/first_load.py shows them on SmolLM2)
    assert phases[-1] == "loaded"
    log = r.log()
    assert (
        "model a: memory estimate" in log and "model a: loaded in" in log and "the worker's own load" in log
    )


def test_a_chat_completion_after_a_permanent_failure_of_another_model_is_served(router_factory: Factory,
                                                                               tmp_path: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(
        GGUF.read_bytes()[:4000]
    )  # a header, then nothing: llama.cpp's "not within the file bounds"
    r = router_factory(f'{preset_defaults(256)}[models.cut]\nmodel = "{bad}"\n[models.a]\nmodel = "{GGUF}"\n')
    with r.client(timeout=60) as c:
        resp = c.post("/v1/chat/completions", json=chat("cut"))
        assert resp.status_code == 500 and resp.headers["x-should-retry"] == "false"
        assert c.post("/v1/chat/completions", json=chat("a")).status_code == 200
    msg = resp.json()["error"]["message"]
    assert "failed to load" in msg and "\n" not in msg


def test_hints_name_the_preset_key_through_the_router_bug_they_named_worker_flags(
    router_factory: Factory,
) -> None:
    """Bug: through the router, "Start it with `--embeddings`" and "try increasing --ctx-size"
    gave advice for a process the user never starts. Reproduced with embeddings on a chat model
    and a prompt longer than a slot (ctx-size 256 / parallel 2 = 128 cells)."""
    r = router_factory(f'{preset_defaults(256)}[models.chat]\nmodel = "{GGUF}"\n')
    with r.client(timeout=60) as c:
        emb = c.post("/v1/embeddings", json={"model": "chat", "input": "hi"}).json()["error"]["message"]
        long = c.post(
            "/v1/chat/completions", json=chat("chat", messages=[{"role": "user", "content": "word " * 300}])
        )
    assert "Set `embedding = true` in the preset of model 'chat'" in emb and "--embeddings" not in emb
    msg = long.json()["error"]["message"]
    assert (
        long.status_code == 400
        and "raise `ctx-size` (or lower `parallel`) in the preset of model 'chat'" in msg
    )
    assert "ctx-size 256 / parallel 2 = 128 cells" in msg and "--ctx-size" not in msg


def test_worker_flags_in_a_preset_reach_the_worker(router_factory: Factory) -> None:
    """`n-predict` (any omni-worker flag by its long name) caps every request's tokens."""
    r = router_factory(f'{preset_defaults(256)}[models.a]\nmodel = "{GGUF}"\nn-predict = 3\ntemp = 0\n')
    with r.client(timeout=60) as c:
        body = c.post(
            "/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}]}
        )
        props = c.get("/props", params={"model": "a"}).json()
    assert body.status_code == 200, body.text
    assert body.json()["usage"]["completion_tokens"] <= 3
    assert props["default_generation_settings"]["params"]["temperature"] == 0


def test_a_missing_model_file_fails_that_model_only_bug_it_stopped_the_router(router_factory: Factory,
                                                                             tmp_path: Path) -> None:
    """Bug: `models.ghost.model: ... does not exist` stopped the whole router. Now the router
    starts, prints a banner naming it, serves the others, answers for it at once (a 503
    `model_misconfigured` the SDK does not retry: the configuration's fault, no server crash)
    and loads it once the file is there. With --log-level debug, polling
    /health during a load writes no httpcore lines."""
    ghost = tmp_path / "later" / "ghost.gguf"
    r = router_factory(f'{preset_defaults(256)}[models.ghost]\nmodel = "later/ghost.gguf"\n'
                       f'[models.a]\nmodel = "{GGUF}"\n', "--log-level", "debug")
    log = r.log()
    assert "omni-router: 2 models, 1 with a missing file" in log
    assert "model path 'later/ghost.gguf' does not exist (looked in the current directory" in log
    assert f"web UI: {r.base}/" in log and "logs:" in log
    card = r.models()["ghost"]
    assert card["status"]["value"] == "failed" and card["status"]["permanent"] is True
    client, attempts = _counting_client(r.base)
    with pytest.raises(openai.InternalServerError, match="does not exist"):
        client.chat.completions.create(
            model="ghost", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert attempts == [503] and _spawns(r, "ghost") == 0
    assert client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    ghost.parent.mkdir()
    ghost.write_bytes(GGUF.read_bytes())  # beside the preset file, where the message said
    assert client.chat.completions.create(
        model="ghost", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    log = r.log()
    assert "httpcore" not in log and "model a: loaded in" in log
