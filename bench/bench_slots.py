"""Conversations that come back to a server with more slots than are busy.

    .venv/bin/python -m bench.bench_slots [--rounds 3] [--parallel 8] [--threads 2]

With a KV stream per slot (both servers' default), llama.cpp decodes a step in one pass over the
weights per run of consecutive busy sequence ids. Slots are picked by the prefix they hold, so
conversations that come back land wherever their last turn was. Here 8 conversations take a
first turn at once (one per slot), then 4 of them (the 1st, 3rd, 5th and 7th) send a second turn
at once and stream 200 tokens (`ignore_eos`): the busy slots and the steady ITL of those 4
streams (tokens 20 to 200), per round, ours and llama-server interleaved, on the real SmolLM2
Q4_1 with both at their defaults (`--parallel P --ctx-size 8192 --threads T` / `-np P -c 8192 -t T`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.bench_worker import ours_and_llama_server
from bench.common import ROOT

MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
TOPICS = ["lighthouses", "bicycles", "volcanoes", "bees", "glaciers", "pianos", "comets", "forests"]


def _turn(base: str, messages: list[dict[str, str]], max_tokens: int, gaps: list[float] | None) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": gaps is not None}
    text, ts = [], []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                ts.append(time.perf_counter())
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    if gaps is not None:
        gaps.extend((b - a) * 1e3 for a, b in itertools.pairwise(ts[20:]))
    return "".join(text)


def _at_once(fn: object, args: list[tuple[object, ...]]) -> None:
    threads = [threading.Thread(target=fn, args=a) for a in args]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_round(base: str, r: int, back: list[int]) -> tuple[list[int], float]:
    """(the busy slots while the returning conversations generate, their median ITL in ms)."""
    history: dict[int, list[dict[str, str]]] = {}

    def first(i: int) -> None:
        msgs = [{"role": "user", "content": f"Round {r}. Tell me about {TOPICS[i % len(TOPICS)]}."}]
        history[i] = [*msgs, {"role": "assistant", "content": _turn(base, msgs, 40, None)}]

    _at_once(first, [(i,) for i in range(len(TOPICS))])
    gaps: list[float] = []
    busy: list[int] = []

    def watch() -> None:
        time.sleep(1.0)
        busy.extend(s["id"] for s in httpx.get(f"{base}/slots", timeout=10).json() if s.get("is_processing"))

    more = {"role": "user", "content": "Tell me much more, in detail."}
    watcher = threading.Thread(target=watch)
    watcher.start()
    _at_once(_turn, [(base, [*history[i], more], 200, gaps) for i in back])
    watcher.join()
    return busy, statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    servers = ours_and_llama_server(args.model, args.parallel, args.threads, args.llama_server, "bench_slots")
    back = list(range(0, args.parallel, 2))[:4]
    itl: dict[str, list[float]] = {s.name: [] for s in servers}
    try:
        for s in servers:
            s.start(180)
        for r in range(args.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                busy, ms = one_round(s.base_url, r, back)
                itl[s.name].append(ms)
                print(f"round {r} {s.name}: busy slots {busy}, ITL {ms:.2f} ms", flush=True)
    finally:
        for s in servers:
            s.stop()
    ours, theirs = itl["ours"], itl["llama-server"]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    print(f"ITL median: ours {statistics.median(ours):.2f} ms, llama-server {statistics.median(theirs):.2f} "
          f"ms; ours/llama-server paired per round {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
