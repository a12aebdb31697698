"""Memory of one worker: the process tree's RSS and USS (psutil) and its VRAM (NVML or nvidia-smi).

Effects only, and blocking (USS reads /proc/PID/smaps_rollup; nvidia-smi is a subprocess):
callers run `tree_memory` in a thread. USS, the memory unique to the tree, is what stopping the
worker gives back; RSS also counts shared pages (libraries, page cache of mmapped weights) and
so overstates it. VRAM is the sum over the tree's pids of what the driver reports per process;
None where there is no NVIDIA GPU (no `pynvml` module and no `nvidia-smi`). The driver is asked
through router.lifecycle.gpus (NVML or nvidia-smi), which also reads each device for the GPU
placement.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass

import psutil

from router.lifecycle.gpus import nvidia_smi, nvml

log = logging.getLogger("omni.router.memory")

SAMPLE_LOADING_S = 0.25  # while loading, memory grows quickly: sample often
SAMPLE_RUNNING_S = 2.0


@dataclass(frozen=True)
class TreeMemory:
    rss_bytes: int
    uss_bytes: int
    vram_bytes: int | None = None  # None: no GPU to ask

    def exceeds(self, other: TreeMemory) -> bool:
        """More USS or more VRAM than `other`."""
        return self.uss_bytes > other.uss_bytes or (self.vram_bytes or 0) > (other.vram_bytes or 0)

    def peak_with(self, other: TreeMemory | None) -> TreeMemory:
        """The larger of each figure (a run's peak so far)."""
        if other is None:
            return TreeMemory(self.rss_bytes, self.uss_bytes, self.vram_bytes or 0)
        return TreeMemory(max(self.rss_bytes, other.rss_bytes), max(self.uss_bytes, other.uss_bytes),
                          max(self.vram_bytes or 0, other.vram_bytes or 0))


def tree_memory(pid: int) -> TreeMemory | None:
    """RSS and USS summed over `pid` and its descendants, and their VRAM; None if `pid` is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rss = uss = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # a child may exit between the listing and here
            info = p.memory_full_info()
            rss += info.rss
            uss += info.uss
    vram = gpu_memory_by_pid()
    return TreeMemory(rss, uss, None if vram is None else sum(vram.get(p.pid, 0) for p in procs))


def has_gpu() -> bool:
    return nvml() is not None or shutil.which("nvidia-smi") is not None


def gpu_memory_by_pid() -> dict[int, int] | None:
    """Bytes of VRAM used per pid on every NVIDIA GPU; None when there is none to ask."""
    lib = nvml()
    if lib is not None:
        out: dict[int, int] = {}
        with contextlib.suppress(Exception):
            for i in range(lib.nvmlDeviceGetCount()):
                for proc in lib.nvmlDeviceGetComputeRunningProcesses(lib.nvmlDeviceGetHandleByIndex(i)):
                    out[proc.pid] = out.get(proc.pid, 0) + int(proc.usedGpuMemory or 0)
        return out
    text = nvidia_smi("--query-compute-apps=pid,used_memory")
    if text is None:
        return None
    found: dict[int, int] = {}
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            pid, mib = (s.strip() for s in line.split(","))
            found[int(pid)] = found.get(int(pid), 0) + int(mib) * (1 << 20)
    return found


def gpu_total_bytes() -> int | None:
    """Total VRAM of all NVIDIA GPUs, or None."""
    lib = nvml()
    if lib is not None:
        with contextlib.suppress(Exception):
            return sum(int(lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(i)).total)
                       for i in range(lib.nvmlDeviceGetCount()))
    text = nvidia_smi("--query-gpu=memory.total")
    try:
        return (
            None if text is None else sum(int(s.strip()) for s in text.splitlines() if s.strip()) * (1 << 20)
        )
    except ValueError:
        return None


def host_total_bytes() -> int:
    return int(psutil.virtual_memory().total)


BUDGET_MARGIN = 0.10  # `auto` leaves this share of the total (at least 1 GiB) to everything else


def budget(raw: str, total: int | None) -> int:
    """`--ram-budget` / `--vram-budget`: a size (`512M`, `20GiB`), `0` (no limit) or `auto`
    (the total less a margin; no limit where there is no total, e.g. no GPU)."""
    from router.presets import parse_size

    if raw.strip().lower() == "auto":
        return 0 if not total else max(0, total - max(int(total * BUDGET_MARGIN), 1 << 30))
    return parse_size(raw)
