"""The engine: one thread that owns the backend and everything that touches it.

Everything else talks to it through its inbox (`submit`, `call`, `call_when_idle`, `stop`);
only `Task.cancel()` is a direct write, noticed at the next step. One step is llama-server's
`update_slots`, and reads like one:

    scheduler.reap_cancelled(); scheduler.admit(); plan = scheduler.plan()
    backend.decode(plan) -> scheduler.commit(plan) -> backend.sample(slots that want a token)
    -> scheduler.postprocess(slots, samples, read) -> report the tasks that ended

The slots, the waiting queue and every change of a request's status live in
worker/engine/scheduler.py (`postprocess` decides EOS, max_tokens and a full context, and frees
slots); where KV rows go is worker/engine/kv.py's. This module is the thread, its inbox and
commands, and the output side of each token (`_read_token`: grammar, detokenizer, stop strings,
the token event), whose verdict the scheduler applies.

Determinism: a request's greedy output does not depend on what else runs or on the slot it
lands in; it may depend on what ran before only through rows it reuses from finished requests
(a history reuse, below), and on the torch CPU path not even then. Floating point is not
associative, so that holds only if every number of a request is computed by the same kernels,
reducing in the same order, whatever the batch. What we do, and why:

- A KV stream per slot (llama-server's default; `--kv-unified` opts out). In one shared pool
  a sequence's cells sit wherever llama.cpp found room, so its attention sums in an order that
  depends on the other requests (the measured cause of 8 of 32 differing answers). In its own
  stream a sequence's cell i holds position i. The torch backend keeps one pool but reads each
  sequence's cells through its own position-ordered table.
- Batch-invariant rows where the kernels allow it. The torch backend on the CPU is exact: its
  matmuls are oneDNN's prepacked kernels, whose rows do not depend on the row count, and one
  attention kernel computes every row (prompt or generated) over its sequence's cells in a
  fixed order (`RowRecipe.exact()`). llama.cpp's kernels change with the number of rows of a
  sequence in a ubatch (flash attention: per-row below 64 rows, tiled from 64; matmuls and
  attention without flash attention: one row vs several), so the llama.cpp backend states a
  recipe (which pieces a prompt is cut in, which cached rows may stand in for which) that
  makes every prompt row's kernels a function of the prompt alone; the scheduler plans by it
  and the backend runs the ubatches it promises (worker/backends/llama_cpp.py).
- Reuse of equal rows from what runs now. Sharing with a slot that is busy (prefilling or
  generating) gives a request only rows of the class it would compute itself; a prompt that is
  entirely cached is sampled from the logits saved when it was first computed, not from a
  re-decoded last row. Rows of the same class left by a finished request are taken the same
  way (the last piece is then redone as the recipe says, and the answer is bitwise a fresh one's).
- History reuse of rows left by finished requests (an idle slot, the prompt cache; issue 24).
  A conversation's next turn holds its earlier turns, whose answers are decode rows, and a new
  question starts with a system prompt that another question computed in other pieces: no fresh
  prompt computes those rows the same way on llama.cpp. Recomputing them cost a chat turn 5-10x
  llama-server's prompt time, so they are reused as they are and only the rest of the prompt
  is computed (cut by the recipe as a prompt of its own). On llama.cpp the answer may then
  differ at float rounding level from the same prompt sent to a fresh worker: it depends on
  what ran before, never on what runs beside it. `--strict-reuse` turns this off.
  Measured on SmolLM2-135M Q4_1 (2-core AVX2): a decode row computed beside another sequence
  and a prompt row in a piece under 64 rows are bitwise equal (its quantized matmuls give
  every row the same bits whatever the row count, and flash attention's per-row kernel reads
  the cells in order); a piece of 64+ rows (the tiled kernel) and a lone decode past 256 cells
  (split-KV) are not (logits up to 0.5-0.7 apart, same greedy pick). Making every row equal
  would mean prompts in pieces under 64 rows: 2.9x slower prefill of 1,500 tokens (63-row vs
  512-row pieces), so we do not.

What it costs, measured on the 2-core box (small-llama F16): a KV stream per slot is faster
than one pool (a decode step of 8 rows of ~100 cells: 14.9 vs 22.0 ms); prompts of 64+ tokens
with flash attention redo the last 64 rows instead of 1 after a partial cache hit (a shared
1000-token prefix: 64 rows per follower instead of its own suffix); and one-row ubatches,
which llama.cpp would compute with other kernels, are never formed for prompt rows.
What is left on llama.cpp: a decode step with a single sequence runs llama.cpp's one-row
matmul kernel (and, past 256 cells with flash attention, its split-KV attention), so one lone
request and the same request beside others differ at float rounding level (~1e-6 of the logits
for F32 weights, ~1e-4 for F16). Padding such steps with a second row would remove that but
costs 40% of a single request's speed (measured), so we do not; no greedy answer differed in
our tests (16 prompts x 64 tokens, alone vs 4 at once, both models).

Why one file of over 500 lines: a seventh of it is this docstring, the determinism contract
the code keeps; the rest is one thread's state (inbox, commands, load, sleep, the step and the
output side of a token), which split would need to share its private fields.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from worker.backends.base import Backend, DecodeStatus, Sample, SampleItem
from worker.backends.lora import LoraAdapter
from worker.engine.adapters import Adapters
from worker.engine.beam import emit_results
from worker.engine.disk_tier import DiskCacheConfig, DiskTier, open_disk_tier
from worker.engine.draft_model import DraftModel
from worker.engine.grammar import MaskBatch, consume
from worker.engine.metrics import WorkerMetrics
from worker.engine.prompt_cache import PromptCache
from worker.engine.scheduler import Plan, Scheduler
from worker.engine.slot import Slot
from worker.engine.speculation import SpecConfig, Speculator
from worker.engine.step_cost import StepCost
from worker.engine.task import GO_ON, EmbeddingEvent, ErrorEvent, FinishEvent, Task, TokenEvent, Verdict

log = logging.getLogger("worker.engine.engine")

T = TypeVar("T")
Progress = Callable[[str, float], None]
BackendFactory = Callable[[Progress], Backend]


@dataclass(frozen=True, slots=True)
class LoadStatus:
    """Published by the engine thread (a reference swap), read by /health."""

    phase: str = "starting"
    fraction: float = 0.0
    is_ready: bool = False
    error: str | None = None


@dataclass(slots=True)
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    needs_idle: bool = False


_STOP = object()


class Engine:
    def __init__(
        self,
        factory: BackendFactory,
        n_slots: int,
        metrics: WorkerMetrics,
        on_load_failed: Callable[[], None] | None = None,
        *,
        cache_ram_mib: int = 0,
        strict_reuse: bool = False,
        media_piece: int = 16,
        spec: SpecConfig | None = None,
        draft_factory: BackendFactory | None = None,
        disk_cache: DiskCacheConfig | None = None,
        lora: tuple[tuple[str, float], ...] = (),
    ) -> None:
        """`cache_ram_mib`: the host-RAM prompt cache (worker/engine/prompt_cache.py); 0 off, -1 unbounded.
        `strict_reuse`: reuse no row of another class, not even a finished request's (Determinism).
        `spec`: speculative decoding (worker/engine/speculation.py).
        `media_piece`: rows of an image's or audio's chunk per piece (worker/backends/media.py).
        `lora`: LoRA adapters (path, global scale) loaded with the model, ids 0, 1, ... in order
        (worker/engine/adapters.py); one that does not fit the model fails the load."""
        self._factory = factory
        self._lora = lora
        self.adapters = Adapters()
        self._spec_config = spec or SpecConfig()
        self._draft_factory = draft_factory  # the draft model's (--spec-draft-model)
        self._draft: DraftModel | None = None
        self._strict_reuse = strict_reuse
        self._media_piece = media_piece
        self._cache_ram_mib = cache_ram_mib
        self._disk_config = disk_cache
        self._disk: DiskTier | None = None  # made with the scheduler
        self._on_load_failed = on_load_failed
        self._metrics = metrics
        self.n_slots = n_slots
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._deferred: _Command | None = None  # a command waiting for the engine to be idle
        self._stopping = False
        self._backend: Backend | None = None
        self._scheduler: Scheduler | None = None  # made once the backend is loaded
        self.status = LoadStatus()
        self._flush_hooks: list[Callable[[], None]] = []
        self._gauges = (-1, -1, -1)  # last values published by _update_gauges
        self._masks: MaskBatch | None = None  # made at the first constrained task
        self._mask_totals: tuple[int, float, float] = (0, 0.0, 0.0)  # published to metrics so far
        self.last_busy = time.monotonic()  # engine thread writes; when it last had a task
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # -- any thread ---------------------------------------------------------------------------
    @property
    def backend(self) -> Backend | None:
        """The loaded backend (its tokenizer and metadata are safe from any thread), or None."""
        return self._backend

    def start(self) -> None:
        self._thread.start()

    def is_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def add_flush_hook(self, hook: Callable[[], None]) -> None:
        """`hook` runs on the engine thread before each decode and before the engine waits
        (see worker/server/generation.py: deferred event-loop wake-ups)."""
        self._flush_hooks = [*self._flush_hooks, hook]  # copy-on-write: read without a lock

    def flush_events(self) -> None:
        for hook in self._flush_hooks:
            hook()

    def submit(self, task: Task) -> None:
        if self._stopping:
            task.emit(ErrorEvent("worker is shutting down", 503, "unavailable_error"))
            return
        self._inbox.put(task)

    def submit_many(self, tasks: list[Task]) -> None:
        """Submit tasks that the engine must see together (one request's inputs: one step admits
        as many of them as there are free slots, instead of whichever arrived before it woke)."""
        if self._stopping:
            for t in tasks:
                t.emit(ErrorEvent("worker is shutting down", 503, "unavailable_error"))
            return
        self._inbox.put(list(tasks))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread between two steps."""
        cmd = _Command(fn)
        self._inbox.put(cmd)
        return cmd.future

    def call_when_idle(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` once every task submitted before it has finished (e.g. sleep)."""
        cmd = _Command(fn, needs_idle=True)
        self._inbox.put(cmd)
        return cmd.future

    def stop(self, timeout: float = 2.0) -> None:
        """Fail all tasks, free the model, end the thread (bounded wait)."""
        self._stopping = True
        self._inbox.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- engine thread: lifecycle -------------------------------------------------------------
    def _run(self) -> None:
        if not self._load():
            return
        while not self._stopping:
            try:
                self._pump_inbox()
                if self._has_work() and not self._stopping:
                    self._step()
                    self.last_busy = time.monotonic()
            except Exception as e:
                log.exception("engine step failed; failing the tasks in flight")
                self._fail_all(f"internal error: {e!r}", 500)
        self._save_to_disk()  # before _fail_all forgets the KV
        self._fail_all("worker is shutting down", 503)
        self._close_backend()

    def _load(self) -> bool:
        def progress(phase: str, fraction: float) -> None:
            if not self.status.is_ready:  # a wake reloads too, but the worker stays "ready"
                self.status = LoadStatus(phase, min(max(fraction, 0.0), 1.0))

        t0 = time.monotonic()
        try:
            self._backend = self._factory(progress)
            for path, scale in self._lora:
                self.adapters.load(self._backend, path, scale)
            if self._draft_factory is not None:
                self._draft = DraftModel(
                    self._draft_factory(progress), self._backend, self._spec_config.p_min
                )  # refused here when the vocabularies differ
        except Exception as e:
            log.error("model load failed: %s", e)
            self.status = LoadStatus("failed", 0.0, error=str(e) or repr(e))
            if self._on_load_failed is not None:
                self._on_load_failed()
            return False
        if self._stopping:
            self._close_backend()
            return False
        mib = self._cache_ram_mib
        use_cache = mib != 0 and self._backend.supports_seq_state
        decode_class = self._backend.recipe.decode_class
        prompt_cache = (
            PromptCache(None if mib < 0 else mib << 20, decode_class=decode_class) if use_cache else None
        )
        use_spec = self._backend.pooling is None  # a request may opt in without --spec-type
        self._scheduler = Scheduler(
            self._backend, self.n_slots, self._metrics, prompt_cache, reuse_history=not self._strict_reuse,
            media_piece=self._media_piece,
            spec=Speculator(self._spec_config, self._metrics, self._draft,
                            verify_apart=getattr(self._backend, "verify_apart", False)) if use_spec else None,
        )
        if (config := self._disk_config) is not None:
            r = self._backend.recipe
            self._disk = open_disk_tier(config, r, self._scheduler, self._metrics, self.submit, self.call)
        self.status = LoadStatus("ready", 1.0, is_ready=True)
        b = self._backend
        log.info(
            "model loaded in %.2f s: %d slots of %d cells (%s KV), staging %s, prompt cache %s",
            time.monotonic() - t0,
            self.n_slots,
            b.n_ctx_seq,
            "unified" if b.kv_unified else "per-slot",
            "on" if self._scheduler.staging is not None else "off",
            "off" if prompt_cache is None else f"{mib} MiB",
        )
        return True

    def _save_to_disk(self) -> None:
        if self._disk is not None and self._scheduler is not None and not self._require_backend().is_sleeping:
            try:
                self._disk.save(self._scheduler)
            except Exception:
                log.exception("prompt cache: saving to disk failed")

    def _close_backend(self) -> None:
        if self._disk is not None:
            self._disk.close()
        if self._masks is not None:
            self._masks.close()
        for b in (self._backend, self._draft.backend if self._draft is not None else None):
            if b is not None:
                try:
                    b.close()
                except Exception:
                    log.exception("backend close failed")

    def _has_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_work()

    def _pump_inbox(self) -> None:
        """Take everything queued; block only when there is nothing else to do."""
        while not self._stopping:
            if self._deferred is not None:
                if self._has_work():
                    return  # later items wait in the inbox until the deferred command has run
                cmd, self._deferred = self._deferred, None
                self._run_command(cmd)
                continue
            if not self._has_work():
                self.flush_events()  # about to block
            try:
                item = self._inbox.get(block=not self._has_work())
            except queue.Empty:
                return
            if item is _STOP:
                self._stopping = True
            elif isinstance(item, _Command):
                if item.needs_idle and self._has_work():
                    self._deferred = item
                else:
                    self._run_command(item)
            elif isinstance(item, list):
                for task in item:
                    self._enqueue(task)
            else:
                self._enqueue(item)

    def _run_command(self, cmd: _Command) -> None:
        self.flush_events()
        try:
            cmd.future.set_result(cmd.fn())
        except Exception as e:
            cmd.future.set_exception(e)

    def _enqueue(self, task: Task) -> None:
        self.last_busy = time.monotonic()
        if not self.adapters.is_loaded(task.params.lora):  # unloaded since the request was read
            task.emit(ErrorEvent("lora: the request names an adapter that has been unloaded", 400,
                                 "invalid_request_error"))
            return
        if self._disk is None or not self._disk.divert(task, self._require_scheduler()):
            self._require_scheduler().enqueue(task)  # first: if waking fails, _fail_all answers it too
        if self._require_backend().is_sleeping:
            try:
                self.wake()
            except Exception as e:  # the backend stays asleep (its wake is all or nothing)
                log.exception("wake failed")
                self._fail_all(f"the model could not wake: {e}", 500)

    def _require_backend(self) -> Backend:
        assert self._backend is not None, "engine used before the model loaded"
        return self._backend

    def _require_scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "engine used before the model loaded"
        return self._scheduler

    # -- engine thread: commands ---------------------------------------------------------------
    def sleep(self) -> None:
        """Free weights and KV (engine thread, idle). Cached prefixes go to the disk prompt cache
        when there is one, else they are gone with the KV."""
        backend = self._require_backend()
        if not backend.is_sleeping:
            self._save_to_disk()
            self._require_scheduler().kv.forget_all()
            backend.sleep()
            if self._draft is not None:
                self._draft.forget()
                self._draft.backend.sleep()
            log.info("sleeping: weights and KV cache freed")

    def sleep_if_idle_for(self, idle_s: float) -> None:
        """`--sleep-idle-seconds` (engine thread, idle): sleep unless a task ran in the last `idle_s`."""
        if time.monotonic() - self.last_busy >= idle_s:
            self.sleep()

    def wake(self) -> None:
        """Reload the model, and the draft model if there is one: all or nothing. A draft that
        cannot load again (its file changed or went away while asleep) puts the model back to
        sleep and raises RuntimeError: half awake, the next speculative step would draft with a
        freed model."""
        backend = self._require_backend()
        if backend.is_sleeping:
            t0 = time.monotonic()
            self.last_busy = t0  # a fresh idle period: --sleep-idle-seconds counts from the wake
            backend.wake()
            if self._draft is not None:
                try:
                    self._draft.backend.wake()
                except Exception as e:
                    backend.sleep()
                    raise RuntimeError(f"the draft model could not be loaded again at wake ({e}); the "
                                       "model stays asleep: put the draft model's file back") from e
            log.info("awake: model reloaded in %.2f s", time.monotonic() - t0)

    # -- LoRA adapters (worker/engine/adapters.py) ------------------------------------------------
    def load_lora(self, path: str, scale: float, name: str | None) -> LoraAdapter:
        """Engine thread: load an adapter at run time (LoraError: why it does not fit); a sleeping
        model wakes first (an adapter is loaded onto its weights)."""
        self.wake()
        return self.adapters.load(self._require_backend(), path, scale, name)

    def unload_lora(self, lora_id: int) -> LoraAdapter:
        """Engine thread, idle (no task may hold it): free an adapter."""
        return self.adapters.unload(self._require_backend(), lora_id)

    def slot_snapshot(self, slot_id: int) -> tuple[list[int], tuple[int, int], bytearray | None]:
        """Engine thread, idle: what the slot holds (POST /slots/{id}?action=save). ValueError for
        rows computed with LoRA adapters: a slot file is the base model's (restored as such)."""
        scheduler = self._require_scheduler()
        slot = scheduler.slots[slot_id]
        if slot.lora and slot.cache:
            raise ValueError(f"slot {slot_id} holds rows computed with LoRA adapters {list(slot.lora)}: "
                             "slot files keep the base model's rows only")
        return scheduler.kv.snapshot(slot)

    def restore_slot(self, slot_id: int, tokens: list[int], rows: tuple[int, int], state: bytes) -> bool:
        """Engine thread, idle: load a saved slot (action=restore); False if it did not fit."""
        scheduler = self._require_scheduler()
        return scheduler.kv.load(scheduler.slots[slot_id], tokens, rows, state)

    def erase_slot(self, slot_id: int) -> int:
        """Engine thread, idle: forget a slot's KV (action=erase); the tokens it held."""
        scheduler = self._require_scheduler()
        return scheduler.kv.erase(scheduler.slots[slot_id])

    def slots_info(self) -> list[dict[str, Any]]:
        n_ctx = self._require_backend().n_ctx_seq
        out = []
        for s in self._require_scheduler().slots:
            t = s.task
            out.append(
                {
                    "id": s.id,
                    "n_ctx": n_ctx,
                    "is_processing": t is not None,
                    "id_task": t.id if t else -1,
                    "n_cached_tokens": len(s.cache),
                    "n_prompt_tokens": len(t.prompt) if t else 0,
                    "n_decoded": t.stats.n_decoded if t else 0,
                    "is_prefill": s.is_prefill,
                    **({"params": _params_info(t)} if t else {}),  # as llama-server: an idle slot has none
                }
            )
        return out

    # -- engine thread: one step -----------------------------------------------------------------
    def _step(self) -> None:
        scheduler = self._require_scheduler()
        for task in scheduler.reap_cancelled():
            self._free_sampler(task)
        scheduler.admit()
        plan = scheduler.plan()
        if plan:
            self._run_batch(scheduler, plan)
        else:
            self.flush_events()  # no decode ahead to carry the wake-up
        self._update_gauges()

    def _run_batch(self, scheduler: Scheduler, plan: Plan) -> None:
        backend = self._require_backend()
        to_sample: list[Slot] = []
        masks = self._start_masks(plan)  # on a helper thread, while the decode runs
        if plan.entries:
            self.flush_events()  # the event loop wakes as the decode releases the GIL
            backend.set_lora(plan.lora)  # (a no-op while the set is unchanged) outside the decode's time
            t0 = time.perf_counter()
            if backend.decode([entry for _, entry in plan.entries]) is DecodeStatus.NO_KV_SPACE:
                if masks is not None:
                    masks.wait()  # unused: the matchers' state did not change
                scheduler.on_no_kv_space(plan)
                return
            step_s = time.perf_counter() - t0
            self._metrics.decode_seconds.inc(step_s)
            if scheduler.spec is not None:  # what a decode costs per row: how long a draft pays
                self._observe_cost(scheduler.spec.cost, plan, step_s)
            to_sample = scheduler.commit(plan, step_s * 1e3)
            self._metrics.n_busy_slots.inc(scheduler.n_busy())
        if backend.pooling is not None:  # an embedding model: an evaluated prompt is a finished task
            for i, task in enumerate(scheduler.release_pooled(to_sample)):
                self._finish_embedding(task, backend.embedding(i))
            return
        slots = to_sample + plan.from_saved
        if slots:
            rows = self._wait_masks(masks) if masks is not None else [None] * len(slots)
            first = _first_rows(plan)  # an entry's first output row (a verify entry has several)
            if any(s.task is not None and s.task.beam is not None for s in slots):
                keep = self._step_beams(scheduler, slots, first)
                n_sampled = len(to_sample)  # the slots of this decode come first, the saved ones after
                to_sample = [slots[i] for i in keep if i < n_sampled]
                first = [first[i] for i in keep if i < n_sampled]
                slots, rows = [slots[i] for i in keep], [rows[i] for i in keep]
            tasks = [s.task for s in slots if s.task is not None]
            items = [
                SampleItem(t.sampler, first[i] if i < len(first) else i, mask=m)
                for i, (t, m) in enumerate(zip(tasks, rows, strict=True))
            ]
            spec = scheduler.spec if scheduler.spec is not None and scheduler.spec.has_pending else None
            if spec is not None:
                spec.before_sampling({s.id: first[i] for i, s in enumerate(to_sample)})
            for item, slot in zip(items[len(to_sample) :], slots[len(to_sample) :], strict=True):
                item.logits_index, item.logits = -1, slot.logits
            samples = backend.sample(items, [t.params for t in tasks])
            if any(t.budget is not None for t in tasks):
                samples = [_forced(t, s) for t, s in zip(tasks, samples, strict=True)]
            slot_ids = {id(t): s.id for t, s in zip(tasks, slots, strict=True)}
            for task, verdict in scheduler.postprocess(slots, samples, self._read_token):
                self._report_end(task, slot_ids[id(task)], verdict)
            if spec is not None:  # the drafted slots' further rows, while their drafts hold
                one = partial(_one, scheduler, self._read_token)
                for task, verdict, slot_id in spec.verify(backend, one):
                    self._report_end(task, slot_id, verdict)
            if scheduler.spec is not None and plan.entries:  # drafting's measured yield
                scheduler.spec.record_step(len(samples), time.perf_counter() - t0)

    def _observe_cost(self, cost: StepCost, plan: Plan, step_s: float) -> None:
        """Feed the step-cost fit with decodes of output rows only (generating slots, verify
        entries): a prompt piece's rows cost less each (tiled kernels). A backend that runs a
        decode in several calls reports each call of output rows (`timed_calls`): the fit then
        learns a call's fixed cost and its rows' apart, as `draft_length` counts them."""
        calls = getattr(self._backend, "timed_calls", None)
        if calls is not None:
            for rows, seconds in calls:
                cost.observe(rows, seconds)
        elif all(e.is_output_rows for _, e in plan.entries):
            cost.observe(sum(len(e.tokens) for _, e in plan.entries), step_s)

    def _step_beams(self, scheduler: Scheduler, slots: list[Slot], first: list[int]) -> list[int]:
        """The beam searches' step (worker/engine/beam.py) on their slots' logits; the searches
        that ended report their answers. Returns the indices of the other slots, which sample.
        `first`: the logits row of each of the step's sampled entries (the first slots)."""
        backend = self._require_backend()
        beams: dict[int, np.ndarray] = {}
        keep: list[int] = []
        for i, s in enumerate(slots):
            if s.task is None or s.task.beam is None:
                keep.append(i)
            else:
                row = backend.logits_row(first[i]) if i < len(first) else s.logits  # else: saved logits
                assert row is not None
                beams[s.id] = row
        for task in scheduler.advance_beams(beams):
            self._report_beams(task)
        return keep

    def _wait_masks(self, masks: MaskBatch) -> list[Any]:
        rows = masks.wait()
        totals = (masks.n_masks, masks.compute_seconds, masks.wait_seconds)
        published, self._mask_totals = self._mask_totals, totals
        m = self._metrics
        m.grammar_masks.inc(totals[0] - published[0])
        m.grammar_mask_seconds.inc(totals[1] - published[1])
        m.grammar_wait_seconds.inc(totals[2] - published[2])
        return rows

    def _start_masks(self, plan: Plan) -> MaskBatch | None:
        """Start computing the grammar masks of the slots that sample this step (in sample
        order: entries asking for logits, then saved logits); None if none is constrained."""
        sampling = [slot for slot, entry in plan.entries if entry.logits] + plan.from_saved
        matchers = [slot.task.matcher if slot.task is not None else None for slot in sampling]
        if all(m is None for m in matchers):
            return None
        if self._masks is None:
            self._masks = MaskBatch(self._require_backend().meta.n_vocab, self.n_slots + 1)
        self._masks.start(matchers, overlap=bool(plan.entries))
        return self._masks

    def _read_token(self, task: Task, sample: Sample, is_eog: bool) -> Verdict:
        """The output side of one sampled token (the scheduler applies the verdict): the grammar
        consumes it, then, unless it ends the generation, its text is pushed through the
        detokenizer and stop strings and streamed as a token event."""
        token = sample.token
        grammar = consume(task.matcher, token) if task.matcher is not None else None
        if grammar is not None and grammar.error is not None:
            return Verdict(error=f"constrained decoding failed: {grammar.error}")
        if is_eog:
            return Verdict("stop")
        text, stop_word = task.output.push(self._require_backend().token_to_piece(token))
        if task.budget is not None:
            task.budget.observe(text)
        task.emit(TokenEvent(text, token, sample.logprob, sample.top_logprobs, sample.prob, sample.top_probs))
        if stop_word is not None:
            return Verdict("stop", stop_word)
        if grammar is not None and grammar.is_complete:  # nothing but end-of-generation may follow
            return Verdict("stop")
        return GO_ON

    def _report_end(self, task: Task, slot_id: int, verdict: Verdict) -> None:
        """A task the scheduler let go: its last event, its sampler, the metrics and the log."""
        self._free_sampler(task)
        if verdict.error is not None:
            log.error("task %d failed on slot %d: %s", task.id, slot_id, verdict.error)
            task.emit(ErrorEvent(verdict.error, 500, "server_error"))
            return
        assert verdict.reason is not None
        st = task.stats
        st.t_end = time.monotonic()
        m = self._metrics  # counted before the answer goes: a client that then reads /metrics sees it
        m.on_task_done(
            n_evaluated=st.n_evaluated,
            n_cached=st.n_cached,
            prompt_s=st.prompt_ms / 1e3,
            n_decoded=st.n_decoded,
            predicted_s=st.predicted_ms / 1e3,
            n_tokens=st.n_prompt + st.n_decoded,
        )
        m.prefix_hit_tokens.inc(st.n_cached)
        m.requests.labels(verdict.reason).inc()
        task.emit(FinishEvent(verdict.reason, task.output.finish(), verdict.stop_word, st))
        tps = st.n_decoded / (st.predicted_ms / 1e3) if st.predicted_ms > 0 else 0.0
        log.info(
            "task %d done on slot %d: %s; prompt %d tokens (%d cached) in %.1f ms; "
            "%d tokens in %.1f ms (%.1f t/s)",
            task.id,
            slot_id,
            verdict.reason,
            st.n_prompt,
            st.n_cached,
            st.prompt_ms,
            st.n_decoded,
            st.predicted_ms,
            tps,
        )

    def _report_beams(self, task: Task) -> None:
        """A beam search ended: its n best answers go to the request's choices, then the metrics."""
        self._free_sampler(task)
        assert task.beam is not None
        st = task.stats
        st.t_end = time.monotonic()
        n_tokens = emit_results(task, task.beam, task.choice_emits)
        m = self._metrics
        m.on_task_done(
            n_evaluated=st.n_evaluated,
            n_cached=st.n_cached,
            prompt_s=st.prompt_ms / 1e3,
            n_decoded=n_tokens,
            predicted_s=st.predicted_ms / 1e3,
            n_tokens=st.n_prompt + n_tokens,
        )
        m.prefix_hit_tokens.inc(st.n_cached)
        best = task.beam.best()
        m.requests.labels(best[0].reason if best else "stop").inc()
        log.info("task %d: beam search of width %d done in %d steps (%.1f ms), %d answers", task.id,
                 task.beam.width, st.n_decoded, st.predicted_ms, min(task.params.n, len(task.beam.done)))

    def _finish_embedding(self, task: Task, vectors: Any) -> None:
        if task.on_embedding is None:  # the HTTP layer refuses generation on an embedding model
            self._free_sampler(task)
            task.emit(ErrorEvent("an embedding model does not generate", 501, "not_supported_error"))
            return
        st = task.stats
        st.t_first_token = st.t_end = time.monotonic()
        self._free_sampler(task)
        m = self._metrics  # counted before the answer goes, as in _report_end
        m.on_task_done(
            n_evaluated=st.n_evaluated,
            n_cached=st.n_cached,
            prompt_s=st.prompt_ms / 1e3,
            n_decoded=0,
            predicted_s=0.0,
            n_tokens=st.n_prompt,
        )
        m.embeddings.inc()
        task.on_embedding(EmbeddingEvent(vectors, st))

    def _free_sampler(self, task: Task) -> None:
        if task.sampler is not None and self._backend is not None:
            self._backend.free_sampler(task.sampler)
            task.sampler = None

    def _fail_all(self, message: str, status_code: int) -> None:
        """Fail every task in flight and forget all KV (after an error, or at shutdown)."""
        tasks = self._scheduler.take_all() if self._scheduler is not None else []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Task):
                tasks.append(item)
            elif isinstance(item, list):
                tasks.extend(item)
            elif isinstance(item, _Command):
                item.future.set_exception(RuntimeError(message))
        if self._deferred is not None:
            self._deferred.future.set_exception(RuntimeError(message))
            self._deferred = None
        kind = "unavailable_error" if status_code == 503 else "server_error"
        for t in tasks:
            self._free_sampler(t)
            if not t.is_cancelled:
                t.emit(ErrorEvent(message, status_code, kind))
        self.flush_events()
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self._scheduler is None:
            return
        # A prometheus set takes a lock: each gauge is set when its value changes, not per step.
        values = (self._scheduler.n_busy(), len(self._scheduler.waiting), self._scheduler.kv_used())
        last, self._gauges = self._gauges, values
        m = self._metrics
        if values[0] != last[0]:
            m.requests_processing.set(values[0])
        if values[1] != last[1]:
            m.requests_deferred.set(values[1])
        if values[2] != last[2]:
            m.kv_cells_used.set(values[2])
            m.kv_usage_ratio.set(values[2] / max(1, self._require_backend().n_ctx))


def _first_rows(plan: Plan) -> list[int]:
    """The first output row of each entry asking for logits, in batch order."""
    out, row = [], 0
    for _, entry in plan.entries:
        if entry.logits:
            out.append(row)
            row += entry.n_outputs
    return out


def _one(scheduler: Scheduler, read: Callable[[Task, Sample, bool], Verdict], slot: Slot,
         sample: Sample) -> tuple[Task, Verdict] | None:
    """Postprocess one slot's sample (a verified draft's next token): the task if it ended."""
    ended = scheduler.postprocess([slot], [sample], read)
    return ended[0] if ended else None


def _params_info(task: Task) -> dict[str, Any]:
    p = task.params
    return {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_penalty": p.repeat_penalty,
        "repeat_last_n": p.repeat_last_n,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "seed": task.seed,
        "max_tokens": p.max_tokens,
        "stop": list(p.stop),
        "ignore_eos": p.ignore_eos,
        "n_probs": p.top_logprobs,
        "lora": [{"id": i, "scale": s} for i, s in p.lora],  # as llama-server's (the adapters not at 0)
    }


def _forced(task: Task, sample: Sample) -> Sample:
    """A reasoning budget's forced token replaces what was sampled (its log-probabilities are
    the sampled token's: the forced one was not drawn)."""
    assert task.budget is not None
    token = task.budget.next_token(sample.token)
    return sample if token == sample.token else dataclasses.replace(sample, token=token)
