"""Helpers shared by the real-process tests: free ports, deadlines, spawning workers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
# For the helpers that poll or call often: `httpx.get()` builds a client per call, and with it an
# SSL context that loads the CA bundle, ~23 ms of CPU each time; polled every 20-50 ms, that took
# half a core from the very process being waited for on a 2-core box. This one is built once
# (~0.3 ms a call), keeps no connection alive (each call connects afresh, as httpx.get did), and
# is thread-safe. (No server here sets cookies, so its cookie jar stays empty.)
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
# A test's own clients (a base URL, a kept connection) share one SSL context for the same reason.
TLS = ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    pred: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll `pred` until it returns a truthy value (returned) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as e:  # the thing polled may not be up yet
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM the process group, wait, SIGKILL if needed."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def wait_healthy(
    proc: subprocess.Popen[bytes], base: str, timeout: float = 60.0, log_tail: Callable[[], str] = lambda: ""
) -> None:
    """Poll `base`/health until 200; fail at once (with the log tail) if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if HTTP.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} not healthy after {timeout}s:\n{log_tail()}")
        time.sleep(0.02)


@contextlib.contextmanager
def run_worker(model: str | Path, *args: str, timeout: float = 60.0) -> Iterator[str]:
    """Start `omni-worker --model MODEL ARGS` on a free port; yield its base URL once healthy."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "worker.server.cli",
        "--model",
        str(model),
        "--port",
        str(port),
        "--metrics",
        *args,
    ]
    # A file, not a pipe: an undrained pipe would block a chatty worker.
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def log_tail() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-3000:]

        wait_healthy(proc, base, timeout, log_tail)
        yield base
    finally:
        stop_process(proc)
        log.close()


def preset_defaults(ctx_size: int) -> str:
    """The `[defaults]` section the real-worker router tests share: a small context, 2 slots, one
    thread each (2 cores here), a quick stop."""
    return f"[defaults]\nctx-size = {ctx_size}\nparallel = 2\nthreads = 1\nstop-timeout = 5\n"


def llama_server_binary() -> Path | None:
    """llama.cpp's own llama-server, built by scripts/build_llama_server.sh from the pinned
    sources ($OMNI_LLAMA_SERVER wins): None when there is none."""
    env = os.environ.get("OMNI_LLAMA_SERVER")
    if env:
        return Path(env)
    hits = sorted(ROOT.glob("third_party/llama-server-build-*/bin/llama-server"))
    return hits[-1] if hits else None


@contextlib.contextmanager
def run_llama_server(model: str | Path, *args: str, log_path: Path, timeout: float = 60.0) -> Iterator[str]:
    """Start llama-server on `model` with ARGS on a free port (output to `log_path`); yield its
    base URL once healthy. Skips the test when there is no llama-server."""
    import pytest

    binary = llama_server_binary()
    if binary is None or not binary.is_file():
        pytest.skip("no llama-server: run scripts/build_llama_server.sh (or set OMNI_LLAMA_SERVER)")
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(binary), "-m", str(model), "--port", str(port), "--no-warmup", *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", timeout)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process(proc)


def answer(r: httpx.Response) -> str:
    """The message text of a 200 chat completion (the response's body in the failure)."""
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["message"]["content"]
    return text


def greedy_chat(base: str, content: Any, max_tokens: int = 24, timeout: float = 120) -> dict[str, Any]:
    """The JSON of a 200 greedy chat completion of one user message (`content`: text or parts)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def metric(base: str, name: str) -> float:
    """One unlabelled sample of a server's /metrics."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", HTTP.get(f"{base}/metrics", timeout=10).text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))
