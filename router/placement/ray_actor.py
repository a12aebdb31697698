"""The Ray actor on a node: it starts one model's worker as a subprocess there, with the argv a
local worker gets, bound to the node's IP, and then only answers the router's questions.

- The worker is spawned from the actor's event-loop thread, which lives as long as the actor:
  its PR_SET_PDEATHSIG (router.lifecycle.process) then fires when the actor process dies,
  whatever killed it, and `--parent-pid` is the actor's pid, which our worker also watches.
- `wait()` returns the worker's exit code; `log_lines(cursor)` long-polls the log tail from a
  cursor, so the router's `/logs` and crash reports read as for a local worker; `memory()` is
  the same psutil/NVML sample, taken on the node; `stop()` is the local stop (SIGTERM to the
  group, bounded wait, SIGKILL, drain).
- Tokens never pass through here: the router speaks HTTP straight to `host:port`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import psutil

from router.lifecycle.effects import worker_env
from router.lifecycle.memory import TreeMemory, tree_memory
from router.lifecycle.process import WorkerProcess, free_port, worker_argv
from router.presets import ModelPreset

LONG_POLL_S = 5.0  # a log_lines call with nothing new answers after this long
LOG_BATCH_S = 0.2  # lines are sent this long after the first new one, together: a worker logs a
# line per request, and a Ray call per line competed with the requests (measured: +2 ms p50 on 2 cores)


def node_ip() -> str:
    """The node's own IP as Ray knows it (127.0.0.1 on a one-machine test cluster)."""
    with contextlib.suppress(ImportError):
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # ray ships no hints here
    return socket.gethostbyname(socket.gethostname())


def _node_niceness() -> int | None:
    """The raylet's niceness: Ray runs its workers (this actor) niced by `RAY_worker_niceness`
    (15 by default), which an inference worker must not inherit."""
    with contextlib.suppress(psutil.Error):
        return int(_raylet().nice())
    return None


def _raylet() -> psutil.Process:
    """The node's raylet, which started this actor's process."""
    return psutil.Process(int(os.environ.get("RAY_RAYLET_PID") or os.getppid()))


def _as_the_node(env: dict[str, str] | None) -> dict[str, str]:
    """Without what Ray sets for its own workers only: OMP_NUM_THREADS (1 for a 1-CPU actor,
    which would starve a torch worker) unless the node itself was started with it."""
    env = dict(os.environ) if env is None else env  # (None: a `cmd` server inherits ours)
    if "OMP_NUM_THREADS" not in env:
        return env
    with contextlib.suppress(psutil.Error):
        if "OMP_NUM_THREADS" in _raylet().environ():
            return env
    return {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}


class WorkerActor:
    """One model's worker on this node (decorated with `ray.remote` by the router, lazily)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: WorkerProcess | None = None

    async def start(self, preset: ModelPreset) -> dict[str, Any]:
        host = node_ip()
        port = free_port(host)
        argv = worker_argv(preset, port, os.getpid(), host)
        self.proc = await WorkerProcess.spawn(argv, self.name, env=_as_the_node(worker_env(preset)),
                                              nice=_node_niceness())
        return {"host": host, "port": port, "argv": argv, "pid": self.proc.pid, "actor_pid": os.getpid()}

    def _running(self) -> WorkerProcess:
        assert self.proc is not None, "start() first"
        return self.proc

    async def wait(self) -> int:
        return await self._running().wait()

    async def log_lines(self, cursor: int) -> tuple[list[str], int, bool]:
        """The lines after `cursor` (at most the tail's 50), the new cursor, and whether the
        worker has exited and every line it wrote was sent."""
        proc = self._running()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LONG_POLL_S
        while proc.num_lines <= cursor and proc.returncode is None and loop.time() < deadline:
            proc.output.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.output.wait(), deadline - loop.time())
        if proc.returncode is None and proc.num_lines > cursor:
            await asyncio.sleep(LOG_BATCH_S)
        if proc.returncode is not None:
            await asyncio.shield(proc.wait())  # the pipe drained: nothing comes after
        num_new = min(proc.num_lines - cursor, len(proc.log_tail))
        lines = list(proc.log_tail)[len(proc.log_tail) - num_new:] if num_new > 0 else []
        return lines, proc.num_lines, proc.returncode is not None

    async def memory(self) -> TreeMemory | None:
        return await asyncio.to_thread(tree_memory, self._running().pid)

    async def stop(self, timeout: float) -> int:
        return await self._running().stop(timeout)
