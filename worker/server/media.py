"""Images and audio in chat requests: where they come from, the limits, and the 400s.

A chat message's image parts (OpenAI's `image_url`, also `input_image` with its URL as a
string), its audio parts (OpenAI's `input_audio`: base64 `data` and a `format`) and
sglang-omni's request-level `images` list (prepended to the last user message) become the
model's media marker in the text, and their bytes are loaded here, in order. Images:

- `data:` URLs (base64): always;
- `file://` URLs and plain paths: only under `--allowed-local-media-path` (llama-server's
  flag), after symlinks are resolved;
- `http(s)://` URLs: only with `--allow-remote-media` (the box may have no internet), with a
  timeout and the size limit.

Audio: the part's base64 `data` only (no URLs, as OpenAI's); `format` "wav" or "mp3" (OpenAI's),
or "flac" (libmtmd decodes it too). libmtmd decodes by the bytes; a `format` the bytes
contradict is a 400.

Limits: `--max-images` and `--max-audio` per request, `MAX_MEDIA_BYTES` per image or audio,
and the model's `--image-max-pixels` and `--audio-max-seconds` (checked by the backend once
decoded). Every failure is a 400 that says which image or audio ("image 0", "audio 1": counted
per kind, in order) and why; a model whose projector lacks the encoder (or that has no
projector) answers 400 not_supported_error naming the model (`check_accepts`).
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.backends import media_probe
from worker.backends.media import AudioBytes, Vision, audio_format
from worker.protocol.errors import APIError
from worker.protocol.wire import ChatMessage

MAX_MEDIA_BYTES = 20 * 1024 * 1024  # an image's or an audio's bytes
_REMOTE_TIMEOUT_S = 10.0
_IMAGE_PARTS = ("image_url", "input_image", "image")
_AUDIO_PARTS = ("input_audio",)
AUDIO_FORMATS = ("wav", "mp3", "flac")


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """The worker's flags on image and audio input."""

    allowed_local_path: str | None = None  # --allowed-local-media-path
    allow_remote: bool = False  # --allow-remote-media
    max_images: int = 8  # --max-images: per request
    max_audio: int = 4  # --max-audio: per request
    # per-request totals, from each item's header before anything is decoded (0: no limit)
    request_max_pixels: int = 0  # --request-max-pixels
    request_max_audio_seconds: float = 0.0  # --request-max-audio-seconds
    request_max_media_bytes: int = 0  # --request-max-media-bytes


@dataclass(frozen=True, slots=True)
class AudioPart:
    """An `input_audio` part: its base64 data (decoded off the event loop) and declared format."""

    data: str
    format: str


@dataclass(slots=True)
class ChatMedia:
    """The request's messages with every image and audio part replaced by the marker, and what
    each marker stands for, in order: an image's URL or an audio part."""

    messages: list[ChatMessage]
    items: list[str | AudioPart]

    @property
    def n_images(self) -> int:
        return sum(isinstance(i, str) for i in self.items)

    @property
    def n_audio(self) -> int:
        return len(self.items) - self.n_images


def media_kinds(messages: list[ChatMessage], images: list[str] | None) -> set[str]:
    """Which media the request sends: "image", "audio" (empty: none)."""
    kinds = {"image"} if images else set()
    for m in messages:
        if isinstance(m.content, list):
            for p in m.content:
                kind = p.get("type")
                if kind in _IMAGE_PARTS:
                    kinds.add("image")
                elif kind in _AUDIO_PARTS:
                    kinds.add("audio")
    return kinds


def check_accepts(vision: Vision | None, kinds: set[str], model: str, backend_kind: str) -> None:
    """400 not_supported_error, naming the model, for media it has no encoder for."""
    if "image" in kinds and (vision is None or not vision.has_vision):
        if vision is not None:
            how = "its projector has no vision encoder"
        elif backend_kind == "llama_cpp":
            how = "it has no vision projector: serve it with --mmproj"
        else:
            how = ("it has no vision projector: the torch backend reads images for an "
                   "Idefics3/SmolVLM model folder only")
        raise APIError(f"model {model!r} does not accept images ({how})", param="messages",
                       type="not_supported_error")
    if "audio" in kinds and (vision is None or not vision.has_audio):
        if backend_kind != "llama_cpp":
            how = "the torch backend takes no audio"
        elif vision is not None:
            how = "its projector has no audio encoder"
        else:
            how = "it has no audio projector: serve it with the --mmproj of an audio model"
        raise APIError(f"model {model!r} does not accept audio ({how})", param="messages",
                       type="not_supported_error")


def _url_of(part: dict[str, Any]) -> str:
    value = part.get("image_url", part.get("url", part.get("source")))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise APIError(f"an image part of type {part.get('type')!r} has no URL", param="messages")
    return value


def _audio_of(part: dict[str, Any], index: int) -> AudioPart:
    where = f"audio {index}"
    value = part.get("input_audio")
    if not isinstance(value, dict):
        raise APIError(f"{where}: an input_audio part needs an `input_audio` object "
                       '({"data": base64, "format": "wav"|"mp3"})', param="messages")
    data, fmt = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data:
        raise APIError(f"{where}: `input_audio.data` must be the audio's bytes in base64", param="messages")
    if fmt not in AUDIO_FORMATS:
        raise APIError(f"{where}: `input_audio.format` must be one of {', '.join(AUDIO_FORMATS)}, "
                       f"not {fmt!r}", param="messages")
    return AudioPart(data, fmt)


def extract(messages: list[ChatMessage], images: list[str] | None, marker: str) -> ChatMedia:
    """Flatten each message with media into one string as llama-server does (text parts joined
    with newlines, none before or after an image's or an audio's `marker`), noting the images'
    URLs and the audio parts in order; sglang-omni's `images` go first in the last user message."""
    items: list[str | AudioPart] = []
    out: list[ChatMessage] = []
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    if images and last_user < 0:
        raise APIError("`images` needs a user message to go into", param="images")
    for i, m in enumerate(messages):
        parts: list[dict[str, Any]] = (
            [{"type": "text", "text": m.content}] if isinstance(m.content, str)
            else list(m.content) if m.content is not None else []
        )
        if i == last_user and images:
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in images] + parts
        if not any(p.get("type") in _IMAGE_PARTS + _AUDIO_PARTS for p in parts):
            out.append(m)
            continue
        text = ""
        after_marker = False
        for p in parts:
            kind = p.get("type")
            if kind in _IMAGE_PARTS:
                items.append(_url_of(p))
                text, after_marker = text + marker, True
            elif kind in _AUDIO_PARTS:
                items.append(_audio_of(p, sum(isinstance(x, AudioPart) for x in items)))
                text, after_marker = text + marker, True
            elif kind in ("text", "input_text"):
                sep = "\n" if text and not after_marker else ""
                text, after_marker = text + sep + str(p.get("text", "")), False
            else:
                raise APIError(f"content part type {kind!r} is not supported", param="messages")
        out.append(m.model_copy(update={"content": text}))
    return ChatMedia(out, items)


def load_media(items: list[str | AudioPart], policy: MediaPolicy) -> list[bytes]:
    """Each item's bytes, in order (an audio's as `AudioBytes`); blocking: file and network reads."""
    out: list[bytes] = []
    n_images = n_audio = 0
    totals = _Totals(policy)
    for item in items:
        if isinstance(item, AudioPart):
            out.append(load_audio(n_audio, item))
            totals.add_audio(n_audio, out[-1])
            n_audio += 1
        else:
            out.append(load_image(n_images, item, policy))
            totals.add_image(n_images, out[-1])
            n_images += 1
    return out


class _Totals:
    """A request's media summed as its items load: bytes, and the pixels and seconds their headers
    state (a header that says nothing adds nothing here; the backend checks the decoded item
    against the per-item limit). Eight images each under --image-max-pixels still decode to
    gigabytes together: the totals refuse that before the first decode. One item alone is the
    per-item limits' business (their message names them), so pixels and seconds are refused by
    total from the second item on."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.bytes = self.pixels = self.n_images = self.n_audio = 0
        self.seconds = 0.0

    def _add_bytes(self, where: str, data: bytes) -> None:
        self.bytes += len(data)
        limit = self.policy.request_max_media_bytes
        if limit and self.bytes > limit:
            raise APIError(f"{where}: the request's media come to {self.bytes} bytes with it, over this "
                           f"server's --request-max-media-bytes {limit}", param="messages")

    def add_image(self, index: int, data: bytes) -> None:
        where = f"image {index}"
        self._add_bytes(where, data)
        size = media_probe.image_size(data)
        limit = self.policy.request_max_pixels
        if size is None or not limit:
            return
        self.pixels += size[0] * size[1]
        self.n_images += 1
        if self.pixels > limit and self.n_images > 1:
            raise APIError(f"{where}: the request's images come to {self.pixels} pixels with it "
                           f"({size[0]}x{size[1]}), over this server's --request-max-pixels {limit} "
                           "(read from the headers, not decoded)", param="messages")

    def add_audio(self, index: int, data: bytes) -> None:
        where = f"audio {index}"
        self._add_bytes(where, data)
        seconds = media_probe.audio_seconds(data)
        limit = self.policy.request_max_audio_seconds
        if seconds is None or not limit:
            return
        self.seconds += seconds
        self.n_audio += 1
        if self.seconds > limit and self.n_audio > 1:
            raise APIError(f"{where}: the request's audio comes to {self.seconds:.1f} s with it, over this "
                           f"server's --request-max-audio-seconds {limit:g} (read from the headers, not "
                           "decoded)", param="messages")


def load_audio(index: int, part: AudioPart) -> AudioBytes:
    where = f"audio {index}"
    if len(part.data) > (MAX_MEDIA_BYTES + 2) // 3 * 4 + 4:
        raise APIError(f"{where}: over the limit of {MAX_MEDIA_BYTES} bytes", param="messages")
    try:
        data = base64.b64decode(part.data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{where}: `input_audio.data` is not valid base64", param="messages") from None
    if len(data) > MAX_MEDIA_BYTES:
        raise APIError(f"{where}: {len(data)} bytes is over the limit of {MAX_MEDIA_BYTES}", param="messages")
    found = audio_format(data)  # bytes that are no audio at all: the backend's 400 says so
    if found is not None and found != part.format:
        raise APIError(f"{where}: `input_audio.format` is {part.format!r}, but the bytes are {found.upper()}",
                       param="messages")
    return AudioBytes(data)


def load_image(index: int, url: str, policy: MediaPolicy) -> bytes:
    """The bytes of one image URL, under the policy (blocking: file and network reads)."""
    where = f"image {index}"
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise APIError(f"{where}: a data URL must be base64 (data:image/png;base64,...)",
                           param="messages")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(f"{where}: the data URL is not valid base64", param="messages") from None
    elif url.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise APIError(f"{where}: remote image URLs are refused (this server has no "
                           "--allow-remote-media); send the image as a data URL", param="messages")
        data = _fetch(where, url)
    else:
        data = _read_local(where, url, policy)
    if len(data) > MAX_MEDIA_BYTES:
        raise APIError(f"{where}: {len(data)} bytes is over the limit of {MAX_MEDIA_BYTES}", param="messages")
    return data


def _read_local(where: str, url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise APIError(f"{where}: local files are refused (this server has no --allowed-local-media-path); "
                       "send the image as a data URL", param="messages")
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file://") else url
    root = Path(policy.allowed_local_path).resolve()
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise APIError(f"{where}: {path!r} is outside --allowed-local-media-path", param="messages")
    try:
        with real.open("rb") as f:
            return f.read(MAX_MEDIA_BYTES + 1)
    except OSError as e:
        raise APIError(f"{where}: cannot read {path!r}: {e.strerror}", param="messages") from None


def _fetch(where: str, url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_REMOTE_TIMEOUT_S) as r:  # http(s) only, checked above
            data: bytes = r.read(MAX_MEDIA_BYTES + 1)
            return data
    except OSError as e:
        raise APIError(f"{where}: cannot fetch {url!r}: {e}", param="messages") from None
