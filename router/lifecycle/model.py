"""One model's lifecycle: a single owner task per model (`ModelHandle`).

Single-writer lifecycle (llama-swap's lesson): each `ModelHandle` has one owner task, the only
writer of its `phase` and of everything that goes with it (process, base URL, progress,
memory). Public operations (`ensure_ready`, `load`, `sleep`, `unload`, `evict`, `drain`,
`reconfigure`) put a command on the owner's queue, most with a reply future; the decision
"start or not" is made inside the owner, so concurrent requests for a loading model join its
waiter list and the worker is spawned once. Long effects (ask for a slot, spawn, readiness,
sleep, wake, stop, exit watch, memory samples) run as tasks that only report back with a
message (`router.lifecycle.messages`) tagged with the attempt (or process) they belong to; a stale
message is ignored. The phases and their transition table: `router.lifecycle.state.Phase`.

Hot path: `can_admit()` / `admit()` are synchronous, so on a READY model a request is admitted
without a round trip through the owner; nothing can interleave between the two calls (no
await), and the owner leaves READY synchronously before any effect that needs the model idle.
`num_in_flight` and `last_used` are counters written by `admit()` / `release()`; the release
that leaves a model idle pokes its owner (idle timers, a drain that waits for it).

A handle depends on `ModelDeps` (admission, events, effects, the memory book, the queue
bound, the idle defaults), never on the pool that holds it.

Why one file of over 500 lines: the owner's handlers are one state machine over one set of
fields (`phase`, process, waiters, attempt); split across modules they would read each other's
private state. It is kept readable by sections (loading, sleeping, draining, the process, idle
tiers), one handler per message; the policies it applies live beside it, pure: the request
queue and crash requeue (`request_queue`), the idle tiers (`idle`), failures and their backoff
(`load_failure`), a reload's change (`preset_change`); its card is `views`'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.events import EventBus
from router.hub.download import Pulled
from router.hub.pulls import PULLS
from router.lifecycle import hub_files, idle
from router.lifecycle import messages as msg
from router.lifecycle.admission import Admission, SlotsFull
from router.lifecycle.effects import Effects, Process
from router.lifecycle.estimate import Estimate, MemoryBook
from router.lifecycle.eviction import Need, Occupancy
from router.lifecycle.idle import IdleDefaults
from router.lifecycle.load_failure import (
    KILLED_LOADS_KEPT,
    STABLE_AFTER_S,
    LoadFailure,
    backoff_delay,
    diagnose,
    permanent_failure,
    removed,
    unavailable,
    worker_load_line,
)
from router.lifecycle.memory import SAMPLE_LOADING_S, SAMPLE_RUNNING_S, TreeMemory
from router.lifecycle.preset_change import needs_restart
from router.lifecycle.process import SpawnError
from router.lifecycle.request_queue import (
    FORWARD_MARGIN,
    RequestQueue,
    RespawnFor,
    ShowFailed,
    Waiting,
    after_failure,
    forward_limit,
    keeps_queue_after_crash,
)
from router.lifecycle.state import ModelState, Phase
from router.presets import ModelPreset
from worker.protocol.errors import APIError

log = logging.getLogger("omni.router.model")
QUEUED_NOTICE_S = 0.2  # a load not granted a slot this soon shows "queued" (else straight to "spawning")
_STRAYS: set[asyncio.Task[Any]] = set()


@dataclass
class ModelDeps:
    """The services a model's owner uses; nothing else of the pool."""

    slots: Admission
    events: EventBus
    effects: Effects
    book: MemoryBook
    waiting: Waiting = field(default_factory=Waiting)
    idle: IdleDefaults = field(default_factory=IdleDefaults)
    created: int = 0
    forward_margin: int = FORWARD_MARGIN  # requests forwarded beyond a worker's slots
    # an `hf-repo` model's files from the hub (router/hub): the one function that goes outside
    fetch: hub_files.Fetch = PULLS.fetch


@dataclass(frozen=True)
class _Pending:
    """A reload's change, applied once the model is idle and stopped: the new preset, or None (removed)."""

    preset: ModelPreset | None


def _reply(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():  # the asker may have gone (client disconnect)
        fut.set_result(value)


@dataclass(eq=False)
class ModelHandle:
    preset: ModelPreset
    deps: ModelDeps
    phase: Phase = Phase.UNLOADED
    progress: dict[str, Any] | None = None
    exit_code: int | None = None
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)
    info: dict[str, Any] | None = None  # the worker's own /v1/models entry
    argv: list[str] = field(default_factory=list)  # the last command line spawned
    process: Process | None = None
    node: dict[str, Any] | None = None  # where the last process ran, when not on this box (Ray)
    base_url: str | None = None
    num_in_flight: int = 0
    last_used: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    last_failure: dict[str, Any] | None = None  # a transient failure it was unloaded after (its card)
    ready_since: float = 0.0
    memory: TreeMemory | None = None  # the worker's process tree, last sample; None without a process
    need: Estimate | None = None  # what this run was admitted with
    load_seconds: float | None = None  # the last load, from its grant to ready (the swap scheduler's cost)
    _granted_at: float = 0.0
    can_sleep: bool = True  # the server speaks our /sleep + /wake contract (its /health has is_sleeping)
    _peak: TreeMemory | None = None  # this run's largest sample while awake (learned for the next load)
    _failure: str | None = None  # why we stop it (STOPPING_AFTER_FAILURE), for the FAILED message
    _pending: _Pending | None = None
    _attempt: int = 0  # tags effect messages: one per queue, wake or sleep
    _load_started: float = 0.0  # monotonic time the current load was asked for
    is_permanent: bool = (
        False  # FAILED in a way that repeats: not retried until the file changes or a load is asked
    )
    is_misconfigured: bool = False  # (with is_permanent) its preset names a file or hub tag not there: 503
    _failed_stamp: tuple[int, int] | None = None  # the model file's (size, mtime) when it failed
    _queue: RequestQueue = field(default_factory=RequestQueue)  # waiting requests, the forwarding bound
    _stop_waiters: list[asyncio.Future[bool]] = field(default_factory=list)
    _commands: asyncio.Queue[msg.Command] = field(default_factory=asyncio.Queue)
    _effect: asyncio.Task[Any] | None = None
    _task: asyncio.Task[None] | None = None
    _watcher: asyncio.Task[None] | None = None
    is_removed: bool = False  # a reload removed it and it has stopped: the owner has ended
    pulled: Pulled | None = None  # an `hf-repo` model's files, once in the hub cache
    keep_alive: float | None = None  # an Ollama request's keep_alive (s; <0: never): overrides unload-after

    # ---- public, synchronous (hot path)

    @property
    def name(self) -> str:
        return self.preset.name

    @property
    def state(self) -> ModelState:
        progress = self.progress
        if self.phase is Phase.QUEUED and progress is not None and progress.get("phase") == "downloading":
            return ModelState.DOWNLOADING
        return self.phase.status

    @property
    def run_preset(self) -> ModelPreset:
        """The preset a worker runs: an `hf-repo` model's with the files its pull brought."""
        return hub_files.run_preset(self.preset, self.pulled)

    @property
    def is_draining(self) -> bool:
        return self.phase is Phase.DRAINING

    @property
    def forward_limit(self) -> int | None:
        """Slot-occupying requests forwarded to the worker at once at most (None: no bound); the
        rest wait here, in arrival order (router.lifecycle.request_queue)."""
        return forward_limit(self.preset, self.deps.forward_margin)

    def can_admit(self, occupies_slot: bool = True) -> bool:
        # FIFO: while requests wait here for room, a new one queues behind them
        return self.phase is Phase.READY and self._queue.can_admit(
            self.forward_limit, occupies_slot, self.deps.slots.admits_before(self.name))

    def admit(self, occupies_slot: bool = True) -> str:
        self.num_in_flight += 1
        self._queue.num_occupying += occupies_slot
        self.last_used = time.monotonic()
        assert self.base_url is not None
        return self.base_url

    def release(self, occupies_slot: bool = True) -> None:
        """The end of a request admitted with the same `occupies_slot`."""
        self.num_in_flight -= 1
        self._queue.num_occupying -= occupies_slot
        self.last_used = time.monotonic()
        if self._queue.has_slot_waiters() and self.phase is Phase.READY:
            self._commands.put_nowait(msg.Poke())  # room for the next waiting request
        if self.num_in_flight == 0 and not self.preset.is_remote:
            if self.phase is Phase.DRAINING or self._ttl() > 0 or self._unload_after() > 0:
                self._commands.put_nowait(
                    msg.Poke()
                )  # idle timers start now; a reload restart waits for this
            if self.deps.slots.queued:
                self.deps.slots.poke()  # an idle model may now be evicted for a queued one

    @property
    def num_waiting(self) -> int:
        """Requests waiting here (not yet forwarded): what a load or an undrain would serve."""
        return self._queue.num_waiting()

    @property
    def waiting_since(self) -> float | None:
        """When its oldest request waiting for a load arrived (None when ready: its requests
        wait for room in its own worker, not for a swap)."""
        return None if self.phase is Phase.READY else self._queue.oldest_arrival()

    def recheck(self) -> None:
        """Admission changed (the swap rule "fifo"'s bound moved): admit who now may go."""
        self._commands.put_nowait(msg.Poke())

    def occupancy(self) -> Occupancy:
        ram, vram = self.charge()
        return Occupancy(
            self.name,
            self.phase.is_up,
            self.phase.is_stopping,
            self.num_in_flight,
            self.last_used,
            self.preset.pin,
            ram,
            vram,
            self.preset.group,
            self.num_waiting,
        )

    def charge(self) -> tuple[int, int]:
        """Bytes of RAM and VRAM charged against the budgets: the larger of what this run was
        admitted with and what was measured; asleep, what is measured (sleep frees budget)."""
        m = self.memory
        ram, vram = (m.uss_bytes, m.vram_bytes or 0) if m is not None else (0, 0)
        if self.phase is Phase.SLEEPING and m is not None:
            return ram, vram
        need = self.need or Estimate(0, 0, "unknown")
        return max(need.ram_bytes, ram), max(need.vram_bytes, vram)

    # ---- public commands

    async def ensure_ready(self, requeued: bool = False, occupies_slot: bool = True) -> str:
        """Return the worker's base URL with one request admitted; the caller must
        `release(occupies_slot)`. `requeued`: a request whose worker died before it reached it:
        it waits through the crash backoff for the respawn instead of a 503. `occupies_slot`
        False: a request that bypasses the forwarding bound (router.lifecycle.request_queue)."""
        if self.can_admit(occupies_slot):
            return self.admit(occupies_slot)
        waiting = self.deps.waiting
        if waiting.num_waiting >= waiting.max_queue:
            self.load()  # the bound limits waiting requests, never loads: the retry finds it loaded
            raise unavailable("too many queued requests, retry later", retry_after=1)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(self._on_waiter_done)
        self._post(msg.EnsureReady(fut, requeued, occupies_slot))
        waiting.num_waiting += 1
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(occupies_slot)  # admitted just as the client left
            raise
        finally:
            waiting.num_waiting -= 1

    def load(self) -> None:
        """Start loading (or waking) without waiting and without taking a place in the queue."""
        self._commands.put_nowait(msg.Load())

    async def sleep(self) -> bool:
        return await self._ask(msg.Sleep)

    async def unload(self) -> bool:
        return await self._ask(msg.Unload)

    async def evict(self) -> bool:
        return await self._ask(msg.Evict)

    async def drain(self, is_on: bool) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._post(msg.Drain(is_on, fut))
        return await fut

    def reconfigure(self, preset: ModelPreset | None) -> None:
        """A reload changed this model's preset (or removed it: None); applied once it is idle."""
        self._commands.put_nowait(msg.Reconfigure(preset))

    async def settled(self) -> None:
        """Return once the owner has handled every command and message sent before this call."""
        await self._ask(msg.Sync)

    async def _ask(self, kind: type[msg.Sleep] | type[msg.Unload] | type[msg.Evict] | type[msg.Sync]) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._post(kind(fut))
        return await fut

    def _on_waiter_done(self, fut: asyncio.Future[str]) -> None:
        if fut.cancelled():
            self._commands.put_nowait(msg.Poke())

    def _post(self, message: msg.Command) -> None:
        self._commands.put_nowait(message)
        if self.is_removed:
            self._answer_after_removal()

    # ---- the owner

    def start(self) -> None:
        if self.preset.is_remote:
            self.base_url = self.preset.upstream
            self.phase = Phase.READY
        elif self.preset.model_error is not None:  # (before the owner runs: no one else writes yet)
            self._fail_missing()
            self.phase = Phase.FAILED
        self._task = asyncio.create_task(self._run(), name=f"owner:{self.name}")

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the owner task has ended (a removed model, after its last request)."""
        if self._task is None or self._task.done():
            callback()
        else:
            self._task.add_done_callback(lambda _task: callback())

    def cancel(self) -> None:
        """The router is shutting down: end the owner task and any effect in flight at once (the
        pool then stops the process itself, with its stop-timeout)."""
        if self._task is not None:
            self._task.cancel()
        self._cancel_effect()

    async def _run(self) -> None:
        while not self.is_removed:
            try:
                cmd = await asyncio.wait_for(self._commands.get(), self._idle_timeout())
            except TimeoutError:
                cmd = msg.Poke()
            try:
                self._handle(cmd)
            except Exception:  # a bug here must not kill the owner and wedge the model
                log.exception("model %s: error handling %r", self.name, cmd)
        self._answer_after_removal()

    def _answer_after_removal(self) -> None:
        """Removed by a reload: whoever still asks (a request that looked the model up just
        before) gets an answer, never a wait."""
        while not self._commands.empty():
            match self._commands.get_nowait():
                case msg.EnsureReady(reply) if not reply.done():
                    reply.set_exception(removed(f"model {self.name!r} was removed from the presets"))
                case msg.Sleep(reply) | msg.Unload(reply) | msg.Evict(reply) | msg.Drain(_, reply):
                    _reply(reply, False)
                case msg.Sync(reply):
                    _reply(reply, True)

    def _handle(self, cmd: msg.Command) -> None:
        match cmd:
            case msg.EnsureReady(reply, requeued, occupies_slot):
                self._on_ensure_ready(reply, requeued, occupies_slot)
            case msg.Load():
                self._on_load()
            case msg.Sleep(reply):
                _reply(reply, self._on_sleep())
            case msg.Unload(reply):
                self._on_unload(reply)
            case msg.Evict(reply):
                _reply(reply, self._on_evict())
            case msg.Drain(is_on, reply):
                self._on_drain(is_on)
                _reply(reply, True)
            case msg.Reconfigure(preset):
                self._on_reconfigure(preset)
            case msg.Sync(reply):
                _reply(reply, True)
            case msg.Poke():
                self._on_poke()
            case msg.Settle(attempt):
                self._on_settle(attempt)
            case msg.Estimated(attempt, need) if attempt == self._attempt:
                self._on_estimated(need)
            case msg.Granted(attempt) if attempt == self._attempt:
                self._on_granted()
            case msg.Refused(attempt, reason) if attempt == self._attempt:
                self._on_refused(reason)
            case msg.Spawned(attempt, proc, base_url, argv):
                self._on_spawned(attempt, proc, base_url, argv)
            case msg.Progress(attempt, progress) if attempt == self._attempt:
                if self.phase in (Phase.QUEUED, Phase.STARTING, Phase.WAKING):
                    self._set(self.phase, {**progress, "phase": str(progress.get("phase", "loading"))})
            case msg.Ready(attempt, can_sleep, info) if attempt == self._attempt:
                self._on_ready(can_sleep, info)
            case msg.LoadFailed(attempt, error, can_retry) if attempt == self._attempt:
                self._on_load_failed(error, can_retry)
            case msg.Fetched(attempt, pulled) if attempt == self._attempt:
                self._on_fetched(pulled)
            case msg.FetchFailed(attempt, error, is_transient, is_misconfigured) if attempt == self._attempt:
                if self.phase is Phase.QUEUED:
                    self._fail(None, LoadFailure(error, is_permanent=not is_transient,
                                                 is_misconfigured=is_misconfigured))
            case msg.SleepDone(attempt, ok) if attempt == self._attempt:
                self._on_sleep_done(ok)
            case msg.Exited(proc, code):
                self._on_exited(proc, code)
            case msg.Measured(proc, memory):
                self._on_measured(proc, memory)

    def _set(self, phase: Phase, progress: dict[str, Any] | None = None) -> None:
        old, old_progress = self.phase, self.progress
        self.phase = phase
        self.progress = progress
        if not phase.holds_slot:
            # The one place a slot is given back: every way out (reaped, spawn failed, left the
            # queue, refused, a grant that raced a cancel) ends in a phase without a process.
            self.deps.slots.release(self)
        if phase is old and progress == old_progress:
            return
        if self.deps.slots.queued:
            self.deps.slots.poke()
        if phase is not old:
            log.info("model %s: %s", self.name, phase.value)
        if phase.status is not old.status or progress != old_progress:
            self.deps.events.emit("status_change", {"model": self.name, "status": self.status()})

    # ---- loading

    def _on_ensure_ready(self, reply: asyncio.Future[str], requeued: bool = False,
                         occupies_slot: bool = True) -> None:
        if reply.done():
            return
        phase = self.phase
        if requeued and phase is Phase.FAILED and not self.is_permanent and time.monotonic() < self.retry_at:
            self._queue.add(reply, occupies_slot)  # its worker died before it got it: wait for the respawn
            asyncio.get_running_loop().call_later(self.retry_at - time.monotonic(), self._respawn_if_failed)
            return
        if phase is Phase.READY:
            self._queue.add(reply, occupies_slot)  # behind those already waiting for room
            self._resolve_waiters()
            return
        if phase is Phase.FAILED and self.is_permanent and self._file_stamp() == self._failed_stamp:
            reply.set_exception(permanent_failure(self.name, self.error or "", self.log_tail,
                                                  is_misconfigured=self.is_misconfigured))
            return
        if phase is Phase.FAILED and time.monotonic() < self.retry_at:
            wait = self.retry_at - time.monotonic()
            reply.set_exception(unavailable(
                f"model {self.name!r} keeps crashing (exit code {self.exit_code}); retrying in {wait:.0f}s: "
                f"{self.error or ''}", retry_after=wait))
            return
        self._queue.add(reply, occupies_slot)
        if phase in (Phase.UNLOADED, Phase.FAILED):
            self._begin_queue()
        elif phase is Phase.SLEEPING:
            self._begin_wake()
        # Loading phases: joins the load. FALLING_ASLEEP: wakes once the sleep is done.
        # DRAINING, stopping: served once undrained, or loaded again after the exit.

    def _on_load(self) -> None:
        if self.phase is Phase.FAILED:  # asked for explicitly: try again, whatever failed before
            self.is_permanent, self.retry_at = False, 0.0
        if self.phase in (Phase.UNLOADED, Phase.FAILED, Phase.FALLING_ASLEEP, Phase.SLEEPING):
            # A waiter nobody awaits: it keeps a queued load from being dropped as abandoned.
            intent: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            intent.add_done_callback(self._on_load_intent_done)
            self._on_ensure_ready(intent)

    def _on_load_intent_done(self, fut: asyncio.Future[str]) -> None:
        if not fut.cancelled() and fut.exception() is None:  # (reading it marks it retrieved)
            self.release()

    def _begin_queue(self) -> None:
        self.last_failure = None
        self.exit_code = None
        self.error = None
        self.info = None
        self._attempt += 1
        self._load_started = time.monotonic()
        if self.preset.hf_repo is not None and self.pulled is None:
            self._set(Phase.QUEUED, {"phase": "downloading", "fraction": 0.0})
            self._effect = asyncio.create_task(self._download(self._attempt), name=f"download:{self.name}")
            return
        self._set(Phase.QUEUED, {"phase": "estimating memory", "fraction": 0.0})
        self._effect = asyncio.create_task(self._estimate(self._attempt), name=f"estimate:{self.name}")

    async def _download(self, attempt: int) -> None:
        """The files of an `hf-repo` model into the hub cache (router.lifecycle.hub_files)."""
        self._post(await hub_files.download(attempt, self.preset, self.deps.fetch,
                                            lambda p: self._post(msg.Progress(attempt, p))))

    def _on_fetched(self, pulled: Pulled) -> None:
        if self.phase is not Phase.QUEUED:
            return
        self.pulled = pulled
        log.info("model %s: %s is in the hub cache (%s)", self.name, pulled.name, pulled.model)
        self._set(Phase.QUEUED, {"phase": "estimating memory", "fraction": 0.0})
        self._effect = asyncio.create_task(self._estimate(self._attempt), name=f"estimate:{self.name}")

    async def _estimate(self, attempt: int) -> None:
        self._post(msg.Estimated(attempt, await asyncio.to_thread(self.deps.book.estimate, self.run_preset)))

    def _on_estimated(self, need: Estimate) -> None:
        if self.phase is not Phase.QUEUED:
            return
        self.need = need  # set before the request: a holder is charged from its grant on
        self._effect = asyncio.create_task(
            self._acquire(self._attempt, Need(need.ram_bytes, need.vram_bytes)), name=f"acquire:{self.name}"
        )

    async def _acquire(self, attempt: int, need: Need) -> None:
        acquire = asyncio.ensure_future(self.deps.slots.acquire(self, need))
        try:
            done, _ = await asyncio.wait({acquire}, timeout=QUEUED_NOTICE_S)
            if not done:  # not granted at once: say what it waits for
                self._post(msg.Progress(attempt, {"phase": "queued", "fraction": 0.0,
                                                  "waiting_for": "--models-max or the memory budgets"}))
            await acquire
        except SlotsFull as e:
            self._post(msg.Refused(attempt, str(e)))
            return
        finally:
            acquire.cancel()  # (a no-op once done) our own cancellation leaves the queue
        self._post(msg.Granted(attempt))

    def _on_granted(self) -> None:
        if self.phase is not Phase.QUEUED:
            return  # left the queue meanwhile: its slot was given back on the way out
        self._set(Phase.SPAWNING, {"phase": "spawning", "fraction": 0.0})
        self._granted_at = time.monotonic()
        self.deps.events.emit("load_started", {"model": self.name})
        self._effect = asyncio.create_task(self._spawn(self._attempt), name=f"spawn:{self.name}")

    async def _spawn(self, attempt: int) -> None:
        try:
            proc, base_url, argv = await self.deps.effects.spawn(self.run_preset)
        except Exception as e:  # OSError from the spawn, or a surprise: never stay SPAWNING
            self._post(msg.LoadFailed(attempt, str(e), can_retry=isinstance(e, SpawnError)))
            return
        self._post(msg.Spawned(attempt, proc, base_url, argv))

    def _on_refused(self, reason: str) -> None:
        if self.phase is not Phase.QUEUED:
            return
        self._set(Phase.UNLOADED)  # not FAILED: the model is fine, no backoff applies
        self._fail_waiters(f"model {self.name!r} cannot be loaded now: {reason}")
        self._apply_pending()

    def _on_spawned(self, attempt: int, proc: Process, base_url: str, argv: list[str]) -> None:
        if attempt != self._attempt or self.phase not in (Phase.SPAWNING, Phase.SPAWNING_THEN_STOP):
            log.error("model %s: a process nobody waits for (pid %d): stopping it", self.name, proc.pid)
            task = asyncio.create_task(proc.stop(self.preset.stop_timeout))
            _STRAYS.add(task)
            task.add_done_callback(_STRAYS.discard)
            return
        self.process, self.base_url, self.argv, self.node = proc, base_url, argv, proc.node
        self.memory = self._peak = None
        self._watcher = asyncio.create_task(self._watch(proc), name=f"watch:{self.name}")
        if self.phase is Phase.SPAWNING_THEN_STOP:
            self._begin_stop()
            return
        self._set(Phase.STARTING, {"phase": "starting", "fraction": 0.0})
        self._effect = asyncio.create_task(self._start(attempt, proc, base_url), name=f"start:{self.name}")

    async def _start(self, attempt: int, proc: Process, base_url: str) -> None:
        effects = self.deps.effects
        try:
            if self.preset.load_delay > 0:  # a preset's `load-delay` (tests, benchmarks): a slower load
                await asyncio.sleep(self.preset.load_delay)
            can_sleep = await effects.wait_ready(proc, base_url, self.preset.load_timeout,
                                                 lambda p: self._post(msg.Progress(attempt, p)))
            info = await effects.info(base_url)
        except Exception as e:  # LoadError, or a surprise: never stay STARTING
            self._post(msg.LoadFailed(attempt, str(e)))
            return
        self._post(msg.Ready(attempt, can_sleep, info))

    def _on_ready(self, can_sleep: bool | None, info: dict[str, Any] | None) -> None:
        if self.phase not in (Phase.STARTING, Phase.WAKING):
            return
        if can_sleep is not None:
            self.can_sleep, self.info = can_sleep, info
            self.ready_since = time.monotonic()
            self.load_seconds = self.ready_since - self._granted_at
            self._learn_peak()
            tail = list(self.process.log_tail) if self.process is not None else []
            log.info("model %s: loaded in %.2f s (from the first request or load; %s)", self.name,
                     self.ready_since - self._load_started, worker_load_line(tail))
        self.last_used = time.monotonic()
        if self._pending is not None:  # a reload changed it while it loaded: restart, its requests wait
            self._begin_stop()
            return
        self._set(Phase.READY)
        self._resolve_waiters()
        self.deps.slots.poke()  # (the swap rule "fifo": its waiters no longer bound the others' admission)

    def _on_load_failed(self, error: str, can_retry: bool = False) -> None:
        if (
            self.phase is Phase.SPAWNING
        ):  # e.g. a `cmd` whose program does not exist: it will not next time either
            self._fail(None, LoadFailure(error, is_permanent=not can_retry))
        elif self.phase is Phase.SPAWNING_THEN_STOP:
            self._set(Phase.UNLOADED)
            self._resolve_stop_waiters(True)
            self._apply_pending()
        elif self.phase in (Phase.STARTING, Phase.WAKING):  # the process exists: stop it, then FAILED
            self._begin_stop(failure=error)

    def _resolve_waiters(self) -> None:
        """Admit waiting requests in arrival order while the worker has room (`forward_limit`)."""
        self._queue.admit_waiting(self.forward_limit, self.admit, self.deps.slots.admits_before(self.name))

    def _fail_waiters(self, message: str, *, is_removed: bool = False, error: APIError | None = None) -> None:
        self._queue.fail_all(lambda: error or (removed(message) if is_removed else unavailable(message)))

    # ---- sleeping and waking

    def _begin_wake(self) -> None:
        self._attempt += 1
        self._set(Phase.WAKING, {"phase": "waking", "fraction": 0.0})
        self.deps.events.emit("wake_started", {"model": self.name})
        self._effect = asyncio.create_task(self._wake(self._attempt), name=f"wake:{self.name}")

    async def _wake(self, attempt: int) -> None:
        proc, base_url = self.process, self.base_url
        assert proc is not None and base_url is not None
        effects = self.deps.effects
        try:
            await effects.wake(base_url, self.preset.load_timeout)
            await effects.wait_ready(proc, base_url, self.preset.load_timeout,
                                     lambda p: self._post(msg.Progress(attempt, p)))
        except Exception as e:  # LoadError, httpx.HTTPError, or a surprise: never stay WAKING
            self._post(msg.LoadFailed(attempt, f"wake failed: {e!r}"))
            return
        self._post(msg.Ready(attempt, None, None))

    def _on_sleep(self) -> bool:
        if self.phase is not Phase.READY or self.num_in_flight or self.preset.is_remote:
            return False
        self._begin_sleep()
        return True

    def _begin_sleep(self) -> None:
        if not self.can_sleep:  # e.g. a `cmd` llama-server: it has no /wake, so it is stopped
            log.info("model %s: no sleep support, stopping instead", self.name)
            self.deps.events.emit("evicted", {"model": self.name, "reason": "idle"})
            self._begin_stop()
            return
        self._attempt += 1
        self._set(Phase.FALLING_ASLEEP)
        self._effect = asyncio.create_task(self._sleep(self._attempt), name=f"sleep:{self.name}")

    async def _sleep(self, attempt: int) -> None:
        assert self.base_url is not None
        self._post(msg.SleepDone(attempt, await self.deps.effects.sleep(self.base_url)))

    def _on_sleep_done(self, ok: bool) -> None:
        if self.phase is not Phase.FALLING_ASLEEP:
            return
        if not ok:
            log.info("model %s: no /sleep (or it failed): unloading instead", self.name)
            self._begin_stop()
            return
        self._set(Phase.SLEEPING)
        self._prune_waiters()
        if self._pending is not None:
            self._begin_stop()
        elif self._queue:
            self._begin_wake()

    # ---- draining, eviction, unload, reload

    def _on_drain(self, is_on: bool) -> None:
        if is_on and self.phase is Phase.READY:
            log.info("model %s: draining for a queued model", self.name)
            self._set(Phase.DRAINING)
        elif not is_on and self.phase is Phase.DRAINING and self._pending is None:
            log.info("model %s: no longer draining", self.name)
            self._set(Phase.READY)
            self._resolve_waiters()

    def _on_evict(self) -> bool:
        if not self.phase.is_up or self.num_in_flight or self.preset.pin:
            return False
        log.info("model %s: evicted (least recently used, idle)", self.name)
        self.deps.events.emit("evicted", {"model": self.name, "reason": "lru"})
        self._begin_stop()
        return True

    def _on_unload(self, reply: asyncio.Future[bool]) -> None:
        phase = self.phase
        if phase in (Phase.UNLOADED, Phase.FAILED) or self.preset.is_remote:
            _reply(reply, False)
            return
        self._stop_waiters.append(reply)
        if phase.is_stopping or phase is Phase.SPAWNING_THEN_STOP:
            return
        self._fail_waiters(f"model {self.name!r} was unloaded")
        if phase is Phase.QUEUED:  # no process yet: just leave the queue
            self._cancel_effect()
            self._set(Phase.UNLOADED)
            self._resolve_stop_waiters(True)
        elif phase is Phase.SPAWNING:  # being spawned: cancelling now could orphan it
            self._set(Phase.SPAWNING_THEN_STOP, self.progress)
        else:
            self._begin_stop()

    def _on_reconfigure(self, preset: ModelPreset | None) -> None:
        if preset is not None and not needs_restart(self.preset, preset):
            self.preset = preset  # router-side keys only: nothing to restart
            return
        if self.preset.is_remote:  # no process: the change applies at once
            self._pending = _Pending(preset)
            self.base_url = None
            self._set(Phase.UNLOADED)
            self._apply_pending()
            return
        self._pending = _Pending(preset)
        phase = self.phase
        if phase in (Phase.UNLOADED, Phase.FAILED):
            self._apply_pending()
        elif phase is Phase.QUEUED:  # its need was figured with the old preset: queue again
            self._cancel_effect()
            self._set(Phase.UNLOADED)
            self._apply_pending()
        elif phase is Phase.READY:
            self._set(Phase.DRAINING)
            self._stop_if_drained()
        elif phase is Phase.DRAINING:
            self._stop_if_drained()
        elif phase in (Phase.FALLING_ASLEEP, Phase.SLEEPING):
            self._begin_stop()
        # Loading: restarted once ready. Stopping: applied at the exit.

    def _stop_if_drained(self) -> None:
        if self.phase is Phase.DRAINING and self._pending is not None and not self.num_in_flight:
            log.info("model %s: idle, restarting for the new preset", self.name)
            self._begin_stop()

    def _apply_pending(self) -> None:
        """In a phase without a process: take the reload's change (or retire)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.preset is None:
            self._fail_waiters(f"model {self.name!r} was removed from the presets", is_removed=True)
            self._resolve_stop_waiters(True)
            log.info("model %s: removed by a preset reload", self.name)
            self.is_removed = True  # the owner loop ends after this command
            return
        self.preset = pending.preset
        self.pulled = None  # an hf-repo model's files are looked up again for the new preset
        self.failures = 0
        if self.preset.is_remote:
            self.base_url = self.preset.upstream
            self._set(Phase.READY)
            self._resolve_waiters()
            return
        if self.phase is Phase.FAILED:
            self._set(Phase.UNLOADED)
        if self.preset.model_error is not None:
            self._fail_missing()
            self._set(Phase.FAILED)
            self._fail_waiters("", error=permanent_failure(self.name, self.preset.model_error, [],
                                                           is_misconfigured=True))
            return
        self.need = None
        self._prune_waiters()
        if self._queue:
            self._begin_queue()

    def _cancel_effect(self) -> None:
        if self._effect is not None and not self._effect.done():
            self._effect.cancel()
        self._effect = None

    def _begin_stop(self, failure: str | None = None) -> None:
        self._cancel_effect()
        proc = self.process
        assert proc is not None
        self._failure = failure
        self._set(Phase.STOPPING if failure is None else Phase.STOPPING_AFTER_FAILURE)
        self._effect = asyncio.create_task(proc.stop(self.preset.stop_timeout), name=f"stop:{self.name}")

    def _resolve_stop_waiters(self, ok: bool) -> None:
        waiters, self._stop_waiters = self._stop_waiters, []
        for w in waiters:
            _reply(w, ok)

    # ---- the process

    async def _watch(self, proc: Process) -> None:
        sampler = asyncio.create_task(self._sample_memory(proc), name=f"memory:{self.name}")
        try:
            code = await proc.wait()
        finally:
            sampler.cancel()
        self._post(msg.Exited(proc, code))

    async def _sample_memory(self, proc: Process) -> None:
        """Report the process tree's memory, often while loading, then now and then."""
        async for memory in self.deps.effects.samples(
                proc, lambda: SAMPLE_LOADING_S if self.phase.is_loading else SAMPLE_RUNNING_S):
            self._post(msg.Measured(proc, memory))

    def _on_measured(self, proc: Process, memory: TreeMemory) -> None:
        if proc is not self.process:
            return
        self.memory = memory
        if self._peak is None or memory.exceeds(self._peak):
            self._peak = memory.peak_with(self._peak)
            if self.phase.is_up or self.phase is Phase.WAKING:
                self._learn_peak()
        if self.deps.slots.queued:
            self.deps.slots.poke()  # less memory (asleep) may make room

    def _learn_peak(self) -> None:
        """The largest sample of a run that loaded (loading samples included) is the next estimate."""
        if self._peak is not None:
            self.deps.book.learn(self.run_preset, self._peak.uss_bytes, self._peak.vram_bytes)

    def _on_exited(self, proc: Process, code: int) -> None:
        if proc is not self.process:
            return
        self.process = None
        self.memory = None
        if self.base_url is not None:
            self.deps.effects.forget(self.base_url)
        self.base_url = None
        self.log_tail = list(proc.log_tail)
        if self.phase is Phase.STOPPING:
            self.failures = 0
            self._set(Phase.UNLOADED)
        else:
            reason = self._failure or proc.exit_cause or f"exited with code {code}"
            was_serving = self.phase is Phase.READY or self.phase is Phase.DRAINING
            # killed by a signal while loading (SIGKILL from outside, the OOM killer): transient,
            # but a load that kills itself again and again is a crash loop, cut off after a few
            failure = diagnose(self.log_tail, code, reason, was_ready=self.ready_since > 0)
            self._fail(code, failure, keep_waiters=keeps_queue_after_crash(
                was_serving=was_serving, killed_by_signal=code < 0, is_the_box=failure.is_the_box,
                failures=self.failures, killed_loads_kept=KILLED_LOADS_KEPT))
        self._resolve_stop_waiters(True)
        self._apply_pending()
        self._prune_waiters()
        if self._queue and self.phase is Phase.UNLOADED:
            self._begin_queue()  # requests arrived while it was stopping

    def _fail(self, code: int | None, failure: LoadFailure, keep_waiters: bool = False) -> None:
        """FAILED, with a backoff before the next load; what follows (a respawn for the requests
        still queued, or for the preset; or `failed` shown a while, then unloaded) is
        `request_queue.after_failure`'s decision. `keep_waiters`: `keeps_queue_after_crash`."""
        self._cancel_effect()
        now = time.monotonic()
        if self.ready_since and now - self.ready_since > STABLE_AFTER_S:
            self.failures = 0
        self.failures += 1
        self.retry_at = now + backoff_delay(self.failures)
        self.exit_code, self.error, self.is_permanent = code, failure.cause, failure.is_permanent
        self.is_misconfigured = failure.is_misconfigured
        self._failed_stamp, self.ready_since, self._failure = self._file_stamp(), 0.0, None
        log.error("model %s: failed (exit code %s)%s: %s", self.name, code, ", not retried until its "
                  "file or preset changes or POST /models/load asks" if failure.is_permanent else "",
                  failure.cause)
        self._set(Phase.FAILED)
        self._prune_waiters()
        loop, p = asyncio.get_running_loop(), self.preset
        match after_failure(failure.is_permanent, keep_waiters and bool(self._queue),
                            p.pin or p.load_on_startup, self.failures, self.retry_at - now):
            case RespawnFor(delay, is_for_queue=True):
                log.info("model %s: %d queued requests wait for the respawn in %.1f s", self.name,
                         len(self._queue), delay)
                loop.call_later(delay, self._respawn_if_failed)
                return  # they were never forwarded to it: they stay queued
            case RespawnFor(delay):
                loop.call_later(delay, self._respawn_if_failed)  # the preset keeps it up
            case ShowFailed(delay):
                attempt = self._attempt
                loop.call_later(delay, lambda: self._commands.put_nowait(msg.Settle(attempt)))
        self._fail_waiters(
            "",
            error=permanent_failure(self.name, failure.cause, self.log_tail,
                                    is_misconfigured=failure.is_misconfigured)
            if failure.is_permanent
            else unavailable(f"model {self.name!r} failed to load: {failure.cause}"),
        )

    def _on_settle(self, attempt: int) -> None:
        """Still the same transient failure, and nobody asked since: unloaded, as a crash of llama-swap's
        or Ollama's leaves a model, the next request loading it (the failure stays on the card as
        `last_failure`)."""
        if (self.phase is Phase.FAILED and attempt == self._attempt and not self.is_permanent
                and not self._queue and not self.is_removed):
            self.last_failure = {"exit_code": self.exit_code, "error": self.error}
            self._set(Phase.UNLOADED)

    def _respawn_if_failed(self) -> None:
        """The backoff after a crash is over: load again, unless something else (an unload, a
        reload, a request) has moved the model on meanwhile."""
        if self.phase is Phase.FAILED and not self.is_removed:
            self._commands.put_nowait(msg.Load())

    def _fail_missing(self) -> None:
        """The preset's model file does not exist: FAILED, permanent until the file is there."""
        self.exit_code, self.error = None, self.preset.model_error
        self.is_permanent, self._failed_stamp, self.log_tail = True, None, []
        self.is_misconfigured = True

    def _file_stamp(self) -> tuple[int, int] | None:
        """The model file's (size, mtime): a permanent failure is tried again once it changes."""
        try:
            st = self.preset.model.stat() if self.preset.model is not None else None
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns) if st is not None else None

    # ---- idle tiers

    def _ttl(self) -> float:
        return idle.sleep_after(self.preset, self.deps.idle)

    def set_keep_alive(self, seconds: float | None) -> None:
        """Ollama's `keep_alive` (router/ollama/): unload once idle this long from now on (0: as
        soon as idle, <0: never; None: the preset's `unload-after` again). A pinned model stays."""
        self.keep_alive = seconds
        self._commands.put_nowait(msg.Poke())  # the idle timer is figured again (now, if idle)

    def unload_at(self) -> float | None:
        """When an idle unload is due if no request comes (wall clock; None: never)."""
        after = self._unload_after()
        if after <= 0:
            return None
        idle_s = 0.0 if self.num_in_flight else time.monotonic() - self.last_used
        return time.time() + max(0.0, after - idle_s)

    def _unload_after(self) -> float:
        if self.keep_alive is not None and not (self.preset.is_remote or self.preset.pin):
            return 0.0 if self.keep_alive < 0 else max(self.keep_alive, 1e-3)  # 0 means now
        return idle.unload_after(self.preset, self.deps.idle)

    def _idle_deadline(self) -> tuple[float, str] | None:
        """When the next idle step is due (monotonic) and what it is: "sleep" or "unload"."""
        if self.num_in_flight or self._queue:
            return None
        return idle.next_step(self.phase, self.last_used, self._ttl(), self._unload_after())

    def _idle_timeout(self) -> float | None:
        due = self._idle_deadline()
        return None if due is None else max(0.0, due[0] - time.monotonic())

    def _prune_waiters(self) -> None:
        self._queue.prune()

    def _on_poke(self) -> None:
        if self.phase is Phase.READY and self._queue:
            # A forwarded request ended: room for the next (those whose clients left are skipped
            # on the way). Still busy: nothing idle to check, and no O(queue) pruning per release.
            self._resolve_waiters()
            if self._queue:
                return
        self._prune_waiters()
        if self.phase is Phase.QUEUED and not self._queue:
            self._cancel_effect()  # every client left while queued for a slot
            self._set(Phase.UNLOADED)
            self._apply_pending()
            return
        self._stop_if_drained()
        due = self._idle_deadline()
        if due is None or time.monotonic() < due[0]:
            return
        if due[1] == "sleep":
            log.info("model %s: idle for %.0fs, sleeping", self.name, self._ttl())
            self._begin_sleep()
        else:
            log.info("model %s: idle for %.0fs, unloading", self.name, self._unload_after())
            self._begin_stop()

    # ---- views

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"value": self.state.value}
        if self.argv:
            st["args"] = self.argv
        if self.phase is Phase.FAILED:
            st.update(failed=True, exit_code=self.exit_code, error=self.error, log_tail=self.log_tail,
                      permanent=self.is_permanent)
        elif self.phase is Phase.UNLOADED and self.last_failure is not None:
            st["last_failure"] = self.last_failure
        if self.progress is not None:
            st["progress"] = self.progress
        return st
