"""Admission under `--models-max`: who holds a slot, who waits (FIFO), whom to evict or drain.

A model holds a slot from its spawn until its process is reaped. A model that needs a slot
joins a FIFO (one entry per model, however many requests wait for it). One task, `Slots.run`,
asks the pure policy (`router.eviction.choose_victim`) what to do for the head of the queue:
admit; evict the LRU idle model (a command to its owner, which refuses if a request slipped in
meanwhile); drain the LRU busy model (it finishes its in-flight requests but admits no new
ones, which wait for it to come back; undone when the queue empties); or wait until something
changes (a release, a request finishing, a load finishing); or, when pinned models hold every
slot, refuse the load at once (`SlotsFull`: the requests get a 503 saying why; the model is
not marked failed). Running requests are never aborted to make room. Slots are given back by
the model's owner alone, when it is left without a process (`ModelHandle._set`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.eviction import Admit, Drain, Evict, Full, choose_victim

if TYPE_CHECKING:
    from router.model import ModelHandle

log = logging.getLogger("omni.router.admission")


class SlotsFull(Exception):
    """No slot can ever be freed for this model (pinned models hold them all)."""


@dataclass
class _SlotRequest:
    name: str
    granted: asyncio.Future[None]


class Slots:
    """`--models-max` bookkeeping: who holds a slot, who waits (FIFO), whom to evict."""

    def __init__(self, models_max: int, handles: Mapping[str, ModelHandle]) -> None:
        self.models_max = models_max
        self.holders: set[str] = set()
        self.draining: set[str] = set()
        self._queue: deque[_SlotRequest] = deque()
        self._changed = asyncio.Event()
        self._handles = handles

    async def acquire(self, name: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(_SlotRequest(name, fut))
        self.poke()
        try:
            await fut
        except asyncio.CancelledError:
            self.poke()  # a slot granted just as we were cancelled is released by the owner
            raise

    def release(self, name: str) -> None:
        """Called by the model's owner only, whenever it is left without a process."""
        self.holders.discard(name)
        self.draining.discard(name)
        self.poke()

    def poke(self) -> None:
        self._changed.set()

    @property
    def queued(self) -> list[str]:
        return [r.name for r in self._queue if not r.granted.done()]

    async def run(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                await self._admit_from_queue()
            except Exception:  # a bug here must not stop admission for good
                log.exception("admission pass failed")
                await asyncio.sleep(0.1)  # retry, without spinning on a persistent bug
                self.poke()

    async def _admit_from_queue(self) -> None:
        refused: set[str] = set()
        while self._queue:
            head = self._queue[0]
            if head.granted.done():  # its load was cancelled
                self._queue.popleft()
                continue
            occupants = [self._handles[n].occupant() for n in sorted(self.holders)]
            decision = choose_victim(occupants, self.models_max)
            if isinstance(decision, Admit):
                self._queue.popleft()
                self.holders.add(head.name)
                head.granted.set_result(None)
            elif isinstance(decision, Evict):
                # The victim's owner re-checks (a request may have been admitted since the
                # snapshot); either way the next decision sees its new state.
                if decision.victim in refused:
                    return  # wait for the next change rather than spin
                if await self._handles[decision.victim].evict():
                    self.draining.discard(decision.victim)
                else:
                    refused.add(decision.victim)
            elif isinstance(decision, Drain):
                if decision.victim not in self.draining:
                    self.draining.add(decision.victim)
                    await self._handles[decision.victim].drain(True)
                return  # its last release() pokes us
            elif isinstance(decision, Full):
                self._queue.popleft()
                head.granted.set_exception(SlotsFull(decision.reason))
            else:
                return
        await self._undrain()

    async def _undrain(self) -> None:
        """Nobody waits any more: models drained for the queue admit requests again."""
        while self.draining:
            await self._handles[self.draining.pop()].drain(False)
