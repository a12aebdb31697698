"""The bridge between one HTTP request and the engine thread.

A `Generation` is the set of tasks of one request (`n` choices per prompt, several prompts for
/v1/completions): choice index = prompt_index * n + i. The engine thread calls each task's
`emit`; the handler reads `(index, event)` pairs from one asyncio queue. Nothing here blocks
the event loop.

Events cross threads through one `EventRelay` per event loop: the engine thread appends to a
deque and wakes the loop only if no wake-up is pending, so a step that produces a token for
each of 8 slots costs one `call_soon_threadsafe` (one self-pipe write), not 8.

When the wake-up happens matters on a small CPU. Events pushed on the engine thread do not wake
the loop at once: the engine calls `Engine.flush_events` right before its next decode (and
before it blocks or runs a command). Waking the loop mid-step made it wait for the GIL the
engine still held (a futex wait, then a second context switch when the engine let go), and
then run at the very start of the decode; now it wakes as the engine releases the GIL for the
decode, and runs in one go. Pushes from any other thread wake the loop immediately.
"""

from __future__ import annotations

import asyncio
import random
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from worker.engine.engine import Engine
from worker.engine.task import ErrorEvent, Event, FinishEvent, Task, TokenEvent
from worker.protocol.sampling import SamplingParams
from worker.server.profiling import generation_trace


class EventRelay:
    """Engine thread -> event loop, one wake-up per burst of events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Engine) -> None:
        self._loop = loop
        self._engine = engine
        self._pending: deque[tuple[asyncio.Queue[tuple[int, Event]], tuple[int, Event]]] = deque()
        self._lock = threading.Lock()
        self._is_scheduled = False
        self._needs_wake = False  # engine-thread pushes since the last flush
        engine.add_flush_hook(self.flush)

    def push(self, queue: asyncio.Queue[tuple[int, Event]], item: tuple[int, Event]) -> None:
        """Any thread; on the engine thread the wake-up waits for the engine's next flush."""
        self._pending.append((queue, item))
        if self._engine.is_engine_thread():
            self._needs_wake = True
            return
        self._wake()

    def push_quiet(self, queue: asyncio.Queue[tuple[int, Event]], item: tuple[int, Event]) -> None:
        """Queue an item without waking the loop: it travels with the next wake-up."""
        self._pending.append((queue, item))

    def flush(self) -> None:
        """Engine thread: wake the loop if anything was pushed since the last flush."""
        if self._needs_wake:
            self._needs_wake = False
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._is_scheduled:
                return  # the pending drain will see this item: it clears the flag before popping
            self._is_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # the event loop is closed: the process is shutting down

    def _drain(self) -> None:
        """Event loop thread."""
        with self._lock:
            self._is_scheduled = False
        while self._pending:
            queue, item = self._pending.popleft()
            queue.put_nowait(item)


_relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventRelay] = weakref.WeakKeyDictionary()


def _relay(loop: asyncio.AbstractEventLoop, engine: Engine) -> EventRelay:
    relay = _relays.get(loop)
    if relay is None or relay._engine is not engine:
        relay = _relays[loop] = EventRelay(loop, engine)
    return relay


class Generation:
    """`quiet_tokens`: the reader only wants the whole result (a non-streaming response), so
    token events ride along with the next wake-up instead of waking the event loop per token;
    finish and error events wake it as usual."""

    def __init__(
        self, engine: Engine, prompts: list[list[int]], params: SamplingParams, *, quiet_tokens: bool = False,
        media: dict[int, Any] | None = None,
    ) -> None:
        self._engine = engine
        self._relay = _relay(asyncio.get_running_loop(), engine)
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.prompts = prompts
        self.params = params
        self.tasks: list[Task] = []
        base_seed = params.seed if params.seed is not None else random.getrandbits(32)
        for p, prompt in enumerate(prompts):
            for i in range(params.n):
                index = p * params.n + i
                emit = partial(self._emit, index)
                self.tasks.append(Task(prompt, params, (base_seed + index) & 0xFFFFFFFF, emit, media=media))
        # A beam search (params.beam_width) is one engine task per prompt, which answers all n
        # choices of that prompt at its end: the other choices' tasks only carry their `emit`.
        self._submitted = self.tasks
        if params.beam_width:
            n = params.n
            self._submitted = [self.tasks[p * n] for p in range(len(prompts))]
            for p, leader in enumerate(self._submitted):
                leader.choice_emits = [t.emit for t in self.tasks[p * n : (p + 1) * n]]
        self._is_started = False
        self._quiet_tokens = quiet_tokens
        self.trace = generation_trace(self.tasks)  # None unless a profiling run is active

    def _emit(self, index: int, event: Event) -> None:  # engine thread
        if self.trace is not None:
            self.trace.on_event(index, event)
        if self._quiet_tokens and isinstance(event, TokenEvent):
            self._relay.push_quiet(self._queue, (index, event))
        else:
            self._relay.push(self._queue, (index, event))

    def start(self) -> None:
        if not self._is_started:
            self._is_started = True
            if self.trace is not None:
                self.trace.on_start()
            for t in self._submitted:
                self._engine.submit(t)

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.trace is not None:
            self.trace.on_cancel()

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.params.n]

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """Every task's events until each has finished or failed."""
        self.start()
        pending = len(self.tasks)
        while pending:
            index, event = await self._queue.get()
            if isinstance(event, FinishEvent | ErrorEvent):
                pending -= 1
            yield index, event
