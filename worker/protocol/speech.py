"""Text to speech on the wire, one set of rules for both sides: OpenAI's `POST /v1/audio/speech`
body (served by a speech worker, worker/speech/), the voice file's own description (read by the
router for /v1/models and chat audio without loading the voice), and the sentence splitter that
makes streaming sentence by sentence (the worker's speech route and the router's chat pairing,
router/speech/, cut text the same way).

A voice is Piper's pair of files: `NAME.onnx` (the network, run by ONNX Runtime) and
`NAME.onnx.json` beside it (sample rate, phonemizer, speakers). A request's `voice` is one of
the voice's speakers (`speaker_id_map` of a multi-speaker voice; the file's stem or `default`
for a single-speaker one), or one of OpenAI's voice names, which map onto the speakers in turn
(so clients written for OpenAI work unchanged). Any other name is a 400 naming `voice`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from worker.protocol.errors import APIError
from worker.protocol.strict import StrictModel

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for `speed`
# response_format -> its media type. pcm: raw 16-bit signed little-endian mono at the voice's rate.
FORMATS: dict[str, str] = {
    "wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
    "aac": "audio/aac",
}
# Formats OpenAI names that no library kept here encodes: none (aac needs PyAV, a dependency).
UNSUPPORTED_FORMATS: dict[str, str] = {}
# Formats whose pieces, encoded sentence by sentence, concatenate into one valid file: a raw
# (`stream_format: audio`) body in these streams as the sentences are synthesised; flac, mp3 and
# opus files carry lengths in their headers and are encoded whole at the end.
STREAMABLE_FORMATS = frozenset({"pcm", "wav"})
# OpenAI's built-in voice names: each maps to one of the voice's speakers, in turn.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                 "verse", "marin", "cedar")
VOICE_SUFFIX = ".onnx"


def is_voice_file(path: str | Path) -> bool:
    """A Piper voice: an `.onnx` file (its `.onnx.json` config is checked when it loads)."""
    return str(path).lower().endswith(VOICE_SUFFIX)


def check_format(fmt: str, param: str = "response_format") -> str:
    if fmt == "aac" and importlib.util.find_spec("av") is None:
        raise APIError(f"{param} 'aac' needs PyAV (pip install av), which encodes it with FFmpeg",
                       param=param)
    if fmt in FORMATS:
        return fmt
    why = UNSUPPORTED_FORMATS.get(fmt)
    raise APIError(f"{param} {fmt!r} is not supported" + (f": {why}" if why else "")
                   + f"; use one of {', '.join(FORMATS)}", param=param)


class SpeechRequest(StrictModel):
    """OpenAI's `POST /v1/audio/speech` body."""

    model: str | None = None
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str = Field(min_length=1)
    response_format: str = "mp3"  # OpenAI's default
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)
    stream_format: Literal["audio", "sse"] = "audio"

    @field_validator("input")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("input has no text to speak (only whitespace)")
        return v


@dataclass(frozen=True)
class VoiceInfo:
    """What a voice's `.onnx.json` says, without loading the network."""

    name: str  # the file's stem, e.g. en_US-joe-medium
    sample_rate: int
    speakers: tuple[str, ...]  # the voice's own speaker names, in id order
    language: str

    def speaker_id(self, voice: str, param: str = "voice") -> int:
        """The speaker a request's `voice` names; a 400 naming `param` for any other name."""
        if voice in self.speakers:
            return self.speakers.index(voice)
        if voice in OPENAI_VOICES:
            return OPENAI_VOICES.index(voice) % len(self.speakers)
        raise APIError(f"{param} {voice!r} is not a voice of this model; use one of "
                       f"{', '.join(self.voices)}", param=param)

    @property
    def voices(self) -> tuple[str, ...]:
        return (*self.speakers, *OPENAI_VOICES)


def config_path(model: str | Path) -> Path:
    return Path(f"{model}.json")


def read_voice(model: str | Path) -> VoiceInfo:
    """The voice's description from its `.onnx.json`; ValueError saying what is wrong."""
    path = config_path(model)
    st = path.stat()  # OSError: no config beside the voice
    return _read_voice(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read_voice(path: Path, size: int, mtime_ns: int) -> VoiceInfo:
    config = json.loads(path.read_text(encoding="utf-8"))
    try:
        rate = int(config["audio"]["sample_rate"])
        n_speakers = int(config.get("num_speakers", 1))
        id_map: dict[str, int] = dict(config.get("speaker_id_map") or {})
        language = str(config.get("language", {}).get("code") or config.get("espeak", {}).get("voice", ""))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a Piper voice config ({e!r})") from None
    stem = path.name.removesuffix(".onnx.json")
    if n_speakers > 1 and id_map:
        speakers = tuple(name for name, _ in sorted(id_map.items(), key=lambda kv: kv[1]))
    else:
        speakers = (stem,) if n_speakers <= 1 else tuple(str(i) for i in range(n_speakers))
    return VoiceInfo(stem, rate, speakers, language)


# ---- sentences

# A sentence ends at . ! ? or … (closing quotes or brackets may follow) followed by whitespace,
# at a CJK full stop, or at a line break; "3.5" and "e.g. " do not end one. An end at the very end
# of the text waits for the next piece (it may be "3." of "3.5").
_END = re.compile(r"""[.!?…]+["'”’)\]]*\s+|[。！？]+["'”’)\]]*|\n+""")
_ABBREVIATIONS = frozenset({"mr.", "mrs.", "ms.", "dr.", "st.", "vs.", "etc.", "e.g.", "i.e.", "no."})


def split_sentences(text: str) -> tuple[list[str], str]:
    """The complete sentences at the start of `text` and the rest (an unfinished sentence, or
    ""): streaming feeds the rest back with the next piece of text. Sentences keep their own
    spacing, so that "".join(sentences) + rest == text."""
    out: list[str] = []
    start = 0
    for m in _END.finditer(text):
        words = text[start:m.end()].split()
        if words and words[-1].lower() in _ABBREVIATIONS:
            continue
        out.append(text[start:m.end()])
        start = m.end()
    return out, text[start:]


def sentences(text: str) -> list[str]:
    """`text` cut into sentences, the last one whether or not it ended; blank ones dropped."""
    done, rest = split_sentences(text)
    return [s for s in [*done, rest] if s.strip()]
