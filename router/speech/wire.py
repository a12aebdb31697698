"""The two chat-completions fields that ask for a spoken answer (OpenAI's): `modalities:
["text", "audio"]` and `audio: {voice, format}`. The router takes them off the request before
the chat model sees it (router/speech/chat.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from worker.protocol.strict import StrictModel

# chat audio `format` -> response_format of the voice (OpenAI names raw samples pcm16 here)
CHAT_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "pcm16": "pcm", "aac": "aac"}


class ChatAudio(StrictModel):
    voice: str = Field(min_length=1)
    format: str


class SpokenRequest(StrictModel):
    """Just the fields the pairing reads; the rest of the body goes on to the chat model as is."""

    modalities: list[Literal["text", "audio"]] = Field(min_length=1)
    audio: ChatAudio | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
