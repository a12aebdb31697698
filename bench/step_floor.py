"""How close a server's decode steps are to the bare cost of llama.cpp's forward pass.

    .venv/bin/python -m bench.step_floor [--concurrency 1,4,8] [--rounds 3] [--threads 2]

A generating step of N conversations is one `llama_decode` of N rows, one per sequence: its
rows are forced (each conversation needs its previous token), so no server running llama.cpp's
kernels can take less per step than that call. This script measures the call bare, in process
(llama-cpp-python, the real SmolLM2 Q4_1, flash attention on, `-np 4 -c 8192`-style KV streams,
`--threads`, the sequences going on from position 200 in blocks of calls of one shape, so that
llama.cpp reuses its graph as in steady decoding), then each server's steady inter-token gap with N
long greedy streams (`ignore_eos`, tokens 50 to 300 of each), in interleaved rounds. A server
whose ITL equals the bare step has nothing left to win at that N; what ours has above it is
the per-token cost of the worker around the call (HTTP, Python).

Both servers at their defaults as bench_worker.py starts them: ours `--parallel P --ctx-size
8192 --threads T`, llama-server `-np P -c 8192 -t T`, P = the largest N.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.bench_worker import ours_and_llama_server
from bench.common import ROOT

MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"


def bare_steps(model: Path, sizes: list[int], threads: int, reps: int) -> dict[int, float]:
    """Median ms of one llama_decode of k one-row sequences, for each k in `sizes`."""
    import llama_cpp as ll

    ll.llama_backend_init()
    m = ll.llama_model_load_from_file(str(model).encode(), ll.llama_model_default_params())
    n_seq = max(sizes)
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 8192, 2048, 512, n_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = 1  # on: what "auto" picks on the CPU, in both servers
    ctx = ll.llama_init_from_model(m, cp)
    mem = ll.llama_get_memory(ctx)
    batch = ll.llama_batch_init(512, 0, n_seq)

    def decode(seqs: list[int], n: int, pos: int) -> float:
        batch.n_tokens = 0
        for s in seqs:
            for i in range(n):
                k = batch.n_tokens
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = 100 + i, pos + i, 1
                batch.seq_id[k][0], batch.logits[k] = s, i == n - 1
                batch.n_tokens += 1
        t0 = time.perf_counter()
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return (time.perf_counter() - t0) * 1e3

    try:
        for s in range(n_seq):
            decode([s], 200, 0)  # a prompt's worth of context in each stream
        times: dict[int, list[float]] = {k: [] for k in sizes}
        for _ in range(3):  # blocks of one shape, as steady decoding runs (llama.cpp reuses the graph)
            for k in sizes:
                for i in range(reps):
                    times[k].append(decode(list(range(k)), 1, 200 + i))
                for s in range(k):
                    ll.llama_memory_seq_rm(mem, s, 200, -1)
        return {k: statistics.median(v) for k, v in times.items()}
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(m)


def steady_itl(base: str, n: int, max_tokens: int = 300) -> float:
    """Median gap (ms) between tokens 50 and `max_tokens` of n concurrent greedy streams."""
    gaps: list[float] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Write a very long story, number {i}."}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        ts = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    ts.append(time.perf_counter())
        with lock:
            gaps.extend((b - a) * 1e3 for a, b in itertools.pairwise(ts[50:]))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=60, help="bare calls of each size, per block (3 blocks)")
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.concurrency.split(",")]
    bare = bare_steps(args.model, sizes, args.threads, args.reps)
    print("bare llama_decode of k one-row sequences: "
          + ", ".join(f"k={k} {ms:.2f} ms" for k, ms in bare.items()), flush=True)
    servers = ours_and_llama_server(args.model, max(sizes), args.threads, args.llama_server, "step_floor")
    itl: dict[tuple[str, int], list[float]] = {}
    try:
        for s in servers:
            s.start(180)
            steady_itl(s.base_url, 1, 60)  # warm up
        for r in range(args.rounds):
            for n in sizes:
                for s in servers if (r + n) % 2 == 0 else servers[::-1]:
                    itl.setdefault((s.name, n), []).append(steady_itl(s.base_url, n))
                    print(f"round {r} N={n} {s.name}: ITL {itl[s.name, n][-1]:.2f} ms",
                          file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    print(f"\n| N | bare step | {' | '.join(f'{s.name} ITL (x bare)' for s in servers)} |")
    print(f"|---|---|{'---|' * len(servers)}")
    for n in sizes:
        cells = []
        for s in servers:
            ms = statistics.median(itl[s.name, n])
            cells.append(f"{ms:.2f} ms ({ms / bare[n]:.3f}x)")
        print(f"| {n} | {bare[n]:.2f} ms | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
