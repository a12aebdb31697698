"""Decode bombs are refused from the header, before anything is decoded
(worker/backends/media_probe.py), by default: a 144-megapixel PNG of 0.4 MB, a FLAC that says
ten hours, 19 MiB of 8 kbps MP3 (5.5 hours). Each is a 400 naming the limit, and the worker's
memory does not grow by what the decode would have taken."""

from __future__ import annotations

import base64
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.util import run_worker
from worker.backends.media_probe import audio_seconds, image_size
from worker.backends.mtmd import decode_rgb
from worker.testing.tiny_audio import AudioModelPaths, wav
from worker.testing.tiny_vlm import VlmPaths, data_url, png

ARGS = ["-np", "1", "-c", "1024", "--threads", "1"]  # the media limits at their defaults


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int) -> bytes:
    """A real PNG of black pixels: width x height RGB, a few hundred KB on the wire."""
    z = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * width)
    body = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def bmp(width: int, height: int) -> bytes:
    """A real 24-bit BMP (rows padded to 4 bytes), grey."""
    stride = (3 * width + 3) & ~3
    pixels = bytes([128]) * (stride * height)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
    head = struct.pack("<2sIHHI", b"BM", 14 + 40 + len(pixels), 0, 0, 14 + 40)
    return head + info + pixels


def flac_header(seconds: float, rate: int = 8000) -> bytes:
    """fLaC and a STREAMINFO block that says `seconds` of mono 16-bit audio (no frames follow)."""
    total = int(seconds * rate)
    bits = rate << 44 | 0 << 41 | 15 << 36 | total
    info = struct.pack(">HH", 4096, 4096) + b"\x00" * 6 + bits.to_bytes(8, "big") + b"\x00" * 16
    return b"fLaC" + bytes([0x80, 0, 0, len(info)]) + info


def mp3_lying(n_bytes: int) -> bytes:
    """One MPEG-1 layer III frame at 320 kbps, 48 kHz, then `n_bytes` of 8 kbps frames: by its
    first frame's bit rate the file is minutes long, by its frames hours."""
    first = bytes([0xFF, 0xFB, 0xE4, 0xC4])  # MPEG-1 layer III, 320 kbps, 48 kHz, no padding
    return first + bytes(144 * 320_000 // 48_000 - 4) + mp3_frames(n_bytes)


def mp3_frames(n_bytes: int, free_format: bool = False) -> bytes:
    """MPEG-2 layer III frames at 8 kbps, 16 kHz (36 bytes, 36 ms each), silent. `free_format`:
    bitrate index 0, the same frames whose header states no bit rate (the decoder measures the
    distance between two headers), so no length can be read from it."""
    frame = bytes([0xFF, 0xF3, 0x08 if free_format else 0x18, 0xC4]) + b"\x00" * 32
    return frame * (n_bytes // len(frame))


@pytest.mark.parametrize(
    ("data", "size"),
    [
        (png(7, 5, 1), (7, 5)),
        (bmp(9, 4), (9, 4)),
        (b"GIF89a" + struct.pack("<HH", 640, 480) + b"\x00" * 8, (640, 480)),
        # JPEG: SOI, an APP0 segment, then a baseline frame header: height 300, width 400
        (b"\xff\xd8\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
         + b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 300, 400) + b"\x00" * 10, (400, 300)),
        (b"\xff\xd8\xff\xda\x00\x08", None),  # a scan before any frame header: the header says nothing
        (b"\x89PNG\r\n\x1a\n", None),  # truncated
    ],
)
def test_image_size(data: bytes, size: tuple[int, int] | None) -> None:
    assert image_size(data) == size


def test_the_header_agrees_with_the_decoder() -> None:
    for data in (png(13, 6, 2), bmp(11, 3)):
        rgb = decode_rgb(0, data)
        assert image_size(data) == (rgb.shape[1], rgb.shape[0])


@pytest.mark.parametrize(
    ("data", "seconds"),
    [
        (wav(2.5, 1), 2.5),
        (flac_header(36000), 36000.0),
        (flac_header(0), None),  # unknown length: the decoder's output is checked instead
        (mp3_frames(36 * 1000), 36.0),  # 1,000 frames of 36 ms, from the bit rate
        (b"ID3\x03\x00\x00\x00\x00\x00\x00" + mp3_frames(36 * 10), 0.36),
        (b"\x00" * 100, None),
        (mp3_frames(36 * 1000, free_format=True), None),  # refused under a limit: see below
        (mp3_lying(36 * 1000), 36.024),  # the frames' sum, not 36 KB at the first frame's 320 kbps
        (mp3_frames(36 * 1000) + b"\x00" * 1300, 36.0 + 1300 * 576 / 8000 / 13),  # junk: at the densest
        (mp3_frames(36 * 1000) + b"TAG" + b"\x00" * 125, 36.0),  # an ID3v1 tag is no audio
    ],
)
def test_audio_seconds(data: bytes, seconds: float | None) -> None:
    got = audio_seconds(data)
    assert (got is None) if seconds is None else got == pytest.approx(seconds, rel=1e-6)


def _chat(url: str, part: dict[str, Any]) -> tuple[httpx.Response, float]:
    content = [{"type": "text", "text": "what?"}, part]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    return r, time.perf_counter() - t0


def _rss(url: str) -> int:
    pid = httpx.get(url + "/health", timeout=10)  # the worker's own process: found by its port
    assert pid.status_code == 200
    port = int(url.rsplit(":", 1)[1])
    for c in psutil.net_connections("tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            return int(psutil.Process(c.pid).memory_info().rss)
    pytest.skip("cannot see the worker's process (no permission to list its sockets)")


@pytest.fixture(scope="module")
def vision(tiny_vlm: VlmPaths) -> Iterator[str]:
    with run_worker(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), *ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def audio(tiny_audio: AudioModelPaths) -> Iterator[str]:
    with run_worker(tiny_audio.gguf, "--mmproj", str(tiny_audio.mmproj), *ARGS) as url:
        yield url


def test_a_144_megapixel_png_is_refused_by_default(vision: str) -> None:
    bomb = png_bomb(12000, 12000)
    assert len(bomb) < 1_000_000  # 432 MB of pixels in under a megabyte
    before = _rss(vision)
    r, seconds = _chat(vision, {"type": "image_url", "image_url": {"url": data_url(bomb)}})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "12000x12000" in message and "--image-max-pixels 50000000" in message, message
    assert _rss(vision) - before < 100 * 2**20  # nothing near the 432 MB a decode takes
    print(f"144 MP PNG ({len(bomb)} bytes) refused in {seconds * 1000:.1f} ms")
    ok, _ = _chat(vision, {"type": "image_url", "image_url": {"url": data_url(png(64, 48, 3))}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("name", "data", "fmt"), [
    ("10 h of FLAC", flac_header(36000), "flac"),
    ("19 MiB of 8 kbps MP3", mp3_frames(19 * 2**20), "mp3"),
    # issue 47, 8: by its first frame's 320 kbps it said 8 minutes and decoded to 5.5 hours
    ("a 320 kbps frame before 19 MiB of 8 kbps MP3", mp3_lying(19 * 2**20), "mp3"),
])
def test_hours_of_audio_are_refused_by_default(audio: str, name: str, data: bytes, fmt: str) -> None:
    before = _rss(audio)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
    r, seconds = _chat(audio, part)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "--audio-max-seconds 1800" in message and "header" in message, message
    assert _rss(audio) - before < 100 * 2**20
    print(f"{name} refused in {seconds * 1000:.1f} ms")


def test_audio_that_states_no_length_is_refused_before_decoding(audio: str) -> None:
    """Regression (issue 47, 8): 19 MiB of free-format MP3 (bitrate index 0) passed the header
    check, as its header states no length, and the request's total skipped it: it was refused
    only after decoding, 13.2 s later, the worker 1.4 GB larger. Now refused at once, naming the
    limit, without decoding."""
    bomb = mp3_frames(19 * 2**20, free_format=True)
    before = _rss(audio)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(bomb).decode(), "format": "mp3"}}
    r, seconds = _chat(audio, part)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "cannot be read from its header" in message, message
    assert "--request-max-audio-seconds 3600" in message, message
    assert _rss(audio) - before < 100 * 2**20
    print(f"19 MiB of free-format MP3 refused in {seconds * 1000:.1f} ms")


def test_each_limit_refuses_audio_of_unknown_length_alone() -> None:
    """The per-item limit (--audio-max-seconds, in the backend) and the request's total
    (--request-max-audio-seconds) each refuse it before any decoding; with both off (0) it
    goes on to the decoder, as the user asked."""
    from worker.backends.media import MediaError
    from worker.backends.mtmd import _decode_audio
    from worker.protocol.errors import APIError
    from worker.server.media import MediaPolicy, _Totals

    bomb = mp3_frames(36 * 100, free_format=True)
    with pytest.raises(MediaError, match=r"cannot be read from its header.*--audio-max-seconds 1800"):
        _decode_audio(None, "audio 0", bomb, 1800.0)  # refused before the decoder is reached
    with pytest.raises(APIError, match=r"audio 0: .*--request-max-audio-seconds 60"):
        _Totals(MediaPolicy(request_max_audio_seconds=60)).add_audio(0, bomb)
    _Totals(MediaPolicy(request_max_audio_seconds=0)).add_audio(0, bomb)  # no total: not counted
    _Totals(MediaPolicy(request_max_audio_seconds=60)).add_audio(0, b"not audio at all")  # the backend's 400


def _chat_parts(url: str, parts: list[dict[str, Any]]) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, *parts]}],
            "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_images_each_under_the_limit_are_refused_by_their_total(vision: str) -> None:
    """Three 36 MP PNGs, each under --image-max-pixels, 108 MP together: over the request's total."""
    bomb = data_url(png_bomb(6000, 6000))
    before = _rss(vision)
    r = _chat_parts(vision, [{"type": "image_url", "image_url": {"url": bomb}}] * 3)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert "image 2" in err["message"] and "--request-max-pixels 100000000" in err["message"], err
    assert _rss(vision) - before < 100 * 2**20


def test_audio_each_under_the_limit_is_refused_by_its_total(audio: str) -> None:
    """Three FLACs of 25 minutes each (under --audio-max-seconds), 75 minutes together."""
    part = {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(flac_header(1500)).decode(), "format": "flac"}}
    r = _chat_parts(audio, [part] * 3)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "audio 2" in message and "--request-max-audio-seconds 3600" in message, message


def test_media_bytes_are_summed_per_request() -> None:
    from worker.protocol.errors import APIError
    from worker.server.media import MediaPolicy, _Totals

    totals = _Totals(MediaPolicy(request_max_media_bytes=1000))
    totals.add_image(0, png(4, 4, 1))
    with pytest.raises(APIError, match="--request-max-media-bytes 1000"):
        totals.add_audio(0, wav(0.1, 1))  # 1.6 KB of samples: over the request's 1,000 bytes
