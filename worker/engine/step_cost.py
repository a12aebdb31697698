"""What a decode step costs as a function of its rows, measured, and the draft length it pays for.

The engine times every decode of output rows only (generating slots' tokens and verify
entries; `llama_decode`, or the torch forward pass) with the number of rows it held
(`StepCost.observe`). A backend that runs one decode as several calls (llama.cpp: a verify entry
runs apart, `verify_apart`) times each call (`timed_calls`): timing the whole decode charged the
extra calls' fixed cost to rows, and on the 2-core CPU the fit then read a row at 0.70-0.80 of a
slot's share beside 7 others and a call at 2.4-3.1, where a call-by-call microbenchmark gives
0.86 and 1.9 (bench_spec rewrite8, 2026-11-27). Timing the whole step instead (its sampling too) was tried
and measured worse: prompt steps sample one row of many, decode steps every row, so the fit
mixed two costs and rewrite fell from 1.34-1.54x to 0.99x (bench_spec, 2026-11-27).
For the few rows a speculative step adds, a step's cost is close to linear
in its rows: `base` (the weights streamed once, the fixed overheads) plus `slope` per further
row. Both are fitted, by least squares, to the running means of steps of 1 to `MAX_ROWS` rows:
the row counts of generating slots and verify entries, not long prompt pieces, whose tiled
kernels cost less per row. On a 2-core CPU one more row costs about 0.45 of a one-row step
(SmolLM2-135M Q4_1, 2 threads, a quiet box: 8.5 ms, then ~3.8 ms a row; 0.65 with 1 thread under
load); on a GPU a few percent.

`draft_length` turns the fit into a decision, per slot and step. A slot among `n` generating
slots costs, per emitted token without drafting, its share of the step, `step(n) / n`; k draft
rows add `k * slope`. With each drafted token accepted with probability `a` (the slot's recent
acceptance rate) and the first mismatch ending the run, the step emits on average
`E(k) = 1 + a + ... + a^k` tokens for that slot. In units of its share, the cost is
`1 + k * r` with `r = slope / (step(n) / n)`; the length chosen maximises `E(k) / (1 + k r)` over
k <= the cap, and is 0 (no draft) unless some k beats 1, the plain step. Where the backend runs
a verify entry in a decode call of its own beside the one-row entries (llama.cpp: other kernels
for several rows of one sequence, `verify_apart`), drafting beside other generating slots also
costs that call, a one-row step's `base` more: `1 + f + k r` with `f = base / (step(n) / n)`.
With r = 0.65 and one slot that asks `a > 0.65` for a single draft token, and long drafts only
near a = 1; with r = 0.05 it drafts the whole cap at any rate a well-guessed n-gram reaches.
Beside many generating slots, r rises towards 1 on a CPU (each row is compute), and drafting
stops by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_ROWS = 64  # steps of more rows than this are prompt work: not fitted
_EWMA = 0.2  # weight of a new observation in a row count's running mean
_MIN_BUCKETS = 2  # distinct row counts needed before the fit is trusted


@dataclass(slots=True)
class StepCost:
    """Running means of step seconds per row count, and their linear fit (engine thread only)."""

    _mean: dict[int, float] = field(default_factory=dict)
    _fit: tuple[float, float] | None = None  # (base, slope), refreshed on the next read
    _dirty: bool = False

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or rows > MAX_ROWS or seconds <= 0:
            return
        old = self._mean.get(rows)
        self._mean[rows] = seconds if old is None else old + _EWMA * (seconds - old)
        self._dirty = True

    def fit(self) -> tuple[float, float] | None:
        """(base, slope): seconds of a one-row step, and of each further row; None until steps
        of at least two row counts were seen."""
        if self._dirty:
            self._dirty = False
            self._fit = _least_squares(self._mean) if len(self._mean) >= _MIN_BUCKETS else None
        return self._fit

    def row_ratio(self, n_generating: int) -> float | None:
        """A draft row's cost over one generating slot's share of a plain step of `n_generating`
        slots (`r` in the module doc); None while nothing is measured."""
        got = self._share(n_generating)
        return None if got is None else got[1] / got[2]

    def call_ratio(self, n_generating: int) -> float | None:
        """One more decode call (a one-row step's cost) over one generating slot's share of a
        plain step of `n_generating` slots; None while nothing is measured."""
        got = self._share(n_generating)
        return None if got is None else got[0] / got[2]

    def _share(self, n_generating: int) -> tuple[float, float, float] | None:
        """(base, slope, one of `n_generating` slots' share of a plain step), or None."""
        f = self.fit()
        if f is None:
            return None
        base, slope = f
        n = max(1, n_generating)
        share = (base + slope * (n - 1)) / n
        return (base, max(0.0, slope), share) if share > 0 else None


def _least_squares(mean: dict[int, float]) -> tuple[float, float]:
    xs = [float(r - 1) for r in mean]
    ys = list(mean.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    slope = max(0.0, slope)
    base = max(my - slope * mx, 1e-9)
    return base, slope


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one step emits for a slot that drafted k, each accepted with probability `rate`
    until the first miss: 1 + rate + ... + rate^k."""
    a = min(max(rate, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def draft_length(rate: float, row_ratio: float, cap: int, fixed: float = 0.0) -> int:
    """The draft length (0..cap) with the most tokens per unit of cost, `E(k) / (1 + f + k r)`,
    `f` the cost of drafting at all (an extra decode call, in the same units); 0 unless
    drafting beats the plain step."""
    a = min(max(rate, 0.0), 1.0)
    best_k, best = 0, 1.0
    term = emitted = 1.0  # a^k and E(k), kept as k grows (once per slot and step: no pow, no calls)
    for k in range(1, max(0, cap) + 1):
        term *= a
        emitted += term
        value = emitted / (1.0 + fixed + k * row_ratio)
        if value > best * (1.0 + 1e-9):
            best_k, best = k, value
    return best_k

