"""The engine's side of the disk prompt cache (worker/engine/disk_cache.py): which arriving task
reads its prefix from disk first, and what is written when the KV is about to be lost.

Read. An arriving task is looked up in the disk index (engine thread, a scan of the index's
token lists) before the scheduler sees it. When a file holds a reusable prefix longer, by at
least `_MIN_GAIN` rows, than anything the slots or the host-RAM cache hold, the task is held
back: the loader thread reads the file and checks it while the engine keeps stepping the other
slots, then an engine command puts the entry into the host-RAM cache and the task is submitted
again. Admission restores it into a slot like any host-RAM entry (`KvBook.restore`: one
`seq_state_set`, a copy into the KV cache), so the engine thread never waits on the disk; its
share of a restore is that copy (31 ms for 4,012 tokens of SmolLM2-135M, 88 MiB, on the shared
2-core box), not a piece of prefill per step: llama.cpp sets a sequence's state in one call
(`llama_state_seq_set_data` empties the sequence first), so a restore cannot be cut in pieces
the way a prefill is. The restored rows are counted
as cached (`usage.prompt_tokens_details.cached_tokens`, `timings.cache_n`).

Write (`save`, engine thread, when idle or stopping). The slots' sequences (most recently used
first), then the host-RAM entries (most recently used first), skipping any whose rows a chosen
one covers, as far as the disk budget goes, are handed to the writer thread; `save` waits for
them at most `SAVE_SECONDS`. Sleep and every graceful stop go through it: SIGTERM is how the
router ends a worker on eviction, `unload-after`, a preset reload and its own shutdown, and the
router waits `stop-timeout` (10 s by default) before a SIGKILL. What a SIGKILL interrupts is
a temp file, deleted at the next start; what was renamed into place is whole.

LoRA adapters. Only the base model's rows go to disk and come from it: a prompt computed with
an adapter set (`CachedPrompt.lora`, worker/engine/scheduler.py) is never written, and a task
with adapters never reads. So the files' fingerprint (the model and its KV settings) keys them
fully: adapters loaded or not, a file's rows are the base model's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.backends.base import RowRecipe
from worker.engine.disk_cache import DiskCache, DiskEntry
from worker.engine.metrics import WorkerMetrics
from worker.engine.policy import Rows, common_prefix_len, reusable
from worker.engine.prompt_cache import CachedPrompt
from worker.engine.scheduler import Scheduler
from worker.engine.slot import Slot
from worker.engine.task import Task

log = logging.getLogger("omni.worker.disk_cache")

SAVE_SECONDS = 4.0  # the most a stop or a sleep waits for its writes
_MIN_GAIN = 16  # read from disk only when it saves at least this many rows of prefill
_MIN_TOKENS = 32  # a shorter sequence is not worth a file


@dataclass(frozen=True, slots=True)
class DiskCacheConfig:
    """`--cache-dir` and `--cache-disk`."""

    root: Path
    limit_bytes: int
    fingerprint: str  # disk_cache.fingerprint of the model and its KV-relevant settings


def open_disk_tier(
    config: DiskCacheConfig,
    recipe: RowRecipe,
    scheduler: Scheduler,
    metrics: WorkerMetrics,
    submit: Callable[[Task], None],
    call: Callable[[Callable[[], None]], Any],
) -> DiskTier | None:
    """Engine thread, once the model is loaded: index the folder; None (logged) if the tier is off."""
    if scheduler.prompt_cache is None:
        log.warning("--cache-dir: the disk prompt cache needs the host-RAM one (--cache-ram): off")
        return None
    try:
        cache = DiskCache(config.root, config.limit_bytes, config.fingerprint, metrics, recipe.decode_class)
    except OSError as e:
        log.error("--cache-dir %s: %s: the disk prompt cache is off", config.root, e)
        return None
    return DiskTier(cache, metrics, recipe, submit, call)


class DiskTier:
    def __init__(
        self,
        cache: DiskCache,
        metrics: WorkerMetrics,
        recipe: RowRecipe,
        submit: Callable[[Task], None],
        call: Callable[[Callable[[], None]], Any],
    ) -> None:
        """`submit` and `call`: the engine's (a task back into its inbox, a command for its thread)."""
        self.cache = cache
        self._metrics = metrics
        self._recipe = recipe
        self._submit = submit
        self._call = call
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="disk-cache-loader")
        self._read_done: set[int] = set()  # tasks back from the loader: admitted as they are

    # -- read ----------------------------------------------------------------------------------
    def divert(self, task: Task, scheduler: Scheduler) -> bool:
        """Engine thread, a task arriving: True if its prefix is read from disk first (the task
        then comes back through `submit`)."""
        if task.id in self._read_done:
            self._read_done.discard(task.id)
            return False
        if scheduler.prompt_cache is None or task.is_embedding or task.generated:
            return False
        if not task.params.cache_prompt or task.params.lora:
            return False  # the disk holds the base model's rows only
        tokens = task.tokens()
        wanted = (len(task.prompt), self._recipe.prompt_class(len(task.prompt)))
        entry, n = self.cache.best(tokens, wanted, any_class=scheduler.reuse_history)
        have = self._in_memory(scheduler, tokens)
        if entry is None or n < have + _MIN_GAIN:
            self._metrics.prompt_cache_disk_misses.inc()
            return False
        log.info("task %d: reading %d cached prompt tokens from disk (%s)", task.id, n, entry.path.name)
        self._loader.submit(self._load, task, entry, have + _MIN_GAIN, wanted, scheduler)
        return True

    @staticmethod
    def _in_memory(scheduler: Scheduler, tokens: list[int]) -> int:
        """The longest prefix of `tokens` the slots or the host-RAM cache hold (any class: a bound)."""
        n = max((common_prefix_len(s.cache, tokens) for s in scheduler.slots), default=0)
        if scheduler.prompt_cache is not None:
            wanted = (len(tokens), 0)
            n = max(n, scheduler.prompt_cache.best(tokens, wanted, any_class=True)[1])
        return n

    def _load(
        self, task: Task, entry: DiskEntry | None, n_min: int, wanted: Rows, scheduler: Scheduler
    ) -> None:
        """Loader thread: read and check the file, install it (engine command), resubmit the task.
        A file that fails its check is dropped from the index; the next best one is tried."""
        prompt = None
        try:
            while entry is not None and prompt is None and not task.is_cancelled:
                prompt = self.cache.read(entry)
                if prompt is None:
                    entry, n = self.cache.best(task.tokens(), wanted, any_class=scheduler.reuse_history)
                    entry = entry if n >= n_min else None
        finally:
            self._read_done.add(task.id)
            if prompt is not None:
                self._call(lambda: self._install(prompt, scheduler))
            self._submit(task)

    @staticmethod
    def _install(prompt: CachedPrompt, scheduler: Scheduler) -> None:
        cache = scheduler.prompt_cache
        if cache is not None and cache.put(prompt.tokens, prompt.state, prompt.rows, prompt.logits) is None:
            log.info("prompt cache: %d tokens read from disk do not fit in --cache-ram", len(prompt.tokens))
        scheduler.kv.update_cache_gauges()

    # -- write ---------------------------------------------------------------------------------
    def save(self, scheduler: Scheduler) -> None:
        """Engine thread: write the most valuable cached prompts (see the module doc)."""
        t0 = time.monotonic()
        chosen: list[CachedPrompt] = []
        total = 0
        slots = sorted(scheduler.slots, key=lambda s: s.t_last_used, reverse=True)
        from_slots = [p for p in (self._of_slot(scheduler, s) for s in slots) if p is not None]
        in_ram = scheduler.prompt_cache.most_recent_first() if scheduler.prompt_cache is not None else []
        for p in [*from_slots, *in_ram]:
            if p.lora or len(p.tokens) < _MIN_TOKENS or total + p.n_bytes > self.cache.limit_bytes:
                continue
            if any(self._covers(c, p) for c in chosen):
                continue
            chosen.append(p)
            total += p.n_bytes
        if not chosen:
            return
        self.cache.put(chosen)
        is_done = self.cache.wait_written(SAVE_SECONDS)
        log.info(
            "prompt cache on disk: %s %d prompts (%.1f MiB) in %.0f ms",
            "saved" if is_done else f"still writing after {SAVE_SECONDS:g} s:",
            len(chosen),
            total / 2**20,
            (time.monotonic() - t0) * 1e3,
        )

    @staticmethod
    def _of_slot(scheduler: Scheduler, slot: Slot) -> CachedPrompt | None:
        tokens, rows, state = scheduler.kv.snapshot(slot)
        if state is None or len(tokens) < _MIN_TOKENS:
            return None
        logits = slot.logits if slot.n_logits == len(tokens) else None
        return CachedPrompt(tuple(tokens), state, rows, logits, lora=slot.lora)

    def _covers(self, longer: CachedPrompt, shorter: CachedPrompt) -> bool:
        n = len(shorter.tokens)
        return (
            len(longer.tokens) >= n
            and longer.tokens[:n] == shorter.tokens
            and reusable(n, longer.rows, shorter.rows, self.cache.decode_class) == n
            and (shorter.logits is None or len(longer.tokens) == n)
        )

    def close(self) -> None:
        self._loader.shutdown(wait=False)  # a read under way still answers its task
        self.cache.close()
