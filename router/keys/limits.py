"""A key's limits: requests and tokens per minute (token buckets), requests at once (a gate
with a bounded line). Pure apart from the gate's futures; the clock is passed in.

A bucket holds up to a minute's allowance and refills continuously (rpm/60 a second), so a key
may burst its whole rpm, and past it waits a fraction of a minute, not the rest of a fixed
window: `Retry-After` is the time until one more request (or, for tpm, any token) fits.
Tokens are debited after the answer, from the usage it reported (router.keys.usage), so the
bucket may go below zero; the key then waits until it is back above.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from router.keys.keyfile import Key


@dataclass
class TokenBucket:
    per_minute: int
    level: float = math.nan  # full at the first use
    t: float = 0.0

    def _refill(self, now: float) -> None:
        if math.isnan(self.level):
            self.level, self.t = float(self.per_minute), now
        self.level = min(float(self.per_minute), self.level + (now - self.t) * self.per_minute / 60.0)
        self.t = now

    def wait_s(self, now: float, need: float = 1.0) -> float:
        """Seconds until `need` fits (0: now)."""
        self._refill(now)
        return max(0.0, (need - self.level) * 60.0 / self.per_minute)

    def take(self, now: float, n: float) -> None:
        self._refill(now)
        self.level -= n


class GateFull(Exception):
    """The key's line of waiting requests is full."""


@dataclass
class Gate:
    """At most `limit` holders; up to `queue` more wait, first come first served."""

    limit: int
    queue: int
    active: int = 0
    _waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def can_enter(self) -> bool:
        """Whether `acquire` would return at once."""
        return self.active < self.limit and not self._waiters

    async def acquire(self) -> None:
        if self.can_enter():
            self.active += 1
            return
        if len(self._waiters) >= self.queue:
            raise GateFull
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # `release` hands its place over: `active` is unchanged
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed over just as we were cancelled: pass it on
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


@dataclass
class KeyLimits:
    """One key's buckets and gate (None where the key has no such limit)."""

    rpm: TokenBucket | None
    tpm: TokenBucket | None
    gate: Gate | None

    @classmethod
    def of(cls, key: Key) -> KeyLimits:
        return cls(
            TokenBucket(key.rpm) if key.rpm else None,
            TokenBucket(key.tpm) if key.tpm else None,
            Gate(key.concurrency, key.queue) if key.concurrency else None,
        )

    def admit(self, now: float) -> tuple[str, float] | None:
        """Take one request from the rpm bucket if it and the tpm bucket allow it; else what is
        exhausted ("requests" or "tokens") and the seconds until it is not."""
        waits = [
            ("requests", self.rpm.wait_s(now) if self.rpm else 0.0),
            ("tokens", self.tpm.wait_s(now, 1e-9) if self.tpm else 0.0),
        ]
        kind, wait = max(waits, key=lambda w: w[1])
        if wait > 0:
            return kind, wait
        if self.rpm is not None:
            self.rpm.take(now, 1)
        return None

    def spend_tokens(self, now: float, n: int) -> None:
        if self.tpm is not None and n:
            self.tpm.take(now, n)


def limits_key(key: Key) -> tuple[int | None, int | None, int | None, int]:
    """What a key's limit state depends on: a reload keeps the state of a key where this is equal."""
    return key.rpm, key.tpm, key.concurrency, key.queue
