"""Admission: who holds a slot and memory, who waits (FIFO), whom to evict or drain.

A model holds a slot from its grant until its process is reaped, and is charged the memory it
uses (or is expected to use) against `--ram-budget` / `--vram-budget`. A model that needs a
slot joins a FIFO (one entry per model, however many requests wait for it) with its `Need`.
One task, `Slots.run`, asks the pure policy (`router.lifecycle.eviction.choose_victim`) what to do for
the head of the queue: admit; evict the LRU idle model (a command to its owner, which refuses
if a request slipped in meanwhile); drain the LRU busy model (it finishes its in-flight
requests but admits no new ones; undone when the queue empties); wait until something changes
(a release, a request finishing, a load finishing, a new memory sample); or, when nothing can
ever make room, refuse the load at once (`SlotsFull`, with the figures; the model is not marked
failed). Running requests are never aborted to make room.

Slots knows its holders only through the small `Occupant` protocol; whether one drains is the
occupant's own state (`Occupancy`), not tracked here. `release` is called by the occupant's
owner alone, when it is left without a process.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.lifecycle.eviction import Admit, Drain, Evict, Full, Limits, Need, Occupancy, choose_victim
from router.presets import ModelPreset

log = logging.getLogger("omni.router.admission")


class SlotsFull(Exception):
    """No eviction can ever make room for this model (the message says why, with figures)."""


class Admission(Protocol):
    """What a model's owner needs of admission: `Slots`, or placement's per-node slots (router.placement)."""

    @property
    def queued(self) -> list[str]: ...

    async def acquire(self, occupant: Occupant, need: Need) -> None: ...

    def release(self, occupant: Occupant) -> None: ...

    def poke(self) -> None: ...

    async def run(self) -> None: ...


class Occupant(Protocol):
    """What Slots needs of a model: a snapshot, and two commands to its owner."""

    @property
    def name(self) -> str: ...

    @property
    def preset(self) -> ModelPreset: ...  # (placement reads where it may run)

    @property
    def is_draining(self) -> bool: ...

    def occupancy(self) -> Occupancy: ...

    async def evict(self) -> bool: ...

    async def drain(self, is_on: bool) -> bool: ...


@dataclass(eq=False)
class _SlotRequest:
    occupant: Occupant
    need: Need
    granted: asyncio.Future[None]


class Slots:
    """`--models-max` and memory budget bookkeeping."""

    def __init__(self, limits: Limits, snapshot: Callable[[Occupant], Occupancy] | None = None) -> None:
        self.limits = limits
        self.snapshot = snapshot or (lambda h: h.occupancy())  # placement adds a node's reservations
        self.holders: list[Occupant] = []
        self._queue: deque[_SlotRequest] = deque()
        self._changed = asyncio.Event()

    async def acquire(self, occupant: Occupant, need: Need) -> None:
        """Wait for a slot and room in the budgets; `SlotsFull` if there never will be."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(_SlotRequest(occupant, need, fut))
        self.poke()
        try:
            await fut
        except asyncio.CancelledError:
            self.poke()  # a slot granted just as we were cancelled is released by the owner
            raise

    def release(self, occupant: Occupant) -> None:
        """Called by the occupant's owner only, whenever it is left without a process. Idempotent."""
        if occupant in self.holders:
            self.holders.remove(occupant)
        self.poke()

    def poke(self) -> None:
        self._changed.set()

    @property
    def queued(self) -> list[str]:
        return [r.occupant.name for r in self._queue if not r.granted.done()]

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
            holders = list(self.holders)
            by_name = {h.name: h for h in holders}
            decision = choose_victim([self.snapshot(h) for h in holders], head.need, self.limits)
            if isinstance(decision, Admit):
                self._queue.popleft()
                self.holders.append(head.occupant)
                head.granted.set_result(None)
            elif isinstance(decision, Evict):
                # The victim's owner re-checks (a request may have been admitted since the
                # snapshot); either way the next decision sees its new state.
                if decision.victim in refused:
                    return  # wait for the next change rather than spin
                if not await by_name[decision.victim].evict():
                    refused.add(decision.victim)
            elif isinstance(decision, Drain):
                await by_name[decision.victim].drain(True)
                return  # its last release pokes us
            elif isinstance(decision, Full):
                self._queue.popleft()
                head.granted.set_exception(SlotsFull(decision.reason))
            else:
                return
        await self._undrain()

    async def _undrain(self) -> None:
        """Nobody waits any more: models drained for the queue admit requests again."""
        for h in list(self.holders):
            if h.is_draining:
                await h.drain(False)
