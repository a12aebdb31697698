"""In-process stand-ins for a model owner's effects, driven step by step by a test.

Every effect the owner starts (spawn, readiness, sleep, wake, stop) becomes a `Call` the test
picks up with `await fx.next("spawn")` and answers with `await fx.answer(call, value)` (or an
exception); `answer` returns once the owner has handled what the effect reported, so a test
reads the owner's state right after it, with no sleeps. Memory samples are pushed per process.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from router.lifecycle.admission import Slots
from router.lifecycle.memory import TreeMemory
from router.lifecycle.model import ModelDeps, ModelHandle
from router.lifecycle.state import Phase
from router.presets import ModelPreset

_pids = itertools.count(10_000)


@dataclass(eq=False)
class Call:
    kind: str
    args: tuple[Any, ...]
    reply: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    returned: asyncio.Event = field(default_factory=asyncio.Event)


class FakeProc:
    """A worker process that exits when the test (or its `stop`) says so."""

    def __init__(self, fx: FakeEffects) -> None:
        self.fx = fx
        self.pid = next(_pids)
        self.log_tail = [f"fake {self.pid} log"]
        self.node: dict[str, Any] | None = None
        self.exit_cause: str | None = None
        self.exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.samples: asyncio.Queue[TreeMemory | None] = asyncio.Queue()

    async def wait(self) -> int:
        return await asyncio.shield(self.exit)

    async def stop(self, timeout: float) -> int:
        call = Call("stop", (self,))
        self.fx.calls["stop"].put_nowait(call)
        code = await call.reply
        self.exit_with(code)
        call.returned.set()
        return await self.wait()

    def exit_with(self, code: int) -> None:
        if not self.exit.done():
            self.exit.set_result(code)
            self.samples.put_nowait(None)

    def tail_text(self, lines: int = 5) -> str:
        return " | ".join(self.log_tail[-lines:])


class FakeEffects:
    def __init__(self) -> None:
        self.calls: defaultdict[str, asyncio.Queue[Call]] = defaultdict(asyncio.Queue)
        self.forgotten: list[str] = []
        self.procs: list[FakeProc] = []
        self._ports = itertools.count(20_000)

    async def _call(self, kind: str, *args: Any) -> Any:
        call = Call(kind, args)
        self.calls[kind].put_nowait(call)
        try:
            return await call.reply
        finally:
            call.returned.set()  # the owner's effect posts its message before the test resumes

    async def next(self, kind: str) -> Call:
        return await asyncio.wait_for(self.calls[kind].get(), 5.0)

    def pending(self, kind: str) -> int:
        return self.calls[kind].qsize()

    async def answer(self, call: Call, value: Any, *handles: ModelHandle) -> None:
        if isinstance(value, BaseException):
            call.reply.set_exception(value)
        else:
            call.reply.set_result(value)
        await call.returned.wait()
        for h in handles:
            await h.settled()

    def new_proc(self) -> tuple[FakeProc, str, list[str]]:
        proc = FakeProc(self)
        self.procs.append(proc)
        return proc, f"http://127.0.0.1:{next(self._ports)}", ["fake", str(proc.pid)]

    # ---- the Effects protocol

    async def spawn(self, preset: ModelPreset) -> tuple[FakeProc, str, list[str]]:
        result: tuple[FakeProc, str, list[str]] = await self._call("spawn", preset)
        return result

    async def wait_ready(self, proc: FakeProc, base_url: str, timeout: float,
                         on_progress: Callable[[dict[str, Any]], None]) -> bool:
        return bool(await self._call("ready", proc, on_progress))

    async def info(self, base_url: str) -> dict[str, Any] | None:
        return {"id": base_url, "meta": {"fake": True}}

    async def sleep(self, base_url: str) -> bool:
        return bool(await self._call("sleep", base_url))

    async def wake(self, base_url: str, timeout: float) -> None:
        await self._call("wake", base_url)

    async def samples(self, proc: FakeProc, interval: Callable[[], float]) -> AsyncIterator[TreeMemory]:
        while (memory := await proc.samples.get()) is not None:
            yield memory

    def forget(self, base_url: str) -> None:
        self.forgotten.append(base_url)


@dataclass
class OwnerRig:
    """Model owners over one `FakeEffects` and their `ModelDeps`, driven by a test (the owner's
    and the GPU placement's tests extend it)."""

    fx: FakeEffects
    slots: Slots
    deps: ModelDeps
    handles: list[ModelHandle] = field(default_factory=list)

    def start(self, preset: ModelPreset) -> ModelHandle:
        h = ModelHandle(preset, self.deps)
        h.start()
        self.handles.append(h)
        return h

    async def quiet(self) -> None:
        """Let the owners and the admission task handle everything already sent (no timers)."""
        for _ in range(5):
            for h in self.handles:
                if not h.is_removed:
                    await h.settled()
            await asyncio.sleep(0)

    async def up(self, h: ModelHandle, can_sleep: bool = True) -> FakeProc:
        """UNLOADED -> QUEUED -> SPAWNING -> STARTING -> READY, with no request left in flight."""
        asked = asyncio.create_task(h.ensure_ready())
        proc = await self.spawn(h)
        await self.fx.answer(await self.fx.next("ready"), can_sleep, h)
        await asked
        h.release()
        await h.settled()
        assert h.phase is Phase.READY
        return proc

    async def spawn(self, h: ModelHandle) -> FakeProc:
        """Answer `h`'s spawn with a new process."""
        call = await self.fx.next("spawn")
        assert call.args[0].name == h.name
        proc, base, argv = self.fx.new_proc()
        await self.fx.answer(call, (proc, base, argv), h)
        return proc
