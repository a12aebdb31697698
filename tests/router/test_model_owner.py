"""The model owner and `Slots`, in process, through every row of `router.lifecycle.state.Phase`'s table.

The effects (spawn, readiness, sleep, wake, stop, memory samples) are `FakeEffects`: each is a
call the test answers, and `answer` returns once the owner has handled the result, so every
phase is read at a known point. Idle tiers use the owner's own timers (tens of milliseconds);
the test then awaits the effect the timer starts. No sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from router.events import EventBus
from router.lifecycle.admission import Slots
from router.lifecycle.estimate import MemoryBook
from router.lifecycle.eviction import Limits
from router.lifecycle.idle import IdleDefaults
from router.lifecycle.memory import TreeMemory
from router.lifecycle.model import ModelDeps, ModelHandle
from router.lifecycle.process import LoadError
from router.lifecycle.request_queue import FORWARD_MARGIN, Waiting
from router.lifecycle.state import Phase
from router.lifecycle.swap import SwapRule
from router.lifecycle.views import card
from router.presets import ModelPreset
from tests.router.fake_effects import FakeEffects, FakeProc, OwnerRig
from worker.protocol.errors import APIError

M = 1 << 20


class Rig(OwnerRig):
    def add(self, name: str, **kw: Any) -> ModelHandle:
        return self.start(preset(name, **kw))

    async def until(self, pred: Callable[[], bool]) -> None:
        for _ in range(200):
            if pred():
                return
            await self.quiet()
        raise AssertionError("condition never held")

    def check_slots(self) -> None:
        """A slot is held exactly while the phase says so (given back in one place)."""
        for h in self.handles:
            assert (h in self.slots.holders) == h.phase.holds_slot, (h.name, h.phase)

    async def stop(self, h: ModelHandle, code: int = 0) -> FakeProc:
        call = await self.fx.next("stop")
        proc: FakeProc = call.args[0]
        await self.fx.answer(call, code)
        await proc.wait()
        await self.quiet()
        return proc


def preset(name: str, **kw: Any) -> ModelPreset:
    return ModelPreset(name, backend="cmd", cmd="fake --port ${PORT}", stop_timeout=1.0, **kw)


@contextlib.asynccontextmanager
async def rig(limits: Limits | None = None, idle: IdleDefaults | None = None) -> AsyncIterator[Rig]:
    fx = FakeEffects()
    slots = Slots(limits or Limits(models_max=4), rule=SwapRule("fifo-batch"))  # drains at once
    deps = ModelDeps(slots, EventBus(), fx, MemoryBook(has_gpu=False), Waiting(16), idle or IdleDefaults())
    r = Rig(fx, slots, deps)
    task = asyncio.create_task(slots.run())
    try:
        yield r
        await r.quiet()
        r.check_slots()
    finally:
        task.cancel()
        for h in r.handles:
            h.cancel()


async def failed_with(task: asyncio.Task[str], text: str) -> APIError:
    with pytest.raises(APIError, match=text) as e:
        await task
    return e.value


@pytest.mark.asyncio
async def test_load_goes_queued_spawning_starting_ready_and_the_wire_shows_loading_then_loaded() -> None:
    async with rig() as r:
        h = r.add("a")
        async with r.deps.events.subscribe(frozenset({"status_change"})) as q:
            asked = asyncio.create_task(h.ensure_ready())
            spawn = await r.fx.next("spawn")
            assert h.phase is Phase.SPAWNING and h in r.slots.holders
            proc, base, argv = r.fx.new_proc()
            await r.fx.answer(spawn, (proc, base, argv), h)
            assert h.phase is Phase.STARTING and h.process is proc and h.argv == argv
            ready = await r.fx.next("ready")
            ready.args[1]({"phase": "weights", "fraction": 0.5})  # the worker's /health progress
            await h.settled()
            assert h.status()["progress"] == {"phase": "weights", "fraction": 0.5}
            await r.fx.answer(ready, True, h)
            assert h.phase is Phase.READY and await asyncio.wait_for(asked, 1) == base
            assert h.num_in_flight == 1 and h.can_admit()
            h.release()
            wire = [(d["status"]["value"], d["status"].get("progress", {}).get("phase")) for _, d in
                    [q.get_nowait() for _ in range(q.qsize())]]
        assert wire == [("loading", "estimating memory"), ("loading", "spawning"), ("loading", "starting"),
                        ("loading", "weights"), ("loaded", None)]
        assert card(h)["meta"] == {"fake": True}
        r.check_slots()


@pytest.mark.asyncio
async def test_a_model_that_can_never_fit_is_refused_with_figures_and_not_failed() -> None:
    """QUEUED -> UNLOADED on _Refused."""
    async with rig(Limits(models_max=4, ram_budget=100 * M)) as r:
        h = r.add("big", memory=200 * M)
        err = await failed_with(asyncio.create_task(h.ensure_ready()),
                                r"needs ~200.0 MiB of RAM, budget 100.0 MiB, pinned 0 B")
        assert err.status_code == 503
        await r.quiet()
        assert h.phase is Phase.UNLOADED and h.failures == 0 and r.fx.pending("spawn") == 0


@pytest.mark.asyncio
async def test_queued_then_unload_or_every_waiter_leaving_returns_to_unloaded_and_undrains_the_busy_model() -> (  # noqa: E501  # the test's name is its description
    None
):
    """QUEUED -> UNLOADED (unload, waiters gone); READY -> DRAINING -> READY (queue emptied)."""
    async with rig(Limits(models_max=1)) as r:
        a, b = r.add("a"), r.add("b")
        await r.up(a)
        a.admit()  # a request in flight: a cannot be evicted, so b waits and a drains
        waiting = asyncio.create_task(b.ensure_ready())
        await r.until(lambda: a.phase is Phase.DRAINING)
        deadline = (
            time.monotonic() + 10
        )  # "queued" is shown once not granted within QUEUED_NOTICE_S (real time)
        while b.status()["progress"]["phase"] != "queued" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert b.status()["progress"]["phase"] == "queued"
        assert b.phase is Phase.QUEUED
        assert not a.can_admit()
        waiting.cancel()
        await r.until(lambda: a.phase is Phase.READY)
        assert b.phase is Phase.UNLOADED

        waiting = asyncio.create_task(b.ensure_ready())
        await r.until(lambda: b.phase is Phase.QUEUED and a.phase is Phase.DRAINING)
        assert await b.unload() is True
        await failed_with(waiting, "was unloaded")
        await r.until(lambda: a.phase is Phase.READY)
        assert b.phase is Phase.UNLOADED and r.fx.pending("spawn") == 0
        a.release()


@pytest.mark.asyncio
async def test_a_spawn_error_fails_the_model_and_gives_its_slot_back() -> None:
    """SPAWNING -> FAILED."""
    async with rig() as r:
        h = r.add("a")
        asked = asyncio.create_task(h.ensure_ready())
        await r.fx.answer(await r.fx.next("spawn"), OSError("no such file"), h)
        await failed_with(asked, "failed to load: no such file")
        assert h.phase is Phase.FAILED and h.exit_code is None and h not in r.slots.holders


@pytest.mark.asyncio
async def test_unload_during_spawn_bug_the_stale_stop_request_stopped_the_next_good_load() -> None:
    """SPAWNING -> SPAWNING_THEN_STOP -> (_Spawned) STOPPING -> UNLOADED, and -> (_LoadFailed) UNLOADED.

    Bug: an unload that arrived while the worker was being spawned set a flag that outlived a
    failure of that worker, so the next good load was stopped the moment it became ready. Now
    the request is the phase SPAWNING_THEN_STOP, which ends when the spawn reports."""
    async with rig() as r:
        h = r.add("a")
        first = asyncio.create_task(h.ensure_ready())
        spawn = await r.fx.next("spawn")
        unload = asyncio.create_task(h.unload())
        await h.settled()
        assert h.phase is Phase.SPAWNING_THEN_STOP and h.status()["value"] == "stopping"
        await failed_with(first, "was unloaded")
        proc, base, argv = r.fx.new_proc()
        await r.fx.answer(spawn, (proc, base, argv), h)
        assert h.phase is Phase.STOPPING  # never started: stopped as soon as it exists
        await r.stop(h, -15)
        assert await unload is True and h.phase is Phase.UNLOADED and h.failures == 0

        first = asyncio.create_task(h.ensure_ready())
        spawn = await r.fx.next("spawn")
        unload = asyncio.create_task(h.unload())
        await h.settled()
        await r.fx.answer(spawn, OSError("gone"), h)
        assert await unload is True and h.phase is Phase.UNLOADED
        await failed_with(first, "was unloaded")

        proc = await r.up(h)  # the next load is not stopped when it becomes ready
        assert h.phase is Phase.READY and r.fx.pending("stop") == 0 and h.process is proc


@pytest.mark.asyncio
async def test_a_load_that_fails_after_the_spawn_stops_the_process_then_fails_with_its_exit_code() -> None:
    """STARTING -> STOPPING_AFTER_FAILURE -> FAILED."""
    async with rig() as r:
        h = r.add("a")
        asked = asyncio.create_task(h.ensure_ready())
        await r.spawn(h)
        await r.fx.answer(await r.fx.next("ready"), LoadError("not ready after 300s"), h)
        assert h.phase is Phase.STOPPING_AFTER_FAILURE and h.status()["value"] == "stopping"
        await r.stop(h, 1)
        await failed_with(asked, "not ready after 300s")
        st = h.status()
        assert h.phase is Phase.FAILED and st["failed"] is True and st["exit_code"] == 1
        assert st["error"] == "not ready after 300s" and st["log_tail"][0].startswith(
            "fake "
        )  # one line; the tail apart


@pytest.mark.asyncio
async def test_unload_while_starting_stops_and_fails_the_waiters() -> None:
    """STARTING -> STOPPING -> UNLOADED."""
    async with rig() as r:
        h = r.add("a")
        asked = asyncio.create_task(h.ensure_ready())
        await r.spawn(h)
        await r.fx.next("ready")
        unload = asyncio.create_task(h.unload())
        await h.settled()
        assert h.phase is Phase.STOPPING
        await r.stop(h)
        assert await unload is True and h.phase is Phase.UNLOADED
        await failed_with(asked, "was unloaded")


@pytest.mark.asyncio
async def test_a_request_while_falling_asleep_wakes_the_same_process_once_the_sleep_is_done() -> None:
    """READY -> FALLING_ASLEEP -> (_SleepDone ok, a waiter) -> WAKING -> READY."""
    async with rig() as r:
        h = r.add("a")
        proc = await r.up(h)
        assert await h.sleep() is True
        assert h.phase is Phase.FALLING_ASLEEP and h.status()["value"] == "sleeping"
        sleep = await r.fx.next("sleep")
        asked = asyncio.create_task(h.ensure_ready())
        await h.settled()
        assert h.phase is Phase.FALLING_ASLEEP  # waits for the sleep before waking
        await r.fx.answer(sleep, True, h)
        assert h.phase is Phase.WAKING and h.status()["progress"]["phase"] == "waking"
        await r.fx.answer(await r.fx.next("wake"), None, h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        assert h.phase is Phase.READY and await asked == h.base_url and h.process is proc
        h.release()
        assert r.fx.pending("spawn") == 0


@pytest.mark.asyncio
async def test_sleeping_then_a_request_wakes_it_and_a_failed_wake_stops_then_fails() -> None:
    """SLEEPING -> WAKING -> READY; SLEEPING -> WAKING -> STOPPING_AFTER_FAILURE -> FAILED."""
    async with rig() as r:
        h = r.add("a")
        await r.up(h)
        await h.sleep()
        await r.fx.answer(await r.fx.next("sleep"), True, h)
        assert h.phase is Phase.SLEEPING
        h.load()  # POST /models/load on a sleeping model wakes it
        await r.fx.answer(await r.fx.next("wake"), None, h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        assert h.phase is Phase.READY and h.num_in_flight == 0

        await h.sleep()
        await r.fx.answer(await r.fx.next("sleep"), True, h)
        asked = asyncio.create_task(h.ensure_ready())
        await r.fx.answer(await r.fx.next("wake"), LoadError("/wake answered 500"), h)
        assert h.phase is Phase.STOPPING_AFTER_FAILURE
        await r.stop(h, 1)
        await failed_with(asked, "wake failed")
        assert h.phase is Phase.FAILED


@pytest.mark.asyncio
async def test_a_sleep_that_fails_or_a_server_that_cannot_sleep_is_stopped_instead() -> None:
    """FALLING_ASLEEP -> (_SleepDone failed) STOPPING; READY -> (idle, cannot sleep) STOPPING."""
    async with rig() as r:
        h = r.add("a")
        await r.up(h)
        await h.sleep()
        await r.fx.answer(await r.fx.next("sleep"), False, h)
        assert h.phase is Phase.STOPPING
        await r.stop(h)
        assert h.phase is Phase.UNLOADED

        await r.up(h, can_sleep=False)  # a `cmd` llama-server: no is_sleeping in /health
        assert await h.sleep() is True and h.phase is Phase.STOPPING and r.fx.pending("sleep") == 0
        await r.stop(h)
        assert h.phase is Phase.UNLOADED


@pytest.mark.asyncio
async def test_idle_tiers_sleep_after_ttl_then_stop_after_unload_after() -> None:
    """READY -> (ttl) FALLING_ASLEEP -> SLEEPING -> (unload-after) STOPPING;
    READY -> (unload-after) STOPPING."""
    async with rig(idle=IdleDefaults(sleep_idle_seconds=0.02, unload_idle_seconds=0.2)) as r:
        h = r.add("a")
        await r.up(h)
        await r.fx.answer(await r.fx.next("sleep"), True, h)  # started by the ttl timer
        assert h.phase is Phase.SLEEPING
        stop = await r.fx.next("stop")  # started by the unload-after timer
        assert h.phase is Phase.STOPPING
        await r.fx.answer(stop, 0)
        await r.quiet()
        assert h.phase is Phase.UNLOADED

        b = r.add("b", ttl=0, unload_after=0.02)  # no sleep tier: stopped straight from READY
        await r.up(b)
        await r.stop(b)
        assert b.phase is Phase.UNLOADED and r.fx.pending("sleep") == 0


@pytest.mark.asyncio
async def test_a_drained_model_is_evicted_when_its_last_request_ends_and_its_new_requests_wait() -> None:
    """READY -> DRAINING -> (evict, nothing in flight) STOPPING -> UNLOADED -> QUEUED (its waiter)."""
    async with rig(Limits(models_max=1)) as r:
        a, b = r.add("a"), r.add("b")
        await r.up(a)
        a.admit()
        for_b = asyncio.create_task(b.ensure_ready())
        await r.until(lambda: a.phase is Phase.DRAINING)
        for_a = asyncio.create_task(a.ensure_ready())  # not admitted while draining: waits
        await a.settled()
        assert not for_a.done() and a.num_in_flight == 1
        a.release()
        await r.until(lambda: a.phase is Phase.STOPPING)
        await r.stop(a)
        assert a.phase is Phase.QUEUED  # its waiter queues behind b
        await r.spawn(b)
        await r.fx.answer(await r.fx.next("ready"), True, b)
        assert await for_b == b.base_url
        for_a.cancel()
        b.release()
        await r.until(lambda: a.phase is Phase.UNLOADED)


@pytest.mark.asyncio
async def test_an_unexpected_exit_fails_the_model_and_the_next_request_loads_it_again() -> None:
    """any with a process -> (_Exited) FAILED -> QUEUED (no backoff after a first failure)."""
    async with rig() as r:
        h = r.add("a")
        proc = await r.up(h)
        base = h.base_url
        proc.exit_with(-9)
        await r.quiet()
        assert h.phase is Phase.FAILED and h.exit_code == -9 and "exited with code -9" in (h.error or "")
        assert base in r.fx.forgotten and h.process is None
        await r.up(h)
        assert h.failures == 1


@pytest.mark.asyncio
async def test_a_reload_restarts_a_changed_model_once_idle_and_its_requests_wait() -> None:
    """READY -> (reconfigure) DRAINING -> (last request done) STOPPING -> UNLOADED -> QUEUED (new preset)."""
    async with rig() as r:
        h = r.add("a")
        await r.up(h)
        h.admit()  # a stream in flight
        new = replace(h.preset, ctx_size=2048)
        h.reconfigure(new)
        await h.settled()
        assert h.phase is Phase.DRAINING and h.status()["value"] == "loaded"
        asked = asyncio.create_task(h.ensure_ready())
        await h.settled()
        assert not asked.done()
        h.release()  # the stream ends
        await r.until(lambda: h.phase is Phase.STOPPING)
        await r.stop(h)
        spawn = await r.fx.next("spawn")
        assert spawn.args[0] == new and h.preset == new
        proc, base, argv = r.fx.new_proc()
        await r.fx.answer(spawn, (proc, base, argv), h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        assert await asked == base
        h.release()

        h.reconfigure(replace(new, aliases=("b",), ttl=5.0))  # router-side keys: no restart
        await h.settled()
        assert h.phase is Phase.READY and h.preset.aliases == ("b",)


@pytest.mark.asyncio
async def test_a_reload_that_removes_a_model_lets_its_requests_finish_then_stops_it_and_ends_its_owner() -> (
    None
):
    """READY -> DRAINING -> STOPPING -> UNLOADED (removed: the owner ends)."""
    async with rig() as r:
        h = r.add("a")
        await r.up(h)
        h.admit()
        h.reconfigure(None)
        await h.settled()
        assert h.phase is Phase.DRAINING and r.fx.pending("stop") == 0
        h.release()
        await r.until(lambda: h.phase is Phase.STOPPING)
        await r.fx.answer(await r.fx.next("stop"), 0)
        assert h._task is not None
        await asyncio.wait_for(h._task, 1)
        assert h.is_removed and h.phase is Phase.UNLOADED


@pytest.mark.asyncio
async def test_memory_charge_is_what_was_measured_and_sleeping_frees_budget() -> None:
    """The budget counts the larger of estimate and measurement while awake, the measurement asleep."""
    async with rig(Limits(models_max=4, ram_budget=300 * M)) as r:
        a, b = r.add("a", memory=200 * M), r.add("b", memory=150 * M)
        proc = await r.up(a)
        proc.samples.put_nowait(TreeMemory(260 * M, 250 * M))
        await r.quiet()
        assert a.charge() == (250 * M, 0) and card(a)["memory"]["ram_bytes"] == 250 * M
        await a.sleep()
        await r.fx.answer(await r.fx.next("sleep"), True, a)
        proc.samples.put_nowait(TreeMemory(40 * M, 20 * M))  # asleep: weights and KV freed
        await r.quiet()
        assert a.charge() == (20 * M, 0)
        await r.up(b)  # 150 + 20 fits 300: a stays asleep, not evicted
        assert a.phase is Phase.SLEEPING and r.fx.pending("stop") == 0


@pytest.mark.asyncio
async def test_the_peak_measured_while_up_is_the_next_loads_estimate() -> None:
    async with rig() as r:
        h = r.add("a")
        assert r.deps.book.estimate(h.preset).source == "unknown"  # a `cmd` server without a model file
        proc = await r.up(h)
        for uss in (50, 120, 80):
            proc.samples.put_nowait(TreeMemory(uss * M + M, uss * M))
        await r.quiet()
        est = r.deps.book.estimate(h.preset)
        assert (est.ram_bytes, est.source) == (120 * M, "measured")
        unload = asyncio.create_task(h.unload())
        await r.stop(h)
        assert await unload is True
        assert card(h)["memory"] == {"estimated_bytes": 120 * M, "ram_bytes": None, "rss_bytes": None,
                                      "vram_bytes": None}


@pytest.mark.asyncio
async def test_a_reload_applies_at_once_when_unloaded_requeues_when_queued_and_restarts_a_load_or_a_sleeper() -> (  # noqa: E501  # the test's name is its description
    None
):
    """UNLOADED|FAILED, QUEUED, STARTING (-> _Ready -> STOPPING), SLEEPING (-> STOPPING) on a reload."""
    async with rig(Limits(models_max=1)) as r:
        a, b = r.add("a"), r.add("b")
        a.reconfigure(replace(a.preset, ctx_size=1))
        await a.settled()
        assert a.phase is Phase.UNLOADED and a.preset.ctx_size == 1

        await r.up(a)
        a.admit()  # a busy: b stays queued
        for_b = asyncio.create_task(b.ensure_ready())
        await r.until(lambda: b.phase is Phase.QUEUED and a.phase is Phase.DRAINING)
        b.reconfigure(replace(b.preset, ctx_size=2))
        await b.settled()
        assert b.phase is Phase.QUEUED and b.preset.ctx_size == 2  # queued again with the new preset
        a.release()
        await r.until(lambda: a.phase is Phase.STOPPING)
        await r.stop(a)
        await r.spawn(b)
        assert b.phase is Phase.STARTING
        b.reconfigure(replace(b.preset, ctx_size=3))
        await r.fx.answer(await r.fx.next("ready"), True, b)
        assert b.phase is Phase.STOPPING and not for_b.done()  # restarted before serving: it waits
        await r.stop(b)
        await r.spawn(b)
        await r.fx.answer(await r.fx.next("ready"), True, b)
        assert await for_b == b.base_url and b.preset.ctx_size == 3
        b.release()

        await b.sleep()
        await r.fx.answer(await r.fx.next("sleep"), True, b)
        b.reconfigure(replace(b.preset, ctx_size=4))
        await b.settled()
        assert b.phase is Phase.STOPPING
        await r.stop(b)
        assert b.phase is Phase.UNLOADED and b.preset.ctx_size == 4


@pytest.mark.asyncio
async def test_a_request_for_a_removed_model_that_looked_it_up_before_the_reload_gets_a_404_not_a_wait() -> (
    None
):
    async with rig() as r:
        h = r.add("a")
        h.reconfigure(None)
        assert h._task is not None
        await asyncio.wait_for(h._task, 1)
        err = await failed_with(asyncio.create_task(h.ensure_ready()), "was removed from the presets")
        assert err.status_code == 404 and await h.unload() is False


@pytest.mark.asyncio
async def test_a_sleeping_model_is_evicted_for_another_when_slots_are_full() -> None:
    """SLEEPING -> (evict) STOPPING -> UNLOADED."""
    async with rig(Limits(models_max=1)) as r:
        a, b = r.add("a"), r.add("b")
        await r.up(a)
        await a.sleep()
        await r.fx.answer(await r.fx.next("sleep"), True, a)
        asked = asyncio.create_task(b.ensure_ready())
        await r.until(lambda: a.phase is Phase.STOPPING)
        await r.stop(a)
        await r.spawn(b)
        await r.fx.answer(await r.fx.next("ready"), True, b)
        await asked
        b.release()
        assert a.phase is Phase.UNLOADED


@pytest.mark.asyncio
async def test_concurrency_limit_queues_requests_past_it_in_arrival_order() -> None:
    async with rig() as r:
        h = r.add("a", concurrency_limit=1)
        await r.up(h)
        assert h.forward_limit == 1  # (a `cmd` server has no bound of its own: the preset's only)
        first = await h.ensure_ready()
        second = asyncio.create_task(h.ensure_ready())
        await r.quiet()
        assert not second.done() and h.num_waiting == 1 and not h.can_admit()
        h.release()
        assert await asyncio.wait_for(second, 1) == first and h.num_in_flight == 1
# ---- our own backends: the forwarding bound and the crash requeue (issue 47; `cmd` has no bound)


def ours(name: str, parallel: int = 1) -> ModelPreset:
    """A model on our own worker (llama_cpp): its slots bound what is forwarded to it."""
    return ModelPreset(name, backend="llama_cpp", model=Path(f"/models/{name}.gguf"), parallel=parallel,
                       memory=1 * M, stop_timeout=1.0)


def add_ours(r: Rig, name: str, parallel: int = 1) -> ModelHandle:
    return r.start(ours(name, parallel))


@pytest.mark.asyncio
async def test_our_worker_gets_slots_plus_margin_and_slot_free_calls_pass_the_full_bound() -> None:
    """Regression (issue 47, item 2): /metrics, /tokenize, token counts... (`occupies_slot=False`)
    waited in the same queue as generations, behind slots + margin."""
    async with rig() as r:
        h = add_ours(r, "ours")
        await r.up(h)
        limit = h.forward_limit
        assert limit == 1 + FORWARD_MARGIN
        for _ in range(limit):
            await asyncio.wait_for(h.ensure_ready(), 1)
        waiting = asyncio.create_task(h.ensure_ready())
        await r.quiet()
        assert not waiting.done() and not h.can_admit()  # the bound is full: it waits here
        for _ in range(3):  # slot-free calls: admitted at once, past the waiting generation
            assert h.can_admit(occupies_slot=False)
            await asyncio.wait_for(h.ensure_ready(occupies_slot=False), 1)
        for _ in range(3):
            h.release(occupies_slot=False)
        await r.quiet()
        assert not waiting.done()  # their end makes no room for a generation
        h.release()
        await asyncio.wait_for(waiting, 1)  # a generation's end does
        for _ in range(limit):
            h.release()
        assert h.num_in_flight == 0


@pytest.mark.asyncio
async def test_a_slot_free_call_waits_for_the_load_then_passes_the_queue() -> None:
    async with rig() as r:
        h = add_ours(r, "ours")
        gens = [asyncio.create_task(h.ensure_ready()) for _ in range(h.forward_limit or 0)]
        extra = asyncio.create_task(h.ensure_ready())
        free = asyncio.create_task(h.ensure_ready(occupies_slot=False))
        await r.spawn(h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        await asyncio.wait_for(asyncio.gather(*gens, free), 1)
        await r.quiet()
        assert not extra.done()  # over the bound: it still waits; the slot-free call did not
        h.release(occupies_slot=False)
        for _ in gens:
            h.release()
        await asyncio.wait_for(extra, 1)
        h.release()


@pytest.mark.asyncio
async def test_a_request_requeued_after_a_crash_of_our_worker_waits_for_the_respawn() -> None:
    """The crash requeue (router.lifecycle.request_queue): a request whose connection was refused
    goes back with `requeued=True`; it waits through the backoff and the respawn instead of a 503."""
    async with rig() as r:
        h = add_ours(r, "ours")
        proc = await r.up(h)
        h.failures = 1  # the next crash is a second one in a row: a backoff of a second
        proc.exit_with(-9)
        await r.quiet()
        assert h.phase is Phase.FAILED and h.retry_at > time.monotonic()
        requeued = asyncio.create_task(h.ensure_ready(requeued=True))
        fresh = asyncio.create_task(h.ensure_ready())
        await r.quiet()
        assert not requeued.done()
        with pytest.raises(APIError, match="keeps crashing"):  # a new request in the backoff: a 503
            await fresh
        await r.spawn(h)  # after the backoff
        await r.fx.answer(await r.fx.next("ready"), True, h)
        assert await asyncio.wait_for(requeued, 1) == h.base_url
        h.release()
