"""Per-request overhead of the worker: a cached one-token answer, with and without the chat
template, tools and a grammar.

    .venv/bin/python -m bench.bench_overhead --model SmolLM2-135M-Instruct.Q4_1.gguf

Each variant sends the same request once to warm the cache (its prompt's logits are saved), then
`--requests` more, one at a time on one keep-alive connection: each is answered from the saved
logits, with no decode, so what is measured is everything else (HTTP, request preparation,
template, tokenization, grammar, scheduling, sampling, the response). Reported per variant: wall
time per request as the client sees it (p50, p99) and the worker's CPU time per request (its
process's user + system time over the run, divided by the requests).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import ROOT, Server, free_port, percentile

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say yes or no: is water wet?"}]

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "completion (token ids)": ("/v1/completions", {"prompt": list(range(100, 148))}),
    "chat (template)": ("/v1/chat/completions", {"messages": MESSAGES}),
    "chat + tools": ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS}),
    "chat + json grammar": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_object"}},
    ),
    "chat + tools + json grammar": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "tools": TOOLS, "response_format": {"type": "json_object"}},
    ),
}


def measure(url: str, pid: int, path: str, body: dict[str, Any], n: int) -> tuple[float, float, float]:
    body = {**body, "max_tokens": 1, "temperature": 0}
    proc = psutil.Process(pid)
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(3):  # the first computes the prompt; then it is cached with its logits
            client.post(path, json=body).raise_for_status()
        walls = []
        cpu0 = sum(proc.cpu_times()[:2])
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.post(path, json=body)
            walls.append((time.perf_counter() - t0) * 1e3)
            r.raise_for_status()
        cpu_ms = (sum(proc.cpu_times()[:2]) - cpu0) * 1e3 / n
    return percentile(walls, 50), percentile(walls, 99), cpu_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "worker.server.cli", "--model", str(args.model), "--port", str(port),
           "--host", "127.0.0.1", "--parallel", "4", "--ctx-size", "8192", "--threads", str(args.threads)]
    log_dir = Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    server = Server("ours", f"http://127.0.0.1:{port}", cmd=cmd, log_path=log_dir / "ours.log",
                    env={"PYTHONPATH": str(ROOT), **{k: v for k, v in __import__("os").environ.items()}})
    print("ours:", " ".join(cmd[3:]))
    server.start(timeout=180)
    try:
        assert server.pid is not None
        print(f"{args.requests} sequential requests per variant, each a cached one-token answer (no decode)")
        print("| variant | wall p50 ms | wall p99 ms | worker CPU ms / request |")
        print("|---|---|---|---|")
        for name, (path, body) in VARIANTS.items():
            p50, p99, cpu = measure(server.base_url, server.pid, path, body, args.requests)
            print(f"| {name} | {p50:.2f} | {p99:.2f} | {cpu:.2f} |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
