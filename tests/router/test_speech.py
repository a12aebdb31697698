"""Speech out through the router (issue 41): a tiny random-weight Piper voice (models/tiny-voice.onnx,
worker/testing/voices.py) served by a real speech worker, and a tiny chat model paired with it by
`speech-model`. The openai SDK's speech calls, the SSE form, spoken chat answers streamed and
whole, and every bad input as a 400 naming its field, all over real HTTP.

The tiny voice has no noise in it (Piper's noise inputs are unused): the same text gives the same
samples, so a streamed answer can be compared with a whole one.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile

from tests.router.conftest import RouterProc
from tests.util import ROOT, preset_defaults

MODELS = ROOT / "models"
VOICE = MODELS / "tiny-voice.onnx"
CHAT = MODELS / "tiny-llama-f32.gguf"
THREE = "The first sentence is here. The second one follows it! Is this the third?"

pytestmark = pytest.mark.skipif(not VOICE.exists() or not CHAT.exists(), reason="make models")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    from tests.router.conftest import router_factory  # the fixture's body, at module scope

    preset = (preset_defaults(512)
              + f'[models.chat]\nmodel = "{CHAT}"\nspeech-model = "voice"\n'
              + f'[models.voice]\nmodel = "{VOICE}"\nalias = ["tts-1"]\n'
              + f'[models.plain]\nmodel = "{CHAT}"\n')
    gen = router_factory.__wrapped__(tmp_path_factory.mktemp("speech"))  # type: ignore[attr-defined]
    start = next(gen)
    yield start(preset)
    with pytest.raises(StopIteration):
        next(gen)


def _client(r: RouterProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r.base}/v1", api_key="none", max_retries=0)


def _decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768, 16000
    if fmt == "aac":  # an ADTS stream: FFmpeg's decoder (libsndfile reads no AAC)
        import av

        with av.open(io.BytesIO(data)) as f:
            frames = [fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]
            return np.concatenate(frames), f.streams.audio[0].rate
    samples, rate = soundfile.read(io.BytesIO(data))
    return samples, rate


@pytest.mark.parametrize(("fmt", "magic"), [("wav", b"RIFF"), ("pcm", b""), ("flac", b"fLaC"), ("mp3", b""),
                                            ("opus", b"OggS"), ("aac", b"\xff\xf1")])
def test_sdk_speech_create_decodes_to_the_requested_format(router: RouterProc, fmt: str,
                                                           magic: bytes) -> None:
    audio = _client(router).audio.speech.create(model="voice", input=THREE, voice="alloy",
                                                response_format=fmt)  # type: ignore[arg-type]
    assert audio.content.startswith(magic)
    samples, rate = _decode(audio.content, fmt)
    assert rate == 16000  # the tiny voice's rate (16 kHz is one of Opus's own)
    assert samples.size > rate // 2 and np.abs(samples).max() > 0.1


def test_sdk_with_streaming_response_gives_the_same_audio_as_a_whole_answer(router: RouterProc) -> None:
    client = _client(router)
    whole = client.audio.speech.create(model="tts-1", input=THREE, voice="alloy", response_format="wav")
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", input=THREE, voice="alloy", response_format="wav") as resp:
        assert resp.headers["content-type"] == "audio/wav"
        streamed = b"".join(resp.iter_bytes())
    # Streamed, the WAV header says "until the end" (no length yet); the samples are the same.
    assert streamed[44:] == whole.content[44:]
    assert _decode(streamed, "wav")[0].size == _decode(whole.content, "wav")[0].size


def _sse(resp: httpx.Response) -> list[Any]:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in resp.iter_lines() if line.startswith("data: ")]


def test_speech_sse_gives_a_delta_per_sentence_then_done_with_finish_reason(router: RouterProc) -> None:
    body = {"model": "voice", "input": THREE, "voice": "tiny-voice", "response_format": "pcm",
            "stream_format": "sse", "speed": 1.5}
    with router.client() as c, c.stream("POST", "/v1/audio/speech", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = _sse(resp)
    deltas, done, end = events[:-2], events[-2], events[-1]
    assert [e["type"] for e in deltas] == ["speech.audio.delta"] * 3  # one per sentence
    assert all(e["format"] == "pcm" for e in deltas)
    assert done == {"type": "speech.audio.done", "format": "pcm", "finish_reason": "stop"} and end == "[DONE]"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    whole = httpx.post(f"{router.base}/v1/audio/speech", json={**body, "stream_format": "audio"}, timeout=30)
    assert pcm == whole.content


def _chat(model: str, stream: bool, audio: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 24, "temperature": 0, "modalities": ["text", "audio"],
            "audio": audio or {"voice": "alloy", "format": "pcm16"}, **extra}


def test_streamed_spoken_chat_gives_text_deltas_and_audio_whose_transcript_is_the_text(
        router: RouterProc) -> None:
    body = _chat("chat", True)
    with router.client(timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    audio = [d["audio"] for d in deltas if "audio" in d]
    assert text.strip() and audio
    assert "".join(a["transcript"] for a in audio).strip() == text.strip()
    assert len({a["id"] for a in audio}) == 1 and all(a["expires_at"] > 0 for a in audio)
    assert sum(len(base64.b64decode(a["data"])) for a in audio) > 0
    # the closing chunk (finish_reason) comes after the last audio chunk
    finish = [i for i, ch in enumerate(chunks) if ch["choices"] and ch["choices"][0].get("finish_reason")]
    last_audio = max(i for i, ch in enumerate(chunks)
                     if ch["choices"] and "audio" in ch["choices"][0]["delta"])
    assert finish and finish[0] > last_audio


def test_whole_spoken_chat_carries_message_audio(router: RouterProc) -> None:
    body = _chat("chat", False, {"voice": "alloy", "format": "wav"})
    answer = _client(router).chat.completions.create(**body)
    message = answer.choices[0].message
    assert message.audio is not None and message.audio.id.startswith("audio_")
    assert message.audio.transcript == message.content and message.audio.expires_at > 0
    samples, rate = _decode(base64.b64decode(message.audio.data), "wav")
    assert rate == 16000 and (samples.size > 0) == bool(message.content and message.content.strip())


def test_models_say_which_model_speaks(router: RouterProc) -> None:
    cards = router.models()
    assert cards["voice"]["modalities"]["speech"] is True
    assert cards["chat"]["modalities"]["audio_output"] is True and cards["chat"]["speech_model"] == "voice"
    assert cards["plain"]["modalities"] == {"vision": False, "audio": False}  # speaks not


def test_the_voice_sleeps_wakes_and_reports_metrics(router: RouterProc) -> None:
    _client(router).audio.speech.create(model="voice", input="Hello.", voice="alloy", response_format="wav")
    assert httpx.post(f"{router.base}/models/sleep", json={"model": "voice"}, timeout=30).status_code == 200
    router.wait_status("voice", "sleeping")
    audio = _client(router).audio.speech.create(model="voice", input="Hello again.", voice="alloy",
                                                response_format="wav")
    assert _decode(audio.content, "wav")[0].size > 0  # woken by the request
    metrics = httpx.get(f"{router.base}/metrics", timeout=10).text
    assert 'omni:speech_sentences_total{model="voice"}' in metrics


LONG = "word " * 820 + "end."  # 4104 characters: over OpenAI's 4096


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": "   "}, "input"),
    ({"input": LONG}, "input"),
    ({"voice": "nobody"}, "voice"),
    ({"response_format": "ogg"}, "response_format"),
    ({"response_format": "m4a"}, "response_format"),
    ({"speed": 0.1}, "speed"),
    ({"speed": 4.5}, "speed"),
    ({"stream_format": "chunks"}, "stream_format"),
    ({"instructions": "whisper"}, "instructions"),
])
def test_bad_speech_input_is_a_400_naming_the_field(router: RouterProc, body: dict[str, Any],
                                                    param: str) -> None:
    full = {"model": "voice", "input": "Hello.", "voice": "alloy", "response_format": "wav", **body}
    r = httpx.post(f"{router.base}/v1/audio/speech", json=full, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(("model", "body", "param"), [
    ("plain", {}, "modalities"),  # no voice paired with it
    ("chat", {"audio": {"voice": "nobody", "format": "wav"}}, "audio.voice"),
    ("chat", {"audio": {"voice": "alloy", "format": "ogg"}}, "audio.format"),
    ("chat", {"audio": None}, "audio"),
    ("chat", {"modalities": ["text"]}, "modalities"),
    ("chat", {"n": 2}, "n"),
])
def test_bad_spoken_chat_is_a_400_naming_the_field(router: RouterProc, model: str, body: dict[str, Any],
                                                  param: str) -> None:
    full = {**_chat(model, False), **body}
    r = httpx.post(f"{router.base}/v1/chat/completions", json=full, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_voice_refuses_text_routes_and_responses_refuse_audio(router: RouterProc) -> None:
    r = httpx.post(f"{router.base}/v1/chat/completions", timeout=30,
                   json={"model": "voice", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{router.base}/v1/responses", timeout=30,
                   json={"model": "chat", "input": "hi", "modalities": ["text", "audio"]})
    assert r.status_code == 400 and "OpenAI defines audio output there only" in r.json()["error"]["message"]


def test_the_tiny_voice_files_are_what_piper_reads() -> None:
    config = json.loads(Path(f"{VOICE}.json").read_text())
    assert config["audio"]["sample_rate"] == 16000 and config["phoneme_type"] == "espeak"


def test_spoken_chat_with_room_for_one_model_takes_turns(router_factory: Any) -> None:
    # With --models-max 1 the chat model and its voice cannot both run: the chat is released
    # once its text is in, the voice takes its place and speaks it (it never waits on itself).
    r = router_factory(preset_defaults(512) + f'[models.chat]\nmodel = "{CHAT}"\nspeech-model = "voice"\n'
                       f'[models.voice]\nmodel = "{VOICE}"\n', "--models-max", "1")
    body = _chat("chat", True)
    with r.client(timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = _sse(resp)
    deltas = [ch["choices"][0]["delta"] for ch in events[:-1] if ch["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    assert "".join(d["audio"]["transcript"] for d in deltas if "audio" in d).strip() == text.strip()
    assert r.status("voice") == "loaded" and r.status("chat") != "loaded"


def test_control_characters_in_the_input_are_spoken_around(router: RouterProc) -> None:
    # Reproduces: a chat model's answer holding a NUL failed its spoken answer mid-stream
    # (espeak-ng's bridge: "embedded null character").
    r = httpx.post(f"{router.base}/v1/audio/speech", timeout=30, json={
        "model": "voice", "input": "One\x00two. \x05Three.", "voice": "alloy", "response_format": "wav"})
    assert r.status_code == 200 and _decode(r.content, "wav")[0].size > 0


def test_a_broken_voice_fails_its_load_with_the_reason(router_factory: Any, tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model\n" * 8)
    Path(f"{broken}.json").write_text(Path(f"{VOICE}.json").read_text())
    r = router_factory(preset_defaults(512) + f'[models.broken]\nmodel = "{broken}"\n')
    resp = httpx.post(f"{r.base}/v1/audio/speech", timeout=60,
                      json={"model": "broken", "input": "Hello.", "voice": "alloy"})
    assert resp.status_code >= 500 and "error" in resp.json(), resp.text
    card = r.wait_status("broken", "failed")
    assert card["status"]["exit_code"] == 1 and "InvalidProtobuf" in card["status"]["error"], card["status"]
