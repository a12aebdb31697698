"""The eviction policy: pure, no I/O, no logging (llama-swap's `EvictionFor` idea).

Given what the model that waits needs (`Need`: one slot, host RAM, VRAM), the limits
(`--models-max`, `--ram-budget`, `--vram-budget`; 0 = none) and a snapshot of the models that
hold slots, decide: admit now, evict one victim first, drain one, wait, or refuse (`Full`).

- Fits: one more slot is free and the memory the holders are charged, plus the need, is within
  each budget.
- Victim = least recently used among models that are up (awake or asleep), have no request in
  flight and are not pinned. A loading model is never a victim (its waiters would be aborted).
  A model that is already stopping frees its share soon, so while one stops we wait instead of
  evicting another.
- If every candidate is busy, the least recently used busy one is *drained*: it finishes what
  it has in flight but admits nothing new, so a model under constant traffic cannot starve
  the queue, and no running request is aborted.
- `Full`: nothing will ever make room (pinned models hold every slot, or the need alone is over
  a budget less what pinned models hold): the load is refused at once with the figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.presets import GroupRule


@dataclass(frozen=True)
class Occupancy:
    """A model that holds a slot, as the policy sees it (a snapshot)."""

    name: str
    is_up: bool  # loaded, draining or asleep: evictable when idle and not pinned
    is_stopping: bool
    num_in_flight: int
    last_used: float
    is_pinned: bool = False
    ram_bytes: int = 0  # what it is charged against the budgets
    vram_bytes: int = 0
    group: GroupRule | None = None  # its preset group (router/lifecycle/swap.py keeps the rules)
    num_queued: int = 0  # requests waiting at it (not yet forwarded)


@dataclass(frozen=True)
class Need:
    ram_bytes: int = 0
    vram_bytes: int = 0


@dataclass(frozen=True)
class Limits:
    models_max: int = 0  # 0 = no limit, as are the budgets
    ram_budget: int = 0
    vram_budget: int = 0


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Evict:
    victim: str


@dataclass(frozen=True)
class Drain:
    victim: str


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Full:
    reason: str


Decision = Admit | Evict | Drain | Wait | Full


def is_evictable(o: Occupancy) -> bool:
    return o.is_up and o.num_in_flight == 0 and not o.is_pinned


def fits(occupants: Sequence[Occupancy], need: Need, limits: Limits) -> bool:
    if limits.models_max > 0 and len(occupants) >= limits.models_max:
        return False
    if limits.ram_budget > 0 and sum(o.ram_bytes for o in occupants) + need.ram_bytes > limits.ram_budget:
        return False
    return not (limits.vram_budget > 0
                and sum(o.vram_bytes for o in occupants) + need.vram_bytes > limits.vram_budget)


def never_fits(occupants: Sequence[Occupancy], need: Need, limits: Limits) -> str | None:
    """Why no eviction can ever make room (pinned models stay), or None."""
    pinned = [o for o in occupants if o.is_pinned]
    if limits.models_max > 0 and len(pinned) >= limits.models_max:
        return f"all {len(pinned)} model slots (--models-max {limits.models_max}) are held by pinned models"
    for kind, budget, needed, held in (
            ("RAM", limits.ram_budget, need.ram_bytes, sum(o.ram_bytes for o in pinned)),
            ("VRAM", limits.vram_budget, need.vram_bytes, sum(o.vram_bytes for o in pinned))):
        if budget > 0 and needed + held > budget:
            return (f"needs ~{format_size(needed)} of {kind}, budget {format_size(budget)}, "
                    f"pinned {format_size(held)} (--{kind.lower()}-budget)")
    return None


def choose_victim(occupants: Sequence[Occupancy], need: Need, limits: Limits) -> Decision:
    """What to do for one more model, given who holds slots and memory now."""
    if fits(occupants, need, limits):
        return Admit()
    if (reason := never_fits(occupants, need, limits)) is not None:
        return Full(reason)
    if any(o.is_stopping for o in occupants):
        return Wait("a model is stopping")
    candidates = [o for o in occupants if is_evictable(o)]
    if candidates:
        return Evict(min(candidates, key=lambda o: (o.last_used, o.name)).name)
    busy = [o for o in occupants if o.is_up and not o.is_pinned]
    if busy:
        return Drain(min(busy, key=lambda o: (o.last_used, o.name)).name)
    return Wait("every loaded model is loading or pinned")


def format_size(n: int) -> str:
    """Bytes for a message: `1.5 GiB`, `300 MiB`."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
