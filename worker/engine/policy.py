"""Pure scheduling decisions for the engine (no I/O, no backend calls, no logging).

- `common_prefix_len` and `reusable`: how much of a cached sequence a new one may keep. Equal
  tokens are not enough for a strict reuse: the rows must also be of the same class
  (`RowRecipe`), or reusing them would change the result. A history reuse (a finished
  request's rows: a conversation's earlier turns, a shared system prompt) takes every row of
  the common prefix, whatever its class (`MIXED_CLASS` marks such a sequence); see
  worker/engine/engine.py, Determinism.
- `pick_slot`: the idle slot for a new task. An explicit `id_slot` wins if that slot is idle;
  otherwise the one whose own cache it may reuse most, else the lowest-numbered idle slot, among
  those that keep the busy slots in the fewest runs of consecutive ids: llama.cpp (per-sequence
  KV streams) splits a decode into one ubatch per such run, one pass over the weights each, so
  packed busy slots keep a step to one pass (measured on SmolLM2 Q4_1, 4 streams at -np 8:
  ~38 ms a step in slots 0-3, ~55 ms in slots 0, 3, 5, 7; llama-server scatters them so too).
  A prefix in a slot that is not picked is copied over (`Scheduler._place`).
- `piece_len`: how many prompt rows a slot decodes this step, within the step's budget, in
  pieces the backend's recipe allows.
- `kv_victims`, `youngest` (one KV pool shared by all slots only): whose cells go first when
  the pool is full.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.slot import Slot

Rows = tuple[int, int]  # (n_prompt_rows, prompt_class); the rows after them are decode rows
# The class of a sequence that continues rows of other classes (a history reuse): a strict reuse
# never takes its rows, since no fresh prompt computes that mix.
MIXED_CLASS = -1


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


def reusable(n_common: int, cached: Rows, wanted: Rows, decode_class: int) -> int:
    """How many of the first `n_common` positions hold rows of the class the new sequence
    would compute there. Each side is (prompt rows, their class); later rows are decode rows."""
    (n_a, class_a), (n_b, class_b) = cached, wanted
    lo, hi = min(n_a, n_b), max(n_a, n_b)
    if lo > 0 and class_a != class_b:
        return 0
    if lo < hi and (class_a if n_a > n_b else class_b) != decode_class:
        return min(n_common, lo)  # [lo, hi): prompt rows on one side, decode rows on the other
    return n_common


def pick_slot(
    idle: Sequence[Slot], reuse: Sequence[int], *, id_slot: int, n_slots: int,
    busy: Sequence[int] = (), packed: bool = False,
) -> Slot | None:
    """The slot for a new task among `idle` (reuse[i]: what it may keep of idle[i]'s cache);
    None if it must wait (no idle slot, or the `id_slot` it asked for is busy).

    `packed` (llama.cpp's KV streams: a pass over the weights per run of consecutive busy
    sequence ids): only the idle slots that leave the `busy` ones with the fewest runs are
    candidates, so that 4 conversations that left their turns in slots 0, 3, 5 and 7 go on in
    one pass a step instead of four (their prefixes are then copied over, `Scheduler._place`)."""
    if 0 <= id_slot < n_slots:
        return next((s for s in idle if s.id == id_slot), None)
    if not idle:
        return None
    if packed and busy:
        taken = set(busy)
        runs = [n_runs(taken | {s.id}) for s in idle]
        keep = [i for i, r in enumerate(runs) if r == min(runs)]
        idle, reuse = [idle[i] for i in keep], [reuse[i] for i in keep]
    best = max(range(len(idle)), key=lambda i: (reuse[i], -idle[i].id))
    return idle[best] if reuse[best] > 0 else min(idle, key=lambda s: s.id)


def n_runs(ids: set[int]) -> int:
    """Runs of consecutive integers in `ids`: {0, 1, 3} has 2."""
    return sum(1 for i in ids if i - 1 not in ids)


def piece_len(remaining: int, budget: int, min_piece: int, max_piece: int) -> int:
    """Rows of the next prompt piece: at most `budget` and `max_piece`, at least `min_piece`,
    leaving a remainder that can still be cut in valid pieces. 0: no valid piece fits this
    step. A remainder that is one valid piece goes whole, over budget if it must."""
    if remaining <= 0:
        return 0
    if remaining <= min(budget, max_piece):
        return remaining
    for take in range(min(budget, max_piece, remaining - min_piece), min_piece - 1, -1):
        rest = remaining - take  # cut in k pieces of [min_piece, max_piece] rows
        if -(-rest // max_piece) * min_piece <= rest:
            return take
    return remaining if min_piece <= budget and remaining <= max_piece else 0


def kv_victims(slots: Sequence[Slot]) -> list[Slot]:
    """Idle slots holding KV cells, least recently used first."""
    return sorted((s for s in slots if s.is_idle and s.cache), key=lambda s: s.t_last_used)


def youngest(slots: Sequence[Slot]) -> Slot | None:
    busy = [s for s in slots if s.task is not None]
    if not busy:
        return None
    return max(busy, key=lambda s: (s.task.stats.t_arrival, s.task.id) if s.task else (0.0, 0))


class PrefillBudget:
    """How many rows of long prompts a step may add while slots are generating (chunked prefill).

    The goal: a step that carries prompt rows takes at most (1 + share) x a step of decode rows
    alone, so the generating slots' inter-token latency stays within that while a long prompt
    comes in. How many rows fit depends on the model, the hardware, the context (a row late in
    a long prompt attends over more cells) and the backend's fixed cost of a piece (llama.cpp
    runs each piece as a ubatch of its own: one more pass over the weights), so it is found,
    not modelled: `rows` grows by a tenth (at least one) after a step under the target and
    shrinks by a fifth after a step over it. A backend whose pieces cannot be smaller than some
    minimum gets one whenever the rows granted since its last piece add up to it (credit): such
    steps come less often instead of every step, but at least every 4th step (`floor`), so a
    long prompt is never starved when even its smallest piece is over the target. With no slot
    generating there is nobody to protect: the whole batch may be prompt.
    """

    def __init__(self, share: float = 1.0, start_rows: float = 16.0, alpha: float = 0.25) -> None:
        self.share = share
        self.alpha = alpha
        self.rows = start_rows
        self.decode_ms: float | None = None  # running average of a step of decode rows alone
        self.credit = 0.0
        self._steady = False  # the last step was decode rows alone

    def grant(self, n_decoding: int, cap: int, min_piece: int = 1) -> int:
        """Rows of long prompts this step may carry (at most `cap`); call it only when some wait."""
        if n_decoding == 0 or self.decode_ms is None:
            self.credit = 0.0
            return cap
        per_step = max(self.rows, min_piece / 4)
        self.credit = min(self.credit + per_step, 2 * per_step + min_piece)
        return max(0, min(cap, int(self.credit)))

    def spend(self, n_rows: int) -> None:
        self.credit = max(0.0, self.credit - n_rows)

    def observe(
        self, step_ms: float, n_budget_rows: int, n_other_prompt_rows: int, n_decode_rows: int
    ) -> None:
        """A step took `step_ms`: decode rows, rows of long prompts (budgeted) and of short ones."""
        steady, self._steady = self._steady, n_decode_rows > 0 and n_budget_rows + n_other_prompt_rows == 0
        if n_decode_rows == 0 or n_other_prompt_rows:
            return  # nothing to learn: no one was protected, or short prompts went in at once
        if n_budget_rows == 0:
            # Only after another such step: llama.cpp rebuilds its graph when shapes change,
            # and the step after a piece pays for it; the target is the steady decode step.
            if steady or self.decode_ms is None:
                self.decode_ms = (
                    step_ms
                    if self.decode_ms is None
                    else self.decode_ms + self.alpha * (step_ms - self.decode_ms)
                )
        elif self.decode_ms is not None:
            if step_ms > (1 + self.share) * self.decode_ms:
                self.rows = max(1.0, self.rows * 0.8)
            else:
                self.rows = min(4096.0, self.rows + max(1.0, self.rows / 10))
