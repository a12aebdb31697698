"""The slots, the queue of waiting tasks and the KV-cache accounting (engine thread only).

`Scheduler` turns "who is waiting, who is generating" into the next step:

    reap_cancelled() -> admit() -> plan() -> [backend.decode] -> commit() | on_no_kv_space()

Admission (`admit`). Waiting tasks go FIFO into idle slots. A task keeps the longest prefix of
its tokens that is already computed *anywhere*: in the slot it lands in, in any other slot
(busy or idle: `Backend.seq_cp` gives it that prefix), in the host-RAM prompt cache (restored),
or, best of all for a burst of requests with one system prompt, in a slot that is computing it
right now: the task then waits (`Slot.source`) until that prefill has passed the shared part and
copies it. So N requests with a common prefix cost one prefill of the prefix and N suffixes,
decoded in one batch. A prompt whose every row is cached, with the logits saved when it was
first computed, is sampled without any decode at all.

Reuse is by row class, not by tokens alone (`RowRecipe`, worker/backends/base.py): on a
backend whose kernels depend on batch shapes, rows that requests running now compute or hold
stand in for a new request's own only where they were computed the way it would compute them
(a strict reuse), and prompts are cut in pieces the recipe allows. That, and a KV stream per
slot, is what makes a request's greedy output independent of what else runs (see
worker/engine/engine.py). Rows left by finished requests (an idle slot, the prompt cache) are
reused whatever their class (a history reuse, unless `reuse_history` is off): a conversation's
next turn continues on its earlier turns' rows, generated ones included, and a new question
on the rows of a system prompt another question computed. Then only the rest of the prompt is
computed, cut by the recipe as if it were a prompt of its own.

Planning (`plan`). One token per generating slot, then prompt pieces, oldest request first.
Short prompts (up to `SHORT_PROMPT` tokens, a ubatch of them per step) go in at once, so a
burst of chat turns starts generating together; longer ones are cut to a per-step row budget
(`PrefillBudget`) that keeps the generating slots' inter-token latency bounded. A prompt with
images or audio goes in runs: its text whole, each media chunk in fixed pieces under that
budget (worker/backends/media.py).

LoRA adapters (worker/backends/lora.py). A task runs with one adapter set and scales
(`SamplingParams.lora`, a `LoraKey`; () is the base model), and rows computed under one key are
other numbers than under another: every reuse is keyed by it. A slot remembers the key its rows
were computed with (`Slot.lora`), and so does a prompt-cache entry; a prefix is taken from a
slot, an entry or a prefill in progress only when the keys are equal (llama-server's pinned
build reuses a slot's prompt across scales, and in a burst mixing scales 0 and 1 gave a third
answer, neither). A step decodes with one adapter set (the engine sets it on the backend), so
`plan` serves one key per step, by this rule of fairness: the key that has gone longest
without a step goes first; a key that has not had a step since its requests came counts as
never served, and ties go to the key of the oldest request. So with k keys among the running
requests each gets a step at least every k steps, whatever the others' traffic: no request
starves behind a stream of another adapter's. Slots are admitted regardless of key; a slot
whose key is not served this step simply waits. With one key (the usual case, no adapters)
every step is that key's and nothing changes.

Embedding tasks (an embedding model) are stateless, as in llama-server: no prefix reuse (they
come with `cache_prompt` off). With a pooling that reads every row (mean, cls, none) a prompt
goes in one piece, whole, in a step with room for it, and the HTTP layer refuses prompts over
`n_ubatch`; with last or rank (`Backend.pools_in_pieces`) it is cut like any prompt.

Overload. When every slot is busy and requests wait, the staging sequence (the backend's last
one) prefills the oldest waiting prompt, its first token is sent at once, and its KV is parked
in the prompt cache until a slot frees; then the request continues from there.

KV space. By default every sequence has a stream of `n_ctx_seq` cells of its own, so a request
never waits for room. With one pool shared by all slots (`kv_unified`), the scheduler makes
room before each step: first by moving idle slots' caches to the prompt cache (or dropping
them), then by preempting the youngest request (requeued with what it generated; it resumes
from its saved state when there is a prompt cache).

Why one file of over 500 lines: admission (where a prefix comes from), planning and
postprocess read and write the same slot and queue state, and this class is that state's only
writer; moving rows between slots and caches is already worker/engine/kv.py's.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.backends.base import Backend, BatchEntry, Sample
from worker.backends.media import is_media, rows_of, run_length, run_piece
from worker.engine.beam import BeamSearch
from worker.engine.kv import KvBook
from worker.engine.metrics import WorkerMetrics
from worker.engine.policy import (
    MIXED_CLASS,
    PrefillBudget,
    Rows,
    common_prefix_len,
    pick_slot,
    piece_len,
    reusable,
    youngest,
)
from worker.engine.prompt_cache import PromptCache
from worker.engine.slot import Slot
from worker.engine.speculation import Speculator
from worker.engine.task import Task, Verdict
from worker.protocol.sampling import LoraKey

log = logging.getLogger("worker.engine")

# Take a prefix from elsewhere (another slot, the prompt cache) only when it saves at least
# this many rows of prefill; wait for a prefill in progress only when it will save this many.
_MIN_REUSE_GAIN = 8
_MIN_SHARE_GAIN = 32
# Save the part of a slot a new task overwrites only when it is at least this long.
# Prompts up to this long (a chat turn) are prefilled at once, up to a ubatch of them per step:
# one step's delay for the others. Longer ones go in budgeted pieces (`PrefillBudget`).
SHORT_PROMPT = 256


@dataclass(slots=True)
class Plan:
    """One step: entries to decode, in batch order, and slots that sample saved logits."""

    entries: list[tuple[Slot, BatchEntry]] = field(default_factory=list)
    from_saved: list[Slot] = field(default_factory=list)
    n_decode_rows: int = 0
    n_budget_rows: int = 0  # rows of long prompts, within the prefill budget
    lora: LoraKey = ()  # the adapter set every entry of the step runs with

    def __bool__(self) -> bool:
        return bool(self.entries or self.from_saved)

    @property
    def n_prompt_rows(self) -> int:
        return sum(len(e.tokens) for _, e in self.entries) - self.n_decode_rows


class Scheduler:
    def __init__(
        self, backend: Backend, n_slots: int, metrics: WorkerMetrics, prompt_cache: PromptCache | None = None,
        *, reuse_history: bool = True, spec: Speculator | None = None, media_piece: int = 16,
    ) -> None:
        """`reuse_history` off (`--strict-reuse`): finished requests' rows too are reused only
        where they are of the class the new prompt would compute (see the module doc).
        `spec`: speculative drafts for generating slots (worker/engine/speculation.py).
        `media_piece`: rows of a piece of an image's or audio's chunk (0: whole), see
        worker/backends/media.py."""
        self._backend = backend
        self.media_piece = media_piece
        self.spec = spec
        self.reuse_history = reuse_history
        self._metrics = metrics
        self._recipe = backend.recipe
        self.prompt_cache = prompt_cache
        self.slots = [Slot(i) for i in range(n_slots)]
        # The staging sequence needs somewhere to park what it prefilled.
        has_staging = prompt_cache is not None and backend.n_seq_max > n_slots
        self.staging: Slot | None = Slot(n_slots) if has_staging else None
        self._all = [*self.slots, *([self.staging] if self.staging is not None else [])]
        self.kv = KvBook(backend, metrics, prompt_cache, self._all)
        self.waiting: deque[Task] = deque()
        self.budget = PrefillBudget()
        self._prefill_cap: int | None = None  # set after llama.cpp found no KV room (shared pool)
        self._n_plans = 0
        self._served: dict[LoraKey, int] = {}  # adapter set -> the plan that last served it (fairness)

    # -- state ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.task is not None for s in self._all)

    def n_busy(self) -> int:
        return sum(1 for s in self.slots if s.task is not None)

    def kv_used(self) -> int:
        return self.kv.used()

    def enqueue(self, task: Task) -> None:
        self.waiting.append(task)

    def take_all(self) -> list[Task]:
        """Detach every task (running or waiting) and forget all KV: after an error, at exit."""
        running = [t for t in (s.release() for s in self._all) if t is not None]
        tasks = list({id(t): t for t in running}.values()) + list(self.waiting)  # a beam search holds several
        self.waiting.clear()
        self.kv.forget_all()
        return tasks

    # -- before the decode ------------------------------------------------------------------------
    def reap_cancelled(self) -> list[Task]:
        """Free the slots of cancelled tasks and drop cancelled waiting tasks; return them all."""
        dropped = []
        for s in self._all:
            if s.task is not None and s.task.is_cancelled:
                task = s.release()
                assert task is not None
                if task not in dropped:  # a beam search's slots all hold it
                    log.info(
                        "task %d cancelled (slot %d freed after %d tokens)", task.id, s.id,
                        task.stats.n_decoded,
                    )
                    dropped.append(task)
        if any(t.is_cancelled for t in self.waiting):
            for t in self.waiting:
                if t.is_cancelled:
                    log.info("task %d cancelled while waiting", t.id)
                    self._unpark(t)
                    dropped.append(t)
            self.waiting = deque(t for t in self.waiting if not t.is_cancelled)
        return dropped

    def admit(self) -> None:
        """Waiting tasks (FIFO) into idle slots; then, if all are busy, one into staging."""
        admitted = False
        while self.waiting and self._has_room(self.waiting[0]) and self._place(self.waiting[0], self.slots):
            task = self.waiting.popleft()
            if task.params.beam_width:
                self._start_beams(task)
            admitted = True
        if admitted and self._backend.kv_unified and self.prompt_cache is not None:
            for s in self.slots:  # idle caches cost every decode attention in a shared pool
                if s.task is None and s.cache:
                    self.kv.offload(s)
        staging = self.staging
        if (
            staging is not None
            and staging.is_idle
            and self.waiting
            and not any(s.is_idle for s in self.slots)
        ):
            staged = next((t for t in self.waiting if not t.generated and not t.params.beam_width), None)
            if staged is not None and self._place(staged, [staging]):
                self.waiting.remove(staged)
                log.info("task %d: every slot busy, prefilling it in the staging sequence", staged.id)

    def _has_room(self, task: Task) -> bool:
        """A beam search of width W waits for W idle slots (FIFO: those behind it wait too)."""
        width = task.params.beam_width
        return width <= 1 or sum(1 for s in self.slots if s.is_idle) >= width

    def _start_beams(self, task: Task) -> None:
        """`task` (a beam search) has its first slot: reserve the others, nearest first (llama.cpp
        decodes a run of consecutive sequence ids in one pass), for the beams to come."""
        first = next(s for s in self.slots if s.task is task)
        idle = sorted((s for s in self.slots if s.is_idle), key=lambda s: (abs(s.id - first.id), s.id))
        others = idle[: task.params.beam_width - 1]
        for s in others:
            self.kv.save_tail(s, 0)  # its cache is overwritten by a beam's
            s.task = task  # no feed: not decoding until a beam gets it (Slot.is_decoding)
        b = self._backend
        # In one shared pool the W beams together must fit it, or a search alone would fill the
        # pool, be preempted and start again for ever: each beam ends by length at n_ctx / W cells.
        n_cells = min(b.n_ctx_seq, b.n_ctx // (len(others) + 1)) if b.kv_unified else b.n_ctx_seq
        task.beam = BeamSearch(task.params, [first, *others], n_cells, b.is_eog, b.token_to_piece)

    def park(self, slot: Slot) -> None:
        """A staged task has its first token: save its KV to the prompt cache, requeue it."""
        task = slot.release()
        assert task is not None
        task.parked = self.kv.park(slot)
        keys = [(t.stats.t_arrival, t.id) for t in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (task.stats.t_arrival, task.id)), task)
        self._metrics.requests_parked.inc()

    def _unpark(self, task: Task) -> None:
        if task.parked is not None and self.prompt_cache is not None:
            self.prompt_cache.unpin(task.parked)
            task.parked = None

    # -- admission: where a task's prefix comes from ---------------------------------------------
    def _wanted(self, task: Task) -> Rows:
        return len(task.prompt), self._recipe.prompt_class(len(task.prompt))

    def _reuse(self, slot: Slot, tokens: list[int], wanted: Rows, lora: LoraKey) -> int:
        """How many of `tokens`' rows `slot`'s cache can stand in for (strict: rows of the class
        `wanted` would compute, under the adapter set `lora`)."""
        if slot.lora != lora:
            return 0
        n = common_prefix_len(slot.cache, tokens)
        return reusable(n, slot.rows, wanted, self._recipe.decode_class) if n else 0

    def _reuse_left(self, slot: Slot, tokens: list[int], wanted: Rows, lora: LoraKey) -> int:
        """As `_reuse`, but an idle slot's rows (a finished request's) all count with `reuse_history`."""
        if self.reuse_history and slot.is_idle:
            return common_prefix_len(slot.cache, tokens) if slot.lora == lora else 0
        return self._reuse(slot, tokens, wanted, lora)

    def _place(self, task: Task, candidates: list[Slot]) -> bool:
        """Put `task` in one of the idle `candidates`, with the best prefix it can get."""
        idle = [s for s in candidates if s.is_idle]
        if not idle:
            return False
        tokens = task.tokens()
        wanted = self._wanted(task)
        p = task.params
        own = [self._reuse_left(s, tokens, wanted, p.lora) if p.cache_prompt else 0 for s in idle]
        id_slot = p.id_slot if candidates is self.slots else -1
        explicit = 0 <= id_slot < len(self.slots)
        packed = self._backend.runs_by_seq_id and candidates is self.slots and not explicit
        busy = [s.id for s in self.slots if s.task is not None]
        slot = pick_slot(idle, own, id_slot=id_slot, n_slots=len(self.slots), busy=busy, packed=packed)
        if slot is None:
            return False
        n_keep = own[idle.index(slot)]
        home = pick_slot(idle, own, id_slot=-1, n_slots=len(self.slots)) if packed else slot
        if home is not None and home is not slot and own[idle.index(home)] > n_keep:
            # Packed elsewhere: take the very rows the slot it would have had holds, whatever the
            # gain, so that the answer does not depend on which slots were busy.
            self.kv.save_tail(slot, 0)
            n_keep = own[idle.index(home)]
            self.kv.copy(home, slot, n_keep)
        logits = slot.logits if slot.n_logits == n_keep == len(tokens) else None
        if p.cache_prompt:
            n_keep, logits = self._better_prefix(slot, task, tokens, wanted, n_keep, logits)
        elif slot.cache:
            self.kv.drop(slot)
        self._assign(slot, task, tokens, n_keep, logits)
        return True

    def _better_prefix(
        self, slot: Slot, task: Task, tokens: list[int], wanted: Rows, n_keep: int, logits: np.ndarray | None
    ) -> tuple[int, np.ndarray | None]:
        """Take a longer prefix from another slot or the prompt cache, or wait for one being
        computed; returns what `slot` now holds of `tokens` (and its saved logits, if any)."""
        others = [s for s in self._all if s is not slot]
        lora = task.params.lora
        src = max(others, key=lambda s: self._reuse_left(s, tokens, wanted, lora), default=None)
        n_src = self._reuse_left(src, tokens, wanted, lora) if src is not None else 0
        cache = self.prompt_cache
        entry, n_entry = (
            cache.best(tokens, wanted, any_class=self.reuse_history, lora=lora)
            if cache is not None
            else (None, 0)
        )
        pending, n_pending = self._pending_source(others, tokens, wanted, lora)
        if n_pending >= max(n_keep, n_src, n_entry) + _MIN_SHARE_GAIN:
            self.kv.save_tail(slot, 0)
            slot.source, slot.source_task, slot.n_source = pending, pending.task, n_pending
            log.info(
                "task %d: waits for slot %d to compute %d shared prompt tokens",
                task.id,
                pending.id,
                n_pending,
            )
            return 0, None
        if src is not None and n_src >= max(n_keep + _MIN_REUSE_GAIN, n_entry):
            self.kv.save_tail(slot, 0)
            self.kv.copy(src, slot, n_src)
            return n_src, slot.logits if slot.n_logits == n_src == len(tokens) else None
        if (
            entry is not None
            and n_entry >= n_keep + _MIN_REUSE_GAIN
            and self.kv.restore(slot, entry, n_entry)
        ):
            return n_entry, slot.logits if slot.n_logits == n_entry == len(tokens) else None
        self.kv.save_tail(slot, n_keep)
        return n_keep, logits

    def _pending_source(
        self, others: list[Slot], tokens: list[int], wanted: Rows, lora: LoraKey
    ) -> tuple[Slot, int]:
        """The slot whose prompt, being prefilled now, will hold the longest prefix of ours."""
        best, n_best = self.slots[0], 0
        for s in others:
            t = s.task
            if t is None or not s.is_prefill or t.params.lora != lora:
                continue
            target = s.cache + s.feed if s.source is None else t.tokens()
            n = common_prefix_len(target, tokens)
            n = reusable(
                n,
                (len(t.prompt), self._recipe.prompt_class(len(t.prompt))),
                wanted,
                self._recipe.decode_class,
            )
            if n > n_best:
                best, n_best = s, n
        return best, n_best

    def _assign(
        self, slot: Slot, task: Task, tokens: list[int], n_keep: int, logits: np.ndarray | None
    ) -> None:
        """`slot` holds `tokens[:n_keep]` (from wherever) and now serves `task`."""
        n = len(tokens)
        n_prompt = len(task.prompt)
        is_history = False
        if n_keep == n and logits is not None:
            pass  # every row cached and the logits saved: sample them, decode nothing
        elif n_keep >= n_prompt and n > n_prompt:
            n_keep = min(n_keep, n - 1)  # what is left are generated tokens: decode rows
        else:  # at least one valid piece of prompt to decode, for its logits
            n_equal = min(n_keep, self._reuse(slot, tokens, self._wanted(task), task.params.lora))
            n_strict = max(0, min(n_equal, n_prompt - self._recipe.min_piece(n_prompt)))
            # A history reuse (rows of another class among those given) keeps them all and
            # computes the rest, one row at least; equal rows alone keep the recipe's last piece.
            is_history = self.reuse_history and n_keep > n_equal and min(n_keep, n_prompt - 1) > n_strict
            n_keep = min(n_keep, n_prompt - 1) if is_history else n_strict
        self.kv.truncate(slot, n_keep)
        slot.lora = task.params.lora  # kept rows are of this key already; what comes is computed with it
        if is_history:  # rows of several classes: no fresh prompt computes this mix
            slot.n_prompt_rows, slot.prompt_class = n_keep, MIXED_CLASS
        else:
            slot.n_prompt_rows = min(slot.n_prompt_rows, n_keep)
            slot.prompt_class = self._recipe.prompt_class(n_prompt)
        slot.n_reused = n_keep
        slot.task = task
        slot.feed = tokens[n_keep:] if slot.source is None else list(tokens)
        slot.is_prefill = True
        self._unpark(task)
        if task.sampler is None:  # first admission (a preempted or parked task keeps its sampler)
            task.sampler = self._backend.new_sampler(task.params, task.seed)
            task.stats.t_start = time.monotonic()
        if task.stats.n_decoded == 0:
            task.stats.n_cached = n_keep
            if slot.source is None:
                task.report_progress(n_keep)  # the first report: nothing computed yet

    def _take_source(self, slot: Slot) -> bool:
        """A slot waiting for a shared prefix: copy it once computed (True: go on computing)."""
        src = slot.source
        task = slot.task
        assert src is not None and task is not None
        tokens = task.tokens()
        wanted = self._wanted(task)
        n_have = self._reuse(src, tokens, wanted, task.params.lora)
        if n_have < slot.n_source and src.is_prefill and src.task is slot.source_task:
            return False  # still being computed
        slot.source, slot.source_task, slot.n_source = None, None, 0
        if n_have >= _MIN_REUSE_GAIN:
            self.kv.copy(src, slot, n_have)
        n_keep = n_have if n_have >= _MIN_REUSE_GAIN else 0
        logits = slot.logits if n_keep == slot.n_logits == len(tokens) else None
        self._assign(slot, task, tokens, n_keep, logits)
        return True

    # -- planning -----------------------------------------------------------------------------------
    def _pick_lora(self) -> LoraKey:
        """The adapter set this step serves (the fairness rule in the module doc)."""
        oldest: dict[LoraKey, float] = {}
        for s in self._all:
            if s.task is not None:
                key, t = s.task.params.lora, s.task.stats.t_arrival
                oldest[key] = min(t, oldest.get(key, t))
        if len(oldest) <= 1:
            self._served.clear()
            return next(iter(oldest), ())
        self._served = {k: n for k, n in self._served.items() if k in oldest}
        return min(oldest, key=lambda k: (self._served.get(k, -1), oldest[k]))

    def plan(self) -> Plan:
        """One token per generating slot, then prompt pieces (oldest first) within the budget,
        of the slots of one adapter set (`_pick_lora`)."""
        self._n_plans += 1
        lora = self._pick_lora()
        self._served[lora] = self._n_plans
        plan = Plan(lora=lora)
        decoding = [s for s in self._all if s.is_decoding]
        free = self._make_room(decoding) if self._backend.kv_unified else 1 << 62
        decoding = [
            s for s in self._all if s.is_decoding and s.task is not None and s.task.params.lora == lora
        ]
        prefilling = [
            s for s in self._all if s.task is not None and s.is_prefill and s.task.params.lora == lora
        ]
        drafts: dict[int, list[int]] = {}
        if self.spec is not None:  # speculation yields to prompts being computed or waiting
            is_busy = bool(prefilling or self.waiting) or self._backend.kv_unified
            b = self._backend
            drafts = self.spec.drafts([s for s in decoding if s.task is not None and s.task.beam is None],
                                      is_busy=is_busy, n_ctx_seq=b.n_ctx_seq,
                                      room=b.n_batch - len(decoding))
        plan.entries = []
        for s in decoding:
            draft = drafts.get(s.id, [])
            entry = BatchEntry(s.id, s.feed + draft, len(s.cache), True, n_outputs=1 + len(draft))
            plan.entries.append((s, entry))
        plan.n_decode_rows = sum(len(e.tokens) for _, e in plan.entries)
        free -= plan.n_decode_rows

        prefilling.sort(key=lambda s: (s is self.staging, _arrival(s)))
        cap = self._backend.n_batch - plan.n_decode_rows
        if self._prefill_cap is not None:
            cap = min(cap, self._prefill_cap)
        long = [s for s in prefilling if _is_long(s)]
        budget = self.budget.grant(len(decoding), cap, self._min_piece(long[0])) if long else 0
        used = short_used = 0  # rows of long prompts (against the budget), of short ones
        for s in prefilling:
            if s.source is not None and not self._take_source(s):
                continue
            if not s.feed:
                plan.from_saved.append(s)
                continue
            assert s.task is not None
            whole = s.task.is_embedding and not self._backend.pools_in_pieces
            # A prompt with media goes in runs: a chunk's rows in fixed pieces under the budget
            # (worker/backends/media.py), a short text run whole, a long one in budgeted pieces as
            # a long prompt's (a document after an image does not skip the budget).
            is_short = not _is_long(s) if s.task.media else whole or _rows_to_compute(s) <= SHORT_PROMPT
            room = cap - used - short_used
            limit = min(room, self._backend.n_ubatch - short_used) if is_short else min(room, budget - used)
            if s.task.media and not is_short and not _at_media(s):
                max_piece = min(self._backend.n_batch, self._backend.n_ubatch)
                min_piece = self._recipe.min_piece(_rows_to_compute(s))
                n = piece_len(run_length(s.feed), limit, min_piece, max_piece)
            elif s.task.media:
                n = run_piece(s.feed, min(self._backend.n_batch, self._backend.n_ubatch), self.media_piece)
                n = n if n <= (room if is_short else limit) else 0  # whole, in a later step
            else:
                n = self._piece(s, limit) if not whole else len(s.feed) if len(s.feed) <= limit else 0
            if self._backend.kv_unified and n > free:
                while free < n and self.kv.evict_idle_cache():
                    free = self.kv.free() - sum(len(e.tokens) for _, e in plan.entries)
                n = n if n <= free else 0 if s.task.media else self._piece(s, min(free, limit))
            if n <= 0:
                continue
            fed = s.feed[:n]
            embd = rows_of(s.task.media, fed) if s.task.media and is_media(fed[0]) else None
            plan.entries.append((s, BatchEntry(s.id, fed, len(s.cache), n == len(s.feed), embd=embd)))
            if is_short:
                short_used += n
            else:
                used += n
            free -= n
        self.budget.spend(used)
        plan.n_budget_rows = used
        if (
            not plan
            and self.n_busy() > 0
            and self._backend.kv_unified
            and not any(s.source for s in self._all)
            and len(self._served) <= 1  # not while another adapter set's slots may still move
        ):
            self._preempt_youngest()  # prompts fill the pool and nothing can move
        return plan

    def _min_piece(self, slot: Slot) -> int:
        """The fewest rows of the slot's next prompt piece (what the budget must come to)."""
        if _at_media(slot):
            return run_piece(slot.feed, min(self._backend.n_batch, self._backend.n_ubatch), self.media_piece)
        return self._recipe.min_piece(_rows_to_compute(slot))

    def _piece(self, slot: Slot, budget: int) -> int:
        """Rows `slot` decodes this step: a piece of its prompt the recipe allows; generated
        tokens to redo (a resumed task without its KV) go one per step, as decode rows, unless
        the backend's rows are exact."""
        task = slot.task
        assert task is not None
        n_prompt = len(task.prompt)
        if len(slot.cache) >= n_prompt and not self._recipe.exact_rows:
            return min(1, budget)
        end = n_prompt if not self._recipe.exact_rows else len(slot.cache) + len(slot.feed)
        # A batch smaller than the recipe's smallest piece (`--batch-size 32` with flash attention)
        # cannot keep its promise: pieces then fit the batch, and rows may differ at rounding level.
        # So can a prompt that no number of pieces in [min_piece, max_piece] adds up to (68 rows,
        # pieces of 64 rows at least and at most): it would wait forever.
        max_piece = min(self._backend.n_batch, self._backend.n_ubatch)
        n_rows = _rows_to_compute(slot)  # the recipe cuts what is computed as a prompt of its own
        min_piece = self._recipe.min_piece(n_rows)
        if min_piece > max_piece or -(-n_rows // max_piece) * min_piece > n_rows:
            min_piece = max(2, max_piece // 2) if not self._recipe.exact_rows else 1
        return piece_len(end - len(slot.cache), budget, min_piece, max_piece)

    def _make_room(self, decoding: list[Slot]) -> int:
        """Shared pool: one free cell per generating slot, by eviction then preemption."""
        free = self.kv.free()
        while free < len(decoding):
            if not self.kv.evict_idle_cache():
                self._preempt_youngest()
                decoding = [s for s in self._all if s.is_decoding]
            free = self.kv.free()
        return free

    def _preempt_youngest(self) -> None:
        slot = youngest(self._all)
        if slot is None:
            return
        task = slot.release()
        assert task is not None
        self.kv.offload(slot)  # with a prompt cache, readmission restores it
        if task.beam is not None:  # a beam search starts again from its prompt
            for s in self._all:
                if s.task is task:
                    s.release()
                    self.kv.erase(s)
            task.beam = None
        task.n_preempted += 1
        self.waiting.appendleft(task)
        self._metrics.n_preempted.inc()
        log.warning(
            "KV cache full: task %d preempted from slot %d (%d tokens generated, requeued)",
            task.id, slot.id, len(task.generated),
        )

    # -- after the decode -------------------------------------------------------------------------
    def on_no_kv_space(self, plan: Plan) -> None:
        """llama_decode found no room: halve the prompt part, or preempt if there is none."""
        self._metrics.n_decode.inc()
        n_prompt = plan.n_prompt_rows
        if n_prompt > 1:
            self._prefill_cap = n_prompt // 2
            log.warning(
                "llama_decode: no KV room for the batch; retrying with %d prompt tokens", n_prompt // 2
            )
        else:
            self._preempt_youngest()

    def commit(self, plan: Plan, step_ms: float | None = None) -> list[Slot]:
        """The batch is in the KV cache: move fed tokens into each slot's cache; return the slots
        whose last entry asked for logits, in batch order (the order `sample` expects)."""
        self._metrics.n_decode.inc()
        self._prefill_cap = None
        if step_ms is not None:
            n_budget = plan.n_budget_rows
            self.budget.observe(step_ms, n_budget, plan.n_prompt_rows - n_budget, plan.n_decode_rows)
        to_sample: list[Slot] = []
        n_rows = 0
        for slot, entry in plan.entries:
            n = len(entry.tokens)
            # A piece of prompt (one row is a decode row, unless every row is alike).
            is_prompt = (
                slot.is_prefill
                and (n > 1 or self._recipe.exact_rows)
                and slot.n_prompt_rows == len(slot.cache)
            )
            slot.cache.extend(entry.tokens)
            if is_prompt:
                slot.n_prompt_rows = len(slot.cache)
            slot.feed = slot.feed[n:]  # a new list: a decode entry's tokens are the old feed
            if slot.is_prefill and slot.task is not None:
                slot.task.stats.n_evaluated += n
                n_rows += n
                slot.task.report_progress(len(slot.cache))
            if entry.logits:
                is_sampled = slot.task is not None and not slot.task.is_embedding
                if (
                    is_prompt and is_sampled
                ):  # the prompt ends here: keep its logits for a later identical prompt
                    slot.logits, slot.n_logits = self._backend.logits_row(len(to_sample)), len(slot.cache)
                to_sample.append(slot)
        if n_rows:
            self._metrics.prompt_rows_evaluated.inc(n_rows)
        return to_sample


    def postprocess(self, slots: Sequence[Slot], samples: Sequence[Sample],
                    read: Callable[[Task, Sample, bool], Verdict]) -> list[tuple[Task, Verdict]]:
        """Apply one step's sampled tokens (nano-vllm's `postprocess`): the scheduler alone changes
        a slot's and a task's state. `read(task, sample, is_eog)` is the engine's output side (the
        grammar, the text, the stop strings, the token event); it says whether the text ended the
        task. End of generation, `max_tokens` and a full context are decided here. A finished or
        failed task leaves its slot; the others get their token as the next step's feed. Returns
        the tasks that ended, with why, for the engine to report."""
        ended: list[tuple[Task, Verdict]] = []
        for slot, sample in zip(slots, samples, strict=True):
            task = slot.task
            assert task is not None
            if slot.is_prefill:
                slot.is_prefill = False
                if not task.stats.t_first_token:
                    task.stats.t_first_token = time.monotonic()
            token = sample.token
            task.generated.append(token)
            task.stats.n_decoded += 1
            p = task.params
            verdict = read(task, sample, not p.ignore_eos and self._backend.is_eog(token))
            if not verdict.is_final and (
                (p.max_tokens is not None and task.stats.n_decoded >= p.max_tokens)
                or len(slot.cache) + 1 >= self._backend.n_ctx_seq
            ):
                # Full once prompt + generated tokens fill the slot, as llama-server counts
                # (n_past + 1 >= n_ctx); the last token would need no cell, but a full slot then
                # holds exactly n_ctx tokens there too.
                verdict = Verdict("length")
            if verdict.is_final:
                slot.release()
                ended.append((task, verdict))
            else:
                slot.feed = [token]
                if slot is self.staging:
                    self.park(slot)
        return ended

    def advance_beams(self, rows: dict[int, np.ndarray]) -> list[Task]:
        """One step of every beam search that has logits this step (`rows`: by slot id; every
        live beam of a search decodes in the same step): the search picks the next beams
        (worker/engine/beam.py), the slots follow (KV copies). Returns the searches that ended,
        their slots all freed."""
        ended: list[Task] = []
        searches = {id(s.task): s.task for s in self.slots if s.id in rows and s.task is not None}
        for task in searches.values():
            search = task.beam
            assert search is not None
            for b in search.live:
                if b.slot.is_prefill:  # the prompt's logits: the first step
                    b.slot.is_prefill = False
                    task.stats.t_first_token = task.stats.t_first_token or time.monotonic()
            step = search.step(rows)
            task.stats.n_decoded += 1
            for src, dst, n in step.copies:
                self.kv.copy(src, dst, n)
            for beam in search.live:
                assert beam.last is not None
                beam.slot.feed = [beam.last.token]
            if search.is_done:
                for slot in search.slots():
                    slot.release()
                ended.append(task)
        return ended

    def release_pooled(self, slots: Sequence[Slot]) -> list[Task]:
        """An embedding model's evaluated prompts are finished tasks: free their slots."""
        tasks = []
        for slot in slots:
            task = slot.release()
            assert task is not None
            tasks.append(task)
        return tasks


def _arrival(slot: Slot) -> float:
    return slot.task.stats.t_arrival if slot.task else 0.0


def _is_long(slot: Slot) -> bool:
    """The slot's next prompt rows go under the prefill budget: a long prompt's, a media chunk's,
    or a long text run of a prompt with media."""
    if slot.task is not None and slot.task.media:
        return _at_media(slot) or run_length(slot.feed, SHORT_PROMPT + 1) > SHORT_PROMPT
    return _rows_to_compute(slot) > SHORT_PROMPT


def _at_media(slot: Slot) -> bool:
    """The slot's next prompt rows are a media chunk's."""
    return bool(slot.task and slot.task.media and slot.feed and is_media(slot.feed[0]))


def _rows_to_compute(slot: Slot) -> int:
    """The prompt rows the slot's task computes itself (those it found cached are not)."""
    return len(slot.task.prompt) - slot.n_reused if slot.task else 0
