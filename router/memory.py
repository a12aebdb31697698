"""Host memory of one worker: the process tree's RSS and USS, read with psutil.

Effects only, and blocking (USS reads /proc/PID/smaps_rollup): callers run `tree_memory` in a
thread. USS, the memory unique to the tree, is what stopping the worker gives back; RSS also
counts shared pages (libraries, page cache of mmapped weights) and so overstates it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import psutil

SAMPLE_LOADING_S = 0.25  # while loading, memory grows quickly: sample often
SAMPLE_RUNNING_S = 2.0


@dataclass(frozen=True)
class TreeMemory:
    rss_bytes: int
    uss_bytes: int


def tree_memory(pid: int) -> TreeMemory | None:
    """RSS and USS summed over `pid` and its descendants; None if `pid` is gone."""
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
    return TreeMemory(rss, uss)
