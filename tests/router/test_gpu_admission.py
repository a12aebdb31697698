"""GPU placement with real model owners, in process: `GpuAdmission` and `GpuEffects`
(router.lifecycle.gpu_admission) around `Slots` and `FakeEffects`, on a simulated inventory (an
injected source the test changes). Each effect is a call the test answers (tests/router/fake_effects.py):
no sleeps, no GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from router.events import EventBus
from router.lifecycle.admission import Slots
from router.lifecycle.estimate import MemoryBook
from router.lifecycle.eviction import Limits
from router.lifecycle.gpu_admission import GpuAdmission, GpuPlacement
from router.lifecycle.gpu_book import DeviceBook, Reserve
from router.lifecycle.gpus import Gpu, Inventory
from router.lifecycle.model import ModelDeps, ModelHandle
from router.lifecycle.process import LoadError
from router.lifecycle.request_queue import Waiting
from router.lifecycle.state import Phase
from router.presets import ModelPreset
from tests.router.fake_effects import FakeEffects, OwnerRig
from worker.protocol.errors import APIError

G = 1 << 30


def gpus(*free_gib: float, total_gib: float = 24) -> Inventory:
    return Inventory(tuple(Gpu(i, f"GPU-{i}", f"Card {i}", int(total_gib * G), int((total_gib - f) * G))
                           for i, f in enumerate(free_gib)), (), "test")


@dataclass(kw_only=True)
class GpuRig(OwnerRig):
    admission: GpuAdmission
    gpus: GpuPlacement
    inventory: list[Inventory]

    def add(self, name: str, vram_gib: float, **kw: Any) -> ModelHandle:
        return self.start(ModelPreset(name, backend="llama_cpp", model=Path(f"/nowhere/{name}.gguf"),
                                      vram=int(vram_gib * G), stop_timeout=1.0, **kw))

    def env_of_spawn(self, call_preset: ModelPreset) -> str | None:
        return dict(call_preset.env).get("CUDA_VISIBLE_DEVICES")


@contextlib.asynccontextmanager
async def rig(*free_gib: float, reserve: Reserve | None = None) -> AsyncIterator[GpuRig]:
    fx = FakeEffects()
    slots = Slots(Limits(models_max=8))
    inventory = [gpus(*free_gib)]
    placement = GpuPlacement(lambda: inventory[0], inventory[0], DeviceBook(reserve or Reserve()))
    effects, admission = placement.wire(fx, slots)
    assert isinstance(admission, GpuAdmission)
    deps = ModelDeps(admission, EventBus(), effects, MemoryBook(has_gpu=True), Waiting(16))
    r = GpuRig(fx, slots, deps, admission=admission, gpus=placement, inventory=inventory)
    task = asyncio.create_task(admission.run())
    try:
        yield r
    finally:
        task.cancel()
        for h in r.handles:
            h.cancel()


@pytest.mark.asyncio
async def test_one_device_that_fits_spread_and_the_worker_gets_it() -> None:
    async with rig(6, 10) as r:
        h = r.add("a", 4)
        asked = asyncio.create_task(h.ensure_ready())
        call = await r.fx.next("spawn")
        started: ModelPreset = call.args[0]
        assert dict(started.env)["CUDA_VISIBLE_DEVICES"] == "1" and started.worker_arg("split-mode") == "none"
        await r.fx.answer(call, r.fx.new_proc(), h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        await asked
        assert r.gpus.devices("a") == [{"index": 1, "uuid": "GPU-1", "name": "Card 1", "vram_bytes": 4 * G}]


@pytest.mark.asyncio
async def test_two_concurrent_loads_do_not_count_the_same_free_memory() -> None:
    # Each GPU has room for one of them: the second placement sees the first one's booking.
    async with rig(7, 7) as r:
        a, b = r.add("a", 5), r.add("b", 5)
        asked = [asyncio.create_task(a.ensure_ready()), asyncio.create_task(b.ensure_ready())]
        first, second = await r.fx.next("spawn"), await r.fx.next("spawn")
        devices = {r.env_of_spawn(first.args[0]), r.env_of_spawn(second.args[0])}
        assert devices == {"0", "1"}
        for call in (first, second):
            await r.fx.answer(call, r.fx.new_proc(), *r.handles)
        for _ in range(2):
            await r.fx.answer(await r.fx.next("ready"), True, *r.handles)
        await asyncio.gather(*asked)


@pytest.mark.asyncio
async def test_a_split_over_two_with_the_tensor_split_in_proportion_to_free_memory() -> None:
    async with rig(9, 3) as r:
        h = r.add("big", 10)
        asked = asyncio.create_task(h.ensure_ready())
        call = await r.fx.next("spawn")
        started: ModelPreset = call.args[0]
        assert dict(started.env)["CUDA_VISIBLE_DEVICES"] == "0,1"
        # room past the 512 MiB each device's context needs: 8.5 : 2.5
        assert started.worker_arg("tensor-split") == "0.773,0.227"
        await r.fx.answer(call, r.fx.new_proc(), h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        await asked
        assert [d["index"] for d in r.gpus.devices("big")] == [0, 1]


@pytest.mark.asyncio
async def test_eviction_on_the_device_that_needs_room_and_no_other() -> None:
    async with rig(8, 7) as r:
        old, other = r.add("old", 6), r.add("other", 6)
        await r.up(old)  # on GPU 0 (most free)
        await r.up(other)  # on GPU 1 (GPU 0 now has 2 GiB)
        assert [d["index"] for d in r.gpus.devices("old")] == [0]
        assert [d["index"] for d in r.gpus.devices("other")] == [1]
        old.last_used, other.last_used = 10.0, 5.0  # `other` is the least recently used of all...
        # ... but 7.5 GiB on one device (torch) fits only GPU 0 once `old` is gone (GPU 1 would have 7)
        torch = ModelPreset("t", backend="torch", model=Path("/nowhere/t"), vram=int(7.5 * G),
                            stop_timeout=1.0)
        t = r.start(torch)
        asked = asyncio.create_task(t.ensure_ready())
        stop = await r.fx.next("stop")
        assert stop.args[0] is old.process and other.phase is Phase.READY
        await r.fx.answer(stop, 0, *r.handles)
        call = await r.fx.next("spawn")
        assert r.env_of_spawn(call.args[0]) == "0" and call.args[0].worker_arg("split-mode") is None
        await r.fx.answer(call, r.fx.new_proc(), *r.handles)
        await r.fx.answer(await r.fx.next("ready"), True, *r.handles)
        await asked
        assert old.phase is Phase.UNLOADED and other.phase is Phase.READY and r.fx.pending("stop") == 0


@pytest.mark.asyncio
async def test_explicit_devices_are_used_as_given() -> None:
    async with rig(20, 2) as r:
        h = r.add("pinned-to-1", 4, devices=(1,))  # does not fit GPU 1: used anyway, with a warning
        asked = asyncio.create_task(h.ensure_ready())
        call = await r.fx.next("spawn")
        assert r.env_of_spawn(call.args[0]) == "1"
        await r.fx.answer(call, r.fx.new_proc(), h)
        await r.fx.answer(await r.fx.next("ready"), True, h)
        await asked


@pytest.mark.asyncio
async def test_a_model_larger_than_all_devices_together_is_refused_with_figures_and_no_spawn() -> None:
    async with rig(20, 18, reserve=Reserve(bytes=G)) as r:
        h = r.add("huge", 60)
        with pytest.raises(APIError, match=r"needs ~60.0 GiB.*more than all the GPUs together.*"
                                           r"GPU 0 \(Card 0\): 20.0 GiB free of 24.0 GiB") as e:
            await h.ensure_ready()
        assert e.value.status_code == 503
        await r.quiet()
        assert h.phase is Phase.UNLOADED and r.fx.pending("spawn") == 0 and not r.fx.procs


@pytest.mark.asyncio
async def test_an_out_of_memory_at_load_evicts_on_that_device_then_retries_once_then_fails() -> None:
    async with rig(10, 3) as r:
        idle, elsewhere = r.add("idle", 3), r.add("elsewhere", 2)
        await r.up(idle)  # GPU 0
        await r.up(elsewhere)  # GPU 0 still has most room (7 vs 3)
        r.inventory[0] = gpus(5, 3)  # ... and so on; the estimate below still fits GPU 0
        h = r.add("m", 4, devices=(0,))
        asked = asyncio.create_task(h.ensure_ready())
        proc = await r.spawn(h)
        proc.log_tail.append("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device "
                             "0: cudaMalloc failed: out of memory")
        await r.fx.answer(await r.fx.next("ready"), LoadError("exited with code 1 while loading"), h)
        await r.fx.answer(await r.fx.next("stop"), 1, *r.handles)  # its own stop after the failed load
        # retried once: first the idle models on GPU 0 are evicted
        stops = [await r.fx.next("stop") for _ in range(2)]
        assert {s.args[0] for s in stops} == {idle.process, elsewhere.process}
        for s in stops:
            await r.fx.answer(s, 0, *r.handles)
        proc = await r.spawn(h)
        proc.log_tail.append("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        await r.fx.answer(await r.fx.next("ready"), LoadError("exited with code 1 while loading"), h)
        await r.fx.answer(await r.fx.next("stop"), 1, *r.handles)
        with pytest.raises(APIError, match=r"out of memory at load on GPU 0 twice.*GPU 0 \(Card 0\): 5.0 GiB "
                                           r"free of 24.0 GiB, the model needed ~4.0 GiB there"):
            await asked
        await r.quiet()
        assert r.fx.pending("spawn") == 0 and len(r.fx.procs) == 4
