"""`omni-router` under tracemalloc, for bench/conn_memory.py's breakdown of where a connection's
bytes go: SIGUSR1 takes the baseline snapshot, SIGUSR2 writes the growth since it, by source
line, to $OMNI_TRACEMALLOC_OUT (the top 30 lines and the total Python heap growth).

    python -m bench.traced_router --preset P ...   (the router's own arguments)
"""

from __future__ import annotations

import os
import signal
import sys
import tracemalloc
from types import FrameType

_FRAMES = 8
_baseline: list[tracemalloc.Snapshot] = []


def _keep_ours(snapshot: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    return snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


def _baseline_now(signum: int, frame: FrameType | None) -> None:
    _baseline[:] = [_keep_ours(tracemalloc.take_snapshot())]


def _short(path: str) -> str:
    return path.split("site-packages/")[-1].split("lib/python3.11/")[-1].removeprefix(os.getcwd() + "/")


def _report(signum: int, frame: FrameType | None) -> None:
    now = _keep_ours(tracemalloc.take_snapshot())
    stats = now.compare_to(_baseline[0], "traceback") if _baseline else now.statistics("traceback")
    total = sum(s.size_diff for s in stats) if _baseline else sum(s.size for s in stats)
    lines = [f"python heap growth: {total / 2**20:.1f} MiB in {sum(s.count_diff for s in stats)} blocks"]
    for s in stats[:30]:
        frames = list(s.traceback)[::-1][:4]  # the most recent first
        where = " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in frames)
        lines.append(f"{s.size_diff / 2**20:8.2f} MiB {s.count_diff:8d} blocks  {where}")
    with open(os.environ["OMNI_TRACEMALLOC_OUT"], "w") as out:
        out.write("\n".join(lines) + "\n")


def main() -> None:
    tracemalloc.start(_FRAMES)
    signal.signal(signal.SIGUSR1, _baseline_now)
    signal.signal(signal.SIGUSR2, _report)
    from router.cli import main as router_main

    sys.argv = ["omni-router", *sys.argv[1:]]
    router_main()


if __name__ == "__main__":
    main()
