"""Chat benchmark: real chat traffic on a real model, our worker beside llama.cpp's llama-server.

    .venv/bin/python -m bench.bench_chat --model SmolLM2-135M-Instruct.Q4_1.gguf   # all workloads
    .venv/bin/python -m bench.bench_chat --workloads multiturn --concurrency 1,4 --rounds 3

Both servers start with their defaults, as bench_worker.py starts them (ours `--parallel 4
--ctx-size 8192 --threads 2`, llama-server `-np 4 -c 8192 -t 2`); requests are greedy streaming
chat completions through each server's chat template, answers stop at EOS (`--max-tokens`
caps them). Workloads, each run with N conversations at once:

- multiturn: a conversation of `--turns` user turns with the template's own system prompt; each
  turn sends the whole history, as a chat UI does.
- rag: a shared ~1,500-token few-shot prompt (system message) and then a different question,
  `--turns` questions one after another per client.
- agent: a task, then `--turns` steps in which a tool result is appended to the history and the
  model is called again at once.

Per workload, N and server: TTFT p50/p99 per turn (first content token), prompt rows evaluated
per turn (`timings.prompt_n`), end-to-end time per conversation and generated tokens/s. Rounds
are interleaved (the server order alternates) and each number is the median over rounds; the
ratios are also given paired (each round's conversations differ: the median of the per-round
ratios on the same conversations is steadier than the ratio of medians). The
answers of the two servers are compared turn by turn and the number that differ is reported
(both are greedy on the same file; kernels differ at rounding level, so a few may).
`--svg PATH` writes TTFT per turn (multiturn, N = 1) for both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.bench_worker import build_targets
from bench.common import Server, median, percentile

QUESTIONS = [
    "What is the capital of France?", "Give me one fact about it.", "How many people live there?",
    "What river flows through it?", "Name a famous museum there.", "What food is it known for?",
    "When is the best time to visit?", "Thanks! Summarize in one sentence.",
]
TOPICS = ["France", "Japan", "Brazil", "Kenya", "Canada", "Italy", "India", "Norway", "Egypt", "Peru"]
FEW_SHOT = [
    ("What is the boiling point of water at sea level?", "100 degrees Celsius."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare."),
    ("What is the largest planet in the solar system?", "Jupiter."),
    ("How many continents are there?", "Seven."),
    ("What gas do plants absorb?", "Carbon dioxide."),
    ("What is the chemical symbol for gold?", "Au."),
]
DOCUMENT = (
    "The city library opens at nine in the morning and closes at six in the evening on weekdays. On "
    "Saturdays it opens at ten and closes at four; it is closed on Sundays. Members may borrow up to "
    "eight books for three weeks, renewable twice online. Late returns cost twenty cents per book per "
    "day. The reading room on the second floor is silent; group study rooms on the third floor can be "
    "booked for two hours at a time. Wi-Fi is free; the network is called Library-Guest. "
)
RAG_QUESTIONS = [
    "When does the library open on Saturday?", "How many books can a member borrow?", "What does a late "
    "return cost?", "Where is the silent reading room?", "How long can a study room be booked?",
    "What is the Wi-Fi network called?", "Is the library open on Sunday?", "How often can a loan be renewed?",
]
TOOL_STEPS = [
    '{"tool": "search", "result": "3 flights found: 08:10 (120 EUR), 12:45 (95 EUR), 18:30 (140 EUR)"}',
    '{"tool": "seat_map", "result": "12:45 flight: 14 window seats free, 9 aisle seats free"}',
    '{"tool": "book", "result": "booked seat 17A on the 12:45 flight, reference QX7P2"}',
    '{"tool": "calendar", "result": "event added: flight QX7P2, 12:45, gate opens 12:05"}',
    '{"tool": "email", "result": "confirmation sent to the user"}',
    '{"tool": "weather", "result": "destination: 21 C, sunny"}',
]


def rag_system() -> str:
    shots = "\n".join(f"Q: {q}\nA: {a}" for q, a in FEW_SHOT)
    return ("You answer questions from the document below, in one short sentence.\n\nDocument:\n"
            + DOCUMENT * 9 + "\n\nExamples:\n" + shots)


@dataclass
class Turn:
    ttft_ms: float = float("nan")
    e2e_ms: float = float("nan")
    prompt_n: int = -1
    n_tokens: int = 0
    text: str = ""


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)
    e2e_s: float = 0.0


async def chat_turn(client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int) -> Turn:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    turn = Turn()
    t0 = time.perf_counter()
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if turn.text == "":
                        turn.ttft_ms = (time.perf_counter() - t0) * 1e3
                    turn.text += piece
            if chunk.get("timings"):
                turn.prompt_n = int(chunk["timings"].get("prompt_n", -1))
            if chunk.get("usage"):
                usage = chunk["usage"]
    turn.e2e_ms = (time.perf_counter() - t0) * 1e3
    turn.n_tokens = int(usage.get("completion_tokens", 0))
    if turn.prompt_n < 0 and usage:
        turn.prompt_n = int(usage["prompt_tokens"]) - int(
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        )
    return turn


async def conversation(client: httpx.AsyncClient, workload: str, idx: int, round_idx: int, turns: int,
                       max_tokens: int) -> Conversation:
    conv = Conversation()
    tag = f"{round_idx}-{idx}"
    t0 = time.perf_counter()
    if workload == "multiturn":
        topic = TOPICS[(idx + round_idx) % len(TOPICS)]
        messages: list[dict[str, str]] = []
        for k in range(turns):
            q = QUESTIONS[k % len(QUESTIONS)].replace("France", topic)
            messages.append({"role": "user", "content": q if k else f"(chat {tag}) {q}"})
            turn = await chat_turn(client, messages, max_tokens)
            conv.turns.append(turn)
            messages.append({"role": "assistant", "content": turn.text})
    elif workload == "rag":
        system = rag_system()
        for k in range(turns):
            q = RAG_QUESTIONS[(idx * turns + k + round_idx) % len(RAG_QUESTIONS)]
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"[{tag}.{k}] {q}"},
            ]
            conv.turns.append(await chat_turn(client, messages, max_tokens))
    else:  # agent
        messages = [
            {"role": "system", "content": "You are a travel agent. After each tool result, say in one short "
                                          "sentence what you will do next."},
            {"role": "user", "content": f"(task {tag}) Book me the cheapest flight to Lisbon tomorrow."},
        ]
        for k in range(turns):
            turn = await chat_turn(client, messages, max_tokens)
            conv.turns.append(turn)
            messages.append({"role": "assistant", "content": turn.text})
            messages.append({"role": "user", "content": "Tool result: " + TOOL_STEPS[k % len(TOOL_STEPS)]})
    conv.e2e_s = time.perf_counter() - t0
    return conv


async def run_cell(
    server: Server, workload: str, n: int, round_idx: int, args: argparse.Namespace
) -> list[Conversation]:
    # No keep-alive: an idle connection the server closed meanwhile would fail the next turn.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(
            conversation(client, workload, i, round_idx, args.turns, args.max_tokens) for i in range(n)
        )))


async def decode_seconds(server: Server) -> float | None:
    """Our worker's time in the model's forward passes so far (`omni:decode_seconds_total`, with
    --metrics); None for a server without it."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        r = await client.get("/metrics")
    if r.status_code != 200:
        return None
    for line in r.text.splitlines():
        if line.startswith("omni:decode_seconds_total "):
            return float(line.split()[1])
    return None


def cell_stats(convs: list[Conversation], wall_s: float) -> dict[str, Any]:
    n_turns = max(len(c.turns) for c in convs)
    per_turn = []
    for k in range(n_turns):
        ts = [c.turns[k] for c in convs if len(c.turns) > k]
        per_turn.append(
            {
                "ttft_p50": percentile([t.ttft_ms for t in ts], 50),
                "ttft_p99": percentile([t.ttft_ms for t in ts], 99),
                "prompt_n": median([float(t.prompt_n) for t in ts]),
            }
        )
    tokens = sum(t.n_tokens for c in convs for t in c.turns)
    all_ttft = [t.ttft_ms for c in convs for t in c.turns[1:]] or [t.ttft_ms for c in convs for t in c.turns]
    return {
        "per_turn": per_turn,
        "ttft_p50": percentile(all_ttft, 50), "ttft_p99": percentile(all_ttft, 99),
        "e2e_s": median([c.e2e_s for c in convs]), "tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "wall_s": wall_s,
        "texts": [[t.text for t in c.turns] for c in convs],
    }


def svg_plot(path: Path, series: dict[str, list[float]], title: str) -> None:
    """TTFT per turn, one polyline per server (no plotting library needed)."""
    w, h, pad = 640, 360, 50
    ys = [y for v in series.values() for y in v if y == y]
    n = max(len(v) for v in series.values())
    y_max = max(ys) * 1.1 if ys else 1.0
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]

    def xy(i: int, y: float) -> tuple[float, float]:
        x = pad + (w - 2 * pad) * (i / max(1, n - 1))
        return x, h - pad - (h - 2 * pad) * (y / y_max)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
        f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">turn</text>',
        f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" '
        'text-anchor="middle">TTFT p50 (ms)</text>',
    ]
    for k in range(5):
        y = y_max * k / 4
        _, py = xy(0, y)
        parts.append(f'<text x="{pad - 6}" y="{py + 4}" text-anchor="end">{y:.0f}</text>')
        parts.append(f'<line x1="{pad}" y1="{py}" x2="{w - pad}" y2="{py}" stroke="#ddd"/>')
    for i in range(n):
        px, _ = xy(i, 0)
        parts.append(f'<text x="{px}" y="{h - pad + 16}" text-anchor="middle">{i + 1}</text>')
    for j, (name, values) in enumerate(series.items()):
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(values) if v == v))
        color = colors[j % len(colors)]
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{w - pad - 150}" y="{pad + 16 * j}" fill="{color}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


async def main_async(args: argparse.Namespace, servers: list[Server]) -> dict[str, Any]:
    cells = [int(x) for x in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    samples: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for s in servers:  # warm up: load pages, first-call costs
        await run_cell(s, "multiturn", 1, -1, argparse.Namespace(turns=1, max_tokens=8))
    for r in range(args.rounds):
        for workload in workloads:
            for n in cells:
                order = servers if (r + n) % 2 == 0 else servers[::-1]
                for s in order:
                    decode0 = await decode_seconds(s)
                    t0 = time.perf_counter()
                    convs = await run_cell(s, workload, n, r, args)
                    st = cell_stats(convs, time.perf_counter() - t0)
                    decode1 = await decode_seconds(s)
                    both = decode0 is not None and decode1 is not None
                    st["decode_s"] = decode1 - decode0 if both else None  # type: ignore[operator]
                    samples.setdefault((workload, n, s.name), []).append(st)
                    print(f"round {r} {workload} N={n} {s.name}: TTFT p50 {st['ttft_p50']:.0f} ms, "
                          f"e2e {st['e2e_s']:.2f} s, {st['tok_s']:.1f} tok/s, rows/turn "
                          f"{[int(t['prompt_n']) for t in st['per_turn']]}", file=sys.stderr, flush=True)
    return {"samples": samples, "cells": cells, "workloads": workloads}


def report(result: dict[str, Any], names: list[str], args: argparse.Namespace) -> str:
    samples = result["samples"]
    lines = []
    for workload in result["workloads"]:
        lines.append(f"\n### {workload}\n")
        lines.append(
            "| N | server | TTFT p50 / p99 (turns 2+) ms | TTFT p50 per turn ms | prompt rows per turn | "
            "e2e per conversation s | tokens/s | answers differing |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for n in result["cells"]:
            for name in names:
                ss = samples.get((workload, n, name), [])
                if not ss:
                    continue
                n_turns = len(ss[0]["per_turn"])
                per_turn = [median([s["per_turn"][k]["ttft_p50"] for s in ss]) for k in range(n_turns)]
                rows = [median([s["per_turn"][k]["prompt_n"] for s in ss]) for k in range(n_turns)]
                other = samples.get((workload, n, names[0]), [])
                diff = sum(a != b for s, o in zip(ss, other, strict=False)
                           for ca, cb in zip(s["texts"], o["texts"], strict=False)
                           for a, b in zip(ca, cb, strict=False)) if name != names[0] else 0
                total = sum(len(c) for s in ss for c in s["texts"])
                lines.append(
                    f"| {n} | {name} | {median([s['ttft_p50'] for s in ss]):.0f} / "
                    f"{median([s['ttft_p99'] for s in ss]):.0f} | "
                    f"{', '.join(f'{x:.0f}' for x in per_turn)} | {', '.join(f'{x:.0f}' for x in rows)} | "
                    f"{median([s['e2e_s'] for s in ss]):.2f} | {median([s['tok_s'] for s in ss]):.1f} | "
                    f"{diff}/{total} |"
                )
        for n in result["cells"]:
            a, b = (samples.get((workload, n, x), []) for x in names[:2])
            if a and b:
                # paired: each round's conversations differ (their topics, so their answers' length);
                # the ratio of the two servers on the same round's conversations, then the median
                pair = {k: median([x[k] / y[k] for x, y in zip(a, b, strict=False)])
                        for k in ("ttft_p50", "e2e_s")}
                lines.append(
                    f"\nN={n}: ours/llama-server TTFT p50 "
                    f"{median([s['ttft_p50'] for s in a]) / median([s['ttft_p50'] for s in b]):.2f}x "
                    f"(paired per round {pair['ttft_p50']:.2f}x), "
                    f"e2e {median([s['e2e_s'] for s in a]) / median([s['e2e_s'] for s in b]):.2f}x "
                    f"(paired {pair['e2e_s']:.2f}x)"
                )
                if all(x.get("decode_s") is not None for x in a):
                    # A floor for any server on these kernels: every step's rows are forced (one
                    # token per generating conversation, each turn's new prompt rows), so our time
                    # in the forward passes is time llama-server's own steps take too.
                    pairs = list(zip(a, b, strict=False))
                    wall = median([x["wall_s"] / y["wall_s"] for x, y in pairs])
                    share = median([x["decode_s"] / x["wall_s"] for x in a])
                    floor = median([x["decode_s"] / y["wall_s"] for x, y in pairs])
                    lines.append(
                        f"N={n}: wall per round, paired {wall:.2f}x; ours in forward passes {share:.0%} of "
                        f"its wall; ours' forward-pass seconds / llama-server's wall, paired {floor:.2f}x"
                    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--targets", default="ours,llama-server")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--ctx-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="multiturn,rag,agent")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64, help="a cap; answers stop at EOS")
    p.add_argument("--svg", type=Path, default=None)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--server-arg", action="append", default=[])
    args = p.parse_args()
    args.url, args.kv_unified = [], False
    args.worker_arg = [*args.worker_arg, "--metrics"]  # its forward-pass seconds (decode_seconds)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_chat_"))
    servers, notes = build_targets(args, log_dir)
    for note in notes:
        print(note)
    try:
        for s in servers:
            s.start(timeout=180)
        result = asyncio.run(main_async(args, servers))
    finally:
        for s in servers:
            s.stop()
    names = [s.name for s in servers]
    print(f"rounds {args.rounds}, turns {args.turns}, max_tokens {args.max_tokens}, greedy, streaming chat")
    print(report(result, names, args))
    if args.svg is not None and "multiturn" in result["workloads"]:
        n0 = result["cells"][0]
        series = {
            name: [
                median([s["per_turn"][k]["ttft_p50"] for s in result["samples"][("multiturn", n0, name)]])
                for k in range(args.turns)
            ]
            for name in names
        }
        svg_plot(args.svg, series, f"TTFT per turn, multi-turn chat, N={n0} (SmolLM2-135M Q4_1)")
        print(f"plot: {args.svg}")


if __name__ == "__main__":
    main()
