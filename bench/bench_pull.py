"""Pull throughput on this box: router/hub's download (resumable, SHA-256 checked) against
huggingface_hub's own `hf_hub_download`, both from the stand-in hub (worker/testing/stand_in_hub.py,
a local HTTP server) into fresh temporary caches, interleaved, medians printed.

    .venv/bin/python -m bench.bench_pull [--mb 64] [--rounds 3]

What it shows: the cost of our verification (a SHA-256 pass over the file) and of the stand-in's
Python HTTP server, not a network: both sides read the same local server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from router.hub.choice import parse_ref
from router.hub.download import HubConfig, pull
from worker.testing.stand_in_hub import StandInHub


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    data = os.urandom(args.mb << 20)
    ours: list[float] = []
    theirs: list[float] = []
    with StandInHub() as hub:
        hub.add_repo("bench/x-GGUF", {"x-Q4_K_M.gguf": data})
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                pull(parse_ref("bench/x-GGUF"), None, HubConfig(hub.url, Path(tmp) / "a"))
                ours.append(time.perf_counter() - t)
                from huggingface_hub import hf_hub_download

                t = time.perf_counter()
                hf_hub_download("bench/x-GGUF", "x-Q4_K_M.gguf", cache_dir=str(Path(tmp) / "b"),
                                endpoint=hub.url, token=False)
                theirs.append(time.perf_counter() - t)
    for name, times in (("router/hub pull (+ sha256)", ours), ("hf_hub_download", theirs)):
        med = statistics.median(times)
        print(f"{name:28s} {args.mb} MiB: median {med:.2f} s  {args.mb / med:.0f} MiB/s  "
              f"(runs: {', '.join(f'{x:.2f}' for x in times)})")


if __name__ == "__main__":
    main()
