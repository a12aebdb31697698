"""Video in: a video's header checked against the limits, then frames sampled and decoded (PyAV).

A video goes to the model as frames, each through the image path (worker/backends/media.py's
`FrameBytes`: decoded RGB, keyed by the video's bytes, the frame's index and its size). Two
steps, both on an HTTP worker thread, never on the engine thread:

- `probe`: the container is chosen by its magic bytes (MP4/MOV, Matroska/WebM, AVI: no other
  FFmpeg demuxer ever sees client bytes, so no playlist or concat demuxer can open a file or a
  URL), then opened with FFmpeg's `max_pixels` set to the pixel limit: a decoder that reads a
  frame size over it (FFmpeg's `ff_set_dimensions`, before any buffer) keeps none, so the size
  a header states is checked before anything is allocated for it. The length (seconds), the
  frame count (the header's, or its length times its frame rate) and the frame size are checked
  against the limits here; a header that does not state its length is demuxed (packets only,
  nothing decoded) up to the limits to learn it. The frames times their pixels, what decoding
  them writes, go under `--video-max-decoded-pixels`: a few MB of H.264 can hold thousands of
  near-empty frames of 50 megapixels, minutes of one core to decode although each frame and the
  length pass.
- `sample`: the sample times are every 1/fps seconds from the first frame, or `max_frames`
  times spread evenly over the video when that gives more; each time takes the first frame at
  or after it (a frame once). Decoding stops at the last sample; it counts frames against the
  limit as it goes, so a header that lied costs no more than the limit. Frames may be scaled
  (sglang-omni's `video_min_pixels`, `video_max_pixels`, `video_total_pixels`: each frame's
  pixels between the first two, and all frames' at most the third) by FFmpeg's swscale,
  keeping the aspect ratio.

Every failure is a `MediaError` naming the video ("video 0") and the limit or the reason.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.backends.media import FrameBytes, MediaError

if TYPE_CHECKING:  # PyAV is imported at the first video (~55 ms): a worker that sees none never pays it
    from av.container import InputContainer
    from av.video.stream import VideoStream

# magic -> the FFmpeg demuxer for it; nothing else is opened
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")


def container_format(data: bytes) -> str | None:
    """"mov" (MP4, MOV), "matroska" (MKV, WebM) or "avi" by the magic bytes; None: not a video
    container this server opens."""
    if len(data) >= 12 and data[4:8] in _MP4_BOXES:
        return "mov"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if data.startswith(b"RIFF") and data[8:12] == b"AVI ":
        return "avi"
    return None


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """The server's limits on one request's videos, checked from headers (0: no limit)."""

    max_pixels: int = 0  # a frame's width x height (--image-max-pixels)
    max_seconds: float = 0.0  # the request's videos' length, together (--video-max-seconds)
    max_stream_frames: int = 0  # the request's videos' frames, together (--video-max-stream-frames)
    # the request's videos' frames x their pixels, together: the decoder's work (--video-max-decoded-pixels)
    max_decoded_pixels: int = 0


@dataclass(slots=True)
class Spent:
    """What a request's videos so far take: the limits hold for its videos together."""

    seconds: float = 0.0
    frames: int = 0
    pixels: int = 0  # frames x width x height: what decoding them all writes

    def add(self, info: VideoInfo) -> None:
        self.seconds += info.seconds
        self.frames += info.n_frames
        self.pixels += info.n_frames * info.width * info.height


@dataclass(frozen=True, slots=True)
class Sampling:
    """How frames are taken from a video: `fps` frames a second, `max_frames` at most; their
    pixels scaled into [min_pixels, max_pixels], all frames' at most `total_pixels` (0: no bound)."""

    fps: float = 1.0
    max_frames: int = 8
    min_pixels: int = 0
    max_pixels: int = 0
    total_pixels: int = 0


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a video's header says: its container, frame size, length and frame count."""

    format: str
    width: int
    height: int
    seconds: float
    n_frames: int


def _av() -> tuple[type[Exception], ...]:
    """PyAV, imported; what its calls raise on bad input: FFmpeg's errors, and what its Python
    side raises on fields it cannot read (a tag that is not UTF-8, a value out of range): a 400,
    never a 500 (found by mutating valid files: tests/unit/test_video.py)."""
    import av

    return av.FFmpegError, ValueError, ArithmeticError, OverflowError


def _open(data: bytes, fmt: str, max_pixels: int) -> InputContainer:
    import av

    options = {"max_pixels": str(max_pixels)} if max_pixels else None
    return av.open(io.BytesIO(data), "r", format=fmt, options=options, metadata_errors="replace")


def probe(where: str, data: bytes, limits: VideoLimits, spent: Spent | None = None) -> VideoInfo:
    """The video's header, checked against `limits`, with what the request's earlier videos take
    (`spent`). MediaError: not a video, no video stream, or over a limit."""
    spent = spent or Spent()
    fmt = container_format(data)
    if fmt is None:
        raise MediaError(f"{where}: not an MP4, MOV, WebM, MKV or AVI video")
    error = _av()
    try:
        with _open(data, fmt, limits.max_pixels) as container:
            if not container.streams.video:
                raise MediaError(f"{where}: the file holds no video stream")
            stream = container.streams.video[0]
            if stream.codec_context is None:
                raise MediaError(f"{where}: its video codec is not one this server decodes")
            width, height = int(stream.width), int(stream.height)
            if width <= 0 or height <= 0:
                # FFmpeg keeps no size over `max_pixels` (nor over its own cap, ~268 megapixels)
                limit = limits.max_pixels
                over = f"is over this server's --image-max-pixels {limit}, or " if limit else ""
                raise MediaError(f"{where}: the frame size its header states {over}cannot be read "
                                 "(read from its header, not decoded)")
            if limits.max_pixels and width * height > limits.max_pixels:
                raise MediaError(f"{where}: {width}x{height} = {width * height} pixels a frame is over this "
                                 f"server's --image-max-pixels {limits.max_pixels} (read from its header, "
                                 "not decoded)")
            seconds, n_frames = _header_length(container, stream)
            if seconds is None:
                seconds, n_frames = _demuxed_length(where, container, stream, limits, spent)
    except MediaError:
        raise  # a ValueError too: ours, said as it is
    except error as e:
        raise MediaError(f"{where}: the bytes are not a video this server can decode ({_why(e)})") from None
    info = VideoInfo(fmt, width, height, seconds, n_frames)
    _check_length(where, info, limits, spent, "read from its header")
    return info


def _why(e: Exception) -> str:
    return str(getattr(e, "strerror", None) or e)


def _header_length(container: InputContainer, stream: VideoStream) -> tuple[float | None, int]:
    """(seconds, frames) as the header states them; seconds None when it does not."""
    seconds: float | None = None
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000  # AV_TIME_BASE
    if seconds is None or seconds <= 0:
        return None, 0
    rate = stream.average_rate or stream.guessed_rate
    n_frames = int(stream.frames) or (math.ceil(seconds * float(rate)) if rate else 0)
    return seconds, n_frames


def _demuxed_length(where: str, container: InputContainer, stream: VideoStream, limits: VideoLimits,
                    spent: Spent) -> tuple[float, int]:
    """(seconds, frames) of a video whose header does not say (a live-recorded WebM): its packets
    counted, nothing decoded, stopping past a limit."""
    n, end = 0, 0.0
    for packet in container.demux(stream):
        if packet.size == 0:
            continue
        n += 1
        if packet.pts is not None and packet.time_base is not None:
            end = max(end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
        info = VideoInfo("", int(stream.width), int(stream.height), end, n)
        _check_length(where, info, limits, spent, "counted without decoding")
    if n == 0:
        raise MediaError(f"{where}: the video stream holds no frames")
    return end, n


def _check_length(where: str, info: VideoInfo, limits: VideoLimits, spent: Spent, how: str) -> None:
    together = " with the request's other videos" if spent.frames or spent.seconds else ""
    seconds, frames = info.seconds + spent.seconds, info.n_frames + spent.frames
    pixels = info.n_frames * info.width * info.height + spent.pixels
    if limits.max_seconds and seconds > limits.max_seconds:
        raise MediaError(f"{where}: {seconds:.1f} s of video{together} is over this server's "
                         f"--video-max-seconds {limits.max_seconds:g} ({how}, not decoded)")
    if limits.max_stream_frames and frames > limits.max_stream_frames:
        raise MediaError(f"{where}: {frames} frames of video{together} is over this server's "
                         f"--video-max-stream-frames {limits.max_stream_frames} ({how}, not decoded)")
    if limits.max_decoded_pixels and pixels > limits.max_decoded_pixels:
        raise MediaError(f"{where}: {frames} frames of {info.width}x{info.height}{together} decode to "
                         f"{pixels} pixels, over this server's --video-max-decoded-pixels "
                         f"{limits.max_decoded_pixels} ({how}, not decoded)")


def sample_times(seconds: float, fps: float, max_frames: int) -> list[float]:
    """When frames are taken: every 1/fps s from 0 while in the video, or `max_frames` times
    spread evenly when that is fewer (at least one: the first frame)."""
    n = max(1, math.ceil(seconds * fps - 1e-9))
    if n <= max_frames:
        return [i / fps for i in range(n)]
    return [seconds * i / max_frames for i in range(max_frames)]


def frame_size(width: int, height: int, sampling: Sampling, n_frames: int) -> tuple[int, int]:
    """A sampled frame's size: scaled, aspect kept, into the sampling's pixel bounds (module doc)."""
    pixels = width * height
    upper = sampling.max_pixels or pixels
    if sampling.total_pixels:
        upper = min(upper, max(1, sampling.total_pixels // max(1, n_frames)))
    target = min(pixels, upper) if pixels > upper else max(pixels, sampling.min_pixels)
    if target == pixels:
        return width, height
    scale = math.sqrt(target / pixels)
    w, h = max(1, int(width * scale)), max(1, int(height * scale))
    return w, h


def sample(where: str, data: bytes, info: VideoInfo, sampling: Sampling, limits: VideoLimits,
           spent: Spent | None = None) -> list[FrameBytes]:
    """The sampled frames, decoded to RGB (module doc); MediaError if the video does not decode,
    gives no frame, or decodes to more frames or pixels than the limits allow (with `spent`,
    what the request's earlier videos take)."""
    spent = spent or Spent()
    times = sample_times(info.seconds, sampling.fps, sampling.max_frames)
    size = frame_size(info.width, info.height, sampling, len(times))
    digest = hashlib.sha256(data).digest()
    error = _av()
    out: list[FrameBytes] = []
    k = n_decoded = n_pixels = 0
    origin: float | None = None  # the first frame's time: a stream may start later than 0
    try:
        with _open(data, info.format, limits.max_pixels) as container:
            stream = container.streams.video[0]
            if limits.max_pixels:
                stream.codec_context.options = {"max_pixels": str(limits.max_pixels)}
            for frame in container.decode(stream):
                n_decoded += 1
                n_pixels += frame.width * frame.height
                if limits.max_stream_frames and n_decoded + spent.frames > limits.max_stream_frames:
                    raise MediaError(f"{where}: more frames than this server's --video-max-stream-frames "
                                     f"{limits.max_stream_frames} (counted while decoding: the header said "
                                     f"{info.n_frames})")
                if limits.max_decoded_pixels and n_pixels + spent.pixels > limits.max_decoded_pixels:
                    raise MediaError(f"{where}: more pixels than this server's --video-max-decoded-pixels "
                                     f"{limits.max_decoded_pixels} (counted while decoding)")
                t = frame.time if frame.time is not None else (n_decoded - 1) / max(sampling.fps, 1e-9)
                origin = t if origin is None else origin
                t -= origin
                if t + 1e-6 < times[k]:
                    continue
                rgb = frame.to_ndarray(format="rgb24", width=size[0], height=size[1])
                out.append(FrameBytes.of(digest, n_decoded - 1, rgb, f"{where} frame {len(out)}"))
                while k < len(times) and times[k] <= t + 1e-6:
                    k += 1
                if k == len(times):
                    break
    except MediaError:
        raise  # a ValueError too: ours, said as it is
    except error as e:
        raise MediaError(f"{where}: the video does not decode ({_why(e)})") from None
    if not out:
        raise MediaError(f"{where}: the video stream gave no frame")
    return out

