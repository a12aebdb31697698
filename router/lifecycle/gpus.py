"""The box's NVIDIA GPUs, read live: each device's index, UUID, name, total and used memory, and
what each process uses on each device. A leaf: the only module that asks the driver.

NVML first (`pynvml`, from the `nvidia-ml-py` package: no subprocess per read), else
`nvidia-smi --query-gpu=... --format=csv,noheader,nounits` and `--query-compute-apps=...`: the
fallback serves a box without the binding, and lets tests put a stand-in `nvidia-smi` first on
PATH. No GPU (neither answers, or no device): `read_inventory()` is None and nothing of the GPU
placement is used.

The router's own `CUDA_VISIBLE_DEVICES`, when set, limits the devices it places on (by index or
UUID, as CUDA reads it). Indices are nvidia-smi's (PCI bus order): a worker gets
`CUDA_DEVICE_ORDER=PCI_BUS_ID` with them, so CUDA numbers the devices the same way.

Blocking (a subprocess, or driver calls): call it in a thread.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("omni.router.gpus")
MIB = 1 << 20
SMI_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class GpuProcess:
    """A process's memory on one device (a process on two devices is two of these)."""

    pid: int
    uuid: str
    used_bytes: int


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    processes: tuple[GpuProcess, ...]
    source: str  # "nvml" or "nvidia-smi"

    def by_uuid(self) -> dict[str, Gpu]:
        return {g.uuid: g for g in self.gpus}

    def use_of(self, pids: set[int]) -> dict[int, int]:
        """Bytes these pids use, by device index."""
        index = {g.uuid: g.index for g in self.gpus}
        out: dict[int, int] = {}
        for p in self.processes:
            if p.pid in pids and p.uuid in index:
                out[index[p.uuid]] = out.get(index[p.uuid], 0) + p.used_bytes
        return out


InventorySource = Callable[[], "Inventory | None"]


@functools.cache
def nvml() -> Any | None:
    """The initialized `pynvml` module, or None (not installed, or no driver)."""
    try:
        module = importlib.import_module("pynvml")
        module.nvmlInit()
        return module
    except Exception:  # ImportError, or NVMLError without a driver
        return None


def nvidia_smi(*query: str) -> str | None:
    """`nvidia-smi QUERY --format=csv,noheader,nounits`, or None where it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run([smi, *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def read_inventory() -> Inventory | None:
    """Every visible GPU and every compute process's use of each; None without a GPU."""
    found = _from_nvml() if nvml() is not None else None
    if found is None:
        found = _from_smi()
    found = None if found is None else _visible(found, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return found if found is not None and found.gpus else None


def _from_nvml() -> Inventory | None:
    lib = nvml()
    assert lib is not None
    gpus: list[Gpu] = []
    procs: list[GpuProcess] = []
    try:
        for i in range(lib.nvmlDeviceGetCount()):
            handle = lib.nvmlDeviceGetHandleByIndex(i)
            uuid, name = lib.nvmlDeviceGetUUID(handle), lib.nvmlDeviceGetName(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = lib.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(Gpu(i, uuid, name, int(mem.total), int(mem.used)))
            with contextlib.suppress(Exception):  # per-process accounting may be refused (containers)
                for p in lib.nvmlDeviceGetComputeRunningProcesses(handle):
                    procs.append(GpuProcess(int(p.pid), uuid, int(p.usedGpuMemory or 0)))
    except Exception as e:
        log.debug("NVML read failed: %r", e)
        return None
    return Inventory(tuple(gpus), tuple(procs), "nvml")


def _from_smi() -> Inventory | None:
    text = nvidia_smi("--query-gpu=index,uuid,name,memory.total,memory.used")
    if text is None:
        return None
    apps = nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory") or ""
    return Inventory(parse_gpus(text), parse_processes(apps), "nvidia-smi")


def parse_gpus(text: str) -> tuple[Gpu, ...]:
    """nvidia-smi's `index, uuid, name, memory.total, memory.used` rows (MiB); bad rows skipped."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5:
            continue
        with contextlib.suppress(ValueError):
            out.append(Gpu(int(cells[0]), cells[1], cells[2], int(float(cells[3]) * MIB),
                           int(float(cells[4]) * MIB)))
    return tuple(sorted(out, key=lambda g: g.index))


def parse_processes(text: str) -> tuple[GpuProcess, ...]:
    """nvidia-smi's `pid, gpu_uuid, used_memory` rows (MiB); `[N/A]` and bad rows skipped."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3:
            continue
        with contextlib.suppress(ValueError):
            out.append(GpuProcess(int(cells[0]), cells[1], int(float(cells[2]) * MIB)))
    return tuple(out)


def _visible(inv: Inventory, visible: str | None) -> Inventory:
    """The devices the router's own CUDA_VISIBLE_DEVICES lets it use (unset: all)."""
    if visible is None:
        return inv
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    keep = [g for g in inv.gpus if str(g.index) in wanted or any(g.uuid.startswith(w) for w in wanted
                                                                   if w.startswith("GPU-"))]
    return Inventory(tuple(keep), inv.processes, inv.source)
