"""The swap scheduler: which waiting model gets a slot next, and what makes room. Pure: no I/O,
no logging, no clock of its own (`now` is given), frozen inputs, decisions as types.

When more models are asked for than fit (`--models-max`, the memory budgets, a `swap` group),
requests wait per model and the models wait in `Slots`' queue (router/lifecycle/admission.py),
which asks `decide` what to do after every change and at the time `Hold.until` names.

The rule (`policy = "fair"`, the default; docs/swaps.md has the figures behind it):

1. Requests for a loaded model are served before a swap away from it. A model with a request in
   flight is not drained for a waiting one, unless that one is *overdue*: it has waited
   `max_wait` seconds (`--swap-max-wait`), or `max_passes` other models were loaded while it
   waited (`--swap-max-passes`). An idle model that served a request less than a load time ago
   (the waiting model's load time) is kept as if busy, until the requests waiting for the other
   model have waited that load time together (queued x waited >= load time): rent or buy, the
   ski-rental rule, which never pays more than twice the better of the two choices. Why: a swap
   costs a load (seconds) and the KV cache of the model swapped out, while the next request of a
   conversation often follows within a think time; a proxy that swaps for every request for
   another model (FIFO) swaps on almost every call of agents that alternate models (A, B, A, C),
   one or two requests per load. Waiting a little lets the requests for the other model gather,
   so that each load serves more of them. The bound keeps every model's wait finite however busy
   the loaded one is.
2. The order in which waiting models load: overdue ones first (longest waiting first), then by
   preset `priority` (higher first), then by score, then by arrival.
       score = (queued requests + waited / load time) / load time
   A load serves the requests queued for it: more of them per second of loading is better;
   waiting time counts as that many more requests per load time waited (aging), so that a model
   with one request is not passed over for long (and the bound passes it over at most
   `max_passes` times). Load time is the model's last measured load (unknown: the mean of the
   known ones, else `DEFAULT_LOAD_S`).
3. Only the first model in that order may evict or drain; the others are admitted only when
   they fit as things are (a free slot and memory): a lower-ranked model never takes the room
   that is being made for a higher-ranked one.
4. Groups (presets' `[groups.NAME]`, llama-swap's meanings): members of one `swap` group
   never hold slots at once, so the other member goes first (evicted when idle; busy: drained
   under rule 1); an `exclusive` member's load unloads the members of other groups the same way
   (models in no group are left alone); a `persistent` group's members are never unloaded for
   a model outside their group (as pinned ones are never unloaded at all). Memory budgets and
   `--models-max` then apply as they do without groups.
5. `Refuse` when nothing will ever make room (pinned or persistent models hold it), at once.

Two FIFO rules are kept to measure against (bench/bench_swap.py); in both only the head of the
queue is considered, and a busy model is drained for it at once:
- `policy = "fifo"`: requests in arrival order, one swap per head of the request queue (a naive
  proxy: each request that asks for another model than the one up swaps to it, after the
  requests that arrived before it; llama-swap does better, see docs/swaps.md). A loaded model
  admits only its requests that arrived before the oldest request waiting for another model to
  load (`admits_before`); the models wait in the order of their oldest waiting request.
- `policy = "fifo-batch"`: the router's rule before the scheduler (issue 51): the model of the
  oldest queue entry loads and serves every request queued for it, whenever it arrived.

A loading model is never a victim (its waiters would be aborted); while a model stops, the room
it frees is waited for rather than another model evicted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from router.lifecycle.eviction import Limits, Need, Occupancy, fits, format_size
from router.presets import GroupRule

Policy = Literal["fair", "fifo", "fifo-batch"]
POLICIES: tuple[str, ...] = ("fair", "fifo", "fifo-batch")
DEFAULT_LOAD_S = 1.0  # a load time for the score when no model's load was measured yet
MIN_LOAD_S = 0.25  # load times below this count as this (the score divides by it)


@dataclass(frozen=True)
class SwapRule:
    policy: Policy = "fair"
    max_wait: float = 10.0  # seconds a model may wait for a busy one before it drains it
    max_passes: int = 3  # other models' loads a waiting model may see before it drains a busy one


@dataclass(frozen=True)
class Candidate:
    """A model waiting for a slot, as the policy sees it (a snapshot)."""

    name: str
    since: float  # when it joined the queue (the caller's clock); "fifo": its oldest request's arrival
    order: int  # arrival order in the queue
    need: Need = field(default_factory=Need)
    num_queued: int = 1  # requests waiting for it
    load_s: float | None = None  # its last measured load time, None before one
    priority: int = 0
    group: GroupRule | None = None
    num_passed: int = 0  # loads of other models since it joined


@dataclass(frozen=True)
class Load:
    name: str  # admit this waiting model now


@dataclass(frozen=True)
class Evict:
    victim: str  # idle: stop it (its owner refuses if a request slipped in)
    waiting: str  # for whom


@dataclass(frozen=True)
class Drain:
    victim: str  # busy: it admits no new request, and is evicted once idle
    waiting: str


@dataclass(frozen=True)
class Refuse:
    name: str  # nothing will ever make room for it: its load fails at once
    reason: str


@dataclass(frozen=True)
class Hold:
    reason: str
    until: float | None = None  # decide again then (someone becomes overdue) even if nothing changes


Decision = Load | Evict | Drain | Refuse | Hold


def is_overdue(c: Candidate, rule: SwapRule, now: float) -> bool:
    return now >= c.since + rule.max_wait or c.num_passed >= rule.max_passes


def score(c: Candidate, now: float, load_s: float) -> float:
    load = max(load_s, MIN_LOAD_S)
    return (c.num_queued + (now - c.since) / load) / load


def is_fifo(rule: SwapRule) -> bool:
    return rule.policy != "fair"


def admits_before(rule: SwapRule, name: str, oldest: Mapping[str, float]) -> float | None:
    """"fifo": model `name`, loaded, admits only the requests that arrived before this time: the
    oldest request waiting for another model to load (`oldest`: per model that is not ready, when
    its oldest waiting request arrived). None: no such bound (any other policy)."""
    if rule.policy != "fifo":
        return None
    return min((at for n, at in oldest.items() if n != name), default=None)


def ordered(waiting: Sequence[Candidate], rule: SwapRule, now: float) -> list[Candidate]:
    """The order in which waiting models get room (rule 2; FIFO: arrival)."""
    if rule.policy == "fifo":
        return sorted(waiting, key=lambda c: (c.since, c.order))
    if rule.policy == "fifo-batch":
        return sorted(waiting, key=lambda c: c.order)

    def key(c: Candidate) -> tuple[bool, float, int, float, int]:
        overdue = is_overdue(c, rule, now)
        return (
            not overdue,
            c.since if overdue else 0.0,
            -c.priority,
            -score(c, now, _load_s(c, waiting)),
            c.order,
        )

    return sorted(waiting, key=key)


def _load_s(c: Candidate, waiting: Sequence[Candidate]) -> float:
    """Its measured load time; unknown: the mean of the known ones, else DEFAULT_LOAD_S."""
    if c.load_s is not None:
        return max(c.load_s, MIN_LOAD_S)
    known = [w.load_s for w in waiting if w.load_s is not None]
    return max(sum(known) / len(known) if known else DEFAULT_LOAD_S, MIN_LOAD_S)


def decide(
    holders: Sequence[Occupancy], waiting: Sequence[Candidate], limits: Limits, rule: SwapRule, now: float
) -> Decision:
    """What to do next for the models in `waiting`, given who holds slots and memory now."""
    if not waiting:
        return Hold("nobody waits")
    queue = ordered(waiting, rule, now)
    first, rest = queue[0], [] if is_fifo(rule) else queue[1:]
    cost = _load_s(first, waiting)
    paid_at = first.since + cost / first.num_queued  # its requests have waited a load time, together
    is_paid = now >= paid_at
    linger = 0.0 if is_fifo(rule) or is_paid else cost  # rule 1's rent-or-buy
    step = _room_for(holders, first, limits, _Idle(now, linger))
    if isinstance(step, _Busy):
        if is_fifo(rule) or is_overdue(
            first, rule, now
        ):  # a lingering one is evicted, a busy one drained
            step = _room_for(holders, first, limits, _Idle(now, 0.0))
            return Drain(step.victim, first.name) if isinstance(step, _Busy) else step
        step = Hold(f"{step.victim} serves its requests first (bound: {rule.max_wait:g} s)")
    if not isinstance(step, Hold):
        return step
    for c in rest:  # rule 3: only what fits as things are
        if not _conflicts_of(holders, c) and fits(holders, c.need, limits):
            return Load(c.name)
        if (reason := _never_fits(holders, c, limits)) is not None:
            return Refuse(c.name, reason)
    if is_fifo(rule):
        return step
    wake = [c.since + rule.max_wait for c in waiting if not is_overdue(c, rule, now)]
    kept = [
        o.last_used + linger
        for o in holders
        if o.is_up and not o.num_in_flight and not _Idle(now, linger).is_idle(o)
    ]
    if kept:  # an idle model kept for a while: until the swap is paid for, or it idled a load time
        wake += [paid_at, *kept]
    return Hold(step.reason, min(wake) if wake else None)


@dataclass(frozen=True)
class _Idle:
    now: float
    linger: float

    def is_idle(self, o: Occupancy) -> bool:
        """Up, nothing in flight, and its last request `linger` seconds ago or more."""
        return o.is_up and o.num_in_flight == 0 and self.now >= o.last_used + self.linger


@dataclass(frozen=True)
class _Busy:
    victim: str  # the room is held by this model, busy


def _room_for(holders: Sequence[Occupancy], c: Candidate, limits: Limits, idle: _Idle) -> Decision | _Busy:
    """Load, evict an idle model, refuse; or which busy model holds the room; or Hold."""
    conflicts = _conflicts_of(holders, c)
    if conflicts:  # rule 4: the group's rules first, then the budgets
        stuck = next((o for o in conflicts if o.is_pinned), None)
        if stuck is not None:
            return Refuse(c.name, f"{stuck.name!r} is pinned and {_why_conflict(stuck, c)}")
        return _clear(conflicts, c, idle, "a model of a conflicting group")
    if fits(holders, c.need, limits):
        return Load(c.name)
    if (reason := _never_fits(holders, c, limits)) is not None:
        return Refuse(c.name, reason)
    return _clear(
        [o for o in holders if not _is_protected(o, c)], c, idle, "every model that could make room"
    )


def _clear(victims: Sequence[Occupancy], c: Candidate, idle: _Idle, what: str) -> Decision | _Busy:
    if any(o.is_stopping for o in victims):
        return Hold("a model is stopping")
    idle_ones = [o for o in victims if idle.is_idle(o)]
    if idle_ones:
        return Evict(min(idle_ones, key=lambda o: (o.last_used, o.name)).name, c.name)
    busy = [o for o in victims if o.is_up]
    if busy:
        return _Busy(min(busy, key=lambda o: (o.last_used, o.name)).name)
    return Hold(f"{what} is loading")


def _conflicts_of(holders: Sequence[Occupancy], c: Candidate) -> list[Occupancy]:
    return [o for o in holders if o.name != c.name and _why_conflict(o, c)]


def _why_conflict(o: Occupancy, c: Candidate) -> str:
    """Why holder `o` must go before `c` loads (rule 4), or "" if it need not."""
    g, og = c.group, o.group
    if g is None or og is None:
        return ""
    if og.name == g.name:
        return f"shares swap group {g.name!r} with {c.name!r}" if g.swap else ""
    if g.exclusive and not og.persistent:
        return f"is in group {og.name!r}, and {c.name!r}'s group {g.name!r} is exclusive"
    return ""


def _is_protected(o: Occupancy, c: Candidate) -> bool:
    """Never unloaded for `c`: pinned, or persistent and not in `c`'s group."""
    return o.is_pinned or is_kept_for(o, c.group)


def is_kept_for(o: Occupancy, group: GroupRule | None) -> bool:
    """A persistent group's member, kept when a model of `group` (another one, or none) needs room
    (GPU placement's evictions ask this too, router/lifecycle/gpu_admission.py)."""
    return o.group is not None and o.group.persistent and (group is None or group.name != o.group.name)


def _never_fits(holders: Sequence[Occupancy], c: Candidate, limits: Limits) -> str | None:
    kept = [o for o in holders if _is_protected(o, c)]
    what = "pinned or persistent (of another group)" if any(not o.is_pinned for o in kept) else "pinned"
    if limits.models_max > 0 and len(kept) >= limits.models_max:
        return f"all {len(kept)} model slots (--models-max {limits.models_max}) are held by {what} models"
    for kind, budget, needed, held in (
        ("RAM", limits.ram_budget, c.need.ram_bytes, sum(o.ram_bytes for o in kept)),
        ("VRAM", limits.vram_budget, c.need.vram_bytes, sum(o.vram_bytes for o in kept)),
    ):
        if budget > 0 and needed + held > budget:
            return (
                f"needs ~{format_size(needed)} of {kind}, budget {format_size(budget)}, "
                f"{what} {format_size(held)} (--{kind.lower()}-budget)"
            )
    return None
