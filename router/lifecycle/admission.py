"""Admission: who holds a slot and memory, who waits, whom to evict or drain.

A model holds a slot from its grant until its process is reaped, and is charged the memory it
uses (or is expected to use) against `--ram-budget` / `--vram-budget`. A model that needs a
slot joins the queue (one entry per model, however many requests wait for it) with its `Need`.
One task, `Slots.run`, asks the pure swap scheduler (`router.lifecycle.swap.decide`: which
waiting model next, under the groups' rules and the fairness bound) what to do: admit one;
evict an idle model (a command to its owner, which refuses if a request slipped in meanwhile);
drain a busy one (it finishes its in-flight requests but admits no new ones; undone when the
queue empties); hold until something changes (a release, a request finishing, a load
finishing, a new memory sample) or until a waiting model becomes overdue; or, when nothing can
ever make room, refuse that load at once (`SlotsFull`, with the figures; the model is not
marked failed). Running requests are never aborted to make room.

Slots knows its holders only through the small `Occupant` protocol; whether one drains is the
occupant's own state (`Occupancy`), not tracked here. `release` is called by the occupant's
owner alone, when it is left without a process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.lifecycle import swap
from router.lifecycle.eviction import Limits, Need, Occupancy
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

    def admits_before(self, name: str) -> float | None: ...

    async def run(self) -> None: ...


class Occupant(Protocol):
    """What Slots needs of a model: a snapshot, and two commands to its owner."""

    @property
    def name(self) -> str: ...

    @property
    def preset(self) -> ModelPreset: ...  # (placement reads where it may run)

    @property
    def is_draining(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...  # requests waiting for it

    @property
    def load_seconds(self) -> float | None: ...  # its last measured load, grant to ready

    @property
    def waiting_since(self) -> float | None: ...  # not ready: its oldest waiting request's arrival

    def recheck(self) -> None: ...  # admission changed: admit the waiting requests that now may go

    def occupancy(self) -> Occupancy: ...

    async def evict(self) -> bool: ...

    async def drain(self, is_on: bool) -> bool: ...


@dataclass(eq=False)
class _SlotRequest:
    occupant: Occupant
    need: Need
    granted: asyncio.Future[None]
    since: float  # monotonic, when it joined
    order: int
    num_passed: int = 0  # loads of other models since it joined (the swap scheduler's bound)

    def candidate(self) -> swap.Candidate:
        o, p = self.occupant, self.occupant.preset
        return swap.Candidate(o.name, self.since, self.order, self.need, max(1, o.num_waiting),
                              o.load_seconds, p.priority, p.group, self.num_passed)


class Slots:
    """`--models-max` and memory budget bookkeeping; the swap scheduler decides (`rule`)."""

    def __init__(self, limits: Limits, snapshot: Callable[[Occupant], Occupancy] | None = None,
                 rule: swap.SwapRule | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.rule = rule or swap.SwapRule()
        self.snapshot = snapshot or (lambda h: h.occupancy())  # placement adds a node's reservations
        self.holders: list[Occupant] = []
        self._queue: list[_SlotRequest] = []
        self._seen: dict[str, Occupant] = {}  # every model that asked for a slot, by name (the latest handle)
        self._changed = asyncio.Event()
        self._clock = clock
        self._order = itertools.count()
        self.num_loads = 0  # slots granted (each a load; with --models-max 1, a swap)

    async def acquire(self, occupant: Occupant, need: Need) -> None:
        """Wait for a slot and room in the budgets; `SlotsFull` if there never will be."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seen[occupant.name] = occupant
        since = self._clock()
        if self.rule.policy == "fifo":  # requests in arrival order: it waits as long as its oldest one
            since = min(since, occupant.waiting_since or since)
        self._queue.append(_SlotRequest(occupant, need, fut, since, next(self._order)))
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

    def admits_before(self, name: str) -> float | None:
        """Model `name`, loaded, admits only the requests that arrived before this (monotonic)
        time: the rule "fifo" (`swap.admits_before`, over every model that ever asked for a slot:
        one evicted with requests waiting asks again only after its exit); None: no bound."""
        if self.rule.policy != "fifo":
            return None  # (on every admission: nothing to gather)
        oldest = {o.name: at for o in self._seen.values() if (at := o.waiting_since) is not None}
        return swap.admits_before(self.rule, name, oldest)

    async def run(self) -> None:
        until: float | None = None
        while True:
            timeout = None if until is None else max(0.0, until - self._clock())
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass  # a waiting model became overdue
            self._changed.clear()
            try:
                until = await self._admit_from_queue()
            except Exception:  # a bug here must not stop admission for good
                log.exception("admission pass failed")
                await asyncio.sleep(0.1)  # retry, without spinning on a persistent bug
                self.poke()

    async def _admit_from_queue(self) -> float | None:
        """Act on the scheduler's decisions until it holds; returns when to decide again."""
        refused: set[str] = set()
        while True:
            self._queue = [r for r in self._queue if not r.granted.done()]  # (cancelled loads)
            if not self._queue:
                await self._undrain()
                self._recheck(self.holders)  # nobody waits: no bound on any model's admission
                return None
            holders = list(self.holders)
            by_name = {h.name: h for h in holders}
            entries = {r.occupant.name: r for r in self._queue}
            decision = swap.decide([self.snapshot(h) for h in holders], [r.candidate() for r in self._queue],
                                   self.limits, self.rule, self._clock())
            self._recheck(holders)  # the bound of `admits_before` may have moved
            match decision:
                case swap.Load(name):
                    self._grant(entries[name])
                case swap.Evict(victim):
                    # The victim's owner re-checks (a request may have been admitted since the
                    # snapshot); either way the next decision sees its new state.
                    if victim in refused:
                        return None  # wait for the next change rather than spin
                    if not await by_name[victim].evict():
                        refused.add(victim)
                case swap.Drain(victim):
                    await by_name[victim].drain(True)
                    return None  # its last release pokes us
                case swap.Refuse(name, reason):
                    entry = entries[name]
                    self._queue.remove(entry)
                    entry.granted.set_exception(SlotsFull(reason))
                case swap.Hold(_, until):
                    return until

    def _recheck(self, holders: list[Occupant]) -> None:
        """The rule "fifo": holders with requests waiting admit those that `admits_before` now lets go."""
        if self.rule.policy == "fifo":
            for h in holders:
                if h.num_waiting:
                    h.recheck()

    def _grant(self, entry: _SlotRequest) -> None:
        self._queue.remove(entry)
        self.holders.append(entry.occupant)
        self.num_loads += 1
        for other in self._queue:
            other.num_passed += 1
        entry.granted.set_result(None)

    async def _undrain(self) -> None:
        """Nobody waits any more: models drained for the queue admit requests again."""
        for h in list(self.holders):
            if h.is_draining:
                await h.drain(False)
