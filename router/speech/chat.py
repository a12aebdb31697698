"""`SpokenChat`: a chat completion with `modalities: ["text", "audio"]`, served by pairing the
chat model with the voice its preset names (`speech-model`). The router runs the chat on the
chat model (without the two audio fields), cuts the answer's `content` into sentences
(worker.protocol.speech.split_sentences) and has the voice speak each one through its own
admission (`POST /v1/audio/speech`, raw samples), like any request a client sends it.

- Streamed: the text deltas pass as they come; each sentence, once complete and spoken, adds a
  chunk whose `delta.audio` is OpenAI's `{id, data, transcript, expires_at}` (`data`: base64 of
  that sentence in `audio.format`: pcm16 and wav pieces concatenate into one file, wav's header
  in the first; a flac, mp3 or opus piece is a whole file for its sentence). The voice speaks
  while the model still writes. The chunk with `finish_reason` (and the usage chunk) come last.
- Not streamed: `message.audio` is `{id, data, transcript, expires_at}`, the whole answer in one
  file of `audio.format`.

The audio is encoded (and base64'd) off the event loop, by `AudioEncoder` (at most
`DEFAULT_MAX_ENCODES` at once): LAME, libopus and FFmpeg take about a second a minute of audio,
and every other stream of every model would stall that long.

Unlike OpenAI, `content` keeps the text too (the transcript equals it), so a client that reads
only `content` still works. Nothing is stored: `expires_at` is when the id stops meaning
anything (an hour, as OpenAI), and a later turn sends the text back as the assistant's content.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.lifecycle.pool import Pool
from router.presets import ModelPreset
from router.responses.bridge import ChatBridge
from router.speech.wire import CHAT_FORMATS, ChatAudio, SpokenRequest
from worker.media_encoding.audio import Samples
from worker.media_encoding.offload import AudioEncoder
from worker.protocol.errors import APIError, parse_model
from worker.protocol.speech import MAX_INPUT_CHARS, VoiceInfo, check_format, read_voice, split_sentences

log = logging.getLogger("omni.router.speech")
EXPIRES_S = 3600
_FIELDS = ("modalities", "audio", "stream", "n")


def asks_for_audio(data: dict[str, Any]) -> bool:
    modalities = data.get("modalities")
    return "audio" in data or (isinstance(modalities, list) and "audio" in modalities)


class SpokenChat:
    def __init__(self, pool: Pool, bridge: ChatBridge, encoder: AudioEncoder | None = None) -> None:
        self._pool = pool
        self._bridge = bridge
        self.encoder = encoder or AudioEncoder()

    def takes(self, preset: ModelPreset, data: dict[str, Any]) -> bool:
        """Whether the router answers this chat request itself: it asks for audio and the model
        is ours or paired (a `cmd`/`remote` upstream without a voice gets the fields untouched)."""
        if not asks_for_audio(data):
            return False
        return preset.speech_model is not None or preset.backend not in ("cmd", "remote")

    async def __call__(self, scope: Scope, receive: Receive, send: Send, preset: ModelPreset,
                       data: dict[str, Any]) -> None:
        """Answers the request; an `APIError` before the answer starts is the caller's to send."""
        try:
            response = await self._respond(preset, data)
        except APIError:
            raise
        except Exception as e:  # a bug: the envelope, never a bare 500
            log.exception("spoken answer for model %s failed", preset.name)
            raise APIError(f"internal error: {e!r}", status_code=500, type="server_error") from None
        await response(scope, receive, send)

    async def _respond(self, preset: ModelPreset, data: dict[str, Any]) -> Response:
        if preset.speech_model is None:
            modalities = data.get("modalities")
            param = "modalities" if isinstance(modalities, list) and "audio" in modalities else "audio"
            raise APIError(f"model {preset.name!r} has no voice paired (its preset names no `speech-model`): "
                           "it answers in text only, so 'modalities' audio and 'audio' do not apply",
                           param=param)
        req = parse_model(SpokenRequest, {k: data[k] for k in _FIELDS if k in data})
        if "audio" not in req.modalities:
            raise APIError("`audio` asks for a spoken answer: add modalities ['text', 'audio']",
                           param="modalities")
        if req.audio is None:
            raise APIError("modalities 'audio' needs `audio`: {\"voice\": ..., \"format\": ...}",
                           param="audio")
        info = self._voice(preset.speech_model)
        speaker = info.speaker_id(req.audio.voice, param="audio.voice")
        speech = _Speech(self._bridge, self.encoder, preset.speech_model, req.audio, speaker, info)
        body = {k: v for k, v in data.items() if k not in ("modalities", "audio")}
        if req.stream:
            return await self._streamed(preset.name, body, speech)
        return await self._whole(preset.name, body, speech)

    def _voice(self, name: str) -> VoiceInfo:
        voice = self._pool.get(name)
        if voice is None or voice.preset.model is None:
            raise APIError(f"speech model {name!r} is not served here", param="modalities")
        try:
            return read_voice(voice.preset.model)
        except (OSError, ValueError) as e:
            raise APIError(f"speech model {name!r} cannot be read: {e}", status_code=503,
                           type="unavailable_error", code=503) from None

    async def _whole(self, model: str, body: dict[str, Any], speech: _Speech) -> Response:
        answer = await self._bridge.call_json(model, "/v1/chat/completions", body)
        message = answer["choices"][0]["message"]
        text = message.get("content") or ""
        samples = [await speech.samples(s) for s in _speakable(text)]
        joined = np.concatenate(samples) if samples else np.zeros(0, dtype=np.int16)
        data = await speech.encoder.encode_base64(joined, speech.info.sample_rate, speech.format)
        message["audio"] = {"id": speech.audio_id, "data": data, "transcript": text,
                            "expires_at": speech.expires_at}
        return JSONResponse(answer)

    async def _streamed(self, model: str, body: dict[str, Any], speech: _Speech) -> Response:
        stack = contextlib.AsyncExitStack()
        chunks = await stack.enter_async_context(self._bridge.open_chat(model, body, "/v1/chat/completions"))
        return StreamingResponse(_stream(chunks, speech, stack), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


class _Speech:
    """One answer's voice: its settings, and each sentence spoken through the voice's admission."""

    def __init__(self, bridge: ChatBridge, encoder: AudioEncoder, model: str, audio: ChatAudio, speaker: int,
                 info: VoiceInfo) -> None:
        self._bridge = bridge
        self.encoder = encoder
        self.model = model
        self.voice = audio.voice
        fmt = CHAT_FORMATS.get(audio.format)
        if fmt is None:
            raise APIError(f"audio.format {audio.format!r} is not supported; use one of "
                           f"{', '.join(CHAT_FORMATS)}", param="audio.format")
        self.format = check_format(fmt, param="audio.format")
        self.speaker = speaker
        self.info = info
        self.audio_id = f"audio_{uuid.uuid4().hex}"
        self.expires_at = int(time.time()) + EXPIRES_S

    async def samples(self, text: str) -> Samples:
        raw = await self._bridge.call_bytes(self.model, "/v1/audio/speech", {
            "model": self.model, "input": text, "voice": self.voice, "response_format": "pcm"})
        return np.frombuffer(raw, dtype="<i2").astype(np.int16)


def _speakable(text: str) -> list[str]:
    """`text` as sentences the voice takes (each under its input limit), blank ones left out."""
    done, rest = split_sentences(text)
    out = []
    for s in [*done, rest]:
        while len(s) > MAX_INPUT_CHARS:
            cut = s.rfind(" ", 0, MAX_INPUT_CHARS)
            cut = cut if cut > 0 else MAX_INPUT_CHARS
            out.append(s[:cut])
            s = s[cut:]
        out.append(s)
    return [s for s in out if s.strip()]


def _sse(data: object) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(chunks: AsyncIterator[dict[str, Any]], speech: _Speech,
                  stack: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """The chat's chunks as they come, the audio chunks as sentences are spoken, the closing
    chunks (finish_reason, usage) after the last audio, then [DONE]."""
    out: asyncio.Queue[bytes | None] = asyncio.Queue()
    sentences: asyncio.Queue[str | None] = asyncio.Queue()
    held: list[bytes] = []
    head: dict[str, Any] = {}

    async def read_chat() -> None:
        pending = ""
        try:
            async for chunk in chunks:
                if "error" in chunk:
                    held.append(_sse(chunk))
                    break
                head.setdefault("id", chunk.get("id"))
                head.setdefault("created", chunk.get("created"))
                head.setdefault("model", chunk.get("model"))
                choices = chunk.get("choices") or []
                text = (choices[0].get("delta") or {}).get("content") or "" if choices else ""
                if not choices or choices[0].get("finish_reason") is not None:
                    held.append(_sse(chunk))  # the closing chunks go after the audio
                else:
                    await out.put(_sse(chunk))
                done, pending = split_sentences(pending + text)
                for s in done:
                    await sentences.put(s)
            if pending:
                await sentences.put(pending)
        finally:
            await sentences.put(None)
            # The chat model is released as soon as its text is in: with `--models-max 1` the
            # voice can then take its place (a voice waiting on a chat that waits on the voice
            # would never end).
            await stack.aclose()

    async def speak() -> None:
        is_first = True
        while (sentence := await sentences.get()) is not None:
            for piece in _speakable(sentence) or [sentence]:
                samples = await speech.samples(piece) if piece.strip() else np.zeros(0, dtype=np.int16)
                data = await speech.encoder.encode_base64(samples, speech.info.sample_rate, speech.format,
                                                          is_first)
                is_first = False
                audio = {"id": speech.audio_id, "data": data, "transcript": piece,
                         "expires_at": speech.expires_at}
                await out.put(_sse({**head, "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"audio": audio}, "finish_reason": None}]}))

    tasks = [asyncio.create_task(read_chat()), asyncio.create_task(speak())]
    finisher = asyncio.create_task(_after(tasks, lambda: out.put_nowait(None)))
    try:
        while (item := await out.get()) is not None:
            yield item
        for t in tasks:
            error = t.exception()
            if error is not None:
                message = error.message if isinstance(error, APIError) else repr(error)
                held.append(_sse({"error": {"message": f"spoken answer failed: {message}",
                                            "type": "server_error", "param": None, "code": 500}}))
                break
        for item in held:
            yield item
        yield b"data: [DONE]\n\n"
    finally:
        for t in [*tasks, finisher]:
            t.cancel()
        await asyncio.gather(*tasks, finisher, return_exceptions=True)
        await stack.aclose()


async def _after(tasks: list[asyncio.Task[None]], then: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait(tasks, return_when=asyncio.ALL_COMPLETED)
    then()

