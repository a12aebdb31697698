"""What a model's owner asks of the outside world: spawn a worker, wait until it is ready, put it
to sleep, wake it, read its card, measure it, forget its connections. Effects only; no state.

`ModelHandle` gets one `Effects` object; tests pass a fake with the same methods (in-process,
driven step by step). `Process` is what the owner needs of a running worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from router.lifecycle.memory import TreeMemory, tree_memory
from router.lifecycle.process import (
    LoadError,
    Watched,
    WorkerProcess,
    free_port,
    transient_or_same,
    wait_ready,
    worker_argv,
)
from router.presets import ModelPreset
from router.upstream import UpstreamClient

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class Process(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def log_tail(self) -> Sequence[str]: ...

    async def wait(self) -> int: ...

    async def stop(self, timeout: float) -> int: ...

    def tail_text(self, lines: int = 5) -> str: ...

    @property
    def node(self) -> dict[str, Any] | None: ...  # where it runs, when not on the router's box

    @property
    def exit_cause(self) -> str | None: ...  # why it ended, when its exit code cannot say (node lost)


class Effects(Protocol):
    async def spawn(self, preset: ModelPreset) -> tuple[Process, str, list[str]]: ...

    async def wait_ready(self, proc: Process, base_url: str, timeout: float,
                         on_progress: Callable[[dict[str, Any]], None]) -> bool: ...

    async def info(self, base_url: str) -> dict[str, Any] | None: ...

    async def sleep(self, base_url: str) -> bool: ...

    async def wake(self, base_url: str, timeout: float) -> None: ...

    def samples(self, proc: Process, interval: Callable[[], float]) -> AsyncIterator[TreeMemory]: ...

    def forget(self, base_url: str) -> None: ...


class WorkerEffects:
    """The real effects: subprocesses, and HTTP to them with the pool's shared clients."""

    def __init__(self, client: httpx.AsyncClient, upstream: UpstreamClient, host: str) -> None:
        self.client = client
        self.upstream = upstream
        self.host = host

    async def spawn(self, preset: ModelPreset) -> tuple[Process, str, list[str]]:
        try:  # a port needs a socket: out of descriptors, that fails before the spawn does
            port = free_port(self.host)
        except OSError as e:
            raise transient_or_same(e, "could not pick a port for it") from e
        argv = worker_argv(preset, port, os.getpid(), self.host)
        proc = await WorkerProcess.spawn(argv, preset.name, env=worker_env(preset))
        return proc, f"http://{self.host}:{port}", argv

    async def wait_ready(self, proc: Process, base_url: str, timeout: float,
                         on_progress: Callable[[dict[str, Any]], None]) -> bool:
        assert isinstance(proc, Watched)
        return await wait_ready(self.client, base_url, proc, timeout, on_progress)

    async def info(self, base_url: str) -> dict[str, Any] | None:
        """The worker's own /v1/models entry, if it has one."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            r = await self.client.get(f"{base_url}/v1/models", timeout=2.0)
            data = r.json()["data"]
            return dict(data[0]) if data else None
        return None

    async def sleep(self, base_url: str) -> bool:
        try:
            r = await self.client.post(f"{base_url}/sleep", timeout=30.0)
            return r.status_code < 400
        except httpx.HTTPError:
            return False

    async def wake(self, base_url: str, timeout: float) -> None:
        r = await self.client.post(f"{base_url}/wake", timeout=timeout)
        if r.status_code >= 400:
            raise LoadError(f"/wake answered {r.status_code}: {r.text[:300]}")

    async def samples(self, proc: Process, interval: Callable[[], float]) -> AsyncIterator[TreeMemory]:
        """The tree's memory now, then every `interval()` seconds, until the process is gone."""
        while (memory := await asyncio.to_thread(tree_memory, proc.pid)) is not None:
            yield memory
            await asyncio.sleep(interval())

    def forget(self, base_url: str) -> None:
        self.upstream.forget(base_url)



class LayeredEffects:
    """Effects over another `Effects` (`local`): what a layer does not change (waiting for
    readiness, the card, sleep, wake, forgetting connections) is the local one's. The GPU
    placement (router.lifecycle.gpu_admission) and Ray's (router.placement.ray_cluster) add to
    spawn and samples."""

    def __init__(self, local: Effects) -> None:
        self.local = local

    async def wait_ready(self, proc: Process, base_url: str, timeout: float,
                         on_progress: Callable[[dict[str, Any]], None]) -> bool:
        return await self.local.wait_ready(proc, base_url, timeout, on_progress)

    async def info(self, base_url: str) -> dict[str, Any] | None:
        return await self.local.info(base_url)

    async def sleep(self, base_url: str) -> bool:
        return await self.local.sleep(base_url)

    async def wake(self, base_url: str, timeout: float) -> None:
        await self.local.wake(base_url, timeout)

    def forget(self, base_url: str) -> None:
        self.local.forget(base_url)


def worker_env(preset: ModelPreset) -> dict[str, str] | None:
    """The worker's environment: ours with this checkout importable (a `cmd` server: inherited),
    and the preset's own `env` (with the GPU placement's CUDA_VISIBLE_DEVICES) over it."""
    if preset.backend == "cmd":
        return {**os.environ, **dict(preset.env)} if preset.env else None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
    return {**env, **dict(preset.env)}
