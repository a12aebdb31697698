"""The pure parts of video in (worker/backends/video.py, worker/server/media.py): which container
the magic bytes pick, when frames are taken, the frames' size under sglang-omni's pixel bounds,
a video's marker made one per frame, and the header checks on generated videos (in process, no
worker): the limits hold for the request's videos together, a WebM that states no length is
counted from its packets, and a header that lies about its frame count costs no more than the limit."""

from __future__ import annotations

import io
import re

import pytest

from worker.backends import video
from worker.backends.media import FrameBytes, MediaError, media_key
from worker.protocol.wire import ChatMessage
from worker.server.media import VideoPart, expand_videos, extract, media_kinds
from worker.testing.tiny_video import big_frame_video, long_video, shapes_frames, shapes_video

LIMITS = video.VideoLimits(max_pixels=50_000_000, max_seconds=300, max_stream_frames=18_000)


@pytest.mark.parametrize(("data", "fmt"), [
    (b"\x00\x00\x00\x18ftypisom" + b"\x00" * 8, "mov"),
    (b"\x00\x00\x00\x08moov" + b"\x00" * 8, "mov"),
    (b"\x1a\x45\xdf\xa3" + b"\x00" * 12, "matroska"),
    (b"RIFF\x00\x00\x00\x00AVI LIST", "avi"),
    (b"RIFF\x00\x00\x00\x00WAVEfmt ", None),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 8, None),
    (b"#EXTM3U\nhttp://x/a.ts\n", None),  # a playlist: never handed to FFmpeg
])
def test_the_container_is_chosen_by_its_magic(data: bytes, fmt: str | None) -> None:
    assert video.container_format(data) == fmt


@pytest.mark.parametrize(("seconds", "fps", "max_frames", "times"), [
    (2.0, 2, 8, [0, 0.5, 1.0, 1.5]),
    (2.0, 1, 8, [0, 1.0]),
    (2.0, 2, 2, [0, 1.0]),  # more than the cap: spread evenly
    (0.1, 1, 8, [0]),  # shorter than one period: the first frame
    (10.0, 0.5, 8, [0, 2.0, 4.0, 6.0, 8.0]),
])
def test_sample_times(seconds: float, fps: float, max_frames: int, times: list[float]) -> None:
    assert video.sample_times(seconds, fps, max_frames) == pytest.approx(times)


@pytest.mark.parametrize(("sampling", "n", "size"), [
    (video.Sampling(), 4, (640, 480)),
    (video.Sampling(max_pixels=640 * 480 // 4), 4, (320, 240)),
    (video.Sampling(total_pixels=640 * 480), 4, (320, 240)),  # a quarter each
    (video.Sampling(min_pixels=640 * 480 * 4), 4, (1280, 960)),
    (video.Sampling(min_pixels=100, max_pixels=640 * 480), 4, (640, 480)),
])
def test_frame_size_keeps_the_aspect_within_the_bounds(sampling: video.Sampling, n: int,
                                                       size: tuple[int, int]) -> None:
    assert video.frame_size(640, 480, sampling, n) == size


def test_a_video_marker_becomes_one_per_frame() -> None:
    frames = [FrameBytes.of(b"d" * 32, i, shapes_frames(1)[0], f"video 0 frame {i}") for i in range(3)]
    text, media = expand_videos("a<m>b<m>c", "<m>", [[b"img"], list(frames)])
    assert text == "a<m>b<m><m><m>c" and media == [b"img", *frames]


def test_frames_are_keyed_by_the_video_bytes_the_index_and_the_size() -> None:
    rgb = shapes_frames(1)[0]
    a, b = FrameBytes.of(b"d" * 32, 0, rgb, ""), FrameBytes.of(b"d" * 32, 1, rgb, "")
    c = FrameBytes.of(b"e" * 32, 0, rgb, "")
    d = FrameBytes.of(b"d" * 32, 0, rgb[:10, :10], "")
    keys = {media_key(x, 0) for x in (a, b, c, d)}
    assert len(keys) == 4 and media_key(FrameBytes.of(b"d" * 32, 0, rgb.copy(), ""), 0) == media_key(a, 0)


def test_video_url_parts_and_sglang_videos_are_extracted_in_order() -> None:
    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "q"},
                                                  {"type": "video_url", "video_url": {"url": "data:a"}}])]
    assert media_kinds(messages, None) == {"video"} and media_kinds([], None, ["x"]) == {"video"}
    media = extract(messages, ["data:img"], "<m>", ["data:b"])
    assert media.items == ["data:img", VideoPart("data:b", "videos"), VideoPart("data:a", "messages")]
    assert media.messages[0].content == "<m><m>q<m>" and media.n_videos == 2 and media.n_images == 1


def test_the_header_says_size_length_and_frames() -> None:
    info = video.probe("video 0", shapes_video(4, fps=2), LIMITS)
    assert (info.format, info.width, info.height, info.seconds, info.n_frames) == ("mov", 64, 48, 2.0, 4)


def test_the_limits_hold_for_the_request_s_videos_together() -> None:
    clip = shapes_video(4, fps=2)
    limits = video.VideoLimits(0, max_seconds=3, max_stream_frames=0)
    spent = video.Spent()
    spent.add(video.probe("video 0", clip, limits))  # 2 s, 4 frames of 64x48
    with pytest.raises(MediaError, match=r"4\.0 s of video with the request's other videos"):
        video.probe("video 1", clip, limits, spent)
    with pytest.raises(MediaError, match="--video-max-stream-frames 7"):
        video.probe("video 1", clip, video.VideoLimits(0, 0, 7), spent)
    with pytest.raises(MediaError, match="--video-max-decoded-pixels 20000"):
        video.probe("video 1", clip, video.VideoLimits(0, 0, 0, 20_000), spent)
    video.probe("video 1", clip, video.VideoLimits(0, 4, 8, 8 * 64 * 48), spent)


@pytest.mark.parametrize(("data", "message"), [
    (big_frame_video(16000), "--image-max-pixels 50000000"),
    (big_frame_video(60000), "--image-max-pixels 50000000"),
    (long_video(10 * 3600), "--video-max-seconds 300"),
    (b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, "not a video this server can decode"),
    (b"not a video", "not an MP4, MOV, WebM, MKV or AVI video"),
])
def test_bombs_and_garbage_are_refused_from_the_header(data: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=re.escape(message)):
        video.probe("video 0", data, LIMITS)


def _live_webm(n: int) -> bytes:
    """A WebM written as a live recorder writes it: no length in its header."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="webm", options={"live": "1"}) as out:
        stream = out.add_stream("libvpx", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for rgb in shapes_frames(n, 32, 32):
            for p in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(p)
        for p in stream.encode():
            out.mux(p)
    return buf.getvalue()


def test_a_webm_without_its_length_is_counted_from_its_packets() -> None:
    data = _live_webm(30)  # 3 s
    info = video.probe("video 0", data, LIMITS)
    assert info.n_frames == 30 and info.seconds == pytest.approx(3.0, abs=0.2)
    with pytest.raises(MediaError, match="counted without decoding"):
        video.probe("video 0", data, video.VideoLimits(0, 0, 10))
    frames = video.sample("video 0", data, info, video.Sampling(fps=1), LIMITS)
    assert len(frames) == 3


@pytest.mark.parametrize("limits", [video.VideoLimits(0, 0, 5), video.VideoLimits(0, 0, 0, 5 * 16 * 16)],
                         ids=["frames", "decoded-pixels"])
def test_a_header_that_lies_about_its_frames_is_stopped_at_the_limit(limits: video.VideoLimits) -> None:
    data = shapes_video(20, fps=10, width=16, height=16)
    info = video.probe("video 0", data, LIMITS)
    lying = video.VideoInfo(info.format, info.width, info.height, info.seconds, n_frames=1)
    with pytest.raises(MediaError, match="counted while decoding"):
        video.sample("video 0", data, lying, video.Sampling(fps=10, max_frames=20), limits)


def test_times_count_from_the_first_frame() -> None:
    """A stream whose first frame is at 10 s (an edit, a cut from a broadcast) samples as one at 0."""
    from fractions import Fraction

    from worker.testing.tiny_video import encode

    late = encode(shapes_frames(4), 1, pts=[10, 11, 12, 13], time_base=Fraction(1, 1))
    info = video.probe("video 0", late, LIMITS)
    frames = video.sample("video 0", late, info, video.Sampling(fps=1, max_frames=8), LIMITS)
    assert info.seconds == 4.0 and len(frames) == 4  # from 0: one frame, the first, for every time
    assert [bytes(f)[-12:-8] for f in frames] == [i.to_bytes(4, "little") for i in range(len(frames))]


@pytest.mark.parametrize("container", ["mp4", "matroska", "avi"])
def test_mutated_videos_are_media_errors_never_others(container: str) -> None:
    """Bytes flipped, cut and inserted in a valid file: every outcome is frames or a MediaError (a
    400). Reproduces: a stream with no decoder read as `VideoStream.width` (AttributeError) and a
    tag that is not UTF-8 (UnicodeDecodeError) were 500s; found by running this for 2 minutes."""
    import random

    codec = {"mp4": "mpeg4", "matroska": "libvpx", "avi": "mjpeg"}[container]
    seed = shapes_video(3, container=container, codec=codec)
    rng = random.Random(container)
    for _ in range(300):
        data = bytearray(seed)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(data))
            op = rng.random()
            if op < 0.6:
                data[i] = rng.randrange(256)
            elif op < 0.8:
                del data[i : i + rng.randint(1, 64)]
            else:
                data[i:i] = rng.randbytes(rng.randint(1, 16))
        try:
            info = video.probe("video 0", bytes(data), LIMITS)
            video.sample("video 0", bytes(data), info, video.Sampling(fps=2), LIMITS)
        except MediaError:
            pass


def test_a_limit_s_message_is_said_as_it_is() -> None:
    """Reproduces: a MediaError (a ValueError) raised inside PyAV's `with` was wrapped again as
    "the bytes are not a video this server can decode (video 0: ...)"."""
    with pytest.raises(MediaError) as e:
        video.probe("video 0", big_frame_video(16000), LIMITS)
    assert str(e.value).startswith("video 0: the frame size its header states is over this server's")
