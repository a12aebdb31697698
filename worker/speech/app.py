"""The speech worker's routes. `POST /v1/audio/speech` (OpenAI's) cuts `input` into sentences
(worker/protocol/speech.py) and answers as the synthesizer speaks them:

- `stream_format: "audio"`: the file as the body. pcm and wav stream sentence by sentence (the
  first sentence's audio leaves before the second is synthesised); flac, mp3 and opus carry
  lengths in their headers and are sent whole once all is spoken.
- `stream_format: "sse"`: one `speech.audio.delta` event per sentence (`audio`: base64 of that
  sentence in `response_format`, with `format`: pcm and wav pieces concatenate into one file,
  wav's header in the first; a flac, mp3 or opus piece is a whole file for its sentence), then a
  `speech.audio.done` event carrying `finish_reason`, then `data: [DONE]`.

Every encode (and its base64) runs off the event loop, in the state's `AudioEncoder` (at most
`DEFAULT_MAX_ENCODES` at once, worker/media_encoding/offload.py).

The status routes keep the router's worker contract: /health (503 with progress while loading,
500 when the load failed, then `is_sleeping`), /v1/models, /props, /metrics, /sleep, /wake.
Any other POST is a 400 naming the model: a speech model serves speech only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from worker.media_encoding.audio import Samples
from worker.media_encoding.offload import AudioEncoder
from worker.protocol.errors import APIError, api_error_handler, http_exception_handler, parse_model
from worker.protocol.front import Cors, RequireAPIKey
from worker.protocol.speech import (
    FORMATS,
    STREAMABLE_FORMATS,
    SpeechRequest,
    check_format,
    read_voice,
    sentences,
)
from worker.speech.synth import Job, Piece, Synthesizer


@dataclass
class SpeechState:
    synth: Synthesizer
    model_id: str
    model_path: str
    aliases: tuple[str, ...]
    is_metrics_on: bool
    created: int
    encoder: AudioEncoder = field(default_factory=AudioEncoder)  # encodes off the loop, bounded


def _state(request: Request) -> SpeechState:
    state: SpeechState = request.app.state.speech
    return state


def _not_ready(state: SpeechState) -> APIError | None:
    s = state.synth
    if s.error is not None:
        return APIError(f"Model failed to load: {s.error}", status_code=500, type="server_error", code=500)
    if not s.is_ready:
        return APIError("Loading model", status_code=503, type="unavailable_error", code=503,
                        extra={"progress": {"phase": "loading", "fraction": 0.0}})
    return None


async def speech(request: Request) -> Response:
    state = _state(request)
    req = parse_model(SpeechRequest, await request.body())
    fmt = check_format(req.response_format)
    err = _not_ready(state)
    if err is not None:
        raise err
    speaker = read_voice(state.model_path).speaker_id(req.voice)
    state.synth.metrics.requests_total += 1
    job = Job(sentences(req.input), speaker, req.speed, asyncio.get_running_loop())
    state.synth.submit(job)
    pieces = _pieces(job)
    try:
        first = await anext(pieces)  # an error before any audio is still a status code
    except StopAsyncIteration:
        first = None
    except BaseException:
        job.is_cancelled = True
        raise
    rate = state.synth.sample_rate
    enc = state.encoder
    if req.stream_format == "sse":
        return StreamingResponse(_sse(enc, first, pieces, job, rate, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if fmt in STREAMABLE_FORMATS:
        return StreamingResponse(_raw(enc, first, pieces, job, rate, fmt), media_type=FORMATS[fmt])
    samples = [first[1]] if first else []
    async for _, s in pieces:
        samples.append(s)
    return Response(await enc.encode(_join(samples), rate, fmt), media_type=FORMATS[fmt])


def _join(samples: list[Samples]) -> Samples:
    import numpy as np

    return np.concatenate(samples) if samples else np.zeros(0, dtype=np.int16)


async def _pieces(job: Job) -> AsyncIterator[Piece]:
    while (item := await job.out.get()) is not None:
        if isinstance(item, BaseException):
            raise APIError(f"synthesis failed: {item}", status_code=500, type="server_error", code=500)
        yield item


async def _raw(enc: AudioEncoder, first: Piece | None, rest: AsyncIterator[Piece], job: Job, rate: int,
               fmt: str) -> AsyncIterator[bytes]:
    try:
        if first is None:
            yield await enc.encode_piece(_join([]), rate, fmt, True)
            return
        yield await enc.encode_piece(first[1], rate, fmt, True)
        async for _, samples in rest:
            yield await enc.encode_piece(samples, rate, fmt, False)
    finally:
        job.is_cancelled = True  # a client that left stops the job after its current sentence


def _event(data: object) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _sse(enc: AudioEncoder, first: Piece | None, rest: AsyncIterator[Piece], job: Job, rate: int,
               fmt: str) -> AsyncIterator[bytes]:
    async def delta(samples: Samples, is_first: bool) -> bytes:
        audio = await enc.encode_base64(samples, rate, fmt, is_first)
        return _event({"type": "speech.audio.delta", "audio": audio, "format": fmt})

    try:
        if first is not None:
            yield await delta(first[1], True)
            async for _, samples in rest:
                yield await delta(samples, False)
        yield _event({"type": "speech.audio.done", "format": fmt, "finish_reason": "stop"})
    except APIError as e:
        yield _event(e.body())
    finally:
        job.is_cancelled = True
    yield b"data: [DONE]\n\n"


async def health(request: Request) -> Response:
    state = _state(request)
    err = _not_ready(state)
    if err is not None:
        return JSONResponse(err.body(), status_code=err.status_code)
    return JSONResponse({"status": "ok", "is_sleeping": state.synth.is_sleeping})


def _card(state: SpeechState) -> dict[str, object]:
    card: dict[str, object] = {"id": state.model_id, "aliases": list(state.aliases), "object": "model",
                               "created": state.created, "owned_by": "omni-router"}
    try:
        info = read_voice(state.model_path)
        card["meta"] = {"backend": "piper", "sample_rate": info.sample_rate, "voices": list(info.voices),
                        "language": info.language, "formats": list(FORMATS)}
    except (OSError, ValueError):
        pass
    return card


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_card(_state(request))]})


async def props(request: Request) -> Response:
    state = _state(request)
    return JSONResponse({"model_alias": state.model_id, "model_path": state.model_path,
                         "modalities": {"vision": False, "audio": False, "speech": True},
                         "is_sleeping": state.synth.is_sleeping})


async def metrics(request: Request) -> Response:
    state = _state(request)
    if not state.is_metrics_on:
        raise APIError("This server does not support metrics endpoint. Start it with `--metrics`",
                       status_code=501, type="not_supported_error", code=501)
    return Response(state.synth.metrics.render(), media_type="text/plain; version=0.0.4",
                    headers={"Process-Start-Time-Unix": str(int(state.synth.metrics.t_start))})


async def sleep(request: Request) -> Response:
    state = _state(request)
    err = _not_ready(state)
    if err is not None:
        raise err
    await asyncio.wrap_future(state.synth.sleep())
    return JSONResponse({"status": "sleeping"})


async def wake(request: Request) -> Response:
    state = _state(request)
    err = _not_ready(state)
    if err is not None:
        raise err
    t0 = time.monotonic()
    await asyncio.wrap_future(state.synth.wake())
    return JSONResponse({"status": "ok", "wake_ms": round((time.monotonic() - t0) * 1e3, 1)})


async def not_speech(request: Request) -> Response:
    raise APIError(f"model {_state(request).model_id!r} is a text-to-speech model: it serves "
                   f"POST /v1/audio/speech only, not {request.url.path}", param="model",
                   type="not_supported_error", code="model_not_supported")


def build_app(state: SpeechState, *, api_keys: tuple[str, ...] = (), cors_origins: str = "*") -> ASGIApp:
    starlette = Starlette(
        routes=[
            Route("/v1/audio/speech", speech, methods=["POST"]),
            Route("/audio/speech", speech, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
            Route("/props", props, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/sleep", sleep, methods=["POST"]),
            Route("/wake", wake, methods=["POST"]),
            Route("/{path:path}", not_speech, methods=["POST"]),
        ],
        exception_handlers={APIError: api_error_handler, HTTPException: http_exception_handler},
    )
    starlette.state.speech = state
    outer: ASGIApp = starlette
    if api_keys:
        outer = RequireAPIKey(outer, api_keys)
    return Cors(outer, cors_origins)
