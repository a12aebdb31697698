"""The swap scheduler (router/lifecycle/swap.py): table tests on a simulated clock, then a
simulated agent trace (simulated load times) where the fair rule is measured against both FIFO
rules ("fifo": requests in arrival order; "fifo-batch": the router's rule before)."""

from __future__ import annotations

import itertools
import random

import pytest

from router.lifecycle.eviction import Limits, Need, Occupancy
from router.lifecycle.swap import (
    Candidate,
    Decision,
    Drain,
    Evict,
    Hold,
    Load,
    Refuse,
    SwapRule,
    admits_before,
    decide,
    is_kept_for,
    ordered,
)
from router.presets import GroupRule
from tests.router.swap_sim import Agent, simulate

UP, LOADING, STOPPING = "up", "loading", "stopping"
M = 1 << 20
FAIR = SwapRule("fair", max_wait=10.0, max_passes=3)
FIFO = SwapRule("fifo", max_wait=10.0, max_passes=3)
BATCH = SwapRule("fifo-batch", max_wait=10.0, max_passes=3)
SWAP = GroupRule("pair")  # swap, exclusive (llama-swap's defaults)
OTHER = GroupRule("other")
KEEP = GroupRule("keep", swap=False, exclusive=False, persistent=True)
TOGETHER = GroupRule("together", swap=False, exclusive=False)


def occ(
    name: str,
    kind: str = UP,
    in_flight: int = 0,
    last_used: float = -100.0,
    pinned: bool = False,
    ram: int = 0,
    group: GroupRule | None = None,
    queued: int = 0,
) -> Occupancy:
    return Occupancy(
        name, kind == UP, kind == STOPPING, in_flight, last_used, pinned, ram * M, 0, group, queued
    )


def cand(
    name: str,
    since: float = 0.0,
    order: int = 0,
    queued: int = 1,
    load_s: float | None = 1.0,
    priority: int = 0,
    group: GroupRule | None = None,
    passed: int = 0,
    ram: int = 0,
) -> Candidate:
    return Candidate(name, since, order, Need(ram * M), queued, load_s, priority, group, passed)


ONE = Limits(models_max=1)
TWO = Limits(models_max=2)
# (what, holders, waiting, limits, rule, now, decision)
CASES: list[tuple[str, list[Occupancy], list[Candidate], Limits, SwapRule, float, Decision]] = [
    ("nobody waits", [occ("a")], [], ONE, FAIR, 0, Hold("nobody waits")),
    ("a free slot", [occ("a")], [cand("b")], TWO, FAIR, 0, Load("b")),
    ("idle holder: evicted at once", [occ("a")], [cand("b")], ONE, FAIR, 0, Evict("a", "b")),
    (
        "just used: kept a load time (rent)",
        [occ("a", last_used=-0.5)],
        [cand("b", load_s=2.0)],
        ONE,
        FAIR,
        0,
        Hold("a serves its requests first (bound: 10 s)", until=1.5),
    ),
    (
        "just used, but the waiting requests paid a load (buy)",
        [occ("a", last_used=-0.5)],
        [cand("b", since=-0.5, queued=4, load_s=2.0)],
        ONE,
        FAIR,
        0,
        Evict("a", "b"),
    ),
    (
        "fifo evicts a just-used model at once",
        [occ("a", last_used=-0.1)],
        [cand("b")],
        ONE,
        FIFO,
        0,
        Evict("a", "b"),
    ),
    (
        "busy holder serves first (fair)",
        [occ("a", in_flight=2)],
        [cand("b", since=0)],
        ONE,
        FAIR,
        4,
        Hold("a serves its requests first (bound: 10 s)", until=10.0),
    ),
    (
        "busy holder, overdue by time: drained",
        [occ("a", in_flight=2)],
        [cand("b", since=0)],
        ONE,
        FAIR,
        10,
        Drain("a", "b"),
    ),
    (
        "busy holder, overdue by passes: drained",
        [occ("a", in_flight=1)],
        [cand("b", passed=3)],
        ONE,
        FAIR,
        1,
        Drain("a", "b"),
    ),
    (
        "fifo drains a busy holder at once",
        [occ("a", in_flight=2)],
        [cand("b")],
        ONE,
        FIFO,
        0,
        Drain("a", "b"),
    ),
    (
        "fifo-batch: the head only, by arrival in the queue",
        [occ("a", in_flight=1)],
        [cand("c", order=2, queued=9), cand("b", order=1)],
        ONE,
        BATCH,
        0,
        Drain("a", "b"),
    ),
    (
        "fifo: the head only, by its oldest request (c's waited longer, though it queued later)",
        [occ("a", in_flight=1)],
        [cand("c", since=-3, order=2), cand("b", since=-1, order=1)],
        ONE,
        FIFO,
        0,
        Drain("a", "c"),
    ),
    (
        "fair: more queued requests first",
        [occ("a")],
        [cand("b", order=1), cand("c", order=2, queued=5)],
        ONE,
        FAIR,
        0,
        Evict("a", "c"),
    ),
    (
        "fair: a faster load first",
        [occ("a")],
        [cand("b", order=1, load_s=8.0), cand("c", order=2, load_s=1.0)],
        ONE,
        FAIR,
        0,
        Evict("a", "c"),
    ),
    (
        "fair: priority before score",
        [occ("a")],
        [cand("b", order=1, queued=9), cand("c", order=2, priority=1)],
        ONE,
        FAIR,
        0,
        Evict("a", "c"),
    ),
    (
        "fair: an overdue model before priority",
        [occ("a")],
        [cand("b", order=1, since=0), cand("c", order=2, since=5, priority=9)],
        ONE,
        FAIR,
        10,
        Evict("a", "b"),
    ),
    (
        "fair: waiting counts (aging)",
        [occ("a")],
        [cand("b", order=1, since=0, queued=1), cand("c", order=2, since=6, queued=3)],
        ONE,
        FAIR,
        9.5,
        Evict("a", "b"),
    ),
    (
        "a lower-ranked model loads into free room while the first waits for a busy one",
        [occ("a", in_flight=1, group=SWAP)],
        [cand("b", queued=5, order=1, group=SWAP), cand("c", order=2)],
        TWO,
        FAIR,
        0,
        Load("c"),
    ),
    (
        "a lower-ranked model does not evict for itself",
        [occ("a", in_flight=1, group=SWAP), occ("d")],
        [cand("b", queued=5, order=1, group=SWAP), cand("c", order=2)],
        TWO,
        FAIR,
        0,
        Hold("a serves its requests first (bound: 10 s)", until=10.0),
    ),
    (
        "while one stops, wait for its room",
        [occ("a", STOPPING), occ("b")],
        [cand("c")],
        TWO,
        FAIR,
        0,
        Hold("a model is stopping", until=10.0),
    ),
    (
        "pinned holds every slot: refused",
        [occ("a", pinned=True)],
        [cand("b")],
        ONE,
        FAIR,
        0,
        Refuse("b", "all 1 model slots (--models-max 1) are held by pinned models"),
    ),
    (
        "RAM budget: LRU idle evicted",
        [occ("a", ram=6, last_used=-2), occ("b", ram=3, last_used=-3)],
        [cand("c", ram=3)],
        Limits(ram_budget=10 * M),
        FAIR,
        0,
        Evict("b", "c"),
    ),
    # groups
    (
        "swap group: the other member goes first, even with room",
        [occ("a", group=SWAP)],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Evict("a", "b"),
    ),
    (
        "swap group: a busy member serves first",
        [occ("a", in_flight=1, group=SWAP)],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Hold("a serves its requests first (bound: 10 s)", until=10.0),
    ),
    (
        "swap group: a loading member is waited for",
        [occ("a", LOADING, group=SWAP)],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Hold("a model of a conflicting group is loading", until=10.0),
    ),
    (
        "non-swap group: members live together",
        [occ("a", group=TOGETHER)],
        [cand("b", group=TOGETHER)],
        Limits(),
        FAIR,
        0,
        Load("b"),
    ),
    (
        "exclusive: other groups' idle models go",
        [occ("x", group=OTHER), occ("u")],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Evict("x", "b"),
    ),
    (
        "exclusive: a model in no group stays",
        [occ("u")],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Load("b"),
    ),
    (
        "exclusive: persistent models of other groups stay",
        [occ("k", group=KEEP)],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Load("b"),
    ),
    (
        "exclusive: a busy one is waited for, then drained at the bound",
        [occ("x", in_flight=1, group=OTHER)],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        10,
        Drain("x", "b"),
    ),
    (
        "persistent is never evicted for another group",
        [occ("k", group=KEEP, last_used=-9), occ("u", last_used=-5)],
        [cand("b")],
        TWO,
        FAIR,
        0,
        Evict("u", "b"),
    ),
    (
        "persistent holds every slot: refused for another group",
        [occ("k", group=KEEP)],
        [cand("b")],
        ONE,
        FAIR,
        0,
        Refuse(
            "b",
            "all 1 model slots (--models-max 1) are held by pinned or persistent (of another group) models",
        ),
    ),
    (
        "persistent: evicted for a member of its own group",
        [occ("k", group=KEEP)],
        [cand("k2", group=KEEP)],
        ONE,
        FAIR,
        0,
        Evict("k", "k2"),
    ),
    (
        "a pinned member of the swap group: refused",
        [occ("a", pinned=True, group=SWAP)],
        [cand("b", group=SWAP)],
        Limits(),
        FAIR,
        0,
        Refuse("b", "'a' is pinned and shares swap group 'pair' with 'b'"),
    ),
]


@pytest.mark.parametrize(
    ("holders", "waiting", "limits", "rule", "now", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide(
    holders: list[Occupancy],
    waiting: list[Candidate],
    limits: Limits,
    rule: SwapRule,
    now: float,
    expected: Decision,
) -> None:
    assert decide(holders, waiting, limits, rule, now) == expected


def test_unknown_load_times_count_as_the_mean_of_the_known_ones() -> None:
    waiting = [cand("slow", order=1, load_s=9.0), cand("new", order=2, load_s=None), cand("fast", order=3)]
    assert [c.name for c in ordered(waiting, FAIR, 0)] == ["fast", "new", "slow"]


def test_a_hold_wakes_the_scheduler_when_the_first_model_becomes_overdue() -> None:
    d = decide([occ("a", in_flight=1)], [cand("b", since=3), cand("c", since=1, order=1)], ONE, FAIR, 5)
    assert isinstance(d, Hold) and d.until == 11.0


# --------------------------------------------------------------------------- simulated traces

CHAIN = ("A", "B", "A", "C")


def agent_trace(seed: int, num_agents: int = 6) -> list[Agent]:
    """Agents each at their own point of the chain A, B, A, C, with their own think time, and a
    background chat on A (the bench's trace, bench/bench_swap.py, in simulation)."""
    rnd = random.Random(seed)
    agents = [
        Agent(
            CHAIN[i % 4 :] + CHAIN[: i % 4],
            think_s=rnd.uniform(0.3, 2.0),
            start_s=rnd.uniform(0, 2),
            rounds=3,
        )
        for i in range(num_agents)
    ]
    return [*agents, Agent(("A",), think_s=0.5, start_s=0.0, rounds=30)]


@pytest.mark.parametrize("load_s", [1.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_on_agent_traces_fair_swaps_less_than_fifo_finishes_sooner_and_keeps_the_bound(
    seed: int, load_s: float
) -> None:
    loads = {"A": load_s, "B": load_s, "C": load_s}
    fifo = simulate(agent_trace(seed), loads, FIFO, service_s=0.3)
    fair = simulate(agent_trace(seed), loads, FAIR, service_s=0.3)
    assert fair.num_swaps < fifo.num_swaps and fair.wall_s < fifo.wall_s, (fair, fifo)
    # No model waits past the bound: its wait for a busy model, then the room made and its own load.
    assert fair.longest_wait_s <= FAIR.max_wait + 2 * load_s + 0.3, fair


def test_with_one_busy_model_the_bound_still_serves_the_other() -> None:
    hog = Agent(("A",), think_s=0.0, start_s=0.0, rounds=200)  # A is never idle
    once = Agent(("B",), think_s=0.0, start_s=1.0, rounds=1)
    result = simulate([hog, once], {"A": 1.0, "B": 1.0}, FAIR, service_s=0.3, parallel=2)
    assert FAIR.max_wait <= result.longest_wait_by_model["B"] <= FAIR.max_wait + 2.0 + 0.3
    assert result.num_swaps == 3  # A, B once (when overdue), A again


def bench_trace(num_agents: int, rounds: int, seed: int = 0) -> list[Agent]:
    """bench/bench_swap.py's trace: its seed (0, the default), think times and start offsets; the
    background chat cut at 8 calls (the bench runs it until the agents are done)."""
    rnd = random.Random(seed)
    thinks = [rnd.uniform(0.3, 1.5) for _ in range(num_agents)]
    agents = [
        Agent(CHAIN[i % 4 :] + CHAIN[: i % 4], think_s=thinks[i], start_s=0.2 * i, rounds=rounds)
        for i in range(num_agents)
    ]
    return [*agents, Agent(("A",), think_s=0.5, start_s=0.0, rounds=8)]


@pytest.mark.parametrize(
    ("num_agents", "rounds", "swaps"), [(8, 1, (32, 11, 7)), (4, 2, (30, 12, 13))]
)
def test_the_simulation_makes_the_swaps_the_bench_measured(
    num_agents: int, rounds: int, swaps: tuple[int, int, int]
) -> None:
    """The bench's figures for fifo, fifo-batch and fair (bench/README.md, docs/swaps.md: 2.5 s
    loads, parallel 2 + margin 2), reproduced by the simulation: a change of a rule that changes
    these changes those docs."""
    loads = {"A": 2.5, "B": 2.5, "C": 2.5}
    trace = bench_trace(num_agents, rounds)
    got = tuple(simulate(trace, loads, rule, service_s=0.1) for rule in (FIFO, BATCH, FAIR))
    assert tuple(r.num_swaps for r in got) == swaps, [r.loads for r in got]


@pytest.mark.parametrize(("num_agents", "rounds"), [(4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_on_the_bench_trace_fair_makes_at_most_half_the_swaps_of_fifo_sooner_within_the_bound(
    num_agents: int, rounds: int, seed: int
) -> None:
    """Issue 51's target, on the bench's trace with --models-max 1: at most half of FIFO's swaps (a
    swap per head of the request queue), a lower total wall time, and no call waiting
    past the bound (its wait for the busy model, then the swap it waited for: a stop and a load)."""
    loads = {"A": 2.5, "B": 2.5, "C": 2.5}
    trace = bench_trace(num_agents, rounds, seed)
    fifo = simulate(trace, loads, FIFO, service_s=0.1)
    fair = simulate(trace, loads, FAIR, service_s=0.1)
    assert 2 * fair.num_swaps <= fifo.num_swaps and fair.wall_s < fifo.wall_s, (fair.loads, fifo.loads)
    assert fair.longest_wait_s <= FAIR.max_wait + 2.5 + 0.1 + 0.1, fair


def test_fifo_admits_only_what_arrived_before_the_oldest_request_waiting_for_another_model() -> None:
    assert admits_before(FIFO, "a", {"b": 5.0, "c": 3.0, "a": 1.0}) == 3.0
    assert admits_before(FIFO, "a", {"a": 1.0}) is None  # only its own: no bound
    assert admits_before(BATCH, "a", {"b": 5.0}) is None
    assert admits_before(FAIR, "a", {"b": 5.0}) is None


@pytest.mark.parametrize(
    ("holder_group", "group", "is_kept"),
    [(KEEP, None, True), (KEEP, SWAP, True), (KEEP, KEEP, False), (SWAP, None, False), (None, KEEP, False)],
)
def test_who_a_persistent_group_keeps_for_gpu_evictions_too(
    holder_group: GroupRule | None, group: GroupRule | None, is_kept: bool
) -> None:
    assert is_kept_for(occ("k", group=holder_group), group) is is_kept


def fewest_loads(chains: list[tuple[str, ...]], models: str = "ABC") -> tuple[int, str]:
    """The fewest loads (with models-max 1) any policy, even one that knows the future, can serve
    `chains` in: a chain never calls one model twice in a row, so each of its calls needs a load of
    its own, and the sequence of loads must hold every chain as a subsequence (the shortest common
    supersequence, found by trying every sequence without a repeat, shortest first)."""

    def holds(chain: tuple[str, ...], loads: tuple[str, ...]) -> bool:
        it = iter(loads)
        return all(m in it for m in chain)

    for length in itertools.count(max(len(c) for c in chains)):
        for first in models:
            seqs: list[tuple[str, ...]] = [(first,)]
            for _ in range(length - 1):
                seqs = [(*s, m) for s in seqs for m in models if m != s[-1]]
            for s in seqs:
                if all(holds(c, s) for c in chains):
                    return length, "".join(s)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("rounds", "floor"), [(1, 7), (2, 11)])
def test_the_bench_trace_has_a_floor_of_loads_that_half_of_fifo_batch_is_below(
    rounds: int, floor: int
) -> None:
    """docs/swaps.md "The floor": the bench's agents start at the four points of A, B, A, C, so no
    schedule makes fewer than 7 loads (1 round) or 11 (2 rounds); fifo-batch (which already serves
    every queued request of a model on each load) makes less than twice that, so "half of its
    swaps" is out of reach of any policy; fair makes the floor on 1 round."""
    chains = [(CHAIN[i:] + CHAIN[:i]) * rounds for i in range(4)]
    assert fewest_loads(chains)[0] == floor
    loads = {"A": 2.5, "B": 2.5, "C": 2.5}
    for num_agents in (4, 8):
        batch = simulate(bench_trace(num_agents, rounds), loads, BATCH, service_s=0.1)
        fair = simulate(bench_trace(num_agents, rounds), loads, FAIR, service_s=0.1)
        assert batch.num_swaps < 2 * floor and fair.num_swaps >= floor, (batch.loads, fair.loads)
        if rounds == 1:
            assert fair.num_swaps == floor, fair.loads
