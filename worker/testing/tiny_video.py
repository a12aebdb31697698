"""Test videos, made with PyAV (no files shipped): a few frames of solid colours and shapes, and
the decode bombs (a frame size or a length far over the limits in a file of a few KB).

- `shapes_video`: frames of a solid colour each, with a square of another at a place that moves,
  MPEG-4 part 2 in MP4 (or any codec and container PyAV writes);
- `long_video`: two frames `seconds` apart: a real video of hours in 1 KB;
- `big_frame_video`: a 1-frame MJPEG AVI whose headers (AVI's and the JPEG frame's) say
  `side` x `side` pixels, the frame data of a 64x48 one: what a decoder would allocate for
  before it finds the data short;
- `png_of` and `decoded_frames`: the frames as a client that sends them as images would.
"""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction

import numpy as np

COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 230), (240, 220, 20), (250, 250, 250), (10, 10, 10)]


def shapes_frames(n: int, width: int = 64, height: int = 48) -> list[np.ndarray]:
    """`n` RGB frames: a solid colour each, and a square of the next colour moving left to right."""
    frames = []
    side = max(2, min(width, height) // 3)
    for i in range(n):
        rgb = np.empty((height, width, 3), np.uint8)
        rgb[:] = COLOURS[i % len(COLOURS)]
        x = (i * (width - side)) // max(1, n - 1)
        rgb[height // 3 : height // 3 + side, x : x + side] = COLOURS[(i + 1) % len(COLOURS)]
        frames.append(rgb)
    return frames


def encode(frames: list[np.ndarray], fps: int = 2, container: str = "mp4", codec: str = "mpeg4",
           pts: list[int] | None = None, time_base: Fraction | None = None) -> bytes:
    """The frames as a video file's bytes (`pts` in `time_base`: frames at other times than 1/fps apart)."""
    import av

    height, width = frames[0].shape[:2]
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        assert isinstance(stream, av.video.stream.VideoStream)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if time_base is not None:
            stream.time_base = time_base
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], time_base
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def shapes_video(n: int = 4, fps: int = 2, width: int = 64, height: int = 48, container: str = "mp4",
                 codec: str = "mpeg4") -> bytes:
    return encode(shapes_frames(n, width, height), fps, container, codec)


def long_video(seconds: int) -> bytes:
    """Two frames `seconds` apart: a video `seconds` long of ~1 KB."""
    return encode(shapes_frames(2, 32, 32), 1, pts=[0, seconds], time_base=Fraction(1, 1))


def big_frame_video(side: int) -> bytes:
    """A 1-frame MJPEG AVI whose headers say `side` x `side` pixels (module doc)."""
    data = bytearray(encode(shapes_frames(1, 64, 48), 2, "avi", "mjpeg"))
    for old, new in ((struct.pack("<II", 64, 48), struct.pack("<II", side, side)),):
        at = data.find(old)
        while at >= 0:  # AVI's main header and the stream's BITMAPINFOHEADER
            data[at : at + 8] = new
            at = data.find(old, at + 8)
    at = data.find(b"\xff\xc0")  # the JPEG frame header: FF C0, length, precision, height, width
    while at >= 0:
        if struct.unpack_from(">HH", data, at + 5) == (48, 64):
            struct.pack_into(">HH", data, at + 5, side, side)
        at = data.find(b"\xff\xc0", at + 2)
    return bytes(data)


def decoded_frames(video: bytes) -> list[np.ndarray]:
    """Every frame of the video, RGB, decoded by PyAV as the worker decodes it."""
    import av

    with av.open(io.BytesIO(video), "r") as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def png_of(rgb: np.ndarray) -> bytes:
    """An RGB array as PNG bytes (lossless: the pixels an image decoder gives back)."""
    height, width = rgb.shape[:2]
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body
