"""Load: 500 concurrent streaming requests over 3 models with `--models-max 2 --parallel 4`.

Every request either completes with the right number of tokens or gets a clean 503 with
`Retry-After` (the queue bound); none is lost (an error event, a cut stream, another status)
and none outlives the deadline; each load spawns exactly one worker; the router's RSS stays
bounded. The default test uses fake workers (real subprocesses; the router does the same work
for them); `-m soak` runs the same on real workers with the tiny GGUF model.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.reliability.conftest import GGUF
from tests.router.conftest import RouterProc, fake_model
from tests.util import wait_until

Factory = Callable[..., RouterProc]
MODELS = ("a", "b", "c")
RSS_GROWTH_LIMIT_MB = 64.0


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # 503 + Retry-After
    lost: list[str] = field(default_factory=list)  # anything else, with what it was
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"sent={self.sent} completed={self.completed} rejected_503={self.rejected} lost={len(self.lost)} "
            f"in {self.seconds:.1f}s"
        )


async def one_stream(client: httpx.AsyncClient, model: str, n_tokens: int, body_extra: dict[str, Any],
                     count: Callable[[dict[str, Any]], int], tally: Tally) -> None:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": n_tokens, **body_extra}
    tally.sent += 1
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code == 503:
                await resp.aread()
                ok = resp.headers.get("retry-after", "").isdigit() and "error" in resp.json()
                if ok:
                    tally.rejected += 1
                else:
                    tally.lost.append(f"503 without Retry-After/envelope: {resp.text[:200]}")
                return
            if resp.status_code != 200:
                tally.lost.append(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            tokens, done = 0, False
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tally.lost.append(f"error event: {chunk}")
                        return
                    tokens += count(chunk)
            if done and tokens == n_tokens:
                tally.completed += 1
            else:
                tally.lost.append(f"stream ended after {tokens} tokens (done={done})")
    except httpx.HTTPError as e:
        tally.lost.append(f"transport: {e!r}")


async def blast(base: str, n: int, n_tokens: int, deadline_s: float, body_extra: dict[str, Any],
                count: Callable[[dict[str, Any]], int]) -> Tally:
    tally = Tally()
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(deadline_s), limits=limits) as client:
        tasks = [
            asyncio.create_task(
                one_stream(client, MODELS[i % len(MODELS)], n_tokens, body_extra, count, tally)
            )
            for i in range(n)
        ]
        _done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        tally.lost += [f"hung past the {deadline_s}s deadline"] * len(pending)
    tally.seconds = time.monotonic() - t0
    return tally


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def loads_per_model(r: RouterProc) -> Counter[str]:
    """`omni_router:model_loads` from /metrics: spawns the router started, per model."""
    out: Counter[str] = Counter()
    for line in httpx.get(f"{r.base}/metrics", timeout=10).text.splitlines():
        if line.startswith("omni_router:model_loads_total{"):
            model = line.split('model="', 1)[1].split('"', 1)[0]
            out[model] = int(float(line.rsplit(" ", 1)[1]))
    return out


def spawns_per_model(spawn_dir: Path) -> Counter[str]:
    return Counter({m: len((spawn_dir / f"{m}.txt").read_text().split()) for m in MODELS
                    if (spawn_dir / f"{m}.txt").exists()})


def fake_chunk_tokens(chunk: dict[str, Any]) -> int:
    return sum(1 for ch in chunk.get("choices", []) if ch.get("delta", {}).get("content"))


def run_load(r: RouterProc, n: int, n_tokens: int, deadline_s: float, body_extra: dict[str, Any],
             count: Callable[[dict[str, Any]], int]) -> tuple[Tally, float, float]:
    asyncio.run(blast(r.base, 30, n_tokens, deadline_s, body_extra, count))  # warm: every model loaded once
    rss_before = rss_mb(r.proc.pid)
    tally = asyncio.run(blast(r.base, n, n_tokens, deadline_s, body_extra, count))
    rss_after = rss_mb(r.proc.pid)
    print(f"\n[reliability] load: {tally.line()}; router RSS {rss_before:.0f} -> {rss_after:.0f} MiB")
    return tally, rss_before, rss_after


def test_500_concurrent_streams_over_3_models_lose_nothing(router_factory: Factory, tmp_path: Path) -> None:
    spawn_dir = tmp_path / "spawns"
    spawn_dir.mkdir()
    preset = "".join(fake_model(m, "--tokens", "20", "--token-delay", "0.01", "--load-time", "0.3",
                                "--spawn-log", str(spawn_dir / f"{m}.txt")) for m in MODELS)
    r = router_factory(preset, "--models-max", "2", "--parallel", "4", "--max-queue", "200")
    tally, rss_before, rss_after = run_load(r, 500, 20, 120.0, {}, fake_chunk_tokens)
    assert not tally.lost, Counter(tally.lost).most_common(5)
    assert tally.completed + tally.rejected == tally.sent == 500
    assert tally.completed >= 200  # the queue bound rejects some, not most
    assert spawns_per_model(spawn_dir) == loads_per_model(r)  # one spawn per load, never two
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB
    def left() -> dict[str, list[float]]:  # what is still queued or in flight, per gauge
        metrics = httpx.get(f"{r.base}/metrics", timeout=10).text
        return {gauge: [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith(gauge + "{")]
                for gauge in ("omni_router:requests_in_flight", "omni_router:requests_queued")}

    # nothing left: a request's last byte reaches its client just before the router counts it
    # out, so the gauges are waited for, not read once
    wait_until(lambda: all(sum(v) == 0 for v in left().values()), 10, what="in-flight and queued at 0")


def real_chunk_tokens(chunk: dict[str, Any]) -> int:
    usage = chunk.get("usage")
    return int(usage["completion_tokens"]) if usage else 0


@pytest.mark.soak
@pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
def test_soak_500_concurrent_streams_on_real_workers(router_factory: Factory) -> None:
    preset = "[defaults]\nctx-size = 512\nthreads = 1\nstop-timeout = 5\n" + "".join(
        f'[models.{m}]\nmodel = "{GGUF}"\nbackend = "llama_cpp"\n' for m in MODELS)
    r = router_factory(preset, "--models-max", "2", "--parallel", "4", "--max-queue", "200")
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    tally, rss_before, rss_after = run_load(r, 500, 16, 600.0, extra, real_chunk_tokens)
    assert not tally.lost, Counter(tally.lost).most_common(5)
    assert tally.completed + tally.rejected == tally.sent == 500
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB
