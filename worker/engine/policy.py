"""Pure scheduling decisions for the engine (no I/O, no backend calls, no logging).

- `pick_slot`: llama-server's slot selection. An explicit `id_slot` wins if that slot is idle;
  otherwise the idle slot whose cached tokens share the longest prefix with the prompt (prefix
  reuse), ties and no-match falling back to the least recently used slot (its cache is the one
  we mind losing least).
- `kv_victims`: idle slots whose caches may be dropped to make room, least recently used first.
- `youngest`: the busy slot to preempt when the shared KV cache is full (latest arrival: it has
  the least work to redo and the oldest requests keep their latency).
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.slot import Slot


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, in O(log n) slice comparisons (C speed) rather than a
    Python loop per token: prompts that share thousand-token system prompts are the norm."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if type(a) is not type(b):  # a tuple slice never equals a list slice
        a, b = list(a), list(b)
    lo, step = 1, 64  # a[:lo] == b[:lo]; gallop, then bisect the first differing chunk
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def pick_slot(slots: Sequence[Slot], prompt: Sequence[int], *, id_slot: int, cache_prompt: bool) -> Slot | None:
    """The idle slot for a new task, or None if it must wait (no idle slot, or `id_slot` busy)."""
    if 0 <= id_slot < len(slots):
        return slots[id_slot] if slots[id_slot].is_idle else None
    idle = [s for s in slots if s.is_idle]
    if not idle:
        return None
    if cache_prompt:
        best = max(idle, key=lambda s: (common_prefix_len(s.cache, prompt), -s.t_last_used))
        if common_prefix_len(best.cache, prompt) > 0:
            return best
    return min(idle, key=lambda s: s.t_last_used)


def kv_victims(slots: Sequence[Slot]) -> list[Slot]:
    """Idle slots holding KV cells, least recently used first."""
    return sorted((s for s in slots if s.is_idle and s.cache), key=lambda s: s.t_last_used)


def youngest(slots: Sequence[Slot]) -> Slot | None:
    busy = [s for s in slots if s.task is not None]
    if not busy:
        return None
    return max(busy, key=lambda s: (s.task.stats.t_arrival, s.task.id) if s.task else (0.0, 0))
