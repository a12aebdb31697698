"""Swap benchmark: agent-like traces over more models than fit, FIFO against our scheduler and
against the real llama-swap, side by side in one run (router/lifecycle/swap.py; docs/swaps.md).

    .venv/bin/python bench/bench_swap.py [--agents 8] [--rounds 1] [--load-delay 1.5] [--json out.json]
        [--policies llama-swap,fifo,fifo-batch,fair] [--chat-clients 1 --chat-think 0.5 --chat-tokens 4]

One run per target, the same trace, one model at a time: our router with `--models-max 1` and
`--swap-policy fifo` (requests in arrival order, a swap for each head of the queue), `fifo-batch`
(the router's rule before the scheduler: each load serves every request queued for its model) or
`fair` (ours); and `llama-swap`, the real one (its defaults: one model at a time), built by
scripts/build_llama_swap.sh, running our worker with the argv the router would use
(bench/llama_swap.py). Three tiny GGUF models A, B, C whose loads are made realistic by the
preset's `load-delay`.

The trace: `--agents` clients, each a chain of calls A, B, A, C (`--rounds` times; client i
starts i steps into the chain) with its own think time between calls (seeded, 0.3-1.5 s), plus
a background chat on A: `--chat-clients` clients, each a call of `--chat-tokens` then
`--chat-think` s, until every agent is done (or for `--chat-seconds`). Each call is a greedy
chat completion.

Reported per target: swaps (loads: from /models/sse, or llama-swap's log), total wall time (until
the last agent's last answer), p50 / p99 latency per model (a call's whole time: its wait for the
model and its answer), the longest call, the longest on B or C (the models the chat on A keeps
waiting), and `--swap-max-wait` (the bound: no call should wait much past it, plus the swap it
waited for).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import percentile, router_server  # noqa: E402  # after the sys.path insert above
from bench.llama_swap import BINARY, LlamaSwap, worker_commands  # noqa: E402

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
CHAIN = ("A", "B", "A", "C")


def preset_text(load_delay: float, ctx_size: int = 256, gguf: Path = GGUF) -> str:
    models = "".join(f'[models.{m}]\nmodel = "{gguf}"\nbackend = "llama_cpp"\n' for m in ("A", "B", "C"))
    return (
        f"[defaults]\nctx-size = {ctx_size}\nparallel = 2\nthreads = 1\nstop-timeout = 5\n"
        f"load-delay = {load_delay}\n{models}"
    )


@dataclass
class Run:
    policy: str
    calls: list[tuple[str, float]] = field(default_factory=list)  # (model, seconds)
    loads: dict[str, int] = field(default_factory=dict)
    sequence: list[str] = field(default_factory=list)  # the models in the order they loaded
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def summary(self, max_wait: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "swaps": sum(self.loads.values()),
            "loads": self.loads,
            "wall_s": round(self.wall_s, 2),
            "calls": len(self.calls),
            "errors": len(self.errors),
            "swap_max_wait_s": max_wait,
        }
        for m in ("A", "B", "C"):
            xs = [s for n, s in self.calls if n == m]
            out[m] = {
                "calls": len(xs),
                "p50_s": round(percentile(xs, 50), 2),
                "p99_s": round(percentile(xs, 99), 2),
            }
        out["longest_s"] = round(max(s for _, s in self.calls), 2) if self.calls else None
        others = [s for n, s in self.calls if n != "A"]  # the models the chat on A keeps waiting
        out["longest_bc_s"] = round(max(others), 2) if others else None
        return out


class Router:
    """`omni-router` on `preset` with `args` (warnings only), healthy; its log in a temporary folder."""

    def __init__(self, preset: Path, *args: str) -> None:
        self.log_dir = tempfile.TemporaryDirectory()
        log_path = Path(self.log_dir.name) / "router.log"
        self.server = router_server(preset, log_path, "--log-level", "warning", *args)
        self.base = self.server.base_url
        self.server.start(30)

    def close(self) -> None:
        self.server.stop(30)
        self.log_dir.cleanup()


def count_loads(r: Router, run: Run, stop: threading.Event, ready: threading.Event) -> None:
    """Each move of a model into `loaded` from /models/sse is one load (with --models-max 1, a swap)."""
    last: dict[str, str] = {}
    try:
        with httpx.Client(base_url=r.base, timeout=None) as c, c.stream("GET", "/models/sse") as resp:
            for line in resp.iter_lines():
                if stop.is_set():
                    return
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                name, value = data["model"], data["status"]["value"]
                if value == "loaded" and last.get(name) != "loaded":
                    with run.lock:
                        run.loads[name] = run.loads.get(name, 0) + 1
                        run.sequence.append(name)
                last[name] = value
                ready.set()
    except httpx.HTTPError:
        if not stop.is_set():
            raise


def call(
    c: httpx.Client, run: Run, model: str, n: int, max_tokens: int = 4, *, ignore_eos: bool = False
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"step {n}"}],
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    resp = c.post("/v1/chat/completions", json=body)
    took = time.perf_counter() - t0
    with run.lock:
        run.calls.append((model, took))
        if resp.status_code != 200:
            run.errors.append(f"{model}: {resp.status_code} {resp.text[:200]}")


def agent(base: str, run: Run, i: int, rounds: int, think_s: float, max_tokens: int) -> None:
    chain = CHAIN[i % 4 :] + CHAIN[: i % 4]
    with httpx.Client(base_url=base, timeout=600) as c:
        for n, model in enumerate(chain * rounds):
            call(c, run, model, n, max_tokens)  # an answer that stops at EOS or max_tokens
            time.sleep(think_s)  # the agent thinks (its own work), then calls again


def background(base: str, run: Run, done: threading.Event, args: argparse.Namespace) -> None:
    """One client of the background chat on A: a call of `--chat-tokens`, `--chat-think` s, again;
    until the agents are done, or `--chat-seconds` after the start."""
    until = None if args.chat_seconds is None else time.monotonic() + args.chat_seconds
    with httpx.Client(base_url=base, timeout=600) as c:
        n = 0
        while not done.is_set() and (until is None or time.monotonic() < until):
            call(c, run, "A", n, args.chat_tokens, ignore_eos=True)  # an answer of exactly --chat-tokens
            n += 1
            done.wait(args.chat_think)


def one_policy(policy: str, args: argparse.Namespace, preset: Path) -> Run:
    """The trace through our router with `--swap-policy policy`, or through llama-swap ("llama-swap")."""
    if policy == "llama-swap":
        swap = LlamaSwap(worker_commands(preset), args.llama_swap)
        swap.start(30)
        try:
            run = drive(swap.base_url, policy, args)
            run.sequence = swap.loads()  # (its log goes with stop)
        finally:
            swap.stop()
        for name in run.sequence:
            run.loads[name] = run.loads.get(name, 0) + 1
        return run
    r = Router(
        preset, "--models-max", "1", "--swap-policy", policy, "--swap-max-wait", str(args.swap_max_wait)
    )
    run = Run(policy)
    stop, ready = threading.Event(), threading.Event()
    counter = threading.Thread(target=count_loads, args=(r, run, stop, ready), daemon=True)
    counter.start()
    ready.wait(10)
    try:
        drive(r.base, policy, args, run)
    finally:
        stop.set()
        r.close()
    return run


def drive(base: str, policy: str, args: argparse.Namespace, run: Run | None = None) -> Run:
    """Run the trace against `base`: the agents (client i starts 0.2 s after client i-1) and the
    background chat, until every agent is done."""
    run = run or Run(policy)
    rnd = random.Random(args.seed)
    thinks = [rnd.uniform(0.3, 1.5) for _ in range(args.agents)]
    done = threading.Event()
    t0 = time.perf_counter()
    agents = [
        threading.Thread(target=agent, args=(base, run, i, args.rounds, think, args.answer_tokens))
        for i, think in enumerate(thinks)
    ]
    chats = [
        threading.Thread(target=background, args=(base, run, done, args)) for _ in range(args.chat_clients)
    ]
    for chat in chats:
        chat.start()
    for i, t in enumerate(agents):
        time.sleep(0.2 if i else 0.0)
        t.start()
    for t in agents:
        t.join()
    run.wall_s = time.perf_counter() - t0
    done.set()
    for chat in chats:
        chat.join()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="times each agent runs its chain A, B, A, C")
    ap.add_argument("--load-delay", type=float, default=1.5, help="seconds added to each tiny model's load")
    ap.add_argument("--swap-max-wait", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-clients", type=int, default=1, help="clients of the background chat on A")
    ap.add_argument("--chat-think", type=float, default=0.5, help="seconds between a chat client's calls")
    ap.add_argument("--chat-tokens", type=int, default=4, help="tokens of a chat call's answer (ignore_eos)")
    ap.add_argument("--answer-tokens", type=int, default=4, help="an agent call's max_tokens (EOS ends it)")
    ap.add_argument("--ctx-size", type=int, default=256, help="each model's context (2 slots share it)")
    ap.add_argument("--model", type=Path, default=GGUF, help="the GGUF file models A, B and C run")
    ap.add_argument(
        "--chat-seconds", type=float, default=None, help="the chat stops then (default: with the agents)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--policies", default="fifo,fifo-batch,fair",
        help="--swap-policy values, in order; llama-swap: the real llama-swap on the same workers",
    )
    ap.add_argument("--llama-swap", type=Path, default=BINARY, help="scripts/build_llama_swap.sh builds it")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if not args.model.exists():
        sys.exit(f"{args.model} is missing: make models")
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "swap.toml"
        preset.write_text(preset_text(args.load_delay, args.ctx_size, args.model))
        runs = [one_policy(p, args, preset) for p in policies]
    results = [run.summary(args.swap_max_wait) for run in runs]
    print(
        f"swap bench: {args.agents} agents x {args.rounds} rounds of A, B, A, C (+ a background chat on A: "
        f"{args.chat_clients} client(s), {args.chat_tokens} tokens, {args.chat_think} s think"
        + ("" if args.chat_seconds is None else f", for {args.chat_seconds} s")
        + f"), --models-max 1, {args.model.name}, load-delay {args.load_delay} s, "
        f"--swap-max-wait {args.swap_max_wait} s"
    )
    print(
        f"{'policy':10} {'swaps':>5} {'wall s':>7} {'calls':>5}  "
        + "  ".join(f"{m} p50/p99 s" for m in ("A", "B", "C"))
        + "  longest s (B, C)  errors"
    )
    for s in results:
        cols = "  ".join(f"{s[m]['p50_s']:5.2f}/{s[m]['p99_s']:5.2f} " for m in ("A", "B", "C"))
        print(
            f"{s['policy']:10} {s['swaps']:5d} {s['wall_s']:7.1f} {s['calls']:5d}  {cols} "
            f"{s['longest_s']:9.2f} ({s['longest_bc_s']:5.2f})  {s['errors']:6d}"
        )
    by_policy = {s["policy"]: s for s in results}
    if (fair := by_policy.get("fair")) is not None:
        for name, base in by_policy.items():
            if name != "fair":
                print(
                    f"fair/{name}: swaps {fair['swaps'] / max(1, base['swaps']):.2f}x, wall time "
                    f"{fair['wall_s'] / base['wall_s']:.2f}x"
                )
    for run in runs:
        print(f"  {run.policy} loads in order: {' '.join(run.sequence)}")
        for e in run.errors[:3]:
            print(f"  {run.policy} error: {e}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
