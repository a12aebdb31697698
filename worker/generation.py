"""The bridge between one HTTP request and the engine thread.

A `Generation` is the set of tasks of one request (`n` choices per prompt, several prompts for
/v1/completions): choice index = prompt_index * n + i. The engine thread calls each task's
`emit`, which hops onto the event loop with `call_soon_threadsafe`; the handler reads
`(index, event)` pairs from one asyncio queue. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from functools import partial

from worker.engine import Engine
from worker.sampling_params import SamplingParams
from worker.task import ErrorEvent, Event, FinishEvent, Task


class Generation:
    def __init__(self, engine: Engine, prompts: list[list[int]], params: SamplingParams) -> None:
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.prompts = prompts
        self.params = params
        self.tasks: list[Task] = []
        base_seed = params.seed if params.seed is not None else random.getrandbits(32)
        for p, prompt in enumerate(prompts):
            for i in range(params.n):
                index = p * params.n + i
                emit = partial(self._emit, index)
                self.tasks.append(Task(prompt, params, (base_seed + index) & 0xFFFFFFFF, emit))
        self._is_started = False

    def _emit(self, index: int, event: Event) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
        except RuntimeError:
            pass  # the event loop is closed: the process is shutting down

    def start(self) -> None:
        if not self._is_started:
            self._is_started = True
            for t in self.tasks:
                self._engine.submit(t)

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()

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
