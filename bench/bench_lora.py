"""LoRA adapters: what mixing adapter sets in one burst costs (docs/lora.md, "Batching and fairness").

One omni-worker on the tiny GGUF (or --model/--lora) with two adapters loaded, and one without
any; N concurrent greedy /completion requests of --tokens tokens each, in these mixes:

    no-lora     the worker without adapters, plain requests (the floor)
    base        the worker with adapters, every request on the base model (`lora: []`)
    one         every request on adapter 0
    two         adapters 0 and 1 alternating
    three       the base, adapter 0 and adapter 1 in turn

A step decodes one adapter set, so k sets share the steps k ways: a mix of k sets should take
about k times one set's decode steps, less where prompts and one-set steps overlap. Prints the
median wall time of --rounds rounds and tokens/s per mix.

    .venv/bin/python -m bench.bench_lora [--n 8] [--tokens 64] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Server, free_port
from worker.testing.tiny_lora import ensure_loras, lora_paths

MIXES: dict[str, list[list[dict[str, Any]]]] = {
    "base": [[]],
    "one": [[{"id": 0, "scale": 1.0}]],
    "two": [[{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}]],
    "three": [[], [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}]],
}


def worker(model: Path, threads: int, n: int, lora: list[str], log: Path) -> Server:
    port = free_port()
    cmd = ["python", "-m", "worker.server.cli", "-m", str(model), "--port", str(port), "-np", str(n),
           "-c", str(512 * n), "-t", str(threads)]
    if lora:
        cmd += ["--lora", ",".join(lora)]
    import sys

    cmd[0] = sys.executable
    return Server(model.name, f"http://127.0.0.1:{port}", cmd, log)


def burst(base: str, loras: list[list[dict[str, Any]]] | None, n: int, tokens: int) -> float:
    def one(i: int) -> int:
        body: dict[str, Any] = {"prompt": f"request {i}: the quick brown fox", "n_predict": tokens,
                                "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        if loras is not None:
            body["lora"] = loras[i % len(loras)]
        r = httpx.post(f"{base}/completion", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["tokens_predicted"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        assert sum(pool.map(one, range(n))) == n * tokens
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama-f32.gguf")
    ap.add_argument("--lora", nargs=2, type=Path, default=None, help="two adapters of --model")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.lora is None:
        ensure_loras(ROOT / "models")
        args.lora = [lora_paths(ROOT / "models", x).gguf for x in ("a", "b")]
    results = ROOT / "bench" / "results"
    times: dict[str, list[float]] = {}
    plain = worker(args.model, args.threads, args.n, [], results / "lora-plain.log")
    plain.start(120)
    try:
        burst(plain.base_url, None, args.n, 4)  # warm
        times["no-lora"] = [burst(plain.base_url, None, args.n, args.tokens) for _ in range(args.rounds)]
    finally:
        plain.stop()
    adapted = worker(args.model, args.threads, args.n, [str(p) for p in args.lora], results / "lora.log")
    adapted.start(120)
    try:
        burst(adapted.base_url, MIXES["three"], args.n, 4)
        for _ in range(args.rounds):  # interleaved: the mixes see the same box
            for name, loras in MIXES.items():
                times.setdefault(name, []).append(burst(adapted.base_url, loras, args.n, args.tokens))
    finally:
        adapted.stop()
    print(f"{args.model.name}: N={args.n} x {args.tokens} tokens, {args.threads} thread(s), "
          f"median of {args.rounds}")
    floor = statistics.median(times["no-lora"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:8s} {m:7.2f} s  {args.n * args.tokens / m:7.1f} tok/s  {m / floor:5.2f}x no-lora")


if __name__ == "__main__":
    main()
