"""Worker process lifecycle on the tiny GGUF: load failure, sleep/wake, SIGTERM, parent death,
and a KV cache too small for the load (preemption, context full). Each test owns its process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.util import HTTP, wait_until
from tests.worker.conftest import EXACT_GGUF_ARGS, worker_process
from worker.testing.tiny_models import ModelPaths


def _complete(url: str, **body: Any) -> dict[str, Any]:
    r = HTTP.post(url + "/v1/completions", json={"temperature": 0, "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_load_failure_reports_500_and_exits_nonzero(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with worker_process(bad, wait_healthy=False) as (proc, url):
        seen: list[int] = []

        def health_or_exit() -> bool:
            if proc.poll() is not None:
                return True
            try:
                r = HTTP.get(url + "/health", timeout=1)
            except httpx.HTTPError:
                return False
            seen.append(r.status_code)
            if r.status_code == 500:
                assert r.json()["error"]["type"] == "server_error"
            return False

        wait_until(health_or_exit, timeout=20, interval=0.02, what="the worker to exit")
        assert proc.returncode == 1
        assert 200 not in seen


def test_sleep_and_wake(tiny_models: ModelPaths) -> None:
    with worker_process(tiny_models.gguf_f32, *EXACT_GGUF_ARGS) as (_, url):
        before = _complete(url, prompt="sleepy", max_tokens=8)["choices"][0]["text"]
        _complete(url, prompt="another prompt, so the first one goes to the RAM prompt cache", max_tokens=2)
        assert "omni:prompt_cache_entries 1.0" in HTTP.get(url + "/metrics").text
        assert HTTP.post(url + "/sleep").json() == {"status": "sleeping"}
        assert "omni:prompt_cache_entries 0.0" in HTTP.get(url + "/metrics").text  # sleep frees it too
        assert HTTP.get(url + "/health").json() == {"status": "ok", "is_sleeping": True}
        assert HTTP.get(url + "/props").json()["is_sleeping"] is True
        # Any inference request wakes the model transparently.
        assert _complete(url, prompt="sleepy", max_tokens=8)["choices"][0]["text"] == before
        assert HTTP.get(url + "/health").json()["is_sleeping"] is False
        HTTP.post(url + "/sleep")
        assert HTTP.post(url + "/wake").json()["status"] == "ok"
        assert HTTP.get(url + "/health").json()["is_sleeping"] is False


def test_sigterm_during_stream_exits_zero_fast(tiny_models: ModelPaths) -> None:
    with worker_process(tiny_models.gguf_f32) as (proc, url):
        body = {"prompt": "long", "ignore_eos": True, "stream": True}
        with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            for _ in lines:  # the stream ends (an error event, then close)
                pass
        proc.wait(5)
        assert time.monotonic() - t0 < 2.0
        assert proc.returncode == 0


def test_exits_when_parent_is_gone(tiny_models: ModelPaths) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with worker_process(tiny_models.gguf_f32, "--parent-pid", str(parent.pid)) as (proc, _):
            parent.kill()
            parent.wait()
            t0 = time.monotonic()
            assert proc.wait(5) == 0
            assert time.monotonic() - t0 < 2.0
    finally:
        parent.kill()
        parent.wait()


def test_full_kv_cache_preempts_instead_of_failing(tiny_models: ModelPaths) -> None:
    # 4 sequences x (~8 prompt + 100 generated) tokens need ~430 cells; the cache has 256.
    # One KV pool shared by all slots (the default, a stream per slot, never runs out).
    args = ("--parallel", "4", "--ctx-size", "256", "--kv-unified", *EXACT_GGUF_ARGS)
    with worker_process(tiny_models.gguf_f32, *args) as (_, url):
        prompts = [f"request number {i} wants room" for i in range(4)]
        solo = [
            _complete(url, prompt=p, max_tokens=100, cache_prompt=False)["choices"][0]["text"]
            for p in prompts
        ]
        # One request with four prompts: all four tasks reach the engine at once.
        together = _complete(url, prompt=prompts, max_tokens=100, cache_prompt=False)
        assert [c["text"] for c in together["choices"]] == solo
        assert together["usage"]["completion_tokens"] == 400
        metrics = HTTP.get(url + "/metrics").text
        preemptions = next(line for line in metrics.splitlines() if line.startswith("omni:preemptions_total"))
        assert float(preemptions.split()[1]) > 0


def test_context_full_finishes_with_length(tiny_models: ModelPaths) -> None:
    with worker_process(tiny_models.gguf_f32, "--parallel", "2", "--ctx-size", "256") as (_, url):
        data = _complete(url, prompt=[7] * 200)
        assert data["choices"][0]["finish_reason"] == "length"
        # As llama-server: prompt + generated tokens fill the context (n_past + 1 >= n_ctx ends it).
        assert data["usage"]["completion_tokens"] == 256 - 200
        # A streamed request that hits the limit ends cleanly too.
        body = {"prompt": [7] * 250, "ignore_eos": True, "stream": True}
        with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
