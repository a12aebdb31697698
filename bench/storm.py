"""Storm: many concurrent streams through the router while its workers are killed (issue 39).

    .venv/bin/python -m bench.storm [--streams 20000] [--processes 4] [--kill-every 10]
                                    [--models 3] [--models-max 2] [--tokens 8] [--timeout 600]
                                    [--json PATH]

Starts `omni-router` on a preset of `--models` tiny models (the same GGUF under other names, 8
slots each) with `--models-max`, then `--processes` client processes open `--streams`
streaming chat requests in all, at once, each to a random model, asking `--tokens` tokens.
Every `--kill-every` seconds one worker process is SIGKILLed while streams run. Each stream ends
as one of: completed (the tokens, then [DONE]), an error event, a clean 503 (with Retry-After),
another status, a transport error, or hung (no end by `--timeout`). Printed: those counts, the
kills, the requests the killed workers were running at most (slots x kills), the router's peak
RSS, and each model's state once settled (none may be left failed: one killed just before the
end is shown failed for its backoff, then unloaded; `SETTLE_S` is the wait).

The clients are separate processes so that the client is not the bottleneck; each raises its
open-files limit to the hard one, as the router does. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import random
import resource
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from bench.common import ROOT, router_server

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
SLOTS = 8
SETTLE_S = 45.0  # the longest backoff (30 s) and then some: a model still failed after this is wedged


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _one(client: httpx.AsyncClient, base: str, model: str, tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "storm"}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code == 503:
                return "503" if "retry-after" in r.headers else "503 without Retry-After"
            if r.status_code != 200:
                return f"status {r.status_code}"
            n, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return "error event"
                if event.get("choices") and event["choices"][0].get("finish_reason") is None:
                    n += 1
            return "completed" if done else "ended without [DONE]"
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as e:
        return f"transport: {type(e).__name__}"


def _client(base: str, models: list[str], n: int, tokens: int, timeout: float, seed: int,
            out: mp.Queue) -> None:  # type: ignore[type-arg]
    _raise_nofile()
    rng = random.Random(seed)

    async def main() -> Counter[str]:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=timeout), limits=limits) as c:
            results = await asyncio.gather(*(_one(c, base, rng.choice(models), tokens) for _ in range(n)))
        return Counter(results)

    out.put(dict(asyncio.run(main())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=20000)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=10.0)
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--models-max", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--router-arg", action="append", default=[], help="another router flag (repeatable)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here (tests/reliability)")
    args = ap.parse_args(argv)
    _raise_nofile()
    names = [f"m{i}" for i in range(args.models)]
    tmp = Path(tempfile.mkdtemp(prefix="storm_"))
    preset = tmp / "preset.toml"
    preset.write_text("[defaults]\nctx-size = 2048\nthreads = 1\nstop-timeout = 5\n"
                      f"parallel = {SLOTS}\n" + "".join(f'\n[models.{n}]\nmodel = "{GGUF}"\n' for n in names))
    router = router_server(preset, tmp / "router.log", "--models-max", str(args.models_max), "--max-queue",
                           str(args.streams * 2), "--log-level", "warning", *args.router_arg)
    base = router.base_url
    router.start(60)
    try:
        proc = psutil.Process(router.pid)
        peak_rss, kills, stop = 0, [], threading.Event()

        def watch() -> None:
            nonlocal peak_rss
            next_kill = time.monotonic() + args.kill_every
            while not stop.is_set():
                peak_rss = max(peak_rss, proc.memory_info().rss)
                if args.kill_every > 0 and time.monotonic() >= next_kill:
                    workers = []
                    for c in proc.children():
                        with contextlib.suppress(psutil.Error):  # gone, or a zombie not reaped yet
                            if "worker.server.cli" in " ".join(c.cmdline()):
                                workers.append(c)
                    if workers:
                        victim = random.choice(workers)
                        with contextlib.suppress(psutil.Error):
                            victim.send_signal(signal.SIGKILL)
                            kills.append(victim.pid)
                    next_kill += args.kill_every
                stop.wait(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        per = [args.streams // args.processes + (i < args.streams % args.processes)
               for i in range(args.processes)]
        t0 = time.monotonic()
        clients = [mp.Process(target=_client, args=(base, names, n, args.tokens, args.timeout, i, out))
                   for i, n in enumerate(per)]
        for c in clients:
            c.start()
        total: Counter[str] = Counter()
        for _ in clients:
            total.update(out.get(timeout=args.timeout + 120))
        for c in clients:
            c.join(30)
        wall = time.monotonic() - t0
        stop.set()
        watcher.join(5)
        # A model killed shortly before the end shows `failed` for a while (its backoff, at least
        # FAILED_SHOWN_S), then settles (unloaded, or loaded again if requests wait): wait for it.
        settle_deadline = time.monotonic() + SETTLE_S
        while True:
            listing = httpx.get(base + "/v1/models", timeout=30).json()["data"]
            states = {m["id"]: m["status"]["value"] for m in listing}
            if "failed" not in states.values() or time.monotonic() > settle_deadline:
                break
            time.sleep(0.5)
        settled = SETTLE_S - max(0.0, settle_deadline - time.monotonic())
        scrape = httpx.get(base + "/metrics", timeout=30).text.splitlines()
        refused = next((line.split()[-1] for line in scrape
                        if line.startswith("omni_router:connections_refused_total")), "?")
        print(f"storm: {args.streams} streams over {args.models} models (--models-max {args.models_max}, "
              f"{SLOTS} slots each), {args.processes} client processes, {args.tokens} tokens each, "
              f"a worker killed every {args.kill_every:g} s")
        print(f"wall {wall:.1f} s; kills {len(kills)}; requests the killed workers could be running: "
              f"<= {len(kills) * SLOTS} (slots) or {len(kills) * (SLOTS + 2)} (slots + margin)")
        for outcome, n in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"  {outcome:28s} {n}")
        print(f"  (of the 503s, at the router's connection budget: {refused})")
        print(f"router peak RSS {peak_rss / 2**20:.0f} MiB; models {settled:.1f} s after the last stream: "
              f"{states}")
        if args.json is not None:
            args.json.write_text(json.dumps({
                "outcomes": dict(total), "kills": len(kills), "bound_slots": len(kills) * SLOTS,
                "bound_with_margin": len(kills) * (SLOTS + 2), "budget_503s": refused,
                "peak_rss_mib": peak_rss / 2**20, "states": states, "wall_s": wall}))
        return 0
    finally:
        router.stop(15)

if __name__ == "__main__":
    sys.exit(main())
