"""End to end: the router spawning real `omni-worker` processes on the tiny models."""

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

import openai
import pytest

from tests.router.conftest import HeldStream, RouterProc, chat, kill_router_and_expect_no_workers, stream_chat
from tests.util import ROOT, preset_defaults, wait_until

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
HF = ROOT / "models" / "tiny-llama"

pytestmark = pytest.mark.skipif(not (GGUF.exists() and (HF / "config.json").exists()),
                                reason="tiny models not generated (make models)")

PRESET = f"""
{preset_defaults(1024)}
[models.tiny-gguf]
model = "{GGUF}"
backend = "llama_cpp"

[models.tiny-hf]
model = "{HF}"
backend = "torch"
"""


def test_autoload_joins_one_worker_and_the_openai_sdk_works(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    max_workers = 0

    def one(_: int) -> int:
        with r.client(timeout=60) as c:
            return c.post("/v1/chat/completions", json=chat("tiny-gguf", max_tokens=4)).status_code

    with ThreadPoolExecutor(10) as ex:
        futures = [ex.submit(one, i) for i in range(10)]
        while not all(f.done() for f in futures):
            max_workers = max(max_workers, len(r.workers()))
            time.sleep(0.02)
        assert [f.result() for f in futures] == [200] * 10
    assert max_workers == 1 and len(r.workers()) == 1
    card = r.models()["tiny-gguf"]
    assert card["status"]["value"] == "loaded" and card["meta"]["backend"] == "llama_cpp"
    flag, path = card["status"]["args"][3:5]
    assert flag == "--model" and Path(path).resolve() == GGUF.resolve()  # (models/ may be a symlink)

    with r.client(timeout=60) as c:  # the other proxied routes: model from the body or ?model=
        tokens = c.post("/tokenize?model=tiny-gguf", json={"content": "hello"}).json()["tokens"]
        assert (
            tokens and c.post("/detokenize", json={"model": "tiny-gguf", "tokens": tokens}).status_code == 200
        )
        assert (
            c.post("/v1/completions", json={"model": "tiny-gguf", "prompt": "a", "max_tokens": 2}).status_code
            == 200
        )
        assert c.get("/props", params={"model": "tiny-gguf"}).json().get("role") != "router"
        assert c.get("/slots", params={"model": "tiny-gguf"}).status_code == 200
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="unused")
    out = client.chat.completions.create(
        model="tiny-gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert out.usage is not None and out.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model="tiny-gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_models_max_1_alternating_real_models_never_aborts_a_stream(router_factory: Factory) -> None:
    r = router_factory(PRESET, "--models-max", "1")
    for first, second in (("tiny-gguf", "tiny-hf"), ("tiny-hf", "tiny-gguf")):
        # first is in flight until finish() (max_tokens: within a slot's 512 of context)
        with HeldStream(r, first, max_tokens=400) as held:
            result: dict[str, Any] = {}

            def ask_second(model: str = second, out: dict[str, Any] = result) -> None:
                with r.client(timeout=60) as c:
                    out["resp"] = c.post("/v1/chat/completions", json=chat(model, max_tokens=4))

            t = threading.Thread(target=ask_second)
            t.start()
            r.wait_status(second, "loading", timeout=30)  # waits for the only slot, which first holds
            assert t.is_alive() and r.models()[first]["in_flight"] == 1 and r.status(first) == "loaded"
            events = held.finish()  # first drains: its stream ends in full, then second loads
        t.join(60)
        assert result["resp"].status_code == 200, result["resp"].text
        assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
        finish = [
            json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e)["choices"]
        ]
        assert finish[-1] == "length"
        assert r.status(second) == "loaded" and r.status(first) == "unloaded"
        assert len(r.workers()) == 1


def test_kill_9_mid_stream_gives_an_error_event_then_recovers(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    with r.client(timeout=60) as c:
        assert c.post("/v1/chat/completions", json=chat("tiny-gguf", max_tokens=2)).status_code == 200
    (worker,) = r.workers()
    def kill_at_third(n: int) -> None:
        if n == 3:
            os.kill(worker.pid, signal.SIGKILL)

    events = stream_chat(r, "tiny-gguf", on_chunk=kill_at_third, timeout=60, max_tokens=3000, ignore_eos=True)
    assert "error" in json.loads(events[-1]), events[-3:]
    card = r.wait_status("tiny-gguf", "failed")
    assert card["status"]["exit_code"] == -9 and card["status"]["log_tail"]
    with r.client(timeout=60) as c:  # recovers on the next request
        assert c.post("/v1/chat/completions", json=chat("tiny-gguf", max_tokens=2)).status_code == 200
    assert r.status("tiny-gguf") == "loaded"
    (worker,) = r.workers()
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="unused")
    s = client.chat.completions.create(model="tiny-gguf", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="mid-stream"):  # the SDK raises the error event
        for i, _ in enumerate(s):
            if i == 2:
                os.kill(worker.pid, signal.SIGKILL)


def test_idle_sleep_and_transparent_wake(router_factory: Factory) -> None:
    r = router_factory(PRESET, "--sleep-idle-seconds", "0.5")
    with r.client(timeout=60) as c:
        assert c.post("/v1/chat/completions", json=chat("tiny-gguf", max_tokens=2)).status_code == 200
        (worker,) = r.workers()
        r.wait_status("tiny-gguf", "sleeping", timeout=10)
        resp = c.post("/v1/chat/completions", json=chat("tiny-gguf", max_tokens=2))
        assert resp.status_code == 200
        assert [w.pid for w in r.workers()] == [worker.pid]  # woken, not respawned
        assert r.status("tiny-gguf") == "loaded"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_router_death_leaves_no_real_worker(router_factory: Factory, sig: signal.Signals) -> None:
    r = router_factory(PRESET.replace('backend = "torch"', 'backend = "torch"\nload-on-startup = true'))
    r.wait_status("tiny-hf", "loaded", timeout=60)
    with r.client(timeout=60) as c:
        assert c.post("/v1/chat/completions", json=chat("tiny-gguf", max_tokens=2)).status_code == 200
    kill_router_and_expect_no_workers(r, sig, n_workers=2, timeout=10)


def test_lru_victim_queue_full_and_api_key_with_real_workers(router_factory: Factory) -> None:
    gguf16 = ROOT / "models" / "tiny-llama-f16.gguf"
    # One slot with the whole context each, so the long streams below really are long.
    preset = "".join(f'[models.{name}]\nmodel = "{path}"\nthreads = 1\nparallel = 1\nctx-size = 4096\n\n'
                     for name, path in (("a", GGUF), ("b", gguf16), ("c", GGUF)))
    r = router_factory(preset, "--models-max", "2", "--max-queue", "1", "--api-key", "sekret")
    auth = {"Authorization": "Bearer sekret"}
    with r.client(timeout=60, headers=auth) as c:
        assert c.post("/v1/chat/completions", json=chat("a", max_tokens=2), headers={"Authorization": ""}
                      ).status_code == 401
        for name in ("a", "b", "a", "c"):
            assert c.post("/v1/chat/completions", json=chat(name, max_tokens=2)).status_code == 200
    states = {name: m["status"]["value"] for name, m in r.models().items()}
    assert states == {"a": "loaded", "b": "unloaded", "c": "loaded"}  # b was least recently used

    # Both slots busy, held in flight by their clients: one b request waits (the LRU busy model is
    # drained), the next finds the queue full.
    held = [HeldStream(r, m) for m in ("a", "c")]
    waiting: dict[str, int] = {}
    t = threading.Thread(target=lambda: waiting.update(code=r.client(timeout=60, headers=auth).post(
        "/v1/chat/completions", json=chat("b", max_tokens=2)).status_code))
    t.start()
    # Waiting = queued for a slot or loading ("queued" is shown only when a slot is not granted at
    # once; the estimate no longer takes long enough to be seen): the queue is full either way.
    wait_until(lambda: r.models()["b"]["status"]["value"] == "loading", 10)
    with r.client(timeout=60, headers=auth) as c:
        resp = c.post("/v1/chat/completions", json=chat("b", max_tokens=2))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    # the victim drains: both streams go on
    assert all(r.models()[m]["in_flight"] == 1 for m in ("a", "c")) and t.is_alive()
    for h in held:  # the clients leave: their streams are cancelled, a slot frees up
        h.close()
    t.join(60)
    assert waiting["code"] == 200
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="sekret")
    assert client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{r.base}/v1", api_key="wrong").models.list()


def test_a_model_that_fails_to_load_is_failed_with_the_workers_exit_code(router_factory: Factory,
                                                                          tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    r = router_factory(f'[models.bad]\nmodel = "{bad}"\nbackend = "llama_cpp"\n')
    with r.client(timeout=60) as c:
        resp = c.post("/v1/chat/completions", json=chat("bad"))
    assert (
        resp.status_code == 500 and "failed to load" in resp.json()["error"]["message"]
    )  # permanent: not a 503
    status = r.models()["bad"]["status"]
    assert (status["value"], status["failed"], status["exit_code"]) == ("failed", True, 1)
    assert any("bad.gguf" in line for line in status["log_tail"])


def test_llama_cpp_readme_preset_serves(router_factory: Factory) -> None:
    """The example preset of llama.cpp's server README (tests/router/test_presets.py) runs as written,
    the tiny GGUF in place of its file paths: both models answer, the section's settings reach the worker."""
    from tests.router.test_presets import README_PRESET

    r = router_factory(README_PRESET.format(m=GGUF), suffix=".ini")
    for name in ("ggml-org/MY-MODEL-GGUF:Q8_0", "custom_model"):
        with r.client(timeout=120) as c:
            res = c.post("/v1/chat/completions", json=chat(name, max_tokens=4))
            assert res.status_code == 200, res.text
    args = r.models()["ggml-org/MY-MODEL-GGUF:Q8_0"]["status"]["args"]
    assert (
        args[args.index("--ctx-size") + 1] == "4096" and args[args.index("--chat-template") + 1] == "chatml"
    )
    assert "--jinja" in args and args[args.index("--cache-ram") + 1] == "0"
    with r.client(timeout=60) as c:  # llama-server's token count, routed by the body's model
        body = {"model": "custom_model", "messages": [{"role": "user", "content": "Hello world"}]}
        assert c.post("/chat/completions/input_tokens", json=body).json()["input_tokens"] > 2


def test_slot_files_through_the_router(router_factory: Factory, tmp_path: Path) -> None:
    """`slot-save-path` in a preset, and llama-server's `POST /slots/{id}?action=` routed by `?model=`."""
    r = router_factory(f'[models.tiny]\nmodel = "{GGUF}"\nctx-size = 512\nparallel = 1\nthreads = 1\n'
                       f'slot-save-path = "{tmp_path}"\n')
    with r.client(timeout=60) as c:
        assert (
            c.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 2}
            ).status_code
            == 200
        )
        saved = c.post("/slots/0", params={"action": "save", "model": "tiny"}, json={"filename": "s0.bin"})
        assert saved.status_code == 200 and saved.json()["n_saved"] > 0, saved.text
        assert (tmp_path / "s0.bin").exists()
        restored = c.post("/slots/0?action=restore&model=tiny", json={"filename": "s0.bin"})
        assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"]
        assert c.post("/slots/0?action=erase&model=tiny", json={}).status_code == 200
        bad = c.post("/slots/0?action=save&model=tiny", json={"filename": "../x.bin"})
        assert bad.status_code == 400 and "error" in bad.json()
        assert c.post("/slots/0?action=save&model=nope", json={"filename": "a"}).status_code == 404
        odd = c.post(
            "/slots/%C2%96m?action=save&model=tiny", json={"filename": "a"}
        )  # forwarded still encoded
        assert odd.status_code == 400 and odd.headers["content-type"].startswith("application/json"), odd.text
