"""GPU placement wired into the lifecycle, on a box with NVIDIA GPUs (`GpuPlacement`, the pool's
`Placement`): admission that picks each model's devices, effects that start its worker on them.

- Admission (`GpuAdmission`, around the pool's `Slots`): before a model asks `Slots` for a slot
  (`--models-max`, `--ram-budget`), one placement at a time reads the devices (off the event
  loop), asks the pure policy (router.lifecycle.gpu_placement) and acts: book the devices in the
  per-device book (router.lifecycle.gpu_book: the reservation the next placement sees), evict
  the idle models it names and decide again once they are gone, wait for a change (a release, a
  request ending, every RECHECK_S: other programs free memory too), or refuse the load with the
  figures (`SlotsFull`: a 503, no worker spawned). `--vram-budget` and `--gpu-reserve` apply per
  device there, so `Slots` keeps no VRAM budget of its own.
- Effects (`GpuEffects`, around the local ones): the worker gets CUDA_VISIBLE_DEVICES (with
  CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA's numbers are nvidia-smi's), and llama.cpp gets
  `--split-mode none` on one device or `--tensor-split` over several (torch takes `cuda:0` of
  what it sees); what the preset sets itself (`env`, `split-mode`, `tensor-split`, `main-gpu`) is
  kept. Memory samples also measure the worker's use on each device (the book's figure once it
  runs). An out-of-memory at load is recorded: the next placement evicts the idle models on that
  device and tries it once more; a second one refuses the load with the device's figures.
- A model the estimate puts wholly on the CPU (`n-gpu-layers = 0`, a voice, a `cmd` server
  without `vram` or `devices`) is not placed: its worker starts as it would without GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psutil

from router import worker_flags
from router.lifecycle import swap
from router.lifecycle.admission import Admission, Occupant, Slots, SlotsFull
from router.lifecycle.effects import Effects, LayeredEffects, Process, WorkerEffects
from router.lifecycle.estimate import GPU_CONTEXT_BYTES, cached_shape
from router.lifecycle.eviction import Need, format_size
from router.lifecycle.gpu_book import DeviceBook
from router.lifecycle.gpu_placement import Ask, Evict, NoRoom, Place, Strategy, Wait, place
from router.lifecycle.gpus import Inventory, InventorySource
from router.lifecycle.load_failure import OUT_OF_MEMORY
from router.lifecycle.memory import TreeMemory
from router.lifecycle.process import LoadError, Watched
from router.presets import ModelPreset

log = logging.getLogger("omni.router.gpu")
RECHECK_S = 2.0  # a load waiting for room reads the devices again this often
REFRESH_S = 5.0  # the figures on /metrics and the cards are at most this old
EVICT_WAIT_S = 60.0  # a victim that takes longer than this to stop: decide again anyway


@dataclass(frozen=True)
class OutOfMemory:
    devices: tuple[int, ...]
    count: int  # loads in a row that ran out of memory there
    figures: str


def ask_for(preset: ModelPreset, vram_needed: int, strategy: Strategy) -> Ask | None:
    """What the policy is asked for this preset; None: it runs on the CPU (nothing to place).
    Blocking once per file version (the model's layer count for `fit = partial`)."""
    vram = preset.vram if preset.vram is not None else vram_needed
    devices = preset.devices or _devices_in_env(preset)
    if not vram and not devices:
        return None
    backend = preset.resolved_backend
    split_mode = preset.worker_arg("split-mode")
    n_layers = 0
    if preset.fit == "partial" and backend == "llama_cpp" and preset.model is not None:
        shape = cached_shape(preset.model, is_gguf=True)
        n_layers = shape.n_layers if shape is not None else 0
    return Ask(preset.name, vram, min(vram, GPU_CONTEXT_BYTES.get(backend, GPU_CONTEXT_BYTES["llama_cpp"])),
               devices, can_split=backend == "llama_cpp" and split_mode != "none", strategy=strategy,
               n_layers=n_layers)


def _devices_in_env(preset: ModelPreset) -> tuple[int, ...]:
    """The preset's own CUDA_VISIBLE_DEVICES, when it lists indices: its devices, as given."""
    raw = dict(preset.env).get("CUDA_VISIBLE_DEVICES")
    with contextlib.suppress(ValueError):
        return tuple(int(v) for v in (raw or "").split(",") if v.strip())
    return ()


def on_devices(preset: ModelPreset, where: Place) -> ModelPreset:
    """The preset its worker is started with on `where` (see the module docstring)."""
    env = dict(preset.env)
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in where.devices))
    args = dict(preset.worker_args)
    if preset.resolved_backend == "llama_cpp" and preset.backend != "cmd":
        if len(where.devices) == 1:
            args.setdefault("split-mode", "none")
        elif where.tensor_split and "tensor-split" not in args and args.get("split-mode") != "none":
            args["tensor-split"] = ",".join(f"{x:g}" for x in where.tensor_split)
    layers = where.n_gpu_layers if where.n_gpu_layers is not None else preset.n_gpu_layers
    return replace(preset, env=tuple(sorted(env.items())), worker_args=tuple(sorted(args.items())),
                   n_gpu_layers=layers)


def our_pids() -> set[int]:
    """The router and every process under it (our workers and their children)."""
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in me.children(recursive=True))
    return pids


def tree_pids(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return {pid}


class GpuPlacement:
    """The pool's `Placement` on a box with GPUs; also what the cards, /metrics and the banner show."""

    def __init__(self, source: InventorySource, inventory: Inventory, book: DeviceBook,
                 strategy: Strategy = "spread") -> None:
        self.source = source
        self.inventory = inventory  # the latest read
        self.book = book
        self.strategy: Strategy = strategy
        self.ooms: dict[str, OutOfMemory] = {}
        self.names: dict[int, str] = {}  # worker pid -> model

    def wire(self, local: WorkerEffects | Effects, slots: Slots) -> tuple[Effects, Admission]:
        return GpuEffects(local, self), GpuAdmission(slots, self)

    async def close(self) -> None:
        pass

    def read(self) -> tuple[Inventory | None, dict[int, int]]:
        """Blocking: the devices now, and what our processes use on each."""
        inv = self.source()
        if inv is None:
            return None, {}
        self.inventory = inv
        return inv, inv.use_of(our_pids())

    def use_of_tree(self, pid: int) -> dict[int, int] | None:
        """Blocking: what the worker `pid` and its children use on each device."""
        inv = self.source()
        if inv is None:
            return None
        self.inventory = inv
        return inv.use_of(tree_pids(pid))

    def devices(self, name: str) -> list[dict[str, Any]]:
        """Where the model runs (or is booked to), for its card: [{index, uuid, name, vram_bytes}]."""
        where = self.book.placed.get(name)
        if where is None:
            return []
        gpus = {g.index: g for g in self.inventory.gpus}
        measured = self.book.measured.get(name)  # once it runs; else what it was booked
        out = []
        for index, share in zip(where.devices, where.shares, strict=True):
            g = gpus.get(index)
            out.append({"index": index, "uuid": g.uuid if g else None, "name": g.name if g else None,
                        "vram_bytes": (measured or {}).get(index) or share})
        return out

    def figures(self) -> tuple[Inventory, dict[str, dict[int, int]]]:
        """The latest inventory, and what each model is charged on each device (/metrics)."""
        return self.inventory, {n: self.book.charge(n, n in self.book.measured) for n in self.book.placed}


class GpuAdmission:
    """Devices first, then a slot from the pool's `Slots` (see the module docstring)."""

    def __init__(self, slots: Slots, gpus: GpuPlacement) -> None:
        self.slots = slots
        self.gpus = gpus
        self._lock = asyncio.Lock()  # one placement decision at a time: the book is the reservation
        self._changed = asyncio.Event()
        self._placing: dict[str, Occupant] = {}  # between acquire and the grant

    @property
    def queued(self) -> list[str]:
        return [*self.slots.queued, *(n for n in self._placing if n not in self.slots.queued)]

    def poke(self) -> None:
        self.slots.poke()
        self._changed.set()

    def admits_before(self, name: str) -> float | None:
        return self.slots.admits_before(name)

    def release(self, occupant: Occupant) -> None:
        self.slots.release(occupant)
        if occupant.name not in self._placing:  # (a queued model's progress passes here too)
            self.gpus.book.forget(occupant.name)
        self._changed.set()

    async def run(self) -> None:
        refresh = asyncio.create_task(self._refresh(), name="gpu-inventory")
        try:
            await self.slots.run()
        finally:
            refresh.cancel()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            with contextlib.suppress(Exception):  # a failed read keeps the last figures
                await asyncio.to_thread(self.gpus.read)

    async def acquire(self, occupant: Occupant, need: Need) -> None:
        name = occupant.name
        self._placing[name] = occupant
        try:
            await self._place(occupant, need)
            await self.slots.acquire(occupant, Need(need.ram_bytes, 0))  # VRAM: per device, above
        except BaseException:
            self.gpus.book.forget(name)
            raise
        finally:
            self._placing.pop(name, None)

    async def _place(self, occupant: Occupant, need: Need) -> None:
        name, book = occupant.name, self.gpus.book
        while True:
            self._changed.clear()
            async with self._lock:
                # what its worker runs (an `hf-repo` model's files once pulled: ModelHandle.run_preset)
                preset: ModelPreset = getattr(occupant, "run_preset", occupant.preset)
                ask = await asyncio.to_thread(ask_for, preset, need.vram_bytes, self.gpus.strategy)
                if ask is None:
                    return  # on the CPU
                inv, ours = await asyncio.to_thread(self.gpus.read)
                if inv is None:
                    log.warning("model %s: the GPUs cannot be read now: started without a placement", name)
                    return
                holders = [h for h in self.slots.holders if h is not occupant]
                # a persistent group's members count as pinned for a model of another group (swap.py)
                occupancies = [replace(o, is_pinned=True) if swap.is_kept_for(o, preset.group) else o
                               for o in (h.occupancy() for h in holders)]
                devices = book.devices(inv, ours, {o.name for o in occupancies if o.is_up})
                residents = book.residents(occupancies, asking=name)
                oom = self.gpus.ooms.get(name)
                if oom is not None:
                    if oom.count >= 2:
                        del self.gpus.ooms[name]
                        gpu = _list(oom.devices)
                        raise SlotsFull(f"out of memory at load on GPU {gpu} twice (the second time after "
                                        f"evicting the idle models there): {oom.figures}")
                    victims = tuple(r.name for r in residents if r.is_evictable
                                    and any(r.on(i) for i in oom.devices))
                    decision: Place | Evict | Wait | NoRoom = (
                        Evict(victims, oom.devices) if victims else place(devices, residents,
                                                                          replace(ask, devices=oom.devices)))
                else:  # (in a thread: on 8 GPUs the eviction search takes tens of ms)
                    decision = await asyncio.to_thread(place, devices, residents, ask)
                match decision:
                    case Place():
                        book.book(name, decision)
                        if decision.warning:
                            log.warning("%s", decision.warning)
                        log.info("model %s: on GPU %s (%s)%s", name, _list(decision.devices),
                                 ", ".join(format_size(s) for s in decision.shares),
                                 f", tensor split {decision.tensor_split}" if decision.tensor_split else "")
                        return
                    case NoRoom(reason):
                        raise SlotsFull(reason)
                    case Evict(victims, on):
                        log.info("model %s: evicting %s on GPU %s to make room", name, ", ".join(victims),
                                 _list(on))
                        by_name = {h.name: h for h in holders}
                        stopping = [v for v in victims if v in by_name and await by_name[v].evict()]
                        if stopping:
                            await self._gone(stopping)
                            continue
                    case Wait(reason):
                        log.debug("model %s: waits for GPU memory: %s", name, reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RECHECK_S)

    async def _gone(self, victims: Sequence[str]) -> None:
        """Wait (bounded) until the evicted models have left the book: their workers are gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVICT_WAIT_S
        while any(v in self.gpus.book.placed for v in victims) and loop.time() < deadline:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RECHECK_S)


class GpuEffects(LayeredEffects):
    """The local effects, with the worker started on its devices (see the module docstring)."""

    def __init__(self, local: Effects, gpus: GpuPlacement) -> None:
        super().__init__(local)
        self.gpus = gpus

    async def spawn(self, preset: ModelPreset) -> tuple[Process, str, list[str]]:
        where = self.gpus.book.placed.get(preset.name)
        started = preset if where is None else on_devices(preset, where)
        if started.worker_args:  # the worker's flags are read once (a subprocess): not on the loop
            await asyncio.to_thread(worker_flags.lookup, started.worker_args[0][0])
        proc, base_url, argv = await self.local.spawn(started)
        self.gpus.names[proc.pid] = preset.name
        if where is not None:
            env = dict(started.env)
            log.info("model %s: worker pid %d with CUDA_VISIBLE_DEVICES=%s", preset.name, proc.pid,
                     env.get("CUDA_VISIBLE_DEVICES"))
        return proc, base_url, argv

    async def wait_ready(self, proc: Process, base_url: str, timeout: float,
                         on_progress: Callable[[dict[str, Any]], None]) -> bool:
        name = self.gpus.names.get(proc.pid, "")
        try:
            ready = await self.local.wait_ready(proc, base_url, timeout, on_progress)
        except LoadError as e:
            where = self.gpus.book.placed.get(name)
            if where is not None and isinstance(proc, Watched) and proc.returncode is not None:
                with contextlib.suppress(TimeoutError):  # its last lines: why it ended
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 3.0)
            if where is None or not any(OUT_OF_MEMORY.search(line) for line in proc.log_tail):
                raise
            figures = await asyncio.to_thread(self._figures, where)
            before = self.gpus.ooms.get(name)
            self.gpus.ooms[name] = OutOfMemory(where.devices, (before.count if before else 0) + 1, figures)
            raise LoadError(f"out of memory at load on GPU {_list(where.devices)}: {figures}") from e
        self.gpus.ooms.pop(name, None)
        return ready

    def _figures(self, where: Place) -> str:
        """Blocking: each of its devices' memory now, and what the model was to use there."""
        inv, _ = self.gpus.read()
        gpus = {g.index: g for g in (inv or self.gpus.inventory).gpus}
        parts = []
        for index, share in zip(where.devices, where.shares, strict=True):
            g = gpus.get(index)
            if g is not None:
                parts.append(f"GPU {index} ({g.name}): {format_size(g.total_bytes - g.used_bytes)} free of "
                             f"{format_size(g.total_bytes)}, the model needed ~{format_size(share)} there")
        return "; ".join(parts)

    async def samples(self, proc: Process, interval: Callable[[], float]) -> AsyncIterator[TreeMemory]:
        """The local samples; for a placed model, also its use on each device (into the book)."""
        async for memory in self.local.samples(proc, interval):
            name = self.gpus.names.get(proc.pid)
            if name is not None and name in self.gpus.book.placed:
                with contextlib.suppress(Exception):  # a failed read: the estimate stays
                    used = await asyncio.to_thread(self.gpus.use_of_tree, proc.pid)
                    if used is not None and self.gpus.names.get(proc.pid) == name:
                        self.gpus.book.measure(name, used)
            yield memory
        self.gpus.names.pop(proc.pid, None)


def _list(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices)
