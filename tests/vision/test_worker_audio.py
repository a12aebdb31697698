"""Audio on the llama.cpp worker, on the generated tiny Ultravox-style model
(worker/testing/tiny_audio.py: a Whisper encoder and Ultravox projector in the mmproj):
`input_audio` parts answer, greedy output independent of what else runs, one encode per audio
bytes, the 400s (bad bytes, bad base64, unknown format, too long, too many), and the models
that refuse audio naming themselves (a vision-only projector, no projector); /props and the
router's modalities say audio."""

from __future__ import annotations

import base64
import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.lifecycle.modalities import modalities
from router.presets import load_presets
from tests.util import ROOT, answer, metric, run_worker
from worker.testing.tiny_audio import AUDIO, AudioModelPaths, wav
from worker.testing.tiny_models import ModelPaths
from worker.testing.tiny_vlm import VlmPaths, data_url, png

# F32 KV, one thread: the tiny models' usual exact setup (tests/worker/conftest.py).
ARGS = ["-np", "4", "-c", "4096", "--threads", "1", "--cache-type-k", "f32", "--cache-type-v", "f32",
        "--max-audio", "2", "--audio-max-seconds", "40"]


@pytest.fixture(scope="module")
def audio(tiny_audio: AudioModelPaths) -> Iterator[str]:
    with run_worker(tiny_audio.gguf, "--mmproj", str(tiny_audio.mmproj), *ARGS) as base:
        yield base


def _part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def _audio_turn(data: bytes, text: str = "What do you hear?", fmt: str = "wav") -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}, _part(data, fmt)]


def _chat(base: str, content: Any, max_tokens: int = 12, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)




def test_audio_changes_the_answer_and_counts_as_prompt_rows(audio: str) -> None:
    a = _chat(audio, _audio_turn(wav(1.0, 1, 440.0)))
    b = _chat(audio, _audio_turn(wav(1.0, 2, 1200.0)))
    text = _chat(audio, "What do you hear?")
    # one 30 s window: 3000 mel frames, halved by the encoder, stacked by 10
    assert a.json()["usage"]["prompt_tokens"] == text.json()["usage"]["prompt_tokens"] + AUDIO.rows_per_chunk
    assert answer(a) != answer(b)


def test_audio_over_30_seconds_is_one_chunk_per_window(audio: str) -> None:
    """libmtmd cuts audio in 30 s windows, each its own chunk (and its own media key)."""
    encoded = metric(audio, "omni:image_chunks_encoded_total")
    r = _chat(audio, _audio_turn(wav(31.0, 5)), 4)
    text = _chat(audio, "What do you hear?", 4)
    n_text = text.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens"] == n_text + 2 * AUDIO.rows_per_chunk
    assert metric(audio, "omni:image_chunks_encoded_total") == encoded + 2


def test_greedy_output_is_the_same_whatever_else_runs(audio: str) -> None:
    """An audio request alone, beside 3 text requests, and beside another audio request."""
    clip = _audio_turn(wav(1.0, 7, 300.0), "Transcribe it.")
    other = _audio_turn(wav(0.5, 8, 900.0), "And this one?")
    alone = answer(_chat(audio, clip, cache_prompt=False))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = [pool.submit(_chat, audio, f"Tell me about slot {i}", 24) for i in range(3)]
        beside_text = pool.submit(_chat, audio, clip, cache_prompt=False)
        assert answer(beside_text.result()) == alone
        assert all(f.result().status_code == 200 for f in texts)
        two = [pool.submit(_chat, audio, clip, cache_prompt=False), pool.submit(_chat, audio, other)]
        assert answer(two[0].result()) == alone
        assert answer(two[1].result()) == answer(_chat(audio, other, cache_prompt=False))


def test_the_same_audio_twice_is_encoded_once(audio: str) -> None:
    clip = wav(1.0, 11, 660.0)
    encoded = metric(audio, "omni:image_chunks_encoded_total")
    cached = metric(audio, "omni:image_chunks_cached_total")
    first = _chat(audio, _audio_turn(clip))
    assert metric(audio, "omni:image_chunks_encoded_total") == encoded + 1  # one 30 s window
    follow_up = [{"role": "user", "content": _audio_turn(clip)},
                 {"role": "assistant", "content": answer(first)},
                 {"role": "user", "content": "Say more."}]
    r = httpx.post(f"{audio}/v1/chat/completions",
                   json={"messages": follow_up, "max_tokens": 8, "temperature": 0}, timeout=60)
    answer(r)
    assert metric(audio, "omni:image_chunks_encoded_total") == encoded + 1
    assert metric(audio, "omni:image_chunks_cached_total") == cached + 1
    # and the audio's KV rows were reused from the first turn's slot, not computed again
    n_first = first.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_first


def _mp3() -> Path | None:
    """llama.cpp's own test MP3 (tools/mtmd/test-2.mp3), where the sources are checked out."""
    env = os.environ.get("OMNI_TEST_MP3")
    if env:
        return Path(env)
    hits = sorted(ROOT.glob("third_party/llama-cpp-python-*/vendor/llama.cpp/tools/mtmd/test-2.mp3"))
    return hits[-1] if hits else None


def test_mp3_audio_answers(audio: str) -> None:
    mp3 = _mp3()
    if mp3 is None or not mp3.is_file():
        pytest.skip("no MP3 to send: llama.cpp's tools/mtmd/test-2.mp3 (or set OMNI_TEST_MP3)")
    r = _chat(audio, _audio_turn(mp3.read_bytes(), fmt="mp3"))
    answer(r)
    assert r.json()["usage"]["prompt_tokens"] > AUDIO.rows_per_chunk


def _raw_part(value: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "Listen."}, {"type": "input_audio", "input_audio": value}]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_audio_turn(b"not audio at all, just some text"), "audio 0: not WAV, MP3 or FLAC audio"),
        (_audio_turn(png(20, 20, 1)), "audio 0: not WAV, MP3 or FLAC audio"),
        # no fmt or data chunk: no length in its header, refused before decoding (issue 47, 8)
        (_audio_turn(b"RIFF\x00\x00\x00\x00WAVE" + b"\x00" * 40), "audio 0: its length cannot be read"),
        (_raw_part({"data": "@@@@", "format": "wav"}), "audio 0: `input_audio.data` is not valid base64"),
        (_raw_part({"data": _b64(wav(0.2, 1)), "format": "ogg"}), "`input_audio.format` must be one of"),
        (_raw_part({"data": _b64(wav(0.2, 1))}), "`input_audio.format` must be one of"),
        (_audio_turn(wav(0.2, 1), fmt="mp3"),
         "audio 0: `input_audio.format` is 'mp3', but the bytes are WAV"),
        (_raw_part({"format": "wav"}), "`input_audio.data` must be"),
        (_raw_part("UklGRg=="), "needs an `input_audio` object"),
        (_audio_turn(wav(41.0, 3)), "audio 0: 41.0 s is over this server's --audio-max-seconds 40"),
        ([_part(wav(0.2, 1)), _part(wav(0.2, 2)), _part(wav(0.2, 3))], "at most 2 (--max-audio)"),
        ([_part(wav(0.2, 1)), _part(b"garbage, not audio!")], "audio 1: not WAV"),
    ],
    ids=["garbage", "png-as-audio", "broken-wav", "bad-base64", "unknown-format", "no-format", "wrong-format",
         "no-data", "not-an-object", "too-long", "too-many", "second-is-bad"],
)
def test_bad_audio_is_a_400(audio: str, content: list[dict[str, Any]], message: str) -> None:
    r = _chat(audio, content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and message in err["message"], err


def test_an_audio_only_model_refuses_images_naming_itself(audio: str) -> None:
    r = _chat(audio, [{"type": "image_url", "image_url": {"url": data_url(png(20, 20, 1))}}])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "not_supported_error"
    assert "'tiny-ultravox-f32'" in err["message"] and "no vision encoder" in err["message"]


def test_props_reports_audio(audio: str) -> None:
    assert httpx.get(f"{audio}/props", timeout=10).json()["modalities"] == {"vision": False, "audio": True}


def test_a_vision_only_model_refuses_audio_naming_itself(tiny_vlm: VlmPaths) -> None:
    with run_worker(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), "-np", "1", "-c", "512",
                    "--threads", "1", "-a", "eyes") as base:
        r = _chat(base, _audio_turn(wav(0.5, 1)))
        props = httpx.get(f"{base}/props", timeout=10).json()
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "not_supported_error"
    assert "'eyes'" in err["message"] and "no audio encoder" in err["message"]
    assert props["modalities"] == {"vision": True, "audio": False}


def test_a_text_only_model_refuses_audio_naming_itself(tiny_models: ModelPaths) -> None:
    with run_worker(tiny_models.gguf_f32, "-np", "1", "-c", "512", "--threads", "1", "-a", "plain") as base:
        r = _chat(base, _audio_turn(wav(0.5, 1)))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "not_supported_error" and "'plain'" in err["message"] and "audio" in err["message"]


def test_router_reports_an_audio_projector_without_loading_it(tmp_path: Path, tiny_audio: AudioModelPaths,
                                                              tiny_vlm: VlmPaths) -> None:
    """/v1/models' `modalities`: read from the mmproj's header (clip.has_audio_encoder)."""
    preset = tmp_path / "p.ini"
    preset.write_text(f"[ears]\nmodel = {tiny_audio.gguf}\nmmproj = {tiny_audio.mmproj}\n\n"
                      f"[eyes]\nmodel = {tiny_vlm.gguf}\nmmproj = {tiny_vlm.mmproj}\n")
    got = {p.name: modalities(p) for p in load_presets(preset)}
    assert got == {"ears": {"vision": False, "audio": True}, "eyes": {"vision": True, "audio": False}}
