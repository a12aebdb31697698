"""Fixtures for router tests: a real `omni-router` subprocess on a preset written per test.

`router_factory(preset_text, *cli_args)` writes the preset (TOML), starts the router on a
free port and yields a `RouterProc` once /health answers; everything is stopped at teardown
(router SIGTERM; then any worker it left behind is killed and reported as a failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import h11
import httpx
import psutil
import pytest

from tests.util import HTTP, ROOT, TLS, free_port, stop_process, wait_healthy, wait_until

FAKE = Path(__file__).with_name("fake_worker.py")
PY = sys.executable


def fake_cmd(*flags: str) -> str:
    """A `cmd` preset value that runs the fake worker with `flags`."""
    return f"{PY} {FAKE} --port ${{PORT}} --parent-pid ${{PARENT_PID}} " + " ".join(flags)


def fake_model(name: str, *flags: str, extra: str = "") -> str:
    """A TOML [models.NAME] table for a fake worker."""
    return f'[models.{name}]\nbackend = "cmd"\ncmd = "{fake_cmd("--model", name, *flags)}"\n{extra}\n'


@dataclass
class RouterProc:
    proc: subprocess.Popen[bytes]
    base: str
    log_path: Path
    headers: dict[str, str]  # auth for the helpers below when the router has --api-key

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=kw.pop("timeout", 30.0), verify=TLS, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def models(self) -> dict[str, dict[str, Any]]:
        data = HTTP.get(f"{self.base}/v1/models", headers=self.headers, timeout=10).json()["data"]
        return {m["id"]: m for m in data}

    def status(self, name: str) -> str:
        return str(self.models()[name]["status"]["value"])

    def wait_status(self, name: str, value: str, timeout: float = 30.0) -> dict[str, Any]:
        def card() -> dict[str, Any]:
            c = self.models()[name]
            return c if c["status"]["value"] == value else {}

        return wait_until(card, timeout, what=f"model {name} to be {value}")

    def workers(self) -> list[psutil.Process]:
        """Live child processes of the router (one per running worker)."""
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]


def chat(model: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}], **extra}


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def stream_chat(
    r: RouterProc,
    model: str,
    on_chunk: Callable[[int], object] | None = None,
    timeout: float = 30,
    **extra: Any,
) -> list[str]:
    """Stream one chat completion through the router; returns the SSE data payloads.

    `on_chunk(n)` runs after the n-th payload (to kill or signal something mid-stream)."""
    out: list[str] = []
    with (
        r.client(timeout=timeout) as c,
        c.stream("POST", "/v1/chat/completions", json=chat(model, True, **extra)) as resp,
    ):
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if on_chunk:
                    on_chunk(len(out))
    return out


class HeldStream:
    """A streamed chat completion that stays in flight at the router until the test says so.

    A test that needs a model *busy* must not bet on a long answer outlasting something else (a
    fast machine ends 3000 tokens before another model loads). Here the client reads the first
    event, then stops reading: it connected with a tiny receive buffer and small segments, so
    the kernel buffers fill within ~100 KB (42 KB queued at the router's socket here, plus
    uvicorn's 64 KB write buffer); then the router's next `send` waits (uvicorn's flow control)
    and the request stays in flight, on any machine, until `finish()` reads the rest. The answer
    is far bigger than those buffers: 3000 tokens with 20 top logprobs each, ~5 MB.
    """

    BODY: ClassVar[dict[str, object]] = {
        "stream": True, "max_tokens": 3000, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}

    def __init__(self, r: RouterProc, model: str, timeout: float = 60, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        """`headers`: instead of the router's own (another key); `extra`: fields of the request body."""
        host, port = r.base.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.socket()
        # Before connect, so the handshake already announces them (window scale, MSS).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        self.sock.settimeout(timeout)
        self.http = h11.Connection(h11.CLIENT)
        self.body = bytearray()
        try:
            self.sock.connect((host, int(port)))
            payload = json.dumps({**chat(model), **self.BODY, **extra}).encode()
            auth = r.headers if headers is None else headers
            fields = [("host", "router"), ("content-type", "application/json"),
                      ("content-length", str(len(payload))), *auth.items()]
            for event in (h11.Request(method="POST", target="/v1/chat/completions", headers=fields),
                          h11.Data(data=payload), h11.EndOfMessage()):
                self.sock.sendall(self.http.send(event) or b"")
            while b"data: " not in self.body:  # the first event: the model is serving it
                if isinstance(self._next(), h11.EndOfMessage):
                    raise AssertionError(f"the stream ended at once: {self.body[:2000]!r}")
        except BaseException:
            self.sock.close()
            raise

    def _next(self) -> h11.Event | type[h11.PAUSED]:
        while (event := self.http.next_event()) is h11.NEED_DATA:
            self.http.receive_data(self.sock.recv(65536))
        if isinstance(event, h11.Response):
            assert event.status_code == 200, event
        elif isinstance(event, h11.Data):
            self.body += event.data
        return event

    def finish(self, timeout: float = 120) -> list[str]:
        """Read the rest (the router may end the request now); the SSE data payloads."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        deadline = time.monotonic() + timeout
        try:
            while not isinstance(self._next(), h11.EndOfMessage):
                assert time.monotonic() < deadline, f"the held stream did not end within {timeout}s"
        finally:
            self.sock.close()
        return sse_events(iter(self.body.decode().splitlines()))

    def close(self) -> None:
        """Leave without reading the rest: the router sees the client go and cancels the request."""
        self.sock.close()

    def __enter__(self) -> HeldStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _descendants_by_env(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if p.environ().get("OMNI_TEST_MARKER") == marker:
                found.append(p)
    return found


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator[Callable[..., RouterProc]]:
    started: list[tuple[RouterProc, str]] = []

    def start(
        preset: str, *args: str, suffix: str = ".toml", env: dict[str, str] | None = None,
        nofile: int | None = None,
    ) -> RouterProc:
        """`nofile`: the router's RLIMIT_NOFILE, soft and hard (it raises soft to hard itself)."""
        path = tmp_path / f"preset{len(started)}{suffix}"
        path.write_text(preset)
        port = free_port()
        log_path = tmp_path / f"router{len(started)}.log"
        marker = f"{os.getpid()}-{tmp_path.name}-{len(started)}"
        # Its own state dir (the Responses store, the disk prompt caches), unless the test gives one.
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMNI_TEST_MARKER": marker,
                    "XDG_STATE_HOME": str(tmp_path / "state"), **(env or {})}
        cmd = [PY, "-m", "router.cli", "--preset", str(path), "--port", str(port), *args]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, preexec_fn=None if nofile is None else (
                                        lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))))
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        rp = RouterProc(
            proc, f"http://127.0.0.1:{port}", log_path, {"Authorization": f"Bearer {key}"} if key else {}
        )
        started.append((rp, marker))

        wait_healthy(proc, rp.base, 30, lambda: rp.log()[-3000:])
        return rp

    yield start
    leftovers = []
    for rp, marker in started:
        stop_process(rp.proc)
        # Workers are gone within ~1 s of their router (PDEATHSIG / --parent-pid).
        with contextlib.suppress(TimeoutError):
            wait_until(lambda m=marker: not _descendants_by_env(m), 5, what="workers to exit")  # type: ignore[misc]
        for p in _descendants_by_env(marker):
            leftovers.append(p.cmdline())
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
    assert not leftovers, f"orphan workers left behind: {leftovers}"


def kill_router_and_expect_no_workers(
    r: RouterProc, sig: signal.Signals, n_workers: int, timeout: float
) -> None:
    """Signal the router and wait until every worker it had is gone (or a zombie)."""
    pids = [w.pid for w in r.workers()]
    assert len(pids) == n_workers
    os.kill(r.proc.pid, sig)
    r.proc.wait(timeout + 5)

    def all_gone() -> bool:
        return all(
            not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids
        )

    wait_until(all_gone, timeout, what="workers to exit with their router")


@contextlib.contextmanager
def running_router(
    tmp: Path, preset: str, *args: str, headers: dict[str, str] | None = None
) -> Iterator[RouterProc]:
    """A router on `preset` for a module-scoped fixture (router_factory is per test): healthy on
    entry, stopped on exit. `headers`: what RouterProc's helpers send (an admin key)."""
    (tmp / "preset.toml").write_text(preset)
    log_path = tmp / "router.log"
    port = free_port()
    with log_path.open("wb") as log:
        cmd = [PY, "-m", "router.cli", "--preset", str(tmp / "preset.toml"), "--port", str(port), *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp / "state")}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    r = RouterProc(proc, f"http://127.0.0.1:{port}", log_path, headers or {})
    try:
        wait_healthy(proc, r.base, 30, lambda: r.log()[-3000:])
        yield r
    finally:
        stop_process(proc)
