"""The model owner driven in-process: races that a whole router cannot hit on purpose (an unload
landing in the few milliseconds of a spawn). The worker is still a real subprocess; only the
router's own spawn and readiness steps are wrapped, to hold them at the racy point."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import router.model
from router.pool import Pool, PoolConfig
from router.presets import ModelPreset
from router.process import WorkerProcess
from router.state import ModelState
from tests.router.conftest import fake_cmd
from worker.errors import APIError


@pytest.mark.asyncio
async def test_unload_during_spawn_then_crash_bug_the_stale_stop_request_stopped_the_next_good_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: an unload that arrives while the worker is being spawned sets `_stop_requested`;
    if that worker then crashes before its load reports, the model turns `failed` and the flag
    survived, so the next good load was stopped the moment it became ready (and loaded again).
    Reproduced by holding the first spawn until the unload is in, then spawning a command that
    exits at once while readiness waits forever."""
    spawned: list[list[str]] = []
    in_spawn, go_on = asyncio.Event(), asyncio.Event()
    real_spawn: Callable[..., Coroutine[Any, Any, WorkerProcess]] = WorkerProcess.spawn
    real_wait_ready = router.model.wait_ready

    async def spawn(argv: list[str], name: str, env: dict[str, str] | None = None) -> WorkerProcess:
        spawned.append(argv)
        if len(spawned) == 1:
            in_spawn.set()
            await go_on.wait()
            argv = [sys.executable, "-c", "raise SystemExit(3)"]
        return await real_spawn(argv, name, env=env)

    async def wait_ready(*args: Any, **kw: Any) -> bool:
        if len(spawned) == 1:
            await asyncio.Event().wait()  # the crash is seen first, by the exit watcher
        return await real_wait_ready(*args, **kw)

    monkeypatch.setattr(WorkerProcess, "spawn", staticmethod(spawn))
    monkeypatch.setattr(router.model, "wait_ready", wait_ready)
    pool = Pool([ModelPreset("a", backend="cmd", cmd=fake_cmd("--model", "a"), stop_timeout=2.0)], PoolConfig())
    await pool.start()
    try:
        h = pool.handles["a"]
        first = asyncio.create_task(h.ensure_ready())
        await in_spawn.wait()
        unload = asyncio.create_task(h.unload())
        await h.drain(False)  # a no-op command: once answered, the unload before it was handled
        go_on.set()
        assert await unload is True
        with pytest.raises(APIError, match="was unloaded"):
            await first
        assert h.state is ModelState.FAILED and h.exit_code == 3

        await h.ensure_ready()  # no backoff after a first failure
        h.release()
        assert h.state is ModelState.READY
        assert len(spawned) == 2  # not stopped at once and spawned a third time
    finally:
        await pool.close()
