"""The pure eviction policy (slots and memory budgets) and the crash backoff: table tests."""

from __future__ import annotations

import pytest

from router.lifecycle.eviction import (
    Admit,
    Decision,
    Drain,
    Evict,
    Full,
    Limits,
    Need,
    Occupancy,
    Wait,
    choose_victim,
)
from router.lifecycle.load_failure import backoff_delay

UP, LOADING, STOPPING = "up", "loading", "stopping"
M = 1 << 20


def occ(name: str, kind: str = UP, in_flight: int = 0, last_used: float = 0.0, pinned: bool = False,
        ram: int = 0, vram: int = 0) -> Occupancy:
    return Occupancy(name, kind == UP, kind == STOPPING, in_flight, last_used, pinned, ram * M, vram * M)


def slots(n: int) -> Limits:
    return Limits(models_max=n)


NONE = Need()
CASES: list[tuple[str, list[Occupancy], Need, Limits, Decision]] = [
    ("room left", [occ("a")], NONE, slots(2), Admit()),
    ("unlimited", [occ("a"), occ("b")], NONE, slots(0), Admit()),
    (
        "lru idle victim",
        [occ("a", last_used=5), occ("b", last_used=3), occ("c", last_used=9)],
        NONE,
        slots(3),
        Evict("b"),
    ),
    (
        "busy model is never a victim",
        [occ("a", in_flight=1, last_used=1), occ("b", last_used=7)],
        NONE,
        slots(2),
        Evict("b"),
    ),
    (
        "loading is never a victim",
        [occ("a", LOADING, last_used=0), occ("b", last_used=4)],
        NONE,
        slots(2),
        Evict("b"),
    ),
    ("pinned is never a victim", [occ("a", pinned=True), occ("b", last_used=8)], NONE, slots(2), Evict("b")),
    (
        "all busy: drain the lru busy one",
        [occ("a", in_flight=2, last_used=5), occ("b", in_flight=1, last_used=3)],
        NONE,
        slots(2),
        Drain("b"),
    ),
    ("busy or loading: drain", [occ("a", in_flight=2), occ("b", LOADING)], NONE, slots(2), Drain("a")),
    (
        "loading or pinned: wait",
        [occ("a", LOADING), occ("b", in_flight=1, pinned=True)],
        NONE,
        slots(2),
        Wait("every loaded model is loading or pinned"),
    ),
    (
        "pinned models hold every slot: full",
        [occ("a", pinned=True), occ("b", LOADING, pinned=True)],
        NONE,
        slots(2),
        Full("all 2 model slots (--models-max 2) are held by pinned models"),
    ),
    (
        "a stop in progress frees a slot: wait",
        [occ("a", STOPPING), occ("b")],
        NONE,
        slots(2),
        Wait("a model is stopping"),
    ),
    ("tie broken by name", [occ("b", last_used=1), occ("a", last_used=1)], NONE, slots(2), Evict("a")),
    (
        "over the limit still evicts",
        [occ("a", last_used=1), occ("b", last_used=2), occ("c", last_used=3)],
        NONE,
        slots(1),
        Evict("a"),
    ),
    # memory budgets
    ("fits the ram budget", [occ("a", ram=100)], Need(100 * M), Limits(ram_budget=200 * M), Admit()),
    (
        "over the ram budget: evict the lru idle",
        [occ("a", ram=100, last_used=2), occ("b", ram=100, last_used=1)],
        Need(100 * M),
        Limits(ram_budget=250 * M),
        Evict("b"),
    ),
    (
        "over the ram budget, all busy: drain",
        [occ("a", ram=100, in_flight=1)],
        Need(200 * M),
        Limits(ram_budget=250 * M),
        Drain("a"),
    ),
    (
        "over the vram budget only",
        [occ("a", vram=6000, last_used=1), occ("b", ram=50, last_used=0)],
        Need(vram_bytes=4000 * M),
        Limits(vram_budget=8000 * M),
        Evict("b"),
    ),
    (
        "never fits the budget: full with figures",
        [occ("a", ram=100)],
        Need(300 * M),
        Limits(ram_budget=250 * M),
        Full("needs ~300.0 MiB of RAM, budget 250.0 MiB, pinned 0 B (--ram-budget)"),
    ),
    (
        "pinned memory leaves no room: full",
        [occ("a", ram=200, pinned=True), occ("b", ram=10)],
        Need(100 * M),
        Limits(ram_budget=250 * M),
        Full("needs ~100.0 MiB of RAM, budget 250.0 MiB, pinned 200.0 MiB (--ram-budget)"),
    ),
    (
        "no budget: memory is not counted",
        [occ("a", ram=10_000)],
        Need(10_000 * M),
        Limits(models_max=2),
        Admit(),
    ),
    (
        "both limits: the slot limit evicts even with memory to spare",
        [occ("a", ram=1, last_used=3), occ("b", ram=1)],
        Need(M),
        Limits(models_max=2, ram_budget=1000 * M),
        Evict("b"),
    ),
]


@pytest.mark.parametrize(("why", "occupants", "need", "limits", "expected"), CASES, ids=[c[0] for c in CASES])
def test_choose_victim(
    why: str, occupants: list[Occupancy], need: Need, limits: Limits, expected: Decision
) -> None:
    assert choose_victim(occupants, need, limits) == expected


@pytest.mark.parametrize(
    ("failures", "delay"), [(0, 0), (1, 0), (2, 1), (3, 2), (4, 4), (6, 16), (7, 30), (50, 30)]
)
def test_backoff(failures: int, delay: float) -> None:
    assert backoff_delay(failures) == delay
