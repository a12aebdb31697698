"""`omni-router pull` and the worker's `-hf` against the stand-in hub: plain progress lines when
not on a terminal; a pull killed halfway (SIGKILL) resumes where it stopped; an unknown tag exits
1 listing the tags; `omni-worker -hf REPO:TAG` pulls, then serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.hub.conftest import GGUF_REPO, hub_env
from tests.util import ROOT, free_port, stop_process, wait_healthy, wait_until
from worker.testing.stand_in_hub import StandInHub


def pull_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "router.cli", "pull", *args]


def test_a_pull_killed_halfway_resumes_and_an_unknown_tag_lists_tags(model_hub: StandInHub,
                                                                     tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **hub_env(model_hub, tmp_path / "hub")}
    unknown = subprocess.run(pull_cmd(f"{GGUF_REPO}:Q2_K"), env=env, capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 1 and "tags: F16, Q4_K_M, Q8_0" in unknown.stderr, unknown.stderr

    f = model_hub.repos[GGUF_REPO].files["tiny-llama-Q8_0.gguf"]
    part = tmp_path / "hub" / "models--omni--tiny-llama-GGUF" / "blobs" / f"{f.sha256}.incomplete"
    model_hub.hold_after(128 * 1024)
    proc = subprocess.Popen(pull_cmd(f"{GGUF_REPO}:Q8_0"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: part.is_file() and part.stat().st_size == 128 * 1024, 30, what="128 KiB on disk")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        stop_process(proc)
    model_hub.release()
    done = subprocess.run(pull_cmd(f"{GGUF_REPO}:Q8_0"), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert model_hub.ranges == [f"bytes={128 * 1024}-"]  # it went on from what the killed pull left
    commit = model_hub.repos[GGUF_REPO].commit
    model = tmp_path / "hub" / "models--omni--tiny-llama-GGUF" / "snapshots" / commit
    assert done.stdout.startswith(f"{GGUF_REPO}:Q8_0: {model / 'tiny-llama-Q8_0.gguf'}")
    assert (model / "tiny-llama-Q8_0.gguf").read_bytes() == f.data and not part.exists()
    lines = done.stderr.splitlines()
    assert lines[-1].startswith(f"pulling {GGUF_REPO}:Q8_0: 100% (") and all("\r" not in x for x in lines)

    offline = {**env, "HF_HUB_OFFLINE": "1"}  # the cache answers; the hub is not asked
    asked = len(model_hub.requests)
    cached = subprocess.run(pull_cmd(f"{GGUF_REPO}:q8_0"), env=offline, capture_output=True, text=True,
                            timeout=60)
    assert cached.returncode == 0 and len(model_hub.requests) == asked
    assert cached.stdout.splitlines()[0] == done.stdout.splitlines()[0]
    missing = subprocess.run(pull_cmd(f"{GGUF_REPO}:F16"), env=offline, capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 1 and "HF_HUB_OFFLINE" in missing.stderr, missing.stderr


def test_the_worker_pulls_with_hf_then_serves(model_hub: StandInHub, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **hub_env(model_hub, tmp_path / "hub")}
    port = free_port()
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        argv = [sys.executable, "-m", "worker.server.cli", "-hf", f"{GGUF_REPO}:f16", "--port", str(port),
                "-c", "512", "-np", "1", "-t", "1", "--top-p", "0.5"]
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, 60, lambda: log.read_text()[-3000:])
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert "tiny-llama-F16.gguf" in log.read_text()
        params = httpx.get(f"{base}/props", timeout=10).json()["default_generation_settings"]["params"]
        assert params["temperature"] == 0.2  # the repo's generation_config.json ...
        assert params["top_p"] == 0.5  # ... under the command line's own flags
    finally:
        stop_process(proc)
