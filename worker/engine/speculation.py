"""Speculative decoding: prompt-lookup (n-gram) drafts, verified in the step's shared batch.

llama-server's `--spec-type ngram-simple`: a generating slot whose last `size_n` tokens occurred
earlier in its prompt or output drafts the tokens that followed them there (up to `size_m`, the
slot's adaptive K and the request's `n_max`). The step stays one decode:

    plan     the slot's entry is [last sampled token, d1 .. dk] with k + 1 output rows
             (`BatchEntry.n_outputs`), beside the other slots' one-token entries
    decode   the backend computes every row's logits and writes every row's KV
    sample   row 0 is sampled with the others, as without speculation; then `Speculator.verify`
             goes on while the token just sampled equals the next draft: that draft's KV row is
             valid, its output row is sampled next (row j gives the token after d_j)
    rollback the KV rows of rejected drafts are dropped (`Backend.seq_rm`); the slot's record of
             its rows (`Slot.cache`) holds the accepted ones only

Exactness. Each emitted token is drawn by the task's own sampler from the logits of the same
tokens at the same positions, one draw per emitted token, in order: the sampler's RNG, penalty
window and chain are exactly the non-speculative ones. A draft is accepted iff the sampled token
equals it. For a point-mass draft distribution (an n-gram draft) that *is* speculative rejection
sampling: accept d with probability p(d), else draw from p with d removed and renormalised; the
two steps together draw from p (`accept_point_mass` spells that out; tests/unit/test_speculation.py
checks it with a chi-square test). So at any temperature the output distribution is unchanged;
at temperature 0 the output is the same token for token wherever the backend computes a verify
row (several rows of one sequence in one decode) with the bits of a one-row decode: always on
the exact torch CPU path; on llama.cpp see the README (its one-row and several-row kernels may
round differently).

Draft length. Whether and how long to draft follows the hardware (worker/engine/step_cost.py):
the engine measures what a step costs per row, and a slot drafts the length that gives the most
tokens per unit of cost at its recent acceptance rate, or nothing when no length beats a plain
step. After `_PAUSE_AFTER` rejected drafts in a row the slot stops drafting for a backoff of
steps that doubles each time (up to `_MAX_PAUSE`). Before the cost is measured, and for a
request that asks for a draft length, K limits the draft: it starts at 2, doubles after a fully
accepted draft, falls to accepted + 1 after a partial one and halves after a rejected one. Once
measured, K's slow start no longer applies: it drafted 2 or 11 where only 16 paid (beside 7
others), and on rewrites alone it cost steps that the rate already accounts for (side by side,
the model's own length ran 1.08x faster than the length capped at K, 8 rounds, 2026-11-27).
The rate is estimated from decayed counts of accepted tokens and of misses, with one miss more
than seen (`_UNSEEN_MISS`): drafts of 16 that all held read as ~0.99, not 1. The earlier
estimate (a running mean of per-draft rates, 1.0 after a draft that held, creeping up by 0.02 a
step without one) sat at 1.0 for rewrites beside 7 others, where a whole draft is break-even at
best on this CPU, and the model alone drafted there at 0.81-0.87x (bench_spec rewrite8); with
the counts it drafts there almost never (1.01x, 2 drafts in 3 bursts).
On a CPU, where a verify row costs ~0.45-0.65 of a step, that asks for a high rate and short drafts,
and beside several generating slots it stops drafting; where rows are nearly free (a GPU) it
drafts up to the cap. The model is checked against the result: the engine times whole steps
(decode, sampling, verification) with and without drafts at each count of generating slots, and
where drafting steps emit fewer tokens a second than plain ones, the slots stop drafting there
but for a step in `_RECHECK_EVERY` that keeps the measurement fresh (on this CPU: beside 7
other generating slots, where the model alone left 0.84x). Where some slot drafted in every
step so far, the next steps are plain until `_YIELD_MIN` of them are measured: without them the
check had nothing to compare with, and eight rewrites at once drafted in every step at 0.86x
(beside 7 others a row costs 0.86 of a slot's share and a verify entry's call 1.9: a draft of
16 pays only if nearly all of it holds, and the model stands at break-even).
Before anything is measured a slot drafts (the first verify step is the measurement), and so
does a request that asks for a draft length itself (`num_assistant_tokens`,
`speculative.n_max`: llama-server drafts whenever it can), measured yield or not. Under load
speculation yields: no drafts in a step where a prompt is being computed or a task waits for a
slot (verify rows would take the prompt pieces' place), and the step's verify rows are capped
by `max_rows`.

Not speculated: constrained output (a grammar's mask depends on every token before it), a
reasoning budget (it may replace a sampled token), embedding tasks, the staging sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from worker.backends.base import Backend, Sample, SampleItem
from worker.engine.step_cost import StepCost, draft_length

if TYPE_CHECKING:
    from worker.engine.draft_model import DraftModel
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.slot import Slot
    from worker.engine.task import Task, Verdict

SpecType = Literal["none", "ngram-simple", "draft-simple"]
SPEC_TYPES: tuple[str, ...] = ("none", "ngram-simple", "draft-simple")

_START_K = 2  # a slot's first draft (a wrong one costs little; K doubles while drafts hold)
_PAUSE_AFTER = 3  # rejected drafts in a row before a slot pauses drafting
_MAX_PAUSE = 64  # steps
# A slot's acceptance rate: decayed counts of accepted draft tokens and of misses (the rejected
# token that ends a draft), rate = accepted / (accepted + missed + _UNSEEN_MISS), the geometric
# run's estimate with one miss more than seen.
_PRIOR_ACCEPTED = 3.0  # a new task's counts: a rate of 0.75 before its first draft
_DECAY = 0.9  # per verified draft: the counts are those of about the last 10 drafts
_UNSEEN_MISS = 1.0  # one more miss than seen: a run of held drafts is no proof that the next one holds
_RELAX = 0.02  # per step without a draft the counts relax towards a new task's (half in ~34 steps)
_YIELD_EWMA = 0.1  # weight of a step in the running tokens-a-second means
_YIELD_MIN = 8  # steps of each kind before the measured yield overrules the model
_RECHECK_EVERY = 32  # once drafting measured slower, every this many steps one may draft again


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The worker's settings (llama-server's flags; a request may lower n_max and set size_n)."""

    type: SpecType = "none"
    size_n: int = 12  # --spec-ngram-simple-size-n: the n-gram looked up
    size_m: int = 48  # --spec-ngram-simple-size-m: the most tokens one draft copies
    n_max: int | None = None  # --spec-draft-n-max: the most tokens drafted per step (None: size_m)
    n_min: int = 0  # --spec-draft-n-min: a shorter draft is not verified
    p_min: float = 0.0  # --spec-draft-p-min: a draft model stops below this probability
    max_rows: int = 32  # verify rows per step, all slots together
    # More generating slots than this: no drafts (None: as many as the measured cost allows)
    max_generating: int | None = None

    @property
    def cap(self) -> int:
        if self.type == "draft-simple":
            return 3 if self.n_max is None else self.n_max  # llama-server's default
        return self.size_m if self.n_max is None else min(self.size_m, self.n_max)

    @property
    def enabled(self) -> bool:
        """On by default for every request (a request may still opt in or out)."""
        return self.type != "none" and self.cap > 0


def ngram_draft(history: Sequence[int] | np.ndarray, size_n: int, n_max: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of `history`'s last `size_n`
    tokens (at most n_max of them); [] when there is none."""
    h = np.asarray(history, dtype=np.int64)
    n = len(h)
    if size_n < 1 or n_max < 1 or n <= size_n:
        return []
    tail = h[n - size_n :]
    # candidates: ends of an earlier occurrence (before the last position), latest first
    ends = np.flatnonzero(h[size_n - 1 : n - 1] == tail[-1]) + size_n - 1
    for end in ends[::-1].tolist():
        if np.array_equal(h[end - size_n + 1 : end + 1], tail):
            return h[end + 1 : end + 1 + n_max].tolist()  # type: ignore[no-any-return]  # numpy's tolist is Any
    return []


def accept_point_mass(draft: int, p: np.ndarray, rng: np.random.Generator) -> int:
    """Speculative rejection sampling with a point-mass draft distribution (q(draft) = 1): accept
    the draft with probability min(1, p/q) = p(draft), else draw from max(0, p - q) renormalised,
    which is p without the draft. The engine draws x ~ p and accepts iff x == draft: the same
    distribution (P(draft) = p(draft), P(y) = (1 - p(draft)) * p(y) / (1 - p(draft)) = p(y))
    with one draw per token, so the sampler's RNG stream is that of a plain decode."""
    if rng.random() < p[draft]:
        return draft
    residual = p.copy()
    residual[draft] = 0.0
    total = residual.sum()
    if total <= 0.0:
        return draft
    return int(rng.choice(len(p), p=residual / total))


@dataclass(slots=True)
class _SlotState:
    task_id: int = -1
    k: int = _START_K
    accepted: float = _PRIOR_ACCEPTED  # recent accepted draft tokens (decayed counts)
    missed: float = 0.0  # recent drafts that ended in a rejected token
    n_rejected: int = 0  # drafts in a row with nothing accepted
    pause: int = 0  # steps left without drafting
    backoff: int = 4

    @property
    def rate(self) -> float:
        """A drafted token's chance to be accepted (each until the first miss)."""
        return self.accepted / (self.accepted + self.missed + _UNSEEN_MISS)


@dataclass(slots=True)
class _Yield:
    """Running means of tokens a second, of whole steps with and without drafts (at one count
    of generating slots): the measured check on what `draft_length` predicted."""

    plain: float = 0.0
    spec: float = 0.0
    n_plain: int = 0
    n_spec: int = 0

    def add(self, drafted: bool, tokens_per_s: float) -> None:
        if drafted:
            self.spec = _mean(self.spec, self.n_spec, tokens_per_s)
            self.n_spec += 1
        else:
            self.plain = _mean(self.plain, self.n_plain, tokens_per_s)
            self.n_plain += 1

    def unmeasured_plain(self) -> bool:
        """Steps with drafts are measured and plain ones are not (some slot drafted in each)."""
        return self.n_spec >= _YIELD_MIN and self.n_plain < _YIELD_MIN

    def loses(self) -> bool:
        """Steps with drafts emitted fewer tokens a second than plain ones (both well measured)."""
        return self.n_spec >= _YIELD_MIN and self.n_plain >= _YIELD_MIN and self.spec < self.plain


def _mean(old: float, n: int, new: float) -> float:
    return new if n == 0 else old + _YIELD_EWMA * (new - old)


@dataclass(slots=True)
class _Pending:
    slot: Slot
    task: Task
    draft: list[int]
    first_row: int = -1  # the slot's first output row in the decode


@dataclass(slots=True)
class Speculator:
    config: SpecConfig
    metrics: WorkerMetrics
    draft_model: DraftModel | None = None  # --spec-type draft-simple
    cost: StepCost = field(default_factory=StepCost)  # the engine feeds it every decode
    verify_apart: bool = False  # the backend runs a verify entry in a decode call of its own
    # The check on the model: tokens a second of whole steps (decode, sampling, verification)
    # with and without drafts, per number of generating slots (`record_step`).
    _yields: dict[int, _Yield] = field(default_factory=dict)
    _step: tuple[int, bool] | None = None  # this step's (generating slots, drafted), if measurable
    _n_accepted: int = 0  # tokens accepted in this step's verification
    _n_steps: int = 0
    _slots: dict[int, _SlotState] = field(default_factory=dict)
    _pending: list[_Pending] = field(default_factory=list)

    # -- planning ---------------------------------------------------------------------------------
    def drafts(
        self, decoding: Sequence[Slot], *, is_busy: bool, n_ctx_seq: int, room: int
    ) -> dict[int, list[int]]:
        """Drafts for this step's generating slots (slot id -> tokens), `room` rows at most;
        none when `is_busy` (a prompt is being computed or a task waits: speculation yields)."""
        self._pending = []
        self._step, self._n_accepted = None, 0
        self._n_steps += 1
        cap = self.config.max_generating
        if is_busy or (cap is not None and len(decoding) > cap):
            return {}
        measured = self._yields.get(len(decoding))
        # drafting measured slower at this many generating slots: plain steps, but for a recheck
        losing = measured is not None and measured.loses() and self._n_steps % _RECHECK_EVERY != 0
        # every step here drafted so far: plain ones next, or the check has nothing to compare with
        losing = losing or (measured is not None and measured.unmeasured_plain())
        out: dict[int, list[int]] = {}
        rows = min(self.config.max_rows, room)
        ratio = self.cost.row_ratio(len(decoding))  # a draft row's cost over a slot's share; None: unmeasured
        fixed = 0.0  # drafting's own cost beside others: the verify entry's extra decode call
        if self.verify_apart and len(decoding) > 1:
            fixed = self.cost.call_ratio(len(decoding)) or 0.0
        wants: dict[int, tuple[Slot, Task, int, int]] = {}  # for the draft model
        for slot in decoding:
            task = slot.task
            if task is None or not slot.feed or rows <= 0:
                continue
            plan = self._plan(slot, task, min(rows, n_ctx_seq - len(slot.cache) - 2), ratio, fixed, losing)
            if plan is None:
                continue
            k, n_min, size_n = plan
            if self.draft_model is not None and self.config.type == "draft-simple":
                wants[slot.id] = (slot, task, k, n_min)
                rows -= k
                continue
            draft = ngram_draft(task.tokens(), size_n, k)  # the fed token is the last generated one
            if len(draft) >= max(1, n_min):
                out[slot.id] = draft
                rows -= len(draft)
                self._pending.append(_Pending(slot, task, draft))
        if wants:
            assert self.draft_model is not None
            drafted = self.draft_model.draft({i: (t.tokens(), k) for i, (_, t, k, _) in wants.items()})
            for i, (slot, task, _, n_min) in wants.items():
                if len(drafted[i]) >= max(1, n_min):
                    out[i] = drafted[i]
                    self._pending.append(_Pending(slot, task, drafted[i]))
        self._step = (len(decoding), bool(out))
        return out

    def record_step(self, n_sampled: int, seconds: float) -> None:
        """The engine, after a step without prompt work: `n_sampled` rows sampled with the step
        (the verification's accepted tokens are counted here) in `seconds`, decode to the end."""
        if self._step is None or seconds <= 0:
            return
        n, drafted = self._step
        self._yields.setdefault(n, _Yield()).add(drafted, (n_sampled + self._n_accepted) / seconds)

    def _plan(self, slot: Slot, task: Task, room: int, ratio: float | None,
              fixed: float = 0.0, losing: bool = False) -> tuple[int, int, int] | None:
        """(most tokens to draft, fewest worth verifying, n-gram size) for this slot now, or None."""
        p = task.params
        req = p.speculative  # a request that sets any speculative field opts in, whatever --spec-type
        if req is None and not self.config.enabled:
            return None
        if task.matcher is not None or task.budget is not None or task.is_embedding:
            return None
        st = self._slots.get(slot.id)
        if st is None or st.task_id != task.id:
            st = self._slots[slot.id] = _SlotState(task.id)
        cfg = self.config
        n_max = cfg.cap if req is None or req.n_max is None else min(cfg.cap, req.n_max)
        n_min = cfg.n_min if req is None or req.n_min is None else req.n_min
        size_n = cfg.size_n if req is None or req.size_n is None else req.size_n
        # A request that asks for drafts of a length (num_assistant_tokens, speculative.n_max)
        # gets them, as llama-server drafts; otherwise the measured cost decides.
        asked = req is not None and bool(req.n_max)
        most = min(n_max, room)
        if asked:
            worth = most
        elif losing:  # drafting measured slower here than plain steps
            worth = 0
        elif ratio is None:  # nothing measured yet: this draft is the measurement
            worth = most
        else:  # the length with the most tokens per unit of cost, or none that beats a plain step
            worth = draft_length(st.rate, ratio, most, fixed)
        if st.pause > 0 or worth == 0:
            st.pause = max(0, st.pause - 1)
            st.accepted += _RELAX * (_PRIOR_ACCEPTED - st.accepted)  # so it may try again
            st.missed -= _RELAX * st.missed
            return None
        # Measured: the model's length (the rate remembers how the drafts went). K's slow start
        # (2, 4, 8, ...) is for a draft that is the measurement, or that a request asked for.
        k = worth if ratio is not None and not asked else min(st.k, worth)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - task.stats.n_decoded - 1)
        return (k, n_min, size_n) if k >= max(1, n_min) else None

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    # -- after the decode ---------------------------------------------------------------------------
    def before_sampling(self, first_rows: dict[int, int]) -> None:
        """The decode wrote every drafted row: the slots' records keep only the last sampled
        token's (the drafts' rows are accepted one by one in `verify`)."""
        for pend in self._pending:
            pend.first_row = first_rows[pend.slot.id]
            del pend.slot.cache[len(pend.slot.cache) - len(pend.draft) :]

    def verify(
        self,
        backend: Backend,
        postprocess: Callable[[Slot, Sample], tuple[Task, Verdict] | None],
    ) -> list[tuple[Task, Verdict, int]]:
        """Row 0 of every drafted slot was sampled with the step; accept drafts while the token
        just sampled equals the next one, sampling the row after it; then drop the rejected rows'
        KV. Returns the tasks that ended (with the slot id)."""
        ended: list[tuple[Task, Verdict, int]] = []
        n_draft = n_accepted = 0
        n_verifies = len(self._pending)
        ahead = self._sample_ahead(backend)
        for pend in self._pending:
            slot, task, draft = pend.slot, pend.task, pend.draft
            rows = ahead.get(id(pend))
            n_ok = 0
            while n_ok < len(draft) and slot.task is task and task.generated[-1] == draft[n_ok]:
                # the draft is the token sampled: its KV row (written by the decode) is valid
                slot.cache.append(draft[n_ok])
                n_ok += 1
                sample = rows[n_ok - 1] if rows is not None else backend.sample(
                    [SampleItem(task.sampler, pend.first_row + n_ok)], [task.params]
                )[0]
                end = postprocess(slot, sample)
                if end is not None:
                    ended.append((*end, slot.id))
            backend.seq_rm(slot.id, len(slot.cache))  # the rejected drafts' rows
            task.stats.n_draft += len(draft)
            task.stats.n_draft_accepted += n_ok
            n_draft += len(draft)
            n_accepted += n_ok
            self._n_accepted += n_ok
            self._adapt(slot.id, len(draft), n_ok, task.id)
        self._pending = []
        if n_verifies:
            self.metrics.on_spec(n_draft, n_accepted, n_verifies)
        return ended

    def _sample_ahead(self, backend: Backend) -> dict[int, list[Sample]]:
        """Every drafted row after row 0, of every slot whose sampler is row independent
        (greedy), in one `sample` call for the whole step (one argmax pass and, on a GPU, one
        device sync instead of one per accepted token); the rows of a rejected draft are sampled
        for nothing, which such a sampler allows. Other samplers (an RNG stream, a penalty
        window) go row by row in `verify`, one draw per emitted token. (id of the _Pending ->
        the samples of its rows 1..k)"""
        batch = [p for p in self._pending if p.task.sampler is not None
                 and backend.is_row_independent(p.task.sampler)]
        if not batch:
            return {}
        items = [SampleItem(p.task.sampler, p.first_row + 1 + j) for p in batch for j in range(len(p.draft))]
        samples = backend.sample(items, [p.task.params for p in batch for _ in p.draft])
        out: dict[int, list[Sample]] = {}
        at = 0
        for p in batch:
            out[id(p)] = samples[at : at + len(p.draft)]
            at += len(p.draft)
        return out

    def _adapt(self, slot_id: int, n_draft: int, n_ok: int, task_id: int = -1) -> None:
        st = self._slots.setdefault(slot_id, _SlotState(task_id))
        cap = self.config.cap
        # a geometric run: n_ok accepted, then one miss (none when the whole draft held)
        st.accepted = _DECAY * st.accepted + n_ok
        st.missed = _DECAY * st.missed + (0.0 if n_ok >= n_draft else 1.0)
        if n_ok == n_draft:
            st.k = min(cap, max(st.k, n_draft) * 2)
        elif n_ok > 0:
            st.k = max(2, n_ok + 1)
        else:
            st.k = max(1, st.k // 2)
        if n_ok > 0:
            st.n_rejected, st.backoff = 0, 4
            return
        st.n_rejected += 1
        if st.n_rejected >= _PAUSE_AFTER:
            st.pause, st.backoff = st.backoff, min(st.backoff * 2, _MAX_PAUSE)
            st.n_rejected = 0
