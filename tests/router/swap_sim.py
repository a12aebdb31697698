"""A discrete-event simulation of the router's admission under the swap scheduler: a simulated
clock, simulated load and service times, and the same pure `decide` that `Slots` calls.

Each model serves `parallel` requests at once for `service_s` each; a load takes its load time,
a stop `stop_s`. Agents are chains of calls with think time between them. The bookkeeping is a
small copy of the owner's and `Slots`': a loaded model admits a request at once when it has
room and is not draining (under the rule "fifo", only the requests that arrived before the oldest
request waiting for another model to load: `admits_before`); a model with waiting requests and no slot
joins the queue (under "fifo" it waits as long as its oldest request, as `Slots.acquire` has it);
a drained model stops once idle; when the queue empties, drained models admit again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.lifecycle.eviction import Limits, Occupancy
from router.lifecycle.swap import Candidate, Drain, Evict, Hold, Load, Refuse, SwapRule, admits_before, decide


@dataclass(frozen=True)
class Agent:
    models: tuple[str, ...]  # one round: a call to each, in order
    think_s: float  # between a call's answer and the next call
    start_s: float
    rounds: int


@dataclass
class Result:
    num_swaps: int  # loads (with models-max 1, each load is a swap)
    wall_s: float
    longest_wait_s: float  # from a request's arrival to its start
    longest_wait_by_model: dict[str, float]
    loads: list[tuple[float, str, int]] = field(default_factory=list)  # (time, model, requests waiting)


@dataclass
class _Model:
    name: str
    load_s: float
    phase: str = "down"  # down loading up draining stopping
    until: float = 0.0  # end of the load or stop
    running: list[float] = field(default_factory=list)  # finish times
    waiting: list[tuple[float, int]] = field(default_factory=list)  # (arrival, agent)
    last_used: float = 0.0
    measured: float | None = None


def simulate(
    agents: list[Agent],
    load_s: dict[str, float],
    rule: SwapRule,
    *,
    service_s: float,
    parallel: int = 4,
    models_max: int = 1,
    stop_s: float = 0.1,
) -> Result:
    models = {n: _Model(n, s) for n, s in load_s.items()}
    calls = [[m for _ in range(a.rounds) for m in a.models] for a in agents]
    next_call = [0] * len(agents)
    arrivals: dict[int, float] = {i: a.start_s for i, a in enumerate(agents)}
    finishing: list[tuple[float, int, str]] = []  # (time, agent, model)
    queue: dict[str, list[float]] = {}  # model -> [since, order, passed]
    order = 0
    hold_until: float | None = None
    now, num_loads, end = 0.0, 0, 0.0
    waits: dict[str, float] = {n: 0.0 for n in models}
    log: list[tuple[float, str, int]] = []

    def start(m: _Model, arrival: float, agent: int) -> None:
        m.running.append(now + service_s)
        m.last_used = now
        finishing.append((now + service_s, agent, m.name))
        waits[m.name] = max(waits[m.name], now - arrival)

    def admit(m: _Model) -> None:
        oldest = {o.name: o.waiting[0][0] for o in models.values() if o.waiting and o.phase != "up"}
        bound = admits_before(rule, m.name, oldest)
        while m.phase == "up" and m.waiting and len(m.running) < parallel:
            if bound is not None and m.waiting[0][0] >= bound:
                break
            arrival, agent = m.waiting.pop(0)
            start(m, arrival, agent)

    def enqueue(m: _Model) -> None:
        nonlocal order
        if m.phase == "down" and m.waiting and m.name not in queue:
            queue[m.name] = [min(now, m.waiting[0][0]) if rule.policy == "fifo" else now, order, 0]
            order += 1

    while True:
        times = [
            *arrivals.values(),
            *(f[0] for f in finishing),
            *(m.until for m in models.values() if m.phase in ("loading", "stopping")),
        ]
        if hold_until is not None:
            times.append(hold_until)
        if not times:
            break
        now = max(now, min(times))
        hold_until = None
        for f in [f for f in finishing if f[0] <= now]:
            finishing.remove(f)
            m = models[f[2]]
            m.running.remove(f[0])
            m.last_used = now
            end = max(end, now)
            if next_call[f[1]] < len(calls[f[1]]):
                arrivals[f[1]] = now + agents[f[1]].think_s
        for m in models.values():
            if m.phase == "loading" and m.until <= now:
                m.phase, m.measured = "up", m.load_s
            elif m.phase == "stopping" and m.until <= now:
                m.phase = "down"
        for i, at in list(arrivals.items()):
            if at <= now:
                del arrivals[i]
                m = models[calls[i][next_call[i]]]
                next_call[i] += 1
                m.waiting.append((at, i))
        for m in models.values():
            admit(m)
            if m.phase == "draining" and not m.running:
                m.phase, m.until = "stopping", now + stop_s
            enqueue(m)
        while queue:  # the scheduler, as Slots runs it
            holders = [m for m in models.values() if m.phase not in ("down",)]
            occupancy = [
                Occupancy(
                    m.name,
                    m.phase in ("up", "draining"),
                    m.phase == "stopping",
                    len(m.running),
                    m.last_used,
                    num_queued=len(m.waiting),
                )
                for m in holders
            ]
            waiting = [
                Candidate(
                    n,
                    q[0],
                    int(q[1]),
                    num_queued=max(1, len(models[n].waiting)),
                    load_s=models[n].measured,
                    num_passed=int(q[2]),
                )
                for n, q in queue.items()
            ]
            d = decide(occupancy, waiting, Limits(models_max=models_max), rule, now)
            if isinstance(d, Load):
                del queue[d.name]
                for q in queue.values():
                    q[2] += 1
                models[d.name].phase, models[d.name].until = "loading", now + models[d.name].load_s
                num_loads += 1
                log.append((round(now, 2), d.name, len(models[d.name].waiting)))
            elif isinstance(d, Evict):
                models[d.victim].phase, models[d.victim].until = "stopping", now + stop_s
            elif isinstance(d, Drain):
                v = models[d.victim]
                v.phase = "draining"
                if not v.running:
                    v.phase, v.until = "stopping", now + stop_s
                break
            elif isinstance(d, Refuse):
                raise AssertionError(d)
            elif isinstance(d, Hold):
                hold_until = d.until
                break
        if not queue:
            for m in models.values():
                if m.phase == "draining":
                    m.phase = "up"
                    admit(m)
    return Result(num_loads, end, max(waits.values()), waits, log)
