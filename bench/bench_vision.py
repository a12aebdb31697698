"""Image encode time, and what an encode costs the requests that are generating beside it.

    .venv/bin/python -m bench.bench_vision [--size small] [--decoders 7] [--images 4]

Starts our worker on the generated VLM (`small`: worker/testing/tiny_vlm.py's benchmark model,
a 6-block SigLIP-base-wide tower on 384-pixel tiles, F16; `tiny`: the test model) with
`decoders + 1` slots, streams `decoders` long text generations, and measures the gaps between
their tokens (ITL): first for `--steady` seconds with nothing else running, then while image
requests (a fresh image each: every one is encoded) come one after another. Prints the encode
time per image (the worker's omni:image_encode_seconds over its encoded chunks) and the ITL
p50/p99 of both windows, and their ratio (the goal: the p99 beside an encode <= 2x steady).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import ROOT, Server, free_port, median, percentile
from worker.testing.tiny_vlm import data_url, ensure_small_vlm, ensure_vlm, png


def _stream(base: str, i: int, stop: threading.Event, arrivals: list[float]) -> None:
    # logprobs: a chunk per token (a random model's text is mostly held-back byte fragments)
    body = {"messages": [{"role": "user", "content": f"Tell a long story number {i}."}], "stream": True,
            "max_tokens": 100000, "temperature": 0, "ignore_eos": True, "logprobs": True}
    with httpx.Client(timeout=None) as c, c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"token"' in line:
                arrivals.append(time.perf_counter())
            if stop.is_set():
                return


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _gaps(streams: list[list[float]], t0: float, t1: float) -> list[float]:
    """Inter-token gaps (ms) whose second token arrived in [t0, t1)."""
    return [(b - a) * 1e3 for s in streams for a, b in itertools.pairwise(s) if t0 <= b < t1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "small"], default="small")
    ap.add_argument("--decoders", type=int, default=7)
    ap.add_argument("--images", type=int, default=4, help="image requests, one after another")
    ap.add_argument("--image-side", type=int, default=384)
    ap.add_argument("--steady", type=float, default=8.0, help="seconds of the steady window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--media-piece", type=int, default=None, help="the worker's --media-piece (default: its)")
    args = ap.parse_args()
    models = ROOT / "models"
    paths = ensure_small_vlm(models) if args.size == "small" else ensure_vlm(models)
    port = free_port()
    n_slots = args.decoders + 1
    cmd = [sys.executable, "-m", "worker.server.cli", "-m", str(paths.gguf), "--mmproj", str(paths.mmproj),
           "--port", str(port), "-np", str(n_slots), "-c", str(n_slots * 1024),
           "--threads", str(args.threads), "--metrics"]
    if args.media_piece is not None:
        cmd += ["--media-piece", str(args.media_piece)]
    log = Path(tempfile.mkdtemp()) / "worker.log"
    server = Server("ours", f"http://127.0.0.1:{port}", cmd=cmd, log_path=log,
                    env={**os.environ, "PYTHONPATH": str(ROOT)})
    server.start(120)
    base = server.base_url
    # The requests' bodies are made before the clock starts: the client's work (a PNG, its JSON)
    # runs on the same cores and is not the server's.
    side = args.image_side
    bodies = [json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(side, side, 1000 + k))}},
        {"type": "text", "text": "What is this?"}]}], "max_tokens": 1, "temperature": 0}).encode()
        for k in range(args.images)]
    client = httpx.Client(base_url=base)  # made once: a new client loads its CA bundle (~20 ms of CPU)
    stop = threading.Event()
    streams: list[list[float]] = [[] for _ in range(args.decoders)]
    threads = [threading.Thread(target=_stream, args=(base, i, stop, streams[i]), daemon=True)
               for i in range(args.decoders)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(s) for s in streams) < 5:  # every decoder generating
            if time.monotonic() > deadline:
                raise SystemExit(f"decoders did not start: {[len(s) for s in streams]} tokens")
            time.sleep(0.05)
        t_steady = time.perf_counter()
        time.sleep(args.steady)
        t_images = time.perf_counter()
        windows = []
        encoded0, seconds0 = (_metric(client, "omni:image_chunks_encoded_total"),
                              _metric(client, "omni:image_encode_seconds_total"))
        for k, body in enumerate(bodies):
            a = time.perf_counter()
            client.post("/v1/chat/completions", content=body, timeout=600,
                        headers={"content-type": "application/json"}).raise_for_status()
            windows.append((a, time.perf_counter()))
            print(f"image {k}: {windows[-1][1] - a:.2f} s", file=sys.stderr, flush=True)
        chunks = _metric(client, "omni:image_chunks_encoded_total") - encoded0
        seconds = _metric(client, "omni:image_encode_seconds_total") - seconds0
    finally:
        stop.set()
        client.close()
        server.stop()
    steady = _gaps(streams, t_steady, t_images)
    beside = [g for a, b in windows for g in _gaps(streams, a, b)]
    print(f"model {paths.gguf.name} + {paths.mmproj.name}; {args.decoders} decoders, {args.images} images "
          f"of {args.image_side}x{args.image_side}, --threads {args.threads}")
    per_image, per_chunk = seconds / max(1, args.images) * 1e3, seconds / max(1.0, chunks) * 1e3
    print(f"encode: {chunks:.0f} chunks in {seconds:.2f} s: {per_image:.0f} ms an image, "
          f"{per_chunk:.0f} ms a "
          f"chunk; image request (encode + prefill + 1 token) median "
          f"{median([(b - a) * 1e3 for a, b in windows]):.0f} ms")
    for name, gaps in (("steady", steady), ("beside an encode", beside)):
        p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
        print(f"ITL {name:17s}: n={len(gaps):5d}  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms")
    if steady and beside:
        ratio = percentile(beside, 99) / percentile(steady, 99)
        print(f"p99 ratio (beside / steady): {ratio:.2f} (goal <= 2)")


if __name__ == "__main__":
    main()
