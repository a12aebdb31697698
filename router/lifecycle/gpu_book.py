"""The memory book per GPU: what each of our models is charged on each device, and each device's
room as the placement policy (router.lifecycle.gpu_placement) sees it. Bookkeeping only: no I/O.

- A model placed on devices is charged its share of the VRAM estimate on each (the policy's
  `Place.shares`: llama.cpp's split in proportion to the tensor split, torch's whole on one).
  This is also the reservation: a load booked here is seen by the next placement before its
  worker has allocated anything, so two loads that run at once never count the same free memory.
- Once it runs (`is_up`), what its processes were measured to use on each device replaces the
  estimate; while it loads, the larger of the two counts.
- A device's free memory = total less what processes that are not ours use (the driver's "used"
  less what it reports for our processes) less what our models are charged. `--gpu-reserve`
  (SIZE or N%) is kept free on each device, and `--vram-budget` (0: none) caps our charges on each.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from router.lifecycle.eviction import Occupancy, is_evictable
from router.lifecycle.gpu_placement import Device, Place, Resident
from router.lifecycle.gpus import Inventory

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class Reserve:
    """`--gpu-reserve`: bytes, or a share of each device's total."""

    bytes: int = 0
    fraction: float = 0.0

    def of(self, total: int) -> int:
        return self.bytes + int(total * self.fraction)

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%" if self.fraction else str(self.bytes)


def parse_reserve(raw: str) -> Reserve:
    """`2GiB`, `512M`, `0`, `10%` -> a Reserve; ValueError otherwise."""
    from router.presets import parse_size

    if (m := _PERCENT.match(raw)) is not None:
        value = float(m.group(1))
        if value >= 100:
            raise ValueError("a percentage below 100")
        return Reserve(fraction=value / 100)
    try:
        return Reserve(bytes=parse_size(raw))
    except ValueError:
        raise ValueError("expected a size like 1GiB or 512M, or a percentage like 5%") from None


@dataclass
class DeviceBook:
    reserve: Reserve = field(default_factory=Reserve)
    budget: int = 0  # --vram-budget per device; 0: none
    placed: dict[str, Place] = field(default_factory=dict)
    measured: dict[str, dict[int, int]] = field(default_factory=dict)  # model -> device -> bytes

    def book(self, name: str, where: Place) -> None:
        self.placed[name] = where
        self.measured.pop(name, None)

    def measure(self, name: str, by_device: dict[int, int]) -> None:
        """What its processes use on each device. A device the driver reports nothing for (no
        per-process accounting, as in some containers) keeps the estimate."""
        if name in self.placed:
            self.measured[name] = {i: b for i, b in by_device.items() if b > 0}

    def forget(self, name: str) -> None:
        self.placed.pop(name, None)
        self.measured.pop(name, None)

    def charge(self, name: str, is_up: bool) -> dict[int, int]:
        """Bytes charged to `name` on each of its devices (see the module docstring)."""
        where = self.placed.get(name)
        if where is None:
            return {}
        measured = self.measured.get(name)
        out: dict[int, int] = {}
        for index, share in zip(where.devices, where.shares, strict=True):
            seen = measured.get(index) if measured is not None else None
            out[index] = seen if is_up and seen is not None else max(share, seen or 0)
        return out

    def devices(self, inv: Inventory, ours: dict[int, int], up: Collection[str]) -> list[Device]:
        """Each device's figures for the policy. `ours`: bytes the driver reports for our
        processes; `up`: the models that run (loaded or asleep)."""
        charged: dict[int, int] = {}
        for name in self.placed:
            for index, b in self.charge(name, name in up).items():
                charged[index] = charged.get(index, 0) + b
        out = []
        for g in inv.gpus:
            others = max(0, g.used_bytes - ours.get(g.index, 0))
            mine = charged.get(g.index, 0)
            out.append(Device(g.index, g.name, g.total_bytes, g.total_bytes - others - mine,
                              self.reserve.of(g.total_bytes), self.budget - mine if self.budget else None))
        return out

    def residents(self, occupancies: Iterable[Occupancy], asking: str = "") -> list[Resident]:
        """Our models on the devices as the policy sees them; `asking` (the model being placed) left
        out. A booked model without a slot yet (placed, waiting for `--models-max`) is loading."""
        out = []
        seen = {asking}
        for o in occupancies:
            seen.add(o.name)
            shares = tuple(sorted(self.charge(o.name, o.is_up).items()))
            if shares:
                # busy: serving, loading or stopping: its room comes back later (a pinned one's never)
                out.append(Resident(o.name, shares, is_evictable(o), not o.is_pinned and not is_evictable(o),
                                    o.last_used))
        for name in self.placed:
            if name not in seen:
                out.append(Resident(name, tuple(sorted(self.charge(name, False).items())), False, True))
        return out
