"""Which GPUs a model's worker runs on: pure, no I/O, no logging (beside router/lifecycle/eviction.py).

Inputs are frozen snapshots: each device's room (`Device`: free memory less what others and our
own models hold, less the reserve, within the per-device budget), our models on the devices
(`Resident`) and what the model asks (`Ask`). The decision is one of `Place` (its devices, the
bytes it is charged on each, the tensor split over several, fewer GPU layers for a partial fit,
a warning), `Evict` (idle models to stop first, all on the devices it will then use), `Wait`
(models that are busy now hold the room it needs) or `NoRoom` (never, as things are: the message
names each device's figures and the model's need).

In order (docs/gpu-placement.md has the reasons, beside Ollama's sched.go and GPUStack's):
1. the preset's `devices` as given (with a warning when the estimate says it does not fit);
2. else the best single device where it fits: `spread` (default) the one with the most room,
   `binpack` the one with the least room that still fits;
3. else, for a backend that splits (llama.cpp's layer split), the fewest devices that fit
   together, those with the most room, split in proportion to their room;
4. else evict idle, unpinned models, least recently used first, on the devices that would then
   fit (and on no others), fewest devices and fewest victims first;
5. else wait when busy models hold the room; else, when the preset allows it (`fit = partial`),
   the layers that fit on the device with the most room; else `NoRoom`.

A device is charged `overhead` (its own CUDA context and buffers) plus its part of the rest.
Fits when every device's share is at most its room: no hidden fraction (`--gpu-reserve` is the
one headroom knob).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from router.lifecycle.eviction import format_size

Strategy = Literal["spread", "binpack"]
STRATEGIES: tuple[str, ...] = ("spread", "binpack")


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_bytes: int
    free_bytes: int  # total less what other processes use less what our models are charged
    reserve_bytes: int = 0  # --gpu-reserve
    budget_left: int | None = None  # --vram-budget less our models' charges here; None: no budget

    @property
    def room(self) -> int:
        room = self.free_bytes - self.reserve_bytes
        return room if self.budget_left is None else min(room, self.budget_left)


@dataclass(frozen=True)
class Resident:
    """One of our models with memory on the devices, as the policy sees it."""

    name: str
    shares: tuple[tuple[int, int], ...]  # (device index, bytes charged there)
    is_evictable: bool  # up, idle, unpinned
    is_busy: bool = False  # unpinned but serving, loading or stopping: its room comes back later
    last_used: float = 0.0

    def on(self, index: int) -> int:
        return sum(b for i, b in self.shares if i == index)


@dataclass(frozen=True)
class Ask:
    name: str
    vram_bytes: int  # the whole model's need
    overhead_bytes: int = 0  # the part of it every device it runs on needs
    devices: tuple[int, ...] = ()  # the preset's own `devices`
    can_split: bool = True  # llama.cpp splits layers; torch runs on one device
    strategy: Strategy = "spread"
    n_layers: int = 0  # > 0: `fit = partial` allows fewer GPU layers (the model has this many)


@dataclass(frozen=True)
class Place:
    devices: tuple[int, ...]
    shares: tuple[int, ...]  # bytes charged on each device, in the order of `devices`
    tensor_split: tuple[float, ...] = ()  # over several devices: each one's part of the layers
    n_gpu_layers: int | None = None  # a partial fit: the layers that fit
    warning: str | None = None


@dataclass(frozen=True)
class Evict:
    victims: tuple[str, ...]
    devices: tuple[int, ...]  # where it will then go


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class NoRoom:
    reason: str


Decision = Place | Evict | Wait | NoRoom


def place(devices: Sequence[Device], residents: Sequence[Resident], ask: Ask) -> Decision:
    by_index = {d.index: d for d in devices}
    rooms = {d.index: d.room for d in devices}
    if ask.devices:
        return _explicit(by_index, rooms, ask)
    single = [i for i in sorted(rooms) if rooms[i] >= ask.vram_bytes]
    if single:
        pick = (max(single, key=lambda i: (rooms[i], -i)) if ask.strategy == "spread"
                else min(single, key=lambda i: (rooms[i], i)))
        return Place((pick,), (ask.vram_bytes,))
    if ask.can_split:
        for k in range(2, len(rooms) + 1):
            best = tuple(sorted(sorted(rooms, key=lambda i: (-rooms[i], i))[:k]))
            if (split := _split(best, rooms, ask)) is not None:
                return split
    evictable = [r for r in residents if r.is_evictable]
    if (evict := _eviction(rooms, evictable, ask)) is not None:
        return evict
    held = [r for r in residents if r.is_evictable or r.is_busy]
    if (later := _eviction(rooms, held, ask)) is not None:
        busy = sorted({r.name for r in residents if r.is_busy and any(r.on(i) for i in later.devices)})
        return Wait(f"busy models hold the room on GPU {_indices(later.devices)}: {', '.join(busy)}")
    if ask.n_layers > 0 and (partial := _partial(rooms, ask)) is not None:
        return partial
    return NoRoom(no_room_message(devices, ask))


def _explicit(by_index: dict[int, Device], rooms: dict[int, int], ask: Ask) -> Decision:
    unknown = [i for i in ask.devices if i not in by_index]
    if unknown:
        return NoRoom(f"model {ask.name!r}: devices = {list(ask.devices)} names GPU {_indices(unknown)}, "
                      f"which this box does not have (GPUs: {_indices(sorted(by_index)) or 'none'})")
    chosen = tuple(ask.devices)
    fit = _split(chosen, rooms, ask) if len(chosen) > 1 else (
        Place(chosen, (ask.vram_bytes,)) if rooms[chosen[0]] >= ask.vram_bytes else None)
    if fit is not None:
        return fit
    spread = _shares(chosen, rooms, ask)
    need = ", ".join(f"GPU {i}: ~{format_size(s)} of {format_size(max(0, rooms[i]))} room"
                     for i, s in zip(chosen, spread[0], strict=True))
    return Place(chosen, spread[0], spread[1], warning=(
        f"model {ask.name!r}: devices = {list(chosen)} as the preset says, though the estimate says it "
        f"does not fit there ({need})"))


def _shares(devices: tuple[int, ...], rooms: dict[int, int],
            ask: Ask) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Each device's charge and its part of the layers, in proportion to its room past the overhead
    (equal parts where none has any)."""
    if len(devices) == 1:
        return (ask.vram_bytes,), ()
    weights = [max(0, rooms[i] - ask.overhead_bytes) for i in devices]
    if not sum(weights):
        weights = [1] * len(devices)
    rest = max(0, ask.vram_bytes - ask.overhead_bytes)
    total = sum(weights)
    shares = tuple(ask.overhead_bytes + rest * w // total for w in weights)
    return shares, tuple(round(w / total, 3) for w in weights)


def _split(devices: tuple[int, ...], rooms: dict[int, int], ask: Ask) -> Place | None:
    if not ask.can_split and len(devices) > 1:
        return None
    shares, split = _shares(devices, rooms, ask)
    if all(s <= rooms[i] for i, s in zip(devices, shares, strict=True)):
        return Place(devices, shares, split)
    return None


def _eviction(rooms: dict[int, int], candidates: Sequence[Resident], ask: Ask) -> Evict | None:
    """The fewest devices, then the fewest victims (least recently used first), that make it fit."""
    best: tuple[tuple[int, int, float], Evict] | None = None
    sizes = range(1, (len(rooms) if ask.can_split else 1) + 1)
    for k in sizes:
        for chosen in itertools.combinations(sorted(rooms), k):
            on_them = sorted((r for r in candidates if any(r.on(i) for i in chosen)),
                             key=lambda r: (r.last_used, r.name))
            if not on_them or _split(chosen, _freed(rooms, on_them), ask) is None:
                continue  # not even all of them would make room here
            after = dict(rooms)
            for n, victim in enumerate(on_them, 1):
                for i, b in victim.shares:
                    if i in after:
                        after[i] += b
                if _split(chosen, after, ask) is not None:
                    key = (k, n, sum(v.last_used for v in on_them[:n]))
                    if best is None or key < best[0]:
                        best = key, Evict(tuple(v.name for v in on_them[:n]), chosen)
                    break
        if best is not None:
            return best[1]
    return None


def _freed(rooms: dict[int, int], victims: Sequence[Resident]) -> dict[int, int]:
    after = dict(rooms)
    for victim in victims:
        for i, b in victim.shares:
            if i in after:
                after[i] += b
    return after


def _partial(rooms: dict[int, int], ask: Ask) -> Place | None:
    """`fit = partial`: the layers that fit on the device with the most room (the rest on the CPU)."""
    index = max(sorted(rooms), key=lambda i: rooms[i])
    per_layer = max(1, ask.vram_bytes - ask.overhead_bytes) / ask.n_layers
    layers = min(ask.n_layers - 1, math.floor((rooms[index] - ask.overhead_bytes) / per_layer))
    if layers < 1:
        return None
    share = ask.overhead_bytes + int(layers * per_layer)
    return Place((index,), (share,), n_gpu_layers=layers,
                 warning=f"model {ask.name!r}: {layers} of {ask.n_layers} layers on GPU {index} "
                         "(fit = partial), the rest on the CPU")


def no_room_message(devices: Sequence[Device], ask: Ask) -> str:
    each = "; ".join(
        f"GPU {d.index} ({d.name}): {format_size(max(0, d.free_bytes))} free of {format_size(d.total_bytes)}"
        + (f", {format_size(d.reserve_bytes)} reserved" if d.reserve_bytes else "")
        + (f", {format_size(max(0, d.budget_left))} left of --vram-budget"
           if d.budget_left is not None else "")
        for d in devices)
    together = sum(max(0, d.room) for d in devices)
    is_larger = ask.vram_bytes > sum(d.total_bytes for d in devices)
    larger = " (more than all the GPUs together)" if is_larger else ""
    how = "on one GPU (its backend does not split)" if not ask.can_split else "on the GPUs together"
    return (f"model {ask.name!r} needs ~{format_size(ask.vram_bytes)} of GPU memory{larger} and there is no "
            f"room {how} even after evicting every idle model: {each}; room in all "
            f"{format_size(together)} (--gpu-reserve, --vram-budget, `vram` and `fit = partial` in the "
            "preset)")


def _indices(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices)
