"""Video in: how fast decode bombs are refused, and what a real video costs.

Prints, for each bomb (a 1-frame AVI whose headers say 16000x16000 or 60000x60000, a video of ten
hours), the median time of the header check in
process (`video.probe`) and of the 400 over HTTP from a tiny-VLM worker at the default limits,
with the worker's RSS before and after; then the time to sample and decode frames of a generated
1-second 640x480 video at 30 fps and of 10 s of H.264 720p, and the whole request (decode +
encode + 1 token).

    .venv/bin/python -m bench.bench_video [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.common import Server, listening_pid
from tests.util import ROOT, free_port
from worker.backends import video
from worker.backends.media import MediaError
from worker.server.cli import IMAGE_MAX_PIXELS
from worker.server.media import VIDEO_MAX_SECONDS, VIDEO_MAX_STREAM_FRAMES
from worker.testing.tiny_video import big_frame_video, long_video, shapes_video
from worker.testing.tiny_vlm import data_url, ensure_vlm

LIMITS = video.VideoLimits(IMAGE_MAX_PIXELS, VIDEO_MAX_SECONDS, VIDEO_MAX_STREAM_FRAMES)


def _ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _refused(data: bytes) -> None:
    try:
        video.probe("video 0", data, LIMITS)
    except MediaError:
        return
    raise AssertionError("not refused")


def _rss_mb(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / 2**20


def _h264_720p(n: int) -> bytes:
    """`n` frames of 1280x720 noise scrolling sideways, H.264 (libx264 ultrafast), 30 fps."""
    import io

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 1280, 720, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        base = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), dtype=np.uint8)
        for i in range(n):
            for p in stream.encode(av.VideoFrame.from_ndarray(np.roll(base, 4 * i, axis=1), format="rgb24")):
                out.mux(p)
        for p in stream.encode():
            out.mux(p)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    bombs = {"16000x16000 frame": big_frame_video(16000), "60000x60000 frame": big_frame_video(60000),
             "10 hours": long_video(36_000)}
    vlm = ensure_vlm(ROOT / "models")
    port = free_port()
    server = Server("worker", f"http://127.0.0.1:{port}", [
        str(ROOT / ".venv/bin/python"), "-m", "worker.server.cli", "--model", str(vlm.gguf), "--mmproj",
        str(vlm.mmproj), "--port", str(port), "-np", "1", "-c", "4096", "--threads", "1"],
        ROOT / "bench/results/bench_video.log")
    server.start(120)
    pid = listening_pid(server.base_url) or 0
    try:
        url = f"{server.base_url}/v1/chat/completions"
        client = httpx.Client(timeout=120)  # keep-alive: a new client per request costs ~40 ms itself

        def chat(data: bytes, **extra: object) -> httpx.Response:
            parts = [{"type": "text", "text": "What is it?"},
                     {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}]
            body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1, **extra}
            return client.post(url, json=body)

        print(f"{'bomb':<22} {'bytes':>7} {'probe ms':>9} {'HTTP 400 ms':>12} {'RSS MB before/after':>20}")
        for name, data in bombs.items():
            probe = _ms(lambda d=data: _refused(d), args.rounds)  # type: ignore[misc]
            before = _rss_mb(pid)
            r = chat(data)
            assert r.status_code == 400, r.text
            http = _ms(lambda d=data: chat(d), args.rounds)  # type: ignore[misc]
            after = _rss_mb(pid)
            print(f"{name:<22} {len(data):>7} {probe:>9.2f} {http:>12.2f} {before:>9.0f} / {after:<8.0f}"
                  f"  {r.json()['error']['message'][:90]}")
        clip = shapes_video(30, fps=30, width=640, height=480)
        info = video.probe("video 0", clip, LIMITS)
        for fps in (1.0, 8.0, 30.0):
            sampling = video.Sampling(fps=fps, max_frames=30)
            n = len(video.sample("video 0", clip, info, sampling, LIMITS))
            ms = _ms(lambda s=sampling: video.sample("video 0", clip, info, s, LIMITS), 5)  # type: ignore[misc]
            print(f"decode 640x480 1 s at {fps:g} fps: {n} frames in {ms:.1f} ms")
        hd = _h264_720p(300)
        hd_info = video.probe("video 0", hd, LIMITS)
        ms = _ms(lambda: video.sample("video 0", hd, hd_info, video.Sampling(), LIMITS), 3)
        print(f"decode H.264 1280x720 10 s at 30 fps, 8 frames spread (to 8.75 s, 263 frames): {ms:.0f} ms")
        full = _ms(lambda: chat(clip, video_fps=8, cache_prompt=False), 3)
        print(f"whole request (8 frames decoded and encoded, 1 token; the frames' encodes cached after "
              f"the first): {full:.0f} ms")
    finally:
        server.stop()


if __name__ == "__main__":
    Path(ROOT / "bench/results").mkdir(parents=True, exist_ok=True)
    main()
