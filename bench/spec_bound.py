"""How fast prompt-lookup speculation can possibly make the rewrite workload on this machine.

    .venv/bin/python -m bench.spec_bound [--threads 2] [--reps 30]

Speculation turns K+1 one-row decode steps into one step of K+1 rows. It pays only as far as a
step of K+1 rows costs less than K+1 one-row steps, and that ratio is the hardware's, not ours.
This script measures it and bounds the speed-up any drafting policy could reach:

1. The cost of a verify step: `llama_decode` of n rows of one sequence at context position ~300,
   every row an output (a verify entry's shape), through llama-cpp-python on the real SmolLM2
   Q4_1 with the worker's settings (flash attention on, `--threads`), n = 1, 2, 3, 5, 9, 17, 33;
   the median of `--reps` calls each, in interleaved rounds (min printed too).
2. The workload's answers: our worker (no speculation) answers bench_spec.py's four rewrite
   prompts greedily (chat, temperature 0, 320 tokens at most); the answers' tokens and the
   prompt time are read back.
3. The bound: an oracle drafts, at every step, exactly the tokens that prompt lookup
   (`--size-n`-gram, the latest earlier match in prompt + output) would get right, and nothing
   that would be rejected. No real policy does better. Step cost follows the measured curve
   (interpolated); tokens/s counts the prompt's time as bench_spec.py's wall time does.

The issue's goal is 2x tokens/s at N = 1 on the rewrite workload (bench_spec.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.bench_spec import rewrite_msg
from bench.common import ROOT, Server, free_port

ROWS = (1, 2, 3, 5, 9, 17, 33)


def step_costs(model: str, threads: int, reps: int, rounds: int = 3) -> dict[int, tuple[float, float]]:
    """n rows -> (median ms, min ms) of one llama_decode of n rows of one sequence, all outputs."""
    import llama_cpp as L

    llm = L.Llama(model_path=model, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                  flash_attn=True, logits_all=True, verbose=False)
    toks = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 40)[:400]
    llm.eval(toks[:300])
    ctx, mem = llm._ctx.ctx, L.llama_get_memory(llm._ctx.ctx)
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for _ in range(rounds):
        for n in ROWS:
            batch = L.llama_batch_init(n, 0, 1)
            for _ in range(reps):
                for i in range(n):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = toks[300 + i], 300 + i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, 1
                batch.n_tokens = n
                t0 = time.perf_counter()
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                times[n].append((time.perf_counter() - t0) * 1e3)
                L.llama_memory_seq_rm(mem, 0, 300, -1)
            L.llama_batch_free(batch)
    return {n: (statistics.median(v), min(v)) for n, v in times.items()}


def answers(model: str, threads: int, max_tokens: int) -> list[dict]:
    """Our worker's greedy answers to the rewrite prompts: prompt and answer tokens, prompt ms."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="spec_bound_")) / "worker.log"
    server = Server("ours", f"http://127.0.0.1:{port}", log_path=log, cmd=[
        sys.executable, "-m", "worker.server.cli", "--model", model, "--parallel", "1", "--ctx-size", "4096",
        "--threads", str(threads), "--port", str(port), "--host", "127.0.0.1"])
    server.start(timeout=120)
    out = []
    try:
        url = server.base_url
        for i in range(4):
            msgs = [{"role": "user", "content": rewrite_msg(i)}]
            r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": False}).json()
            text = r["choices"][0]["message"]["content"]
            prompt = httpx.post(f"{url}/apply-template", json={"messages": msgs}).json()["prompt"]
            p = httpx.post(f"{url}/tokenize", json={"content": prompt, "add_special": True,
                                                    "parse_special": True}).json()["tokens"]
            o = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
            out.append({"prompt": p, "out": o, "prompt_ms": r["timings"]["prompt_ms"]})
    finally:
        server.stop()
    return out


def lookup(ctx: list[int], size_n: int) -> int | None:
    """Where the tokens after the latest earlier occurrence of ctx's last size_n tokens start."""
    key = ctx[-size_n:]
    for s in range(len(ctx) - size_n - 1, -1, -1):
        if ctx[s : s + size_n] == key:
            return s + size_n
    return None


def oracle_steps(prompt: list[int], out: list[int], size_n: int, cap: int) -> list[int]:
    """Rows of each decode step when every step drafts exactly what prompt lookup gets right."""
    steps, t = [], 0
    while t < len(out):
        ctx = prompt + out[:t]
        j = lookup(ctx, size_n) if t > 0 else None
        draft = ctx[j : j + cap] if j is not None else []
        a = 0
        while a < len(draft) and t + a < len(out) and draft[a] == out[t + a]:
            a += 1
        steps.append(1 + a)
        t += min(a + 1, len(out) - t)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--size-n", type=int, default=3)
    ap.add_argument("--cap", type=int, default=32, help="the most tokens one draft may hold")
    args = ap.parse_args()
    costs = step_costs(args.model, args.threads, args.reps)
    one = costs[1][0]
    print(f"llama_decode of n rows of one sequence, all outputs (flash attention, -t {args.threads}):")
    print("| rows | median ms | min ms | per row, x one-row step | best speed-up (all accepted) |")
    print("|---|---|---|---|---|")
    for n, (med, lo) in costs.items():
        print(f"| {n} | {med:.1f} | {lo:.1f} | {med / n / one:.2f} | {n * one / med:.2f}x |")
    xs = np.array(ROWS, dtype=float)
    ys = np.array([costs[n][0] for n in ROWS])

    def cost(n: int) -> float:
        if n <= ROWS[-1]:
            return float(np.interp(n, xs, ys))
        return float(ys[-1] + (n - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))  # the last slope

    data = answers(args.model, args.threads, args.max_tokens)
    print(f"\noracle prompt lookup (size_n {args.size_n}, drafts up to {args.cap}) on the rewrite answers:")
    print("| prompt | answer tokens | steps | decode speed-up | tok/s speed-up (prompt time counted) |")
    print("|---|---|---|---|---|")
    ratios = []
    for i, d in enumerate(data):
        steps = oracle_steps(d["prompt"], d["out"], args.size_n, args.cap)
        plain = len(d["out"]) * one
        spec = sum(cost(n) for n in steps)
        wall = (d["prompt_ms"] + plain) / (d["prompt_ms"] + spec)
        ratios.append(wall)
        print(f"| {i} | {len(d['out'])} | {len(steps)} | {plain / spec:.2f}x | {wall:.2f}x |")
    print(f"\nmedian tok/s bound over the prompts: {statistics.median(ratios):.2f}x (goal: 2x)")


if __name__ == "__main__":
    main()
