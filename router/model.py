"""One model's lifecycle: a single owner task per model (`ModelHandle`).

Single-writer lifecycle (llama-swap's lesson): each `ModelHandle` has one owner task that is
the only writer of its `state`. Public operations (`ensure_ready`, `sleep`, `unload`, `evict`,
`drain`) put a command with a reply future on the owner's queue; the decision "start or not" is
made inside the owner, so concurrent requests for a loading model simply join its waiter list
and the worker is spawned once. Long effects (spawn + readiness, wake, sleep, stop) run as
effect tasks started by the owner; they report back with a message, and only the owner changes
state. Transitions: `router.state.ModelState`.

Hot path: `can_admit()` / `admit()` are synchronous, so on a READY model a request is admitted
without a round trip through the owner; nothing can interleave between the two calls (no
await), and the owner leaves READY synchronously before any effect that needs the model idle.
`num_in_flight` and `last_used` are counters written by `admit()` / `release()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from router.admission import SlotsFull
from router.eviction import Occupant
from router.memory import SAMPLE_LOADING_S, SAMPLE_RUNNING_S, TreeMemory, tree_memory
from router.presets import ModelPreset
from router.process import LoadError, WorkerProcess, free_port, wait_ready, worker_argv
from router.state import ModelState
from worker.errors import APIError

if TYPE_CHECKING:
    from router.pool import Pool

log = logging.getLogger("omni.router.model")
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
STABLE_AFTER_S = 60.0  # a model READY this long before crashing starts its backoff afresh
MAX_BACKOFF_S = 30.0


def backoff_delay(failures: int) -> float:
    """Seconds to wait before respawning after `failures` consecutive crashes (first: none)."""
    return 0.0 if failures <= 1 else min(2.0 ** (failures - 2), MAX_BACKOFF_S)


# --------------------------------------------------------------------------- commands


@dataclass
class _EnsureReady:
    reply: asyncio.Future[str]


@dataclass
class _Load:
    """Load (or wake) with no request waiting: load-on-startup, `POST /models/load`, a queue-full request."""


@dataclass
class _Sleep:
    reply: asyncio.Future[bool]


@dataclass
class _Unload:
    reply: asyncio.Future[bool]


@dataclass
class _Evict:
    reply: asyncio.Future[bool]


@dataclass
class _Drain:
    is_on: bool
    reply: asyncio.Future[bool]


@dataclass
class _LoadDone:
    proc: WorkerProcess | None
    error: str | None
    can_sleep: bool = True


@dataclass
class _SlotRefused:
    """No slot can ever be had (pinned models hold them all): not a failure of the model."""

    reason: str


@dataclass
class _SleepDone:
    ok: bool


@dataclass
class _Exited:
    proc: WorkerProcess
    code: int


@dataclass
class _Measured:
    proc: WorkerProcess
    memory: TreeMemory


@dataclass
class _Poke:
    """Something changed (a waiter left, the idle timer fired): re-examine."""


_Command = (_EnsureReady | _Load | _Sleep | _Unload | _Evict | _Drain | _LoadDone | _SlotRefused | _SleepDone
            | _Exited | _Measured | _Poke)


def _reply(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():  # the asker may have gone (client disconnect)
        fut.set_result(value)


@dataclass
class ModelHandle:
    preset: ModelPreset
    pool: Pool
    state: ModelState = ModelState.UNLOADED
    progress: dict[str, Any] | None = None
    exit_code: int | None = None
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)
    info: dict[str, Any] | None = None  # the worker's own /v1/models entry
    argv: list[str] = field(default_factory=list)  # the last command line spawned
    process: WorkerProcess | None = None
    base_url: str | None = None
    num_in_flight: int = 0
    last_used: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    ready_since: float = 0.0
    memory: TreeMemory | None = None  # the worker's process tree, last sample; None without a process
    can_sleep: bool = True  # the server speaks our /sleep + /wake contract (its /health has is_sleeping)
    _waiters: list[asyncio.Future[str]] = field(default_factory=list)
    _stop_waiters: list[asyncio.Future[bool]] = field(default_factory=list)
    _commands: asyncio.Queue[_Command] = field(default_factory=asyncio.Queue)
    _effect: asyncio.Task[Any] | None = None
    _failing: str | None = None  # why we are stopping a worker that failed to come up
    _stop_requested: bool = False  # unload arrived while spawning: stop once the load reports
    is_draining: bool = False  # chosen to make room: finish in-flight work, admit nothing new
    _task: asyncio.Task[None] | None = None
    _watcher: asyncio.Task[None] | None = None

    # ---- public, synchronous (hot path)

    @property
    def name(self) -> str:
        return self.preset.name

    def can_admit(self) -> bool:
        return self.state is ModelState.READY and not self.is_draining

    def admit(self) -> str:
        self.num_in_flight += 1
        self.last_used = time.monotonic()
        assert self.base_url is not None
        return self.base_url

    def release(self) -> None:
        self.num_in_flight -= 1
        self.last_used = time.monotonic()
        if self.num_in_flight == 0 and self.pool.slots.queued:
            self.pool.slots.poke()  # an idle model may now be evicted for a queued one

    def occupant(self) -> Occupant:
        return Occupant(self.name, self.state, self.num_in_flight, self.last_used, self.preset.pin)

    # ---- public commands

    async def ensure_ready(self) -> str:
        """Return the worker's base URL with one request admitted; the caller must `release()`."""
        if self.can_admit():
            return self.admit()
        pool = self.pool
        if pool.num_waiting >= pool.config.max_queue:
            self.load()  # the bound limits waiting requests, never loads: the retry finds it loaded
            raise APIError("too many queued requests, retry later", status_code=503,
                           type="unavailable_error", code=503, headers={"Retry-After": "1"})
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(self._on_waiter_done)
        self._commands.put_nowait(_EnsureReady(fut))
        pool.num_waiting += 1
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # admitted just as the client left
            raise
        finally:
            pool.num_waiting -= 1

    def load(self) -> None:
        """Start loading (or waking) without waiting and without taking a place in the queue."""
        self._commands.put_nowait(_Load())

    async def sleep(self) -> bool:
        return await self._ask(_Sleep)

    async def unload(self) -> bool:
        return await self._ask(_Unload)

    async def evict(self) -> bool:
        return await self._ask(_Evict)

    async def drain(self, is_on: bool) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._commands.put_nowait(_Drain(is_on, fut))
        return await fut

    async def _ask(self, kind: type[_Sleep] | type[_Unload] | type[_Evict]) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._commands.put_nowait(kind(fut))
        return await fut

    def _on_waiter_done(self, fut: asyncio.Future[str]) -> None:
        if fut.cancelled():
            self._commands.put_nowait(_Poke())

    # ---- the owner

    def start(self) -> None:
        if self.preset.is_remote:
            self.base_url = self.preset.upstream
            self.state = ModelState.READY
        self._task = asyncio.create_task(self._run(), name=f"owner:{self.name}")

    async def _run(self) -> None:
        while True:
            timeout = self._idle_timeout()
            try:
                cmd = await asyncio.wait_for(self._commands.get(), timeout)
            except TimeoutError:
                cmd = _Poke()
            try:
                self._handle(cmd)
            except Exception:  # a bug here must not kill the owner and wedge the model
                log.exception("model %s: error handling %r", self.name, cmd)

    def _ttl(self) -> float:
        ttl = self.preset.ttl if self.preset.ttl is not None else self.pool.config.sleep_idle_seconds
        return 0.0 if self.preset.is_remote else ttl

    def _idle_timeout(self) -> float | None:
        ttl = self._ttl()
        if ttl <= 0 or self.state is not ModelState.READY:
            return None
        if self.num_in_flight:
            return min(ttl, 1.0)  # release() does not wake us; look again soon
        return max(0.0, self.last_used + ttl - time.monotonic())

    def _handle(self, cmd: _Command) -> None:
        match cmd:
            case _EnsureReady(reply):
                self._on_ensure_ready(reply)
            case _Load():
                self._on_load()
            case _Sleep(reply):
                _reply(reply, self._begin_sleep())
            case _Unload(reply):
                self._on_unload(reply)
            case _Evict(reply):
                _reply(reply, self._on_evict())
            case _Drain(is_on, reply):
                self._on_drain(is_on)
                _reply(reply, True)
            case _LoadDone(proc, error, can_sleep):
                self._on_load_done(proc, error, can_sleep)
            case _SlotRefused(reason):
                self._on_slot_refused(reason)
            case _SleepDone(ok):
                self._on_sleep_done(ok)
            case _Exited(proc, code):
                self._on_exited(proc, code)
            case _Measured(proc, memory):
                if proc is self.process:
                    self.memory = memory
            case _Poke():
                self._on_poke()

    def _set(self, state: ModelState, progress: dict[str, Any] | None = None) -> None:
        old = self.state
        changed = state is not old or progress != self.progress
        self.state = state
        self.progress = progress
        if not state.has_process:
            # The one place a slot is given back. A slot is held from the grant until the process
            # is gone, and every way out (reaped, spawn failed, left the queue, refused, a grant
            # that raced a cancel) ends here, in UNLOADED or FAILED. Idempotent.
            self.pool.slots.release(self.name)
        if changed:
            if self.pool.slots.queued:
                self.pool.slots.poke()
            if state is not old:
                log.info("model %s: %s", self.name, state.value)
            self.pool.events.emit("status_change", {"model": self.name, "status": self.status()})

    def _set_progress(self, progress: dict[str, Any]) -> None:
        if self.state is ModelState.LOADING:
            self._set(ModelState.LOADING, {**progress, "phase": str(progress.get("phase", "loading"))})

    def _on_ensure_ready(self, reply: asyncio.Future[str]) -> None:
        if reply.done():
            return
        state = self.state
        if state is ModelState.READY and not self.is_draining:
            reply.set_result(self.admit())
            return
        if state is ModelState.FAILED and time.monotonic() < self.retry_at:
            wait = self.retry_at - time.monotonic()
            reply.set_exception(APIError(
                f"model {self.name!r} keeps crashing (exit code {self.exit_code}); retrying in {wait:.0f}s: "
                f"{self.error or ''}", status_code=503, type="unavailable_error", code=503,
                headers={"Retry-After": str(max(1, round(wait)))}))
            return
        self._waiters.append(reply)
        if state in (ModelState.UNLOADED, ModelState.FAILED):
            self._begin_load()
        elif state is ModelState.SLEEPING and not self.is_draining:
            self._begin_wake()
        # LOADING: joins the load. STOPPING: a load starts once the process is reaped.
        # Draining: waits until the model was evicted and loads again (behind the queue).

    def _on_load(self) -> None:
        state = self.state
        if state in (ModelState.UNLOADED, ModelState.FAILED) or (state is ModelState.SLEEPING and not self.is_draining):
            # A waiter nobody awaits: it keeps a queued load from being dropped as abandoned.
            intent: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            intent.add_done_callback(self._on_load_intent_done)
            self._on_ensure_ready(intent)

    def _on_load_intent_done(self, fut: asyncio.Future[str]) -> None:
        if not fut.cancelled() and fut.exception() is None:  # (reading it marks it retrieved)
            self.release()

    def _begin_load(self) -> None:
        self.exit_code = None
        self.error = None
        self.info = None
        self._failing = None
        self._stop_requested = False  # an unload that raced an earlier load ended with it
        self._set(ModelState.LOADING, {"phase": "queued", "fraction": 0.0})
        self._effect = asyncio.create_task(self._load(), name=f"load:{self.name}")

    async def _load(self) -> None:
        proc: WorkerProcess | None = None
        try:
            try:
                await self.pool.slots.acquire(self.name)
            except SlotsFull as e:
                self._commands.put_nowait(_SlotRefused(str(e)))
                return
            self._set_progress({"phase": "spawning", "fraction": 0.0})
            self.pool.events.emit("load_started", {"model": self.name})
            port = free_port(self.pool.config.host)
            base = f"http://{self.pool.config.host}:{port}"
            argv = worker_argv(self.preset, port, os.getpid(), self.pool.config.host)
            self.argv = argv
            proc = await WorkerProcess.spawn(argv, self.name, env=self._env())
            self.process, self.base_url = proc, base
            self._watcher = asyncio.create_task(self._watch(proc), name=f"watch:{self.name}")
            can_sleep = await wait_ready(self.pool.client, base, proc, self.preset.load_timeout, self._set_progress)
            self.info = await self._fetch_info(base)
            self._commands.put_nowait(_LoadDone(proc, None, can_sleep))
        except Exception as e:  # LoadError, OSError from the spawn, or a surprise: never stay LOADING
            self._commands.put_nowait(_LoadDone(proc, str(e)))

    def _env(self) -> dict[str, str] | None:
        if self.preset.backend == "cmd":
            return None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
        return env

    async def _fetch_info(self, base: str) -> dict[str, Any] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            r = await self.pool.client.get(f"{base}/v1/models", timeout=2.0)
            data = r.json()["data"]
            return dict(data[0]) if data else None
        return None

    async def _watch(self, proc: WorkerProcess) -> None:
        sampler = asyncio.create_task(self._sample_memory(proc), name=f"memory:{self.name}")
        try:
            code = await proc.wait()
        finally:
            sampler.cancel()
        self._commands.put_nowait(_Exited(proc, code))

    async def _sample_memory(self, proc: WorkerProcess) -> None:
        """Report the process tree's memory, often while loading, then now and then."""
        while (memory := await asyncio.to_thread(tree_memory, proc.pid)) is not None:
            self._commands.put_nowait(_Measured(proc, memory))
            await asyncio.sleep(SAMPLE_LOADING_S if self.state is ModelState.LOADING else SAMPLE_RUNNING_S)

    def _on_load_done(self, proc: WorkerProcess | None, error: str | None, can_sleep: bool) -> None:
        if self.state is not ModelState.LOADING or (proc is not None and proc is not self.process):
            return
        if self._stop_requested:
            self._stop_requested = False
            if self.process is not None:
                self._begin_stop()
            else:
                self._set(ModelState.UNLOADED)
                self._resolve_stop_waiters(True)
            return
        if error is None:
            self.can_sleep = can_sleep
            self._set(ModelState.READY)
            self.ready_since = time.monotonic()
            self.last_used = time.monotonic()
            self._resolve_waiters()
        elif self.process is None:  # failed before a process existed (e.g. spawn error)
            self._fail(None, error)
        else:  # the process exists (hung, or exiting): stop it; _on_exited finishes the job
            self._failing = error
            self._begin_stop()

    def _on_slot_refused(self, reason: str) -> None:
        if self.state is not ModelState.LOADING or self.process is not None:
            return
        self._set(ModelState.UNLOADED)  # not FAILED: the model is fine, no backoff applies
        self._resolve_stop_waiters(True)
        self._fail_waiters(f"model {self.name!r} cannot be loaded now: {reason}")

    def _resolve_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(self.admit())

    def _fail_waiters(self, message: str, status: int = 503) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_exception(APIError(message, status_code=status, type="unavailable_error", code=status))

    def _begin_wake(self) -> None:
        self._set(ModelState.LOADING, {"phase": "waking", "fraction": 0.0})
        self.pool.events.emit("wake_started", {"model": self.name})
        sleeping = self._effect  # a POST /sleep may still be on its way: wake after it
        self._effect = asyncio.create_task(self._wake(sleeping), name=f"wake:{self.name}")

    async def _wake(self, sleeping: asyncio.Task[Any] | None) -> None:
        proc, base = self.process, self.base_url
        assert proc is not None and base is not None
        try:
            is_asleep = True
            if sleeping is not None:
                await asyncio.wait([sleeping])
                is_asleep = not sleeping.cancelled() and sleeping.result() is True
            if is_asleep:  # a /sleep that failed left the worker awake: nothing to wake
                r = await self.pool.client.post(f"{base}/wake", timeout=self.preset.load_timeout)
                if r.status_code >= 400:
                    raise LoadError(f"/wake answered {r.status_code}: {r.text[:300]}")
            await wait_ready(self.pool.client, base, proc, self.preset.load_timeout, self._set_progress)
            self._commands.put_nowait(_LoadDone(proc, None))
        except Exception as e:  # LoadError, httpx.HTTPError, or a surprise: never stay LOADING
            self._commands.put_nowait(_LoadDone(proc, f"wake failed: {e!r}"))

    def _begin_sleep(self) -> bool:
        if self.state is not ModelState.READY or self.num_in_flight or self.preset.is_remote:
            return False
        if not self.can_sleep:  # e.g. a `cmd` llama-server: it has no /wake, so it is stopped
            log.info("model %s: no sleep support, stopping instead", self.name)
            self.pool.events.emit("evicted", {"model": self.name, "reason": "idle"})
            self._begin_stop()
            return True
        self._set(ModelState.SLEEPING)
        self._effect = asyncio.create_task(self._sleep_effect(), name=f"sleep:{self.name}")
        return True

    async def _sleep_effect(self) -> bool:
        try:
            r = await self.pool.client.post(f"{self.base_url}/sleep", timeout=30.0)
            ok = r.status_code < 400
        except httpx.HTTPError:
            ok = False
        self._commands.put_nowait(_SleepDone(ok))
        return ok

    def _on_sleep_done(self, ok: bool) -> None:
        if not ok and self.state is ModelState.SLEEPING:
            log.info("model %s: no /sleep (or it failed): unloading instead", self.name)
            self._begin_stop()

    def _on_drain(self, is_on: bool) -> None:
        if is_on == self.is_draining:
            return
        self.is_draining = is_on
        log.info("model %s: %s", self.name, "draining for a queued model" if is_on else "no longer draining")
        if is_on or not self._waiters:
            return
        if self.state is ModelState.READY:
            self._resolve_waiters()
        elif self.state is ModelState.SLEEPING:
            self._begin_wake()

    def _on_evict(self) -> bool:
        if self.state not in (ModelState.READY, ModelState.SLEEPING) or self.num_in_flight or self.preset.pin:
            return False
        log.info("model %s: evicted (least recently used, idle)", self.name)
        self.pool.events.emit("evicted", {"model": self.name, "reason": "lru"})
        self._begin_stop()
        return True

    def _on_unload(self, reply: asyncio.Future[bool]) -> None:
        state = self.state
        if state in (ModelState.UNLOADED, ModelState.FAILED) or self.preset.is_remote:
            _reply(reply, False)
            return
        self._stop_waiters.append(reply)
        if state is ModelState.STOPPING:
            return
        self._fail_waiters(f"model {self.name!r} was unloaded")
        if self.process is None and self._is_queued():  # no process yet: just leave the queue
            self._cancel_effect()
            self._set(ModelState.UNLOADED)
            self._resolve_stop_waiters(True)
        elif self.process is None:  # being spawned: cancelling now could orphan it
            self._stop_requested = True
        else:
            self._begin_stop()

    def _is_queued(self) -> bool:
        return self.state is ModelState.LOADING and bool(self.progress) and self.progress.get("phase") == "queued"  # type: ignore[union-attr]

    def _cancel_effect(self) -> None:
        if self._effect is not None and not self._effect.done():
            self._effect.cancel()
        self._effect = None

    def _begin_stop(self) -> None:
        self.is_draining = False
        self._cancel_effect()
        proc = self.process
        assert proc is not None
        self._set(ModelState.STOPPING)
        self._effect = asyncio.create_task(proc.stop(self.preset.stop_timeout), name=f"stop:{self.name}")

    def _resolve_stop_waiters(self, ok: bool) -> None:
        waiters, self._stop_waiters = self._stop_waiters, []
        for w in waiters:
            _reply(w, ok)

    def _on_exited(self, proc: WorkerProcess, code: int) -> None:
        if proc is not self.process:
            return
        self.process = None
        self.memory = None
        self.is_draining = False
        if self.base_url is not None:
            self.pool.upstream.forget(self.base_url)
        self.base_url = None
        self.log_tail = list(proc.log_tail)
        expected = self.state is ModelState.STOPPING and self._failing is None
        if expected:
            self.failures = 0
            self._set(ModelState.UNLOADED)
        else:
            reason = self._failing or f"exited with code {code}"
            self._fail(code, f"{reason}: {proc.tail_text()}")
        self._resolve_stop_waiters(True)
        if self._waiters and self.state is ModelState.UNLOADED:
            self._begin_load()  # requests arrived while it was stopping

    def _fail(self, code: int | None, error: str) -> None:
        self._cancel_effect()
        now = time.monotonic()
        if self.ready_since and now - self.ready_since > STABLE_AFTER_S:
            self.failures = 0
        self.failures += 1
        self.retry_at = now + backoff_delay(self.failures)
        self.exit_code = code
        self.error = error
        self.ready_since = 0.0
        self._failing = None
        self._stop_requested = False
        log.error("model %s: failed (exit code %s): %s", self.name, code, error)
        self._set(ModelState.FAILED)
        self._fail_waiters(f"model {self.name!r} failed to load: {error}")

    def _on_poke(self) -> None:
        self._waiters = [w for w in self._waiters if not w.done()]
        if self._is_queued() and self.process is None and not self._waiters:
            self._cancel_effect()  # every client left while queued for a slot
            self._set(ModelState.UNLOADED)
            return
        ttl = self._ttl()
        if (ttl > 0 and self.state is ModelState.READY and not self.num_in_flight
                and time.monotonic() - self.last_used >= ttl):
            log.info("model %s: idle for %.0fs, sleeping", self.name, ttl)
            self._begin_sleep()

    # ---- views

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"value": self.state.value}
        if self.argv:
            st["args"] = self.argv
        if self.state is ModelState.FAILED:
            st.update(failed=True, exit_code=self.exit_code, error=self.error, log_tail=self.log_tail)
        if self.progress is not None:
            st["progress"] = self.progress
        return st

    def memory_view(self) -> dict[str, int | None]:
        """Host RAM = the worker tree's USS (what stopping it frees); no estimate or VRAM yet."""
        m = self.memory
        return {"estimated_bytes": None, "ram_bytes": m.uss_bytes if m else None,
                "rss_bytes": m.rss_bytes if m else None, "vram_bytes": None}

    def card(self) -> dict[str, Any]:
        p = self.preset
        card: dict[str, Any] = {
            "id": p.name, "object": "model", "created": self.pool.created, "owned_by": "omni-router",
            "aliases": list(p.aliases), "backend": p.backend, "status": self.status(),
            "in_flight": self.num_in_flight, "pinned": p.pin, "memory": self.memory_view(),
        }
        if p.model is not None:
            card["path"] = str(p.model)
        if p.upstream:
            card["upstream"] = p.upstream
        if self.info is not None and self.state is not ModelState.UNLOADED:
            card["meta"] = self.info.get("meta", self.info)
        return card
