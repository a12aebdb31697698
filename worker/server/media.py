"""Images in chat requests: where they come from, the limits, and the 400s.

A chat message's image parts (OpenAI's `image_url`, also `input_image` with its URL as a
string) and sglang-omni's request-level `images` list (prepended to the last user message)
become the model's media marker in the text, and their bytes are loaded here, in order:

- `data:` URLs (base64): always;
- `file://` URLs and plain paths: only under `--allowed-local-media-path` (llama-server's
  flag), after symlinks are resolved;
- `http(s)://` URLs: only with `--allow-remote-media` (the box may have no internet), with a
  timeout and the size limit.

Limits: `--max-images` per request, `MAX_IMAGE_BYTES` per image, and the model's
`--image-max-pixels` (checked by the backend once the image is decoded). Every failure is a
400 that says which image and why; a model without a vision projector answers 400
not_supported_error naming the model. Audio parts are refused the same way (not supported).
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

from worker.protocol.errors import APIError
from worker.protocol.wire import ChatMessage

MAX_IMAGE_BYTES = 20 * 1024 * 1024
_REMOTE_TIMEOUT_S = 10.0
_IMAGE_PARTS = ("image_url", "input_image", "image")
_AUDIO_PARTS = ("input_audio", "audio")


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """The worker's flags on image input."""

    allowed_local_path: str | None = None  # --allowed-local-media-path
    allow_remote: bool = False  # --allow-remote-media
    max_images: int = 8  # --max-images: per request


@dataclass(slots=True)
class ChatMedia:
    """The request's messages with every image part replaced by the marker, and the images' URLs."""

    messages: list[ChatMessage]
    urls: list[str]


def has_media(messages: list[ChatMessage], images: list[str] | None) -> bool:
    if images:
        return True
    return any(isinstance(m.content, list) and any(p.get("type") in _IMAGE_PARTS + _AUDIO_PARTS
                                                     for p in m.content) for m in messages)


def _url_of(part: dict[str, Any]) -> str:
    value = part.get("image_url", part.get("url", part.get("source")))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise APIError(f"an image part of type {part.get('type')!r} has no URL", param="messages")
    return value


def extract(messages: list[ChatMessage], images: list[str] | None, marker: str, model: str) -> ChatMedia:
    """Flatten each message with images into one string as llama-server does (text parts joined
    with newlines, none before or after an image's `marker`), noting the images' URLs in order;
    sglang-omni's `images` go first in the last user message. Audio is refused (not supported)."""
    urls: list[str] = []
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
            if kind in _AUDIO_PARTS:
                raise APIError(f"audio input is not supported by model {model!r}", param="messages",
                               type="not_supported_error")
            if kind in _IMAGE_PARTS:
                urls.append(_url_of(p))
                text, after_marker = text + marker, True
            elif kind in ("text", "input_text"):
                sep = "\n" if text and not after_marker else ""
                text, after_marker = text + sep + str(p.get("text", "")), False
            else:
                raise APIError(f"content part type {kind!r} is not supported", param="messages")
        out.append(m.model_copy(update={"content": text}))
    return ChatMedia(out, urls)


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
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(f"{where}: {len(data)} bytes is over the limit of {MAX_IMAGE_BYTES}", param="messages")
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
            return f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise APIError(f"{where}: cannot read {path!r}: {e.strerror}", param="messages") from None


def _fetch(where: str, url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_REMOTE_TIMEOUT_S) as r:  # http(s) only, checked above
            data: bytes = r.read(MAX_IMAGE_BYTES + 1)
            return data
    except OSError as e:
        raise APIError(f"{where}: cannot fetch {url!r}: {e}", param="messages") from None
