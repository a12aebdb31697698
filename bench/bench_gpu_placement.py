"""How long one GPU placement decision takes (router/lifecycle/gpu_placement.py, pure): the cases
that search, on 8 GPUs with 16 idle models. The router runs it in a thread (the eviction search
is tens of milliseconds at worst there); this prints the figures behind that.

    python -m bench.bench_gpu_placement [--gpus 8] [--models 16] [--rounds 20]
"""

from __future__ import annotations

import argparse
import time

from router.lifecycle.gpu_placement import Ask, Device, Resident, place

G = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--models", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    devices = [Device(i, f"gpu{i}", 80 * G, 2 * G) for i in range(args.gpus)]
    residents = [Resident(f"m{j}", ((j % args.gpus, 9 * G),), True, False, float(j))
                 for j in range(args.models)]
    cases = {"one device fits": Ask("x", G, 512 << 20),
             "split over several": Ask("x", 3 * G, 512 << 20),
             "evict (fewest devices, LRU)": Ask("x", 70 * G, 512 << 20),
             "no room (the whole search)": Ask("x", 1000 * G, 512 << 20)}
    print(f"| case ({args.gpus} GPUs, {args.models} idle models) | decision | ms per decision |")
    print("|---|---|---|")
    for label, ask in cases.items():
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            decision = place(devices, residents, ask)
        ms = (time.perf_counter() - t0) / args.rounds * 1000
        print(f"| {label} | {type(decision).__name__} | {ms:.2f} |")


if __name__ == "__main__":
    main()
