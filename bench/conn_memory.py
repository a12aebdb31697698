"""The router's memory per connection: idle keep-alive connections, and streams waiting in its queue.

    .venv/bin/python -m bench.conn_memory [--connections 4000]

Starts `omni-router` on the tiny model (1 slot, so that nearly every stream waits in the
router's queue), then measures the router's RSS: at rest; with `--connections` idle keep-alive
connections open (a `GET /health` each, then held); and with as many streaming chat requests
open, all but the forwarded few waiting in the queue. Prints each step's RSS and the bytes per
connection. Traffic stays on 127.0.0.1.

`--tracemalloc`: the router runs under tracemalloc (bench/traced_router.py) and each step also
prints the Python heap's growth by source line (slower; the RSS figures then include
tracemalloc's own bookkeeping, so take them from a run without it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.common import ROOT, router_server

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


async def _idle(base: str, n: int, hold: asyncio.Event) -> None:
    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")
        await hold.wait()
        writer.close()

    await asyncio.gather(*(one() for _ in range(n)))


async def _streams(base: str, n: int, hold: asyncio.Event) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def one() -> None:
            try:
                async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        if hold.is_set():
                            break
            except httpx.HTTPError:
                pass

        await asyncio.gather(*(one() for _ in range(n)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=4000)
    ap.add_argument("--tracemalloc", action="store_true", help="where the bytes go, by source line")
    args = ap.parse_args(argv)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(tempfile.mkdtemp(prefix="conn_memory_"))
    preset = tmp / "preset.toml"
    preset.write_text(f'[models.tiny]\nmodel = "{GGUF}"\nparallel = 1\nthreads = 1\nctx-size = 2048\n'
                      "load-on-startup = true\n")
    router = router_server(preset, tmp / "router.log", "--max-queue", str(args.connections * 2),
                           "--log-level", "warning")
    traced = tmp / "tracemalloc.txt"
    if args.tracemalloc:
        assert router.cmd is not None
        router.cmd[router.cmd.index("router.cli")] = "bench.traced_router"
        router.env = {**(router.env or {}), "OMNI_TRACEMALLOC_OUT": str(traced)}
    router.start(60)
    base = router.base_url
    assert router.pid is not None
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/v1/models", timeout=2).json()["data"][0]["status"]["value"] == "loaded":
                    break
            except (httpx.HTTPError, KeyError, IndexError):
                pass
            time.sleep(0.2)
        httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        time.sleep(1)
        rest = _rss(router.pid)
        print(f"router at rest: {rest / 2**20:.1f} MiB")
        steps = (("idle keep-alive connections", _idle), ("streams (queued in the router)", _streams))
        for name, fn in steps:
            async def run(fn=fn) -> int:  # type: ignore[no-untyped-def]
                hold = asyncio.Event()
                task = asyncio.ensure_future(fn(base, args.connections, hold))
                await asyncio.sleep(8 if fn is _idle else 20)
                rss = _rss(router.pid)
                if args.tracemalloc:
                    os.kill(router.pid, signal.SIGUSR2)
                    await asyncio.sleep(5)
                hold.set()
                await asyncio.wait_for(task, 600 if args.tracemalloc else 120)
                return rss

            before = _rss(router.pid)
            if args.tracemalloc:
                os.kill(router.pid, signal.SIGUSR1)
                time.sleep(2)
            rss = asyncio.run(run())
            per = (rss - before) / args.connections
            print(f"{args.connections} {name}: {rss / 2**20:.1f} MiB ({(rss - before) / 2**20:+.1f} MiB, "
                  f"{per / 1024:.1f} KiB each)")
            if args.tracemalloc:
                print(traced.read_text())
            time.sleep(2)
        return 0
    finally:
        router.stop(15)

if __name__ == "__main__":
    sys.exit(main())
