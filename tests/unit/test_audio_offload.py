"""Audio encoding off the event loop (issue 47, item 1). Before the fix the router's spoken chat
answers (router/speech/chat.py) and the speech worker (worker/speech/app.py) ran LAME, libopus and
FFmpeg on the event loop: a 44 s opus answer stalled every stream of every model for 1.6 s.

Checked without timing the CPU: the encode runs in an encoder thread, never the loop's; a probe
on the loop keeps ticking during a long opus encode (its largest gap well under the encode's own
duration, measured in the same test); at most `max_concurrent` encodes run at once; and the two
callers encode only through `AudioEncoder`."""

from __future__ import annotations

import ast
import asyncio
import base64
import threading
import time

import numpy as np
import pytest

import worker.media_encoding.offload as offload
from tests.util import ROOT
from worker.media_encoding.audio import encode
from worker.media_encoding.offload import DEFAULT_MAX_ENCODES, AudioEncoder

RATE = 22050  # not an Opus rate: resampled to 24 kHz first, as a Piper voice's answer is


def _speech(seconds: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    tone = np.sin(2 * np.pi * 220 * t) * 8000 + rng.normal(0, 2000, t.size)
    return tone.astype(np.int16)


@pytest.mark.asyncio
async def test_an_opus_encode_runs_in_an_encoder_thread_and_the_loop_keeps_ticking(
        monkeypatch: pytest.MonkeyPatch) -> None:
    samples = _speech(20.0)
    t0 = time.perf_counter()
    whole = encode(samples, RATE, "opus")  # the same work on the calling thread: its duration here
    blocking_s = time.perf_counter() - t0
    threads: list[str] = []

    def spy(s: np.ndarray, rate: int, fmt: str) -> bytes:
        threads.append(threading.current_thread().name)
        return encode(s, rate, fmt)

    monkeypatch.setattr(offload, "encode", spy)
    encoder = AudioEncoder()
    gaps: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(probe())
    await asyncio.sleep(0)
    try:
        data = await encoder.encode_base64(samples, RATE, "opus")
    finally:
        done.set()
        await ticker
        encoder.close()
    raw = base64.b64decode(data)
    assert raw[:4] == b"OggS" and len(raw) == pytest.approx(len(whole), rel=0.1)
    assert threads and all(name.startswith("audio-encode") for name in threads), threads
    assert threading.current_thread().name not in threads
    # The loop ticked all along: its largest gap is a small part of what the encode blocks for
    # (before the fix, the gap WAS the encode). Generous: the box may be busy with other tests.
    assert len(gaps) >= 3 and max(gaps) < max(0.5 * blocking_s, 0.05) + 0.1, (max(gaps), blocking_s)


@pytest.mark.asyncio
async def test_no_more_than_max_concurrent_encodes_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    running, peak = 0, 0
    lock = threading.Lock()
    release = threading.Event()

    def slow(s: np.ndarray, rate: int, fmt: str, is_first: bool) -> bytes:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(10)
        with lock:
            running -= 1
        return b"x"

    monkeypatch.setattr(offload, "encode_piece", slow)
    encoder = AudioEncoder(2)
    tasks = [asyncio.create_task(encoder.encode_piece(_speech(0.01), RATE, "mp3", False)) for _ in range(5)]
    deadline = time.monotonic() + 10
    while running < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert running == 2 and not any(t.done() for t in tasks)  # three wait for a thread
    release.set()
    assert await asyncio.gather(*tasks) == [b"x"] * 5
    assert peak == 2
    encoder.close()
    assert DEFAULT_MAX_ENCODES >= 1
    with pytest.raises(ValueError):
        AudioEncoder(0)


@pytest.mark.parametrize("path", ["router/speech/chat.py", "worker/speech/app.py"])
def test_the_speech_paths_encode_only_through_the_audio_encoder(path: str) -> None:
    """The blocking encoders (and base64) are not imported where requests are served: only
    `AudioEncoder`, whose methods run them in its threads."""
    tree = ast.parse((ROOT / path).read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names} | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                                        for a in node.names}
    assert not imported & {"encode", "encode_piece", "base64", "b64encode"}, imported
    assert "AudioEncoder" in imported
