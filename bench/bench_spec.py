"""Speculative decoding (issue 29): tokens/s with and without prompt-lookup speculation, ours and
llama-server's, on the real SmolLM2-135M-Instruct Q4_1.

    .venv/bin/python -m bench.bench_spec                       # all workloads, 3 rounds
    .venv/bin/python -m bench.bench_spec --no-llama-server --rounds 5

Four servers with the same flags (`-np 8 -c 8192`; the speculating ones add
`--spec-type ngram-simple --spec-ngram-simple-size-n N --spec-ngram-simple-size-m M`, the same
on both sides), started together and measured round by round, one request (or one burst) at a
time, the order of the servers reversed every other round, so that the ratios are taken side
by side on a noisy box. Workloads (chat, temperature 0):

    rewrite   N = 1: "rewrite this text, changing one thing" (two paragraphs; the answer copies
              the prompt), up to --max-tokens
    fresh     N = 1: an open question (nothing to copy: drafts are rare and mostly rejected)
    rewrite8  N = 8: eight rewrites at once (aggregate tokens/s), ours only; fresh and rewrite8
              answers are cut at --max-tokens-short (a 2-core box takes minutes per burst)

tokens/s is completion tokens / the request's wall time (N = 8: all tokens / the burst's wall
time); the medians over the rounds are printed, with the ratio on/off of each server, the same
ratio in tokens per CPU-second of the server process (steadier than wall time on a shared box,
where another process may take the cores during one request and not the other), and the
acceptance (draft_n_accepted / draft_n from `timings`). The greedy answers with and without
speculation are compared too (a difference is printed: at temperature 0 they should be equal).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Server, free_port, median

LLAMA_SERVER = ROOT / "third_party" / "llama-server-build-0.3.36" / "bin" / "llama-server"

TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
    "keeper climbed the narrow stairs, trimmed the wick, and watched the beam sweep across the dark "
    "water. Ships passing along the coast relied on that light to find their way around the rocks. In "
    "the winter the wind howled through the cracks in the stone walls, and the keeper's cat slept "
    "curled up beside the small iron stove.",
    "Our team meets every Monday morning to plan the week. We review the open tickets, agree on who "
    "takes which task, and write the plan on the whiteboard next to the kitchen. On Friday afternoon "
    "we look at the board again, move the finished tasks to the done column, and talk about what "
    "slowed us down. The meeting never takes more than thirty minutes, and the coffee is always free.",
    "To bake the bread, mix the flour, the water, the salt and the yeast in a large bowl until the "
    "dough comes together. Knead it on a floured table for ten minutes, then let it rest in a warm "
    "place for one hour. Shape the dough into a round loaf, put it on a tray, and bake it in a hot "
    "oven for forty minutes, until the crust is brown and the loaf sounds hollow when you tap it.",
    "The river runs through the middle of the town and under four stone bridges. In the spring the "
    "water rises and the fishermen wait on the banks for the trout to come back from the sea. In the "
    "summer children swim near the mill, and in the autumn the leaves of the tall trees float slowly "
    "down towards the harbour, where the old boats are painted before the winter comes.",
]
CHANGES = ["the cat into a dog", "Monday into Tuesday", "the salt into sugar", "the trout into salmon"]
QUESTIONS = [
    "Explain why the sky is blue in a few sentences.",
    "Give me three ideas for a birthday party for a ten year old.",
    "What are the main differences between a lake and a sea?",
    "Describe how a bicycle works to someone who has never seen one.",
]


def rewrite_msg(i: int) -> str:
    """One of the texts followed by the next (two paragraphs, ~190 tokens), one change asked."""
    k = i % len(TEXTS)
    text = TEXTS[k] + "\n\n" + TEXTS[(k + 1) % len(TEXTS)]
    return f"Rewrite the following text exactly as it is, but change {CHANGES[k]}:\n\n{text}"


def chat(url: str, msg: str, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": msg}], "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    out["_wall"] = time.perf_counter() - t0
    return out


def one(server: Server, msg: str, max_tokens: int) -> tuple[float, float, int, int, str]:
    """(tokens/s, tokens per CPU-second of the server, draft_n, draft_n_accepted, text)."""
    cpu = server.cpu_seconds()
    r = chat(server.base_url, msg, max_tokens)
    cpu = server.cpu_seconds() - cpu
    n = r["usage"]["completion_tokens"]
    t = r.get("timings", {})
    text = r["choices"][0]["message"]["content"]
    per_cpu = n / cpu if cpu > 0 else 0.0
    return n / r["_wall"], per_cpu, t.get("draft_n", 0), t.get("draft_n_accepted", 0), text


def burst(server: Server, msgs: list[str], max_tokens: int) -> tuple[float, float, int, int]:
    cpu = server.cpu_seconds()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(msgs)) as pool:
        rs = list(pool.map(lambda m: chat(server.base_url, m, max_tokens), msgs))
    wall = time.perf_counter() - t0
    cpu = server.cpu_seconds() - cpu
    n = sum(r["usage"]["completion_tokens"] for r in rs)
    drafted = sum(r.get("timings", {}).get("draft_n", 0) for r in rs)
    accepted = sum(r.get("timings", {}).get("draft_n_accepted", 0) for r in rs)
    return n / wall, n / cpu if cpu > 0 else 0.0, drafted, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=320, help="rewrite at N = 1")
    ap.add_argument("--max-tokens-short", type=int, default=96, help="fresh, and rewrite8's each")
    ap.add_argument("--size-n", type=int, default=3, help="--spec-ngram-simple-size-n (both sides)")
    ap.add_argument("--size-m", type=int, default=16, help="--spec-ngram-simple-size-m (both sides)")
    ap.add_argument("--threads", type=int, default=1,
                    help="-t (both sides); 1: llama.cpp's spinning pool of 2 threads crawls on a shared box")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER), help="the llama-server binary")
    ap.add_argument("--arg", action="append", default=[],
                    help="one more flag for all four servers, e.g. --arg=-ngl --arg=99 on a GPU")
    ap.add_argument("--workloads", default="rewrite,fresh,rewrite8")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    common = ["-np", "8", "-c", "8192", "-t", str(args.threads), *args.arg]
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.size_n),
            "--spec-ngram-simple-size-m", str(args.size_m)]
    log_dir = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    # ROOT first, the caller's PYTHONPATH kept (a GPU image with wheels installed beside it)
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    servers: dict[str, Server] = {}

    def add(name: str, cmd: list[str]) -> None:
        port = free_port()
        servers[name] = Server(name, f"http://127.0.0.1:{port}", [*cmd, "--port", str(port)],
                               log_dir / f"{name}.log", env)

    ours = [sys.executable, "-m", "worker.server.cli", "-m", args.model, *common]
    add("ours", ours)
    add("ours+spec", [*ours, *spec])
    if not args.no_llama_server:
        ls = [args.llama_server, "-m", args.model, *common]
        add("llama-server", ls)
        add("llama-server+spec", [*ls, *spec])
    for s in servers.values():
        print(f"{s.name}: {' '.join(s.cmd or [])}", flush=True)
        s.start(120)
    try:
        results: dict[tuple[str, str], list[tuple[float, float, int, int]]] = {}
        texts: dict[tuple[str, str, int], str] = {}
        for r in range(args.rounds):
            for w in workloads:
                order = list(servers.items())  # which side goes first alternates round by round
                for name, s in order if r % 2 == 0 else order[::-1]:
                    if w == "rewrite8" and name.startswith("llama-server"):
                        continue
                    if w == "rewrite8":
                        res = burst(s, [rewrite_msg(i + r) for i in range(8)], args.max_tokens_short)
                    else:
                        msg = rewrite_msg(r) if w == "rewrite" else QUESTIONS[r % len(QUESTIONS)]
                        n = args.max_tokens if w == "rewrite" else args.max_tokens_short
                        tps, tpc, dn, da, text = one(s, msg, n)
                        res = (tps, tpc, dn, da)
                        texts[(name, w, r)] = text
                    results.setdefault((w, name), []).append(res)
                    print(f"round {r} {w:9s} {name:18s} {res[0]:7.2f} tok/s {res[1]:7.2f} tok/cpu-s  "
                          f"drafts {res[3]}/{res[2]}", flush=True)
        print()
        print("| workload | server | tok/s off | tok/s spec | ratio (wall) | ratio (tokens per CPU-s) "
              "| accepted/drafted |")
        print("|---|---|---|---|---|---|---|")
        for w in workloads:
            for side in ("ours", "llama-server"):
                off, on = results.get((w, side)), results.get((w, side + "+spec"))
                if not off or not on:
                    continue
                m_off, m_on = median([x[0] for x in off]), median([x[0] for x in on])
                ratios = [b[0] / a[0] for a, b in zip(off, on, strict=True)]
                cpu_ratios = [b[1] / a[1] for a, b in zip(off, on, strict=True) if a[1] > 0]
                dn, da = sum(x[2] for x in on), sum(x[3] for x in on)
                print(f"| {w} | {side} | {m_off:.2f} | {m_on:.2f} | {median(ratios):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in ratios)}) | {median(cpu_ratios):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in cpu_ratios)}) | {da}/{dn} |")
        diffs = [k for k in texts
                 if k[0].endswith("+spec") and texts[k] != texts.get((k[0][:-5], k[1], k[2]))]
        print(f"\ngreedy answers that differ with speculation: {len(diffs)} of "
              f"{sum(1 for k in texts if k[0].endswith('+spec'))} {diffs}")
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
