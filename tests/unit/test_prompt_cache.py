"""PromptCache: longest-prefix lookup, LRU eviction under a byte limit, prefix de-duplication."""

from __future__ import annotations

import random

from worker.engine.policy import common_prefix_len
from worker.engine.prompt_cache import PromptCache


def state(n: int) -> bytearray:
    return bytearray(n)


def test_best_is_the_longest_common_prefix() -> None:
    c = PromptCache(None)
    c.put([1, 2, 3, 4], state(10))
    c.put([1, 2, 9], state(10))
    c.put([7, 8], state(10))
    entry, n = c.best([1, 2, 3, 5])
    assert entry is not None and entry.tokens == (1, 2, 3, 4) and n == 3
    assert c.best([5, 6]) == (None, 0)


def test_lru_eviction_keeps_within_the_limit() -> None:
    c = PromptCache(25)
    c.put([1], state(10))
    c.put([2], state(10))
    c.best([1])  # touch [1]: [2] is now the least recently used
    c.put([3], state(10))
    assert c.n_bytes == 20 and len(c) == 2
    assert c.best([2]) == (None, 0)
    assert c.best([1])[1] == 1 and c.best([3])[1] == 1


def test_a_longer_prompt_replaces_its_prefix_and_a_prefix_is_not_stored_twice() -> None:
    c = PromptCache(None)
    c.put([1, 2], state(10))
    c.put([1, 2, 3], state(15))
    assert len(c) == 1 and c.n_bytes == 15
    assert c.put([1, 2], state(10))  # covered by [1, 2, 3]
    assert len(c) == 1 and c.n_bytes == 15


def test_a_state_larger_than_the_limit_is_refused() -> None:
    c = PromptCache(8)
    assert not c.put([1], state(9))
    assert not c.put([], state(1))
    assert len(c) == 0 and c.n_bytes == 0
    c.put([1], state(8))
    c.clear()
    assert len(c) == 0 and c.n_bytes == 0


def test_entry_count_is_bounded_too() -> None:
    c = PromptCache(None, max_entries=2)
    for t in range(3):
        c.put([t], state(1))
    assert len(c) == 2 and c.best([0]) == (None, 0)


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
        assert common_prefix_len(a, b) == common_prefix_len(tuple(a), b) == common_prefix_len(b, a) == plain(a, b)
