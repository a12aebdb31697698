"""The eviction policy: pure, no I/O, no logging (llama-swap's `EvictionFor` idea).

Given the model that needs a slot and a snapshot of the models holding slots, decide:
admit now, evict one victim first, drain one, or wait. Victim = least recently used among
models that are READY or SLEEPING, have no request in flight and are not pinned. A model that
is already STOPPING frees a slot soon, so while one is stopping we wait instead of evicting
another. A LOADING model is never a victim (its waiters would be aborted).

If every candidate is busy, the least recently used busy one is *drained*: it finishes what it
has in flight but admits nothing new (new requests for it queue behind the waiting model), so
a model under constant traffic cannot starve the queue, and no running request is aborted.
If pinned models hold every slot, nothing will ever free one: the answer is `Full`, and the
waiting model's load fails at once with that reason instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.state import ModelState


@dataclass(frozen=True)
class Occupant:
    """A model that holds a slot (has a process)."""

    name: str
    state: ModelState
    num_in_flight: int
    last_used: float
    is_pinned: bool = False


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


def is_evictable(o: Occupant) -> bool:
    return o.state in (ModelState.READY, ModelState.SLEEPING) and o.num_in_flight == 0 and not o.is_pinned


def choose_victim(occupants: Sequence[Occupant], models_max: int) -> Decision:
    """What to do for one more model, given who holds the `models_max` slots now."""
    if models_max <= 0 or len(occupants) < models_max:
        return Admit()
    if any(o.state == ModelState.STOPPING for o in occupants):
        return Wait("a model is stopping")
    candidates = [o for o in occupants if is_evictable(o)]
    if candidates:
        return Evict(min(candidates, key=lambda o: (o.last_used, o.name)).name)
    busy = [o for o in occupants if o.state in (ModelState.READY, ModelState.SLEEPING) and not o.is_pinned]
    if busy:
        return Drain(min(busy, key=lambda o: (o.last_used, o.name)).name)
    if all(o.is_pinned for o in occupants):
        return Full(f"all {len(occupants)} model slots (--models-max {models_max}) are held by pinned models")
    return Wait("every loaded model is loading or pinned")
