"""Speech audio into the formats OpenAI's speech API names: 16-bit mono samples in, file bytes out.
Shared by the speech worker (`/v1/audio/speech`) and the router's chat audio (router/speech/),
always through `worker.media_encoding.offload` (never on an event loop: LAME, libopus and FFmpeg
take about a second a minute of audio).

- pcm: the samples as they are (16-bit signed little-endian, the voice's rate).
- wav: a RIFF header, then pcm. Streamed, the header's sizes are 0xFFFFFFFF ("until the end",
  as streaming servers write it), so the header goes first, before the length is known.
- flac, mp3 (LAME), opus (in Ogg): libsndfile through `soundfile` (its wheels bundle libsndfile
  1.2 with those encoders). Opus takes 8, 12, 16, 24 or 48 kHz only: other rates are resampled
  to 24 kHz (linear interpolation: speech from a 16-22 kHz voice loses nothing it had).
- aac: an ADTS stream (what OpenAI's `aac` is), FFmpeg's own AAC encoder through PyAV (its
  wheels bundle FFmpeg; libsndfile has no AAC encoder).

`encode_piece` encodes one sentence's samples for a stream: pieces of pcm and wav (the header
first) concatenate into one valid file; a piece of flac, mp3 or opus is a whole file of its own
(their headers carry the length: LAME's Xing frame, FLAC's STREAMINFO).
"""

from __future__ import annotations

import io
import struct

import numpy as np
import numpy.typing as npt

Samples = npt.NDArray[np.int16]
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_OPUS_RATE = 24000
_SUBTYPES = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def wav_header(rate: int, n_bytes: int | None = None) -> bytes:
    """A 44-byte WAV header for mono 16-bit audio; `n_bytes` None: the streaming form."""
    data = 0xFFFFFFFF if n_bytes is None else n_bytes
    riff = 0xFFFFFFFF if n_bytes is None else 36 + n_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", data))


def resample(samples: Samples, rate: int, to: int) -> Samples:
    if rate == to or samples.size == 0:
        return samples
    n = max(1, round(samples.size * to / rate))
    x = np.linspace(0, samples.size - 1, n)
    return np.interp(x, np.arange(samples.size), samples.astype(np.float32)).round().astype(np.int16)


def encode(samples: Samples, rate: int, fmt: str) -> bytes:
    """One whole file of `samples` in `fmt` (one of worker.protocol.speech.FORMATS). Blocking."""
    pcm = samples.astype("<i2", copy=False).tobytes()
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(rate, len(pcm)) + pcm
    if fmt == "aac":
        return _aac(samples, rate)
    import soundfile  # libsndfile: only the compressed formats need it

    container, subtype = _SUBTYPES[fmt]
    if fmt == "opus" and rate not in _OPUS_RATES:
        samples, rate = resample(samples, rate, _OPUS_RATE), _OPUS_RATE
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", samplerate=rate, channels=1, format=container, subtype=subtype) as f:
        f.write(samples)
    return buf.getvalue()


def _aac(samples: Samples, rate: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="adts") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "mono"
        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def encode_piece(samples: Samples, rate: int, fmt: str, is_first: bool) -> bytes:
    """One sentence of a stream: a piece to concatenate (STREAMABLE_FORMATS), else a whole file."""
    if fmt == "wav":
        pcm = samples.astype("<i2", copy=False).tobytes()
        return (wav_header(rate) if is_first else b"") + pcm
    return encode(samples, rate, fmt)
