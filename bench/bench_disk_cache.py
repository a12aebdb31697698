"""TTFT of a long prompt after its model was evicted, with the disk prompt cache vs a cold load
(issue 28; goal: <= 0.2x of cold on a 4,000-token prefix).

One router (`--models-max 1`) with two models: `smol` (SmolLM2-135M-Instruct Q4_1, the disk
tier on, the router's defaults) and `tiny` (tiny-llama, used to evict it). Each round has fresh
random `--prefix-tokens` prefixes (token ids, never seen before), and measures, side by side:

    cold            smol is unloaded; prefix + q0 (nothing cached anywhere): load and full prefill
    after eviction  tiny evicts smol (smol writes its cache); prefix + q1: the router loads smol,
                    which restores the prefix from disk

Each is measured two ways: end to end (the request is sent while the model is unloaded: the
worker's start is in it) and "model ready" (the model is loaded with POST /models/load first;
then only the request is timed; cold uses a second fresh prefix). TTFT = the time of a
`max_tokens: 1` completion.

    .venv/bin/python -m bench.bench_disk_cache [--rounds 3] [--prefix-tokens 4000]
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Server, free_port, median

SMOL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
TINY = ROOT / "models" / "tiny-llama-f16.gguf"


def _preset(ctx: int) -> str:
    return f"""[defaults]
ctx-size = {ctx}
parallel = 1

[models.smol]
model = "{SMOL}"

[models.tiny]
model = "{TINY}"
"""


def _complete(c: httpx.Client, model: str, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()["usage"]


def _load(c: httpx.Client, model: str) -> None:
    c.post("/models/load", json={"model": model}).raise_for_status()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        card = {m["id"]: m for m in c.get("/v1/models").json()["data"]}[model]
        if card["status"]["value"] == "loaded":
            return
        time.sleep(0.05)
    raise TimeoutError(f"{model} not loaded")


def _evict(c: httpx.Client) -> None:
    _complete(c, "tiny", [1, 2, 3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=4000)
    args = ap.parse_args()
    n = args.prefix_tokens
    tmp = Path(tempfile.mkdtemp(prefix="bench-disk-cache-"))
    preset = tmp / "preset.toml"
    preset.write_text(_preset(n + 512))
    port = free_port()
    cmd = [sys.executable, "-m", "router.cli", "--preset", str(preset), "--port", str(port),
           "--models-max", "1", "--data-dir", str(tmp / "data")]
    router = Server("router", f"http://127.0.0.1:{port}", cmd, tmp / "router.log")
    print(f"router: {' '.join(cmd)}\npreset:\n{preset.read_text()}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the router on the way out
    router.start(60)
    rows: dict[str, list[float]] = {k: [] for k in ("evicted e2e", "cold e2e", "evicted ready", "cold ready")}
    cached: list[int] = []
    rng = random.Random(28)
    try:
        with httpx.Client(base_url=router.base_url, timeout=600) as c:
            _complete(c, "smol", [rng.randrange(100, 40000) for _ in range(64)])  # warm the page cache
            for r in range(args.rounds):
                prefix, other = ([rng.randrange(100, 40000) for _ in range(n)] for _ in range(2))
                q = [[rng.randrange(100, 40000) for _ in range(12)] for _ in range(3)]
                _evict(c)
                dt, usage = _complete(c, "smol", prefix + q[0])
                rows["cold e2e"].append(dt)
                assert usage["prompt_tokens_details"]["cached_tokens"] == 0
                _evict(c)
                dt, usage = _complete(c, "smol", prefix + q[1])
                rows["evicted e2e"].append(dt)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                _evict(c)
                _load(c, "smol")
                dt, usage = _complete(c, "smol", prefix + q[2])
                rows["evicted ready"].append(dt)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                dt, usage = _complete(c, "smol", other + q[2])
                rows["cold ready"].append(dt)
                assert usage["prompt_tokens_details"]["cached_tokens"] == 0
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in rows.items()))
    finally:
        router.stop()
    print(f"\nprefix {n} tokens, {args.rounds} rounds; cached_tokens after eviction: {cached}")
    for kind in ("e2e", "ready"):
        ev, cold = median(rows[f"evicted {kind}"]), median(rows[f"cold {kind}"])
        print(f"TTFT {kind:5}: after eviction {ev * 1e3:7.0f} ms, cold {cold * 1e3:7.0f} ms, "
              f"ratio {ev / cold:.2f}x (goal <= 0.2x)")
    print(f"router log: {tmp / 'router.log'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
