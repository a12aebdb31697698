"""The swap scheduler (router/lifecycle/swap.py): table tests on a simulated clock, then a
simulated agent trace (simulated load times) where the fair rule is measured against FIFO."""

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
        "fifo: the head only, by arrival",
        [occ("a", in_flight=1)],
        [cand("c", order=2, queued=9), cand("b", order=1)],
        ONE,
        FIFO,
        0,
        Drain("a", "b"),
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


def bench_trace(num_agents: int, rounds: int) -> list[Agent]:
    """bench/bench_swap.py's trace: its seed, think times and start offsets; the background chat
    cut at 8 calls (the bench runs it until the agents are done)."""
    rnd = random.Random(0)
    thinks = [rnd.uniform(0.3, 1.5) for _ in range(num_agents)]
    agents = [
        Agent(CHAIN[i % 4 :] + CHAIN[: i % 4], think_s=thinks[i], start_s=0.2 * i, rounds=rounds)
        for i in range(num_agents)
    ]
    return [*agents, Agent(("A",), think_s=0.5, start_s=0.0, rounds=8)]


@pytest.mark.parametrize(
    ("num_agents", "rounds", "fifo_swaps", "fair_swaps"), [(8, 1, 11, 7), (4, 2, 12, 13)]
)
def test_the_simulation_makes_the_swaps_the_bench_measured(
    num_agents: int, rounds: int, fifo_swaps: int, fair_swaps: int
) -> None:
    """The bench's figures (bench/README.md, docs/swaps.md: 2.5 s loads, parallel 2 + margin 2),
    reproduced by the simulation: a change of the rule that changes these changes those docs."""
    loads = {"A": 2.5, "B": 2.5, "C": 2.5}
    fifo = simulate(bench_trace(num_agents, rounds), loads, FIFO, service_s=0.1)
    fair = simulate(bench_trace(num_agents, rounds), loads, FAIR, service_s=0.1)
    assert (fifo.num_swaps, fair.num_swaps) == (fifo_swaps, fair_swaps), (fifo.loads, fair.loads)


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
def test_the_bench_trace_has_a_floor_of_loads_that_half_of_fifo_is_below(rounds: int, floor: int) -> None:
    """docs/swaps.md "The floor": the bench's agents start at the four points of A, B, A, C, so no
    schedule makes fewer than 7 loads (1 round) or 11 (2 rounds); FIFO makes 7-12 and 12-21 there,
    so "half of FIFO's swaps" is out of reach of any policy. Fair makes the floor on 1 round."""
    chains = [(CHAIN[i:] + CHAIN[:i]) * rounds for i in range(4)]
    assert fewest_loads(chains)[0] == floor
    loads = {"A": 2.5, "B": 2.5, "C": 2.5}
    for num_agents in (4, 8):
        fifo = simulate(bench_trace(num_agents, rounds), loads, FIFO, service_s=0.1)
        fair = simulate(bench_trace(num_agents, rounds), loads, FAIR, service_s=0.1)
        assert fifo.num_swaps < 2 * floor and fair.num_swaps >= floor, (fifo.loads, fair.loads)
        if rounds == 1:
            assert fair.num_swaps == floor, fair.loads
