"""Beam search (issue 42): the wall time of a width-4 beam search against greedy decoding, one
request at a time (N = 1), 64 tokens, on the real SmolLM2-135M-Instruct (Q4_1 GGUF on llama.cpp;
its HF twin on torch with --torch).

    .venv/bin/python -m bench.bench_beam                 # llama.cpp, 5 rounds
    .venv/bin/python -m bench.bench_beam --torch --rounds 3

One worker (`-np 4`), chat requests at temperature 0 with `ignore_eos` (so every answer, and
every beam, runs the whole 64 tokens) and `cache_prompt` off (each request computes its prompt),
a different prompt each round; greedy and beam alternate which goes first. Printed: the median
wall time of each, their ratio (the issue's bound: width 4 <= 1.5x greedy), and the median of
the worker's own `timings.predicted_ms` (the generation part alone).

Then the floor (unless --no-floor): the backend alone, in process, with the worker's flags,
times one decode call of W one-row entries (W sequences, as a beam step) against one of a
single row (a greedy step), interleaved, at the answers' depth. A beam step holds W rows, so
beam W's generating ratio cannot fall below that one; what it adds above it is the engine's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Server, free_port, median

QUESTIONS = [
    "Tell me about the history of lighthouses.",
    "How do I bake a loaf of bread at home?",
    "Why is the sky blue during the day?",
    "What should I pack for a week of hiking?",
    "Explain how a bicycle gear works.",
    "Write a short note thanking a colleague.",
    "What are good habits for learning a language?",
    "Describe a quiet morning in a small town.",
]


def worker(args: argparse.Namespace, log: Path) -> Server:
    port = free_port()
    if args.torch:
        model = ROOT / "models" / "smollm2-135m-instruct"
        extra = ["--backend", "torch", "--dtype", "float32"]
    else:
        model = Path(args.model)
        extra = []
    cmd = [sys.executable, "-m", "worker.server.cli", "--model", str(model), "--port", str(port),
           "--parallel", "4", "--ctx-size", "4096", "--threads", str(args.threads), *extra, *args.arg]
    return Server("worker", f"http://127.0.0.1:{port}", cmd, log, {"PYTHONPATH": str(ROOT)})


def ask(base: str, question: str, max_tokens: int, beam: dict[str, Any]) -> tuple[float, float, int]:
    """(wall seconds, the worker's predicted_ms, completion tokens) of one request."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False, **beam}
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    j = r.json()
    return wall, float(j["timings"]["predicted_ms"]), int(j["usage"]["completion_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", action="store_true", help="the HF twin on the torch backend")
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"),
                    help="the GGUF (llama.cpp backend); e.g. the demo requantized to Q4_0, whose rows get "
                    "llama.cpp's repacked multi-row kernels on x86")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arg", action="append", default=[], help="another worker flag (repeatable), e.g. "
                    "--arg=--kv-unified")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-floor", action="store_true", help="skip the backend's own W-row / 1-row decode")
    ap.add_argument("--threads", type=int, default=1,
                    help="the worker's threads (1: on a shared 2-core box, more only wait on each other)")
    args = ap.parse_args()
    kinds = {"greedy": {}, f"beam{args.width}": {"best_of": args.width, "n": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        server = worker(args, Path(tmp) / "worker.log")
        server.start(300)
        try:
            for beam in kinds.values():  # warm-up: first graphs, first pages of the weights
                ask(server.base_url, "hello", 8, beam)
            walls: dict[str, list[float]] = {k: [] for k in kinds}
            gen_ms: dict[str, list[float]] = {k: [] for k in kinds}
            for i in range(args.rounds):
                order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
                for name in order:
                    wall, ms, n = ask(server.base_url, QUESTIONS[i % len(QUESTIONS)], args.max_tokens,
                                      kinds[name])
                    assert n == args.max_tokens, f"{name}: {n} tokens"
                    walls[name].append(wall)
                    gen_ms[name].append(ms)
                    print(f"round {i}: {name:7s} {wall * 1e3:8.1f} ms wall, {ms:8.1f} ms generating",
                          flush=True)
        finally:
            server.stop()
    backend = "torch (HF twin, float32)" if args.torch else f"llama.cpp ({Path(args.model).name})"
    g, b = f"{'greedy':7s}", f"beam{args.width}"
    print(f"\nSmolLM2-135M-Instruct, {backend}, {args.threads} thread(s), N = 1, {args.max_tokens} tokens, "
          f"{args.rounds} rounds (medians)")
    for name in kinds:
        wall, gen = median(walls[name]) * 1e3, median(gen_ms[name])
        print(f"  {name:7s} wall {wall:8.1f} ms   generating {gen:8.1f} ms")
    ratio = median(walls[b]) / median(walls["greedy"])
    gen_ratio = median(gen_ms[b]) / median(gen_ms["greedy"])
    print(f"  {b} / {g.strip()}: {ratio:.2f}x wall, {gen_ratio:.2f}x generating (bound: 1.5x)")
    if not args.no_floor:
        one, wide = floor(args)
        print(f"  the backend's own decode, {args.width} rows / 1 row: {wide * 1e3:.1f} / "
              f"{one * 1e3:.1f} ms = {wide / one:.2f}x (the floor of the generating ratio)")


def floor(args: argparse.Namespace, reps: int = 30) -> tuple[float, float]:
    """(median seconds of a decode of one row, of `args.width` rows of as many sequences), the
    backend loaded in process with the worker's flags, at ~160 cells of depth."""
    from worker.backends import BackendOptions, load_backend
    from worker.backends.base import BatchEntry

    w = args.width
    ngl = None
    if "-ngl" in args.arg[:-1]:
        ngl = int(args.arg[args.arg.index("-ngl") + 1])
    if args.torch:
        options = BackendOptions(n_ctx=4096, n_slots=w, threads=args.threads, device="cpu", dtype="float32")
        backend = load_backend("torch", str(ROOT / "models" / "smollm2-135m-instruct"), options, None)
    else:
        options = BackendOptions(n_ctx=4096, n_slots=w, threads=args.threads, n_gpu_layers=ngl)
        backend = load_backend("llama_cpp", args.model, options, None)
    try:
        depth = 160
        prompt = [(7 * i) % 4000 + 100 for i in range(depth)]
        for seq in range(w):
            backend.decode([BatchEntry(seq, prompt, 0, True)])
        times: dict[int, list[float]] = {1: [], w: []}
        for _ in range(reps):
            for rows in (1, w):
                t0 = time.perf_counter()
                backend.decode([BatchEntry(seq, [42], depth, True) for seq in range(rows)])
                times[rows].append(time.perf_counter() - t0)
                for seq in range(rows):
                    backend.seq_rm(seq, depth)
        return median(times[1]), median(times[w])
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    main()
