"""How often a history reuse changes a greedy answer (README, "Same input, same output").

    .venv/bin/python -m bench.bench_history --model SmolLM2-135M-Instruct.Q4_1.gguf

Runs bench_chat.py's multi-turn conversations one at a time on our worker (each turn reuses
the previous turns' rows, answers included), then sends every turn's prompt again with
`cache_prompt: false` (computed fresh, as a prompt of its own) and counts the answers that
differ, and the turns whose evaluated rows show a reuse.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.bench_chat import QUESTIONS, TOPICS
from bench.common import ROOT, Server, free_port


def chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int, **kw: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                   "temperature": 0, **kw})
    r.raise_for_status()
    return dict(r.json())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--worker-arg", action="append", default=[])
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "worker.server.cli", "--model", str(args.model), "--port", str(port),
           "--host", "127.0.0.1", "--parallel", "4", "--ctx-size", "8192", "--threads", "2", *args.worker_arg]
    server = Server("ours", f"http://127.0.0.1:{port}", cmd=cmd,
                    log_path=Path(tempfile.mkdtemp(prefix="bench_history_")) / "ours.log",
                    env=dict(os.environ, PYTHONPATH=str(ROOT)))
    print("ours:", " ".join(cmd[3:]))
    server.start(timeout=180)
    n_turns = n_differ = n_reused = 0
    try:
        with httpx.Client(base_url=server.base_url, timeout=600) as client:
            for c in range(args.conversations):
                messages: list[dict[str, str]] = []
                for k in range(args.turns):
                    q = QUESTIONS[k % len(QUESTIONS)].replace("France", TOPICS[c % len(TOPICS)])
                    messages.append({"role": "user", "content": q})
                    warm = chat(client, messages, args.max_tokens)
                    fresh = chat(client, messages, args.max_tokens, cache_prompt=False)
                    a, b = warm["choices"][0]["message"]["content"], fresh["choices"][0]["message"]["content"]
                    n_turns += 1
                    n_reused += warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                    n_differ += a != b
                    messages.append({"role": "assistant", "content": a})
    finally:
        server.stop()
    print(
        f"{n_turns} turns ({n_reused} with reused rows): {n_differ} greedy answers differ "
        f"from a fresh prompt's"
    )


if __name__ == "__main__":
    main()
