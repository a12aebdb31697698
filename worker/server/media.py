"""Images, audio and video in chat requests: where they come from, the limits, and the 400s.

A chat message's image parts (OpenAI's `image_url`, also `input_image` with its URL as a
string), its audio parts (OpenAI's `input_audio`: base64 `data` and a `format`) and
sglang-omni's request-level `images` list (prepended to the last user message) become the
model's media marker in the text, and their bytes are loaded here, in order. Images:

- `data:` URLs (base64): always;
- `file://` URLs and plain paths: only under `--allowed-local-media-path` (llama-server's
  flag), after symlinks are resolved;
- `http(s)://` URLs: only with `--allow-remote-media` (the box may have no internet), to public
  addresses only (`--allow-private-media` adds loopback and private ones), each redirect checked,
  under one deadline for the whole fetch (`--remote-media-timeout`) and the size limit
  (worker/server/remote_media.py).

Videos (OpenAI-style `video_url` parts, sglang-omni's request-level `videos`, which go after
`images` in the last user message) come from the same places as images, under the same flags.
A video is sampled to frames (worker/backends/video.py: its header checked against the limits
first) and its one marker becomes one marker per frame, each frame then an image
(`expand_videos`): a video is exactly its frames sent as images, one after another.

Audio: the part's base64 `data` only (no URLs, as OpenAI's); `format` "wav" or "mp3" (OpenAI's),
or "flac" (libmtmd decodes it too). libmtmd decodes by the bytes; a `format` the bytes
contradict is a 400.

Limits: `--max-images`, `--max-audio` and `--max-videos` per request, `MAX_MEDIA_BYTES` per
image, audio or video, and the model's `--image-max-pixels` and `--audio-max-seconds` (checked
from the header by the backend, and again once decoded); a video's frames under
`--image-max-pixels`, its length and frame count under `--video-max-seconds` and
`--video-max-stream-frames` and their frames times pixels under `--video-max-decoded-pixels`
(the request's videos together), all from the header before any decoding. Every failure is a
400 that says which image, audio or video ("image 0", "audio 1", "video 0": counted per kind,
in order) and why; a model whose projector lacks the encoder (or that has no projector) answers
400 not_supported_error naming the model (`check_accepts`).
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.backends import media_probe, video
from worker.backends.media import AudioBytes, MediaError, Vision, audio_format
from worker.protocol.errors import APIError
from worker.protocol.wire import ChatMessage
from worker.server import remote_media

MAX_MEDIA_BYTES = 20 * 1024 * 1024  # an image's or an audio's bytes
REMOTE_TIMEOUT_S = 10.0  # --remote-media-timeout: a whole fetch, redirects included
_IMAGE_PARTS = ("image_url", "input_image", "image")
_AUDIO_PARTS = ("input_audio",)
_VIDEO_PARTS = ("video_url",)
_MEDIA_PARTS = _IMAGE_PARTS + _AUDIO_PARTS + _VIDEO_PARTS
_FROM_VIDEOS = "\u2063omni-videos"  # marks the parts made of sglang-omni's `videos`: their 400s name it
VIDEO_MAX_SECONDS = 300.0  # --video-max-seconds: docs/vision.md says why
VIDEO_MAX_STREAM_FRAMES = 18_000  # --video-max-stream-frames: 300 s at 60 frames a second
VIDEO_MAX_DECODED_PIXELS = 10_000_000_000  # --video-max-decoded-pixels: 300 s of 720p at 30 fps fits
AUDIO_FORMATS = ("wav", "mp3", "flac")


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """The worker's flags on image, audio and video input."""

    allowed_local_path: str | None = None  # --allowed-local-media-path
    allow_remote: bool = False  # --allow-remote-media
    max_images: int = 8  # --max-images: per request
    max_audio: int = 4  # --max-audio: per request
    max_videos: int = 2  # --max-videos: per request
    video_limits: video.VideoLimits = field(
        default_factory=lambda: video.VideoLimits(0, VIDEO_MAX_SECONDS, VIDEO_MAX_STREAM_FRAMES,
                                                  VIDEO_MAX_DECODED_PIXELS))
    # --video-fps, --video-max-frames, --video-max-pixels
    video_sampling: video.Sampling = field(default_factory=video.Sampling)

    # per-request totals, from each item's header before anything is decoded (0: no limit)
    request_max_pixels: int = 0  # --request-max-pixels
    request_max_audio_seconds: float = 0.0  # --request-max-audio-seconds
    request_max_media_bytes: int = 0  # --request-max-media-bytes
    allow_private_remote: bool = False  # --allow-private-media: loopback and private addresses too
    remote_timeout_s: float = REMOTE_TIMEOUT_S  # --remote-media-timeout

@dataclass(frozen=True, slots=True)
class VideoPart:
    """A video's URL and the request field it came in (`messages` or `videos`)."""

    url: str
    param: str = "messages"


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
    items: list[str | AudioPart | VideoPart]
    sampling: video.Sampling = field(default_factory=video.Sampling)  # how the videos are sampled to frames

    @property
    def n_images(self) -> int:
        return sum(isinstance(i, str) for i in self.items)

    @property
    def n_audio(self) -> int:
        return sum(isinstance(i, AudioPart) for i in self.items)

    @property
    def n_videos(self) -> int:
        return sum(isinstance(i, VideoPart) for i in self.items)


def media_kinds(messages: list[ChatMessage], images: list[str] | None,
                videos: list[str] | None = None) -> set[str]:
    """Which media the request sends: "image", "audio", "video" (empty: none)."""
    kinds = {"image"} if images else set()
    if videos:
        kinds.add("video")
    for m in messages:
        if isinstance(m.content, list):
            for p in m.content:
                kind = p.get("type")
                if kind in _IMAGE_PARTS:
                    kinds.add("image")
                elif kind in _AUDIO_PARTS:
                    kinds.add("audio")
                elif kind in _VIDEO_PARTS:
                    kinds.add("video")
    return kinds


def check_accepts(vision: Vision | None, kinds: set[str], model: str, backend_kind: str) -> None:
    """400 not_supported_error, naming the model, for media it has no encoder for (a video is
    frames: it needs the vision encoder)."""
    for what in ("image", "video"):
        if what in kinds and (vision is None or not vision.has_vision):
            if vision is not None:
                how = "its projector has no vision encoder"
            elif backend_kind == "llama_cpp":
                how = "it has no vision projector: serve it with --mmproj"
            else:
                how = ("it has no vision projector: the torch backend reads images for an "
                       "Idefics3/SmolVLM model folder only")
            raise APIError(f"model {model!r} does not accept {'video' if what == 'video' else 'images'} "
                           f"({how})", param="messages", type="not_supported_error")
    if "audio" in kinds and (vision is None or not vision.has_audio):
        if backend_kind != "llama_cpp":
            how = "the torch backend takes no audio"
        elif vision is not None:
            how = "its projector has no audio encoder"
        else:
            how = "it has no audio projector: serve it with the --mmproj of an audio model"
        raise APIError(f"model {model!r} does not accept audio ({how})", param="messages",
                       type="not_supported_error")


def _url_of(part: dict[str, Any], key: str = "image_url") -> str:
    value = part.get(key, part.get("url", part.get("source")))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        what = "a video" if key == "video_url" else "an image"
        raise APIError(f"{what} part of type {part.get('type')!r} has no URL", param="messages")
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


def extract(messages: list[ChatMessage], images: list[str] | None, marker: str,
            videos: list[str] | None = None) -> ChatMedia:
    """Flatten each message with media into one string as llama-server does (text parts joined
    with newlines, none before or after an image's, an audio's or a video's `marker`), noting the
    images' URLs, the audio parts and the videos in order; sglang-omni's `images`, then its
    `videos`, go first in the last user message."""
    items: list[str | AudioPart | VideoPart] = []
    out: list[ChatMessage] = []
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    for name, value in (("images", images), ("videos", videos)):
        if value and last_user < 0:
            raise APIError(f"`{name}` needs a user message to go into", param=name)
    for i, m in enumerate(messages):
        parts: list[dict[str, Any]] = (
            [{"type": "text", "text": m.content}] if isinstance(m.content, str)
            else list(m.content) if m.content is not None else []
        )
        if i == last_user and (images or videos):
            parts = ([{"type": "image_url", "image_url": {"url": u}} for u in images or []]
                     + [{"type": "video_url", "video_url": {"url": u}, _FROM_VIDEOS: 1} for u in videos or []]
                     + parts)
        if not any(p.get("type") in _MEDIA_PARTS for p in parts):
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
            elif kind in _VIDEO_PARTS:
                param = "videos" if p.get(_FROM_VIDEOS) else "messages"
                items.append(VideoPart(_url_of(p, "video_url"), param))
                text, after_marker = text + marker, True
            elif kind in ("text", "input_text"):
                sep = "\n" if text and not after_marker else ""
                text, after_marker = text + sep + str(p.get("text", "")), False
            else:
                raise APIError(f"content part type {kind!r} is not supported", param="messages")
        out.append(m.model_copy(update={"content": text}))
    return ChatMedia(out, items)


def load_media(items: list[str | AudioPart | VideoPart], policy: MediaPolicy,
               sampling: video.Sampling | None = None) -> list[list[bytes]]:
    """Each item's media, in order: an image's bytes, an audio's `AudioBytes`, a video's sampled
    frames (`FrameBytes`, the request's videos checked together against the limits); blocking:
    file and network reads, video decoding."""
    out: list[list[bytes]] = []
    n_images = n_audio = n_videos = 0
    spent = video.Spent()
    totals = _Totals(policy)
    for item in items:
        if isinstance(item, AudioPart):
            out.append([load_audio(n_audio, item)])
            totals.add_audio(n_audio, out[-1][0])
            n_audio += 1
        elif isinstance(item, VideoPart):
            where = f"video {n_videos}"
            data = load_url(where, item.url, policy, "video", item.param)
            totals.add_bytes(where, data, item.param)
            try:
                info = video.probe(where, data, policy.video_limits, spent)
                out.append(list(video.sample(where, data, info, sampling or policy.video_sampling,
                                             policy.video_limits, spent)))
            except MediaError as e:
                raise APIError(str(e), param=item.param) from None
            spent.add(info)
            n_videos += 1
        else:
            out.append([load_image(n_images, item, policy)])
            totals.add_image(n_images, out[-1][0])
            n_images += 1
    return out


class _Totals:
    """A request's media summed as its items load: bytes, and the pixels and seconds their headers
    state. Eight images each under --image-max-pixels still decode to gigabytes together: the
    totals refuse that before the first decode. One item alone is the per-item limits' business
    (their message names them), so pixels and seconds are refused by total from the second item
    on. Audio whose header states no length (a free-format MP3) cannot be counted, so under a
    total it is refused, whatever its place: skipped, it would decode to hours unchecked. (An
    image header that states no size belongs to bytes that stb_image cannot decode either: PNG,
    GIF and BMP always state it, a JPEG before its first scan; those are left to the backend's
    400.) Bytes that are no audio at all are the backend's 400 too."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.bytes = 0
        self.sums: dict[str, tuple[float, int]] = {}  # "pixels" / "seconds" -> (sum, items)

    def add_bytes(self, where: str, data: bytes, param: str = "messages") -> None:
        self.bytes += len(data)
        limit = self.policy.request_max_media_bytes
        if limit and self.bytes > limit:
            raise APIError(f"{where}: the request's media come to {self.bytes} bytes with it, over this "
                           f"server's --request-max-media-bytes {limit}", param=param)

    def add_image(self, index: int, data: bytes) -> None:
        size = media_probe.image_size(data)
        self._add(f"image {index}", data, "pixels", size[0] * size[1] if size else None,
                  self.policy.request_max_pixels, "--request-max-pixels")

    def add_audio(self, index: int, data: bytes) -> None:
        seconds, limit = media_probe.audio_seconds(data), self.policy.request_max_audio_seconds
        if seconds is None and limit and audio_format(data) is not None:
            raise APIError(f"audio {index}: its length cannot be read from its header (a free-format MP3, "
                           "a FLAC stream of unknown length, a cut file?), so it cannot be counted against "
                           f"this server's --request-max-audio-seconds {limit:g}: refused before decoding; "
                           "send WAV, FLAC or MP3 that states its length", param="messages")
        self._add(f"audio {index}", data, "seconds", seconds, limit, "--request-max-audio-seconds")

    def _add(self, where: str, data: bytes, unit: str, amount: float | None, limit: float, flag: str) -> None:
        self.add_bytes(where, data)
        if amount is None or not limit:
            return
        total, n = self.sums.get(unit, (0.0, 0))
        total, n = total + amount, n + 1
        self.sums[unit] = (total, n)
        if total > limit and n > 1:
            raise APIError(f"{where}: the request's media come to {total:.10g} {unit} with it, over this "
                           f"server's {flag} {limit:.10g} (read from the headers, not decoded)",
                           param="messages")


def expand_videos(text: str, marker: str, loaded: list[list[bytes]]) -> tuple[str, list[bytes]]:
    """The prompt text with each item's one marker made one marker per frame (a video), and the
    media in the order of the markers."""
    pieces = text.split(marker)
    if len(pieces) != len(loaded) + 1:  # the backend says so (its own count of markers)
        return text, [m for media in loaded for m in media]
    out = [pieces[0]]
    for media, piece in zip(loaded, pieces[1:], strict=True):
        out.append(marker * len(media) + piece)
    return "".join(out), [m for media in loaded for m in media]


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
    return load_url(f"image {index}", url, policy)


def load_url(where: str, url: str, policy: MediaPolicy, kind: str = "image",
             param: str = "messages") -> bytes:
    """The bytes of one image or video URL, under the policy (blocking: file and network reads)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise APIError(f"{where}: a data URL must be base64 (data:{kind}/...;base64,...)", param=param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(f"{where}: the data URL is not valid base64", param=param) from None
    elif url.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise APIError(f"{where}: remote {kind} URLs are refused (this server has no "
                           f"--allow-remote-media); send the {kind} as a data URL", param=param)
        data = _fetch(where, url, policy, param)
    else:
        data = _read_local(where, url, policy, kind, param)
    if len(data) > MAX_MEDIA_BYTES:
        raise APIError(f"{where}: {len(data)} bytes is over the limit of {MAX_MEDIA_BYTES}", param=param)
    return data


def _read_local(where: str, url: str, policy: MediaPolicy, kind: str, param: str) -> bytes:
    if policy.allowed_local_path is None:
        raise APIError(f"{where}: local files are refused (this server has no --allowed-local-media-path); "
                       f"send the {kind} as a data URL", param=param)
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file://") else url
    root = Path(policy.allowed_local_path).resolve()
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise APIError(f"{where}: {path!r} is outside --allowed-local-media-path", param=param)
    try:
        with real.open("rb") as f:
            return f.read(MAX_MEDIA_BYTES + 1)
    except OSError as e:
        raise APIError(f"{where}: cannot read {path!r}: {e.strerror}", param=param) from None


def _fetch(where: str, url: str, policy: MediaPolicy, param: str) -> bytes:
    rules = remote_media.FetchPolicy(policy.allow_private_remote, policy.remote_timeout_s, MAX_MEDIA_BYTES)
    try:
        return remote_media.fetch(url, rules)
    except remote_media.FetchError as e:
        raise APIError(f"{where}: cannot fetch {url!r}: {e}", param=param) from None
