"""One worker subprocess: argv, spawn, readiness, stop. Effects only; no lifecycle decisions.

- Spawned in a new session (its own process group) so that a stop reaches its children too.
- The child asks the kernel for SIGTERM when the router dies (PR_SET_PDEATHSIG, set in
  preexec) and our own worker also gets `--parent-pid` and watches it: no orphans, however
  the router exits.
- stdout+stderr go to one pipe read line by line into a 50-line tail (the crash report) and
  the model's log ring (router.observability.logs: `GET /logs?model=`).
- `stop()`: SIGTERM to the group, wait `timeout`, SIGKILL to the group, reap, then drain the
  pipe with a bound (a grandchild may still hold it open).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import random
import shlex
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx

from router.log_ring import WORKER_LOGS
from router.presets import ModelPreset

log = logging.getLogger("omni.router.process")

LOG_TAIL_LINES = 50
DRAIN_TIMEOUT_S = 1.0
_PR_SET_PDEATHSIG = 1
_libc: Any = None
with contextlib.suppress(OSError):
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a worker to listen on, below the kernel's ephemeral range when it can: a port
    from that range (what binding port 0 gives) may be taken, before the worker binds it, as the
    local port of one of the many connections a busy router makes and takes (found by
    bench/storm.py: a worker that could not listen, and its queue failed with it)."""
    low = _ephemeral_low()
    if low > 2048:
        for _ in range(32):
            port = random.randrange(max(1024, low - 12000), low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def worker_argv(preset: ModelPreset, port: int, parent_pid: int, host: str = "127.0.0.1") -> list[str]:
    """The command line for one model: our worker, or the user's `cmd` with ${PORT} filled in."""
    if preset.backend == "cmd":
        assert preset.cmd is not None
        text = preset.cmd.replace("${PORT}", str(port)).replace("${HOST}", host)
        text = text.replace("${MODEL}", str(preset.model or "")).replace("${PARENT_PID}", str(parent_pid))
        return shlex.split(text)
    argv = [sys.executable, "-m", "worker.server.cli", "--model", str(preset.model), "--alias", preset.name,
            "--host", host, "--port", str(port), "--parent-pid", str(parent_pid),
            "--metrics"]  # GET /metrics?model= is proxied to the worker
    if preset.resolved_backend == "piper":  # a speech worker: the text flags do not apply to it
        argv += ["--backend", "piper"] + (["--threads", str(preset.threads)] if preset.threads else [])
        return argv + _passed_through(preset.worker_args)
    if preset.backend != "auto":
        argv += ["--backend", preset.backend]
    for flag, value in (("--ctx-size", preset.ctx_size), ("--parallel", preset.parallel),
                        ("--batch-size", preset.batch_size), ("--n-gpu-layers", preset.n_gpu_layers),
                        ("--threads", preset.threads), ("--chat-template", preset.chat_template),
                        ("--cache-ram", preset.cache_ram), ("--flash-attn", preset.flash_attn),
                        ("--pooling", preset.pooling), ("--slot-save-path", preset.slot_save_path),
                        ("--spec-draft-model", preset.model_draft), ("--mmproj", preset.mmproj),
                        ("--cache-dir", preset.cache_dir)):
        if value is not None:
            argv += [flag, str(value)]
    if preset.lora:
        argv += ["--lora", ",".join(str(p) for p in preset.lora)]
    if preset.kv_unified:
        argv.append("--kv-unified")
    if preset.jinja is not None:
        argv.append("--jinja" if preset.jinja else "--no-jinja")
    argv += ["--embedding"] if preset.embedding else []
    argv += ["--reranking"] if preset.reranking else []
    return argv + _passed_through(preset.worker_args)


def _passed_through(worker_args: tuple[tuple[str, str], ...]) -> list[str]:
    """Any other omni-worker flag a preset sets (router.worker_flags): `--name value`, or a switch."""
    from router import worker_flags

    out: list[str] = []
    for name, value in worker_args:
        found = worker_flags.lookup(name)
        if found is not None and found.flag.is_switch:
            if value == "true":
                out.append(f"--{name}")
            elif found.flag.negation:
                out.append(f"--{found.flag.negation}")
        else:
            out += [f"--{name}", value]
    return out


def _die_with_parent(parent_pid: int, nice: int | None = None) -> None:
    """preexec_fn: runs in the child between fork and exec; async-signal-safe calls only."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the router died before prctl took effect
        os._exit(1)
    if nice is not None:
        with contextlib.suppress(OSError):  # lowering it needs the privilege to
            os.setpriority(os.PRIO_PROCESS, 0, nice)


class LoadError(Exception):
    pass


# Spawn errors that say the box is short of something for now, not that the model is broken:
# out of descriptors (per process or system-wide), of memory or processes, or a port in use.
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EADDRINUSE})


class SpawnError(LoadError):
    """A spawn that failed for a reason outside the model (a Ray node lost while the worker
    started): retried with backoff, unlike a command that cannot run (permanent)."""


def transient_or_same(e: OSError, what: str) -> Exception:
    """A SpawnError saying which errno and that it is retried when the box is short of something
    (descriptors, memory, processes, a port); else `e` itself: the model's own problem (e.g. the
    program does not exist), permanent."""
    if e.errno not in TRANSIENT_ERRNOS:
        return e
    code = errno.errorcode.get(e.errno or 0, "?")
    return SpawnError(f"{what}: {os.strerror(e.errno or 0)} ({code}, transient: retried with backoff)")


class WorkerProcess:
    """A started subprocess with its log tail."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.num_lines = 0  # lines read so far (a Ray actor streams the tail from a cursor)
        self.log = WORKER_LOGS.ring(name)  # GET /logs?model= (outlives the process)
        self.output = (
            asyncio.Event()
        )  # set on every line: readiness polls wake on it (router.process.wait_ready)
        self._reader = asyncio.create_task(self._read_log())

    @classmethod
    async def spawn(cls, argv: list[str], name: str, env: dict[str, str] | None = None,
                    nice: int | None = None) -> WorkerProcess:
        """`nice`: the child's niceness (a Ray actor runs niced; its worker should not be)."""
        parent = os.getpid()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent, nice),
                env=env,
            )
        except OSError as e:
            raise transient_or_same(e, "could not start its process") from e
        log.info("model %s: spawned pid %d: %s", name, proc.pid, shlex.join(argv))
        return cls(proc, name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def node(self) -> dict[str, Any] | None:
        return None  # on the router's own box

    @property
    def exit_cause(self) -> str | None:
        return None  # its exit code says it all

    async def _read_log(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the stream limit: skip it
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            self.log_tail.append(text)
            self.num_lines += 1
            self.log.append(text)
            self.output.set()
            log.debug("[%s] %s", self.name, text)

    async def wait(self) -> int:
        """Wait for exit, then drain the pipe with a bound; returns the exit code."""
        code = await self.proc.wait()
        await self._drain()
        return code

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), DRAIN_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            self._reader.cancel()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def stop(self, timeout: float) -> int:
        """SIGTERM the group, wait `timeout`, SIGKILL the group, reap, drain."""
        if self.proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
            except TimeoutError:
                log.warning(
                    "model %s: pid %d ignored SIGTERM for %.1fs, killing", self.name, self.pid, timeout
                )
        # Even after a clean exit, children left in the group must go.
        self._signal_group(signal.SIGKILL)
        return await self.wait()

    def tail_text(self, lines: int = 5) -> str:
        return " | ".join(list(self.log_tail)[-lines:])


def _error_message(r: httpx.Response) -> str:
    """The envelope's message (one line), else the start of the body."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(r.json()["error"]["message"]).splitlines()[0]
    return r.text[:300]


@runtime_checkable
class Watched(Protocol):
    """What readiness polling needs of a worker, local or on a Ray node."""

    @property
    def returncode(self) -> int | None: ...

    @property
    def output(self) -> asyncio.Event: ...  # set whenever the worker writes a line

    async def wait(self) -> int: ...


async def wait_ready(
    client: httpx.AsyncClient,
    base_url: str,
    proc: Watched,
    timeout: float,
    on_progress: Callable[[dict[str, Any]], None],
    interval: float = 0.1,
) -> bool:
    """Poll `GET /health` until 200 (not sleeping); raise LoadError on exit, 500, or timeout.

    Returns whether the server speaks our sleep contract (its /health reports `is_sleeping`, as
    our worker's does; llama-server's and vLLM's do not). A poll every `interval` (10x slower
    after 30 s), and at once whenever the worker writes a line: our worker logs "model loaded"
    as it turns ready, so the router sees it within milliseconds without polling a busy box
    every 20 ms (issue 25: a load read 200 ms late once it took over 5 s).
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout
    while True:
        if proc.returncode is not None:
            raise LoadError(f"exited with code {proc.returncode} while loading")
        try:
            r = await client.get(f"{base_url}/health", timeout=2.0)
            if r.status_code == 200:
                body = r.json()
                if not isinstance(body, dict):
                    return False
                if not body.get("is_sleeping"):
                    return "is_sleeping" in body
            elif r.status_code == 503:
                err = r.json().get("error", {})
                progress = err.get("progress") if isinstance(err, dict) else None
                if isinstance(progress, dict):
                    on_progress(progress)
            elif r.status_code >= 500:
                # The worker exits by itself after reporting a failed load: let it, so that
                # the exit code we report is its own and not our SIGTERM's.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 3.0)
                raise LoadError(f"the worker reported a failed load ({r.status_code}): {_error_message(r)}")
        except (httpx.TransportError, ValueError):
            pass  # not listening yet, or a partial body
        now = loop.time()
        if now > deadline:
            raise LoadError(f"not ready after {timeout:g}s")
        proc.output.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.output.wait(), interval if now - start < 30.0 else 10 * interval)
