"""The pure eviction policy and the crash backoff: table tests."""

from __future__ import annotations

import pytest

from router.eviction import Admit, Decision, Drain, Evict, Full, Occupant, Wait, choose_victim
from router.model import backoff_delay
from router.state import ModelState

R, S, L, X = ModelState.READY, ModelState.SLEEPING, ModelState.LOADING, ModelState.STOPPING


def occ(name: str, state: ModelState = R, in_flight: int = 0, last_used: float = 0.0, pinned: bool = False) -> Occupant:
    return Occupant(name, state, in_flight, last_used, pinned)


CASES: list[tuple[str, list[Occupant], int, Decision]] = [
    ("room left", [occ("a")], 2, Admit()),
    ("unlimited", [occ("a"), occ("b")], 0, Admit()),
    ("lru idle victim", [occ("a", last_used=5), occ("b", last_used=3), occ("c", last_used=9)], 3, Evict("b")),
    ("busy model is never a victim", [occ("a", in_flight=1, last_used=1), occ("b", last_used=7)], 2, Evict("b")),
    ("sleeping counts and can go", [occ("a", last_used=9), occ("b", S, last_used=2)], 2, Evict("b")),
    ("loading is never a victim", [occ("a", L, last_used=0), occ("b", last_used=4)], 2, Evict("b")),
    ("pinned is never a victim", [occ("a", pinned=True), occ("b", last_used=8)], 2, Evict("b")),
    ("all busy: drain the lru busy one", [occ("a", in_flight=2, last_used=5), occ("b", in_flight=1, last_used=3)], 2,
     Drain("b")),
    ("busy or loading: drain", [occ("a", in_flight=2), occ("b", L)], 2, Drain("a")),
    ("loading or pinned: wait", [occ("a", L), occ("b", in_flight=1, pinned=True)], 2,
     Wait("every loaded model is loading or pinned")),
    ("pinned models hold every slot: full", [occ("a", pinned=True), occ("b", L, pinned=True)], 2,
     Full("all 2 model slots (--models-max 2) are held by pinned models")),
    ("a stop in progress frees a slot: wait", [occ("a", X), occ("b")], 2, Wait("a model is stopping")),
    ("tie broken by name", [occ("b", last_used=1), occ("a", last_used=1)], 2, Evict("a")),
    ("over the limit still evicts", [occ("a", last_used=1), occ("b", last_used=2), occ("c", last_used=3)], 1,
     Evict("a")),
]


@pytest.mark.parametrize(("why", "occupants", "models_max", "expected"), CASES, ids=[c[0] for c in CASES])
def test_choose_victim(why: str, occupants: list[Occupant], models_max: int, expected: Decision) -> None:
    assert choose_victim(occupants, models_max) == expected


@pytest.mark.parametrize(("failures", "delay"), [(0, 0), (1, 0), (2, 1), (3, 2), (4, 4), (6, 16), (7, 30), (50, 30)])
def test_backoff(failures: int, delay: float) -> None:
    assert backoff_delay(failures) == delay
