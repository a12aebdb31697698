"""PromptCache: longest reusable prefix, LRU eviction under a byte limit, prefix de-duplication,
pinned entries, row classes; and the pure policy helpers (reusable rows, prompt pieces)."""

from __future__ import annotations

import random

import pytest

from worker.engine.policy import common_prefix_len, piece_len, reusable
from worker.engine.prompt_cache import PromptCache

ROWS = (1 << 30, 0)  # every row a prompt row of class 0


def state(n: int) -> bytearray:
    return bytearray(n)


def test_best_is_the_longest_common_prefix() -> None:
    c = PromptCache(None)
    c.put([1, 2, 3, 4], state(10), ROWS)
    c.put([1, 2, 9], state(10), ROWS)
    c.put([7, 8], state(10), ROWS)
    entry, n = c.best([1, 2, 3, 5], ROWS)
    assert entry is not None and entry.tokens == (1, 2, 3, 4) and n == 3
    assert c.best([5, 6], ROWS) == (None, 0)


def test_lru_eviction_keeps_within_the_limit() -> None:
    c = PromptCache(25)
    c.put([1], state(10), ROWS)
    c.put([2], state(10), ROWS)
    c.best([1], ROWS)  # touch [1]: [2] is now the least recently used
    c.put([3], state(10), ROWS)
    assert c.n_bytes == 20 and len(c) == 2
    assert c.best([2], ROWS) == (None, 0)
    assert c.best([1], ROWS)[1] == 1 and c.best([3], ROWS)[1] == 1


def test_a_longer_prompt_replaces_its_prefix_and_a_prefix_is_not_stored_twice() -> None:
    c = PromptCache(None)
    c.put([1, 2], state(10), ROWS)
    c.put([1, 2, 3], state(15), ROWS)
    assert len(c) == 1 and c.n_bytes == 15
    assert c.put([1, 2], state(10), ROWS)  # covered by [1, 2, 3]
    assert len(c) == 1 and c.n_bytes == 15


def test_a_state_larger_than_the_limit_is_refused() -> None:
    c = PromptCache(8)
    assert not c.put([1], state(9), ROWS)
    assert not c.put([], state(1), ROWS)
    assert len(c) == 0 and c.n_bytes == 0
    c.put([1], state(8), ROWS)
    c.clear()
    assert len(c) == 0 and c.n_bytes == 0


def test_entry_count_is_bounded_too() -> None:
    c = PromptCache(None, max_entries=2)
    for t in range(3):
        c.put([t], state(1), ROWS)
    assert len(c) == 2 and c.best([0], ROWS) == (None, 0)


def test_common_prefix_len_matches_a_plain_loop_for_lists_and_tuples() -> None:
    def plain(a: list[int], b: list[int]) -> int:
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 400))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 400))]
        assert (
            common_prefix_len(a, b)
            == common_prefix_len(tuple(a), b)
            == common_prefix_len(b, a)
            == plain(a, b)
        )


def test_a_pinned_entry_survives_eviction_until_unpinned() -> None:
    c = PromptCache(20)
    parked = c.put([1], state(10), ROWS, pin=True)
    c.put([2], state(10), ROWS)
    c.put([3], state(10), ROWS)  # over the limit: [2] goes, not the older but pinned [1]
    assert parked is not None and c.best([1], ROWS)[1] == 1 and c.best([2], ROWS) == (None, 0)
    c.unpin(parked)
    c.put([4], state(10), ROWS)
    c.put([5], state(10), ROWS)
    assert c.best([1], ROWS) == (None, 0)


def test_rows_of_another_class_are_not_reused() -> None:
    c = PromptCache(None, decode_class=3)
    c.put([1, 2, 3, 4], state(10), (4, 1))  # a short prompt's rows (one-piece kernel)
    assert c.best([1, 2, 3, 4, 5], (5, 2)) == (None, 0)  # a prompt cut in tiled pieces
    assert c.best([1, 2, 3, 9], (4, 1))[1] == 3


@pytest.mark.parametrize(
    ("n_common", "cached", "wanted", "expected"),
    [
        (10, (10, 0), (12, 0), 10),
        (10, (10, 1), (12, 2), 0),  # prompt rows of different kernels
        (10, (6, 2), (6, 2), 10),  # both: 6 prompt rows, then decode rows
        (10, (4, 2), (8, 2), 4),  # rows 4..7 are decode rows here, prompt rows there
        (10, (8, 2), (4, 2), 4),
        (10, (0, 3), (1, 3), 10),  # a one-token prompt is a decode row
        (10, (0, 3), (5, 2), 0),
    ],
)
def test_reusable_rows_are_a_common_prefix_of_the_same_class(
    n_common: int, cached: tuple[int, int], wanted: tuple[int, int], expected: int
) -> None:
    assert reusable(n_common, cached, wanted, decode_class=3) == expected


@pytest.mark.parametrize(
    ("remaining", "budget", "min_piece", "max_piece", "expected"),
    [
        (0, 100, 1, 512, 0),
        (50, 100, 1, 512, 50),
        (500, 100, 1, 512, 100),
        (500, 100, 2, 512, 100),
        (101, 100, 2, 512, 99),  # never leave a single row
        (3, 2, 2, 512, 3),  # 2 + 1 is not allowed, 3 is one piece over budget
        (100, 70, 64, 512, 100),  # cannot cut in two pieces of >= 64: one piece, over budget
        (100, 30, 64, 512, 0),  # not even one valid piece fits: wait for the budget to grow
        (200, 1000, 64, 80, 72),  # <= 80 each and >= 64 each: 72 + 64 + 64
        (40, 1000, 40, 512, 40),  # a one-piece prompt
        (40, 30, 40, 512, 0),
    ],
)
def test_piece_len(remaining: int, budget: int, min_piece: int, max_piece: int, expected: int) -> None:
    assert piece_len(remaining, budget, min_piece, max_piece) == expected
