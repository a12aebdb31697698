"""Video in, on both backends' vision models (the generated tiny SmolVLM: its GGUF twin and mmproj
on the llama.cpp worker, its HF folder on the torch worker), over real HTTP:

- a generated video (worker/testing/tiny_video.py) gives the same greedy answer as its frames
  sent as images, on each backend, and the same on both; `video_url` data URLs, file:// under
  --allowed-local-media-path and sglang-omni's `videos` give one answer; a second request takes
  the frames' rows from the cache (keyed by the video's bytes and the frame index);
- `video_fps` and `video_max_frames` choose the frames (fewer frames: a shorter prompt);
- the 400s, each naming the field: bytes that are no video, a video over the length, frame or
  decoded-pixel limits (from the header), too many videos, a text-only model, a request over
  --video-max-frames;
- decode bombs at the default limits: a 1-frame video whose headers say 16000x16000 and a video
  of ten hours, each a 400 naming the limit, with no growth of the worker's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.util import answer, metric, run_worker
from worker.testing.tiny_models import ModelPaths
from worker.testing.tiny_video import (
    big_frame_video,
    decoded_frames,
    encode,
    long_video,
    png_of,
    shapes_frames,
    shapes_video,
)
from worker.testing.tiny_vlm import VlmPaths, data_url

ARGS = ["-np", "2", "-c", "4096", "--threads", "1", "--max-images", "8"]
F32_KV = ["--cache-type-k", "f32", "--cache-type-v", "f32"]
VIDEO = shapes_video(4, fps=2)  # 2 s, frames at 0, 0.5, 1, 1.5 s
REVERSED = encode(shapes_frames(4)[::-1], fps=2)
QUESTION = "What happens in this video?"


def _mp4(data: bytes) -> str:
    return data_url(data, "video/mp4")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("video")
    (d / "a.mp4").write_bytes(VIDEO)
    return d


@pytest.fixture(scope="module")
def llama_worker(tiny_vlm: VlmPaths, media_dir: Path) -> Iterator[str]:
    # the limits at their defaults (the decode bombs), local files allowed
    with run_worker(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), *ARGS, *F32_KV,
                    "--allowed-local-media-path", str(media_dir)) as base:
        yield base


@pytest.fixture(scope="module")
def torch_worker(tiny_vlm: VlmPaths) -> Iterator[str]:
    with run_worker(tiny_vlm.hf_dir, *ARGS, "--video-max-stream-frames", "100", "--max-videos", "1",
                    "--video-max-decoded-pixels", "200000") as base:
        yield base


def _chat(base: str, content: Any, max_tokens: int = 12, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def _video_turn(url: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": QUESTION}, {"type": "video_url", "video_url": {"url": url}}]


def _frames_turn(video: bytes) -> list[dict[str, Any]]:
    images = [{"type": "image_url", "image_url": {"url": data_url(png_of(rgb))}}
              for rgb in decoded_frames(video)]
    return [{"type": "text", "text": QUESTION}, *images]


def _error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


@pytest.mark.parametrize("backend", ["llama_cpp", "torch"])
def test_a_video_answers_as_its_frames_sent_as_images(backend: str, llama_worker: str,
                                                      torch_worker: str) -> None:
    """video_fps 2 takes each of the 4 frames: the prompt is the 4 frames' images, one after
    another (and the frames matter: in the other order they answer otherwise)."""
    base = llama_worker if backend == "llama_cpp" else torch_worker
    video = _chat(base, _video_turn(_mp4(VIDEO)), video_fps=2)
    frames = _chat(base, _frames_turn(VIDEO))
    assert answer(video) == answer(frames)
    assert video.json()["usage"]["prompt_tokens"] == frames.json()["usage"]["prompt_tokens"]
    assert answer(_chat(base, _video_turn(_mp4(REVERSED)), video_fps=2)) != answer(video)


def test_both_backends_answer_a_video_alike(llama_worker: str, torch_worker: str) -> None:
    turn = _video_turn(_mp4(VIDEO))
    ours, theirs = _chat(torch_worker, turn), _chat(llama_worker, turn)
    assert answer(ours) == answer(theirs)
    assert ours.json()["usage"]["prompt_tokens"] == theirs.json()["usage"]["prompt_tokens"]


def test_file_url_and_sglang_videos_give_the_data_url_answer(llama_worker: str, media_dir: Path) -> None:
    expected = answer(_chat(llama_worker, _video_turn(_mp4(VIDEO))))
    assert answer(_chat(llama_worker, _video_turn(f"file://{media_dir / 'a.mp4'}"))) == expected
    # sglang-omni's `videos` go first in the last user message
    first = [{"type": "video_url", "video_url": {"url": _mp4(VIDEO)}}, {"type": "text", "text": QUESTION}]
    assert answer(_chat(llama_worker, QUESTION, videos=[str(media_dir / "a.mp4")])) == answer(
        _chat(llama_worker, first))


def test_the_frame_rate_and_cap_choose_the_frames(llama_worker: str) -> None:
    """The default 1 frame a second takes 2 of the 4 frames; video_max_frames 1 takes one; a
    request of the same frames again encodes nothing (the cache is keyed by the video's bytes
    and the frame index)."""
    every = _chat(llama_worker, _video_turn(_mp4(VIDEO)), video_fps=2).json()["usage"]["prompt_tokens"]
    default = _chat(llama_worker, _video_turn(_mp4(VIDEO))).json()["usage"]["prompt_tokens"]
    one = _chat(llama_worker, _video_turn(_mp4(VIDEO)), video_max_frames=1).json()["usage"]["prompt_tokens"]
    per_frame = default - one  # 4 frames, 2 frames, 1 frame
    assert per_frame > 0 and every - default == 2 * per_frame
    encoded = metric(llama_worker, "omni:image_chunks_encoded_total")
    cached = metric(llama_worker, "omni:image_chunks_cached_total")
    _chat(llama_worker, _video_turn(_mp4(VIDEO)), video_fps=2)
    assert metric(llama_worker, "omni:image_chunks_encoded_total") == encoded
    assert metric(llama_worker, "omni:image_chunks_cached_total") > cached


@pytest.mark.parametrize(
    ("extra", "video", "param", "message"),
    [
        ({}, data_url(b"not a video at all"), "messages", "not an MP4, MOV, WebM, MKV or AVI video"),
        ({}, _mp4(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64), "messages", "not a video this server can"),
        ({}, _mp4(shapes_video(120, fps=60, width=16, height=16)), "messages", "--video-max-stream-frames 1"),
        ({}, _mp4(shapes_video(100, fps=50)), "messages", "--video-max-decoded-pixels 200000"),
        ({"video_max_frames": 9}, _mp4(VIDEO), "video_max_frames", "--video-max-frames 8"),
        ({"video_fps": 0}, _mp4(VIDEO), "video_fps", ""),
        ({"video_min_pixels": 10**9}, _mp4(VIDEO), "video_min_pixels", "--image-max-pixels"),
        ({}, "http://127.0.0.1:9/a.mp4", "messages", "--allow-remote-media"),
        ({}, "file:///etc/hostname", "messages", "--allowed-local-media-path"),
    ],
    ids=["garbage", "broken-mp4", "too-many-frames", "too-many-pixels", "over-max-frames", "zero-fps",
         "upscale-bomb", "remote", "local"],
)
def test_bad_videos_are_400s_naming_the_field(torch_worker: str, extra: dict[str, Any], video: str,
                                              param: str, message: str) -> None:
    err = _error(_chat(torch_worker, _video_turn(video), **extra))
    assert param in (err["param"] or "") and message in err["message"]


def test_sglang_videos_errors_name_videos(torch_worker: str) -> None:
    err = _error(_chat(torch_worker, QUESTION, videos=[data_url(b"not a video at all")]))
    assert err["param"] == "videos" and "video 0" in err["message"]
    err = _error(_chat(torch_worker, QUESTION, videos=[_mp4(VIDEO), _mp4(VIDEO)]))
    assert err["param"] == "videos" and "(--max-videos)" in err["message"]


def test_a_text_only_model_refuses_video_naming_itself(tiny_models: ModelPaths) -> None:
    with run_worker(tiny_models.gguf_f32, "-np", "1", "-c", "512", "--threads", "1", "-a", "plain") as base:
        for r in (_chat(base, _video_turn(_mp4(VIDEO))), _chat(base, QUESTION, videos=[_mp4(VIDEO)])):
            err = _error(r)
            assert err["type"] == "not_supported_error" and "'plain' does not accept video" in err["message"]


@pytest.mark.parametrize(
    ("video", "message"),
    [(big_frame_video(16000), "--image-max-pixels 50000000"),
     (long_video(10 * 3600), "--video-max-seconds 300")],
    ids=["16000x16000", "ten-hours"],
)
def test_decode_bombs_are_refused_from_the_header_by_default(llama_worker: str, video: bytes,
                                                            message: str) -> None:
    """The limits at their defaults; the frame would be 384 MB of YUV, ten hours 36,000 frames at 1 fps."""
    before = _rss(llama_worker)
    err = _error(_chat(llama_worker, _video_turn(_mp4(video))))
    assert message in err["message"] and "not decoded" in err["message"] and err["param"] == "messages"
    assert _rss(llama_worker) - before < 50 * 2**20


def _rss(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])  # the worker's own process: found by its port
    for c in psutil.net_connections("tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            return int(psutil.Process(c.pid).memory_info().rss)
    pytest.skip("cannot see the worker's process (no permission to list its sockets)")


def test_pixel_bounds_scale_the_frames(torch_worker: str) -> None:
    """sglang-omni's pixel bounds: video_max_pixels and video_total_pixels (all frames' together)
    scale frames down, video_min_pixels scales them up. A frame of another size is another key
    (new encodes); the same size again is a cache hit (the tiny VLM makes every image one slice
    and an overview, so the prompt's length does not show the size)."""
    url = _mp4(shapes_video(2, fps=1, width=192, height=144))

    def encodes(**extra: Any) -> float:
        before = metric(torch_worker, "omni:image_chunks_encoded_total")
        r = _chat(torch_worker, _video_turn(url), max_tokens=1, **extra)
        assert r.status_code == 200, r.text
        return metric(torch_worker, "omni:image_chunks_encoded_total") - before

    assert encodes() == 4  # 2 frames, 2 chunks each
    assert encodes() == 0
    assert encodes(video_max_pixels=64 * 48) == 4
    assert encodes(video_total_pixels=2 * 64 * 48) == 0  # 2 frames: the same size as above
    assert encodes(video_min_pixels=4 * 192 * 144) == 4
    err = _error(_chat(torch_worker, _video_turn(url), video_min_pixels=10, video_max_pixels=5))
    assert err["param"] == "video_min_pixels"
