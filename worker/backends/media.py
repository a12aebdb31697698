"""Images and audio in a prompt: how their rows travel through the engine as token ids.

A prompt with media is one list of ids, as a text prompt is: a media chunk of n rows (the
embeddings a projector makes of one image tile, or of one 30 s window of audio) takes n *media
ids*, negative numbers that say which chunk and which of its rows: `media_id(key, j)`. `key`
is a hash of the media's bytes and the chunk's index in them, so the engine's prefix matching
(slots, the prompt cache) keys media rows by the bytes with no code of its own: the same image
or audio at the same place in a follow-up turn is the same ids, and its KV rows are reused,
never computed again. The embeddings themselves ride with the task (`Task.media`: key ->
float32[n, n_embd]) and enter a batch as `BatchEntry.embd`.

The scheduler cuts a prompt with media ids in *runs*: a run is text tokens up to the next
media chunk, or the rows of one chunk. A text run goes in one piece (cut only at n_ubatch); a
chunk's rows go in pieces of `--media-piece` rows (16) at fixed rows of the chunk (`run_piece`),
under the prefill budget that long text prompts get while other slots generate. The cuts never
depend on the load, so a request's rows, and its greedy output, do not either.

Why pieces: a chunk decoded whole stalls every generating slot for its whole call (64 rows of
the benchmark VLM: ~80 ms beside a ~21 ms decode step, and a SmolVLM tile has 81 rows), and
its encode already halves their speed (`EncodeShare`, worker/backends/mtmd.py).

What it costs: llama.cpp's flash attention computes a call's rows of one sequence with its
per-row kernel below 64 rows and a tiled one from 64 (`RowRecipe`), and llama-server decodes a
chunk whole. A chunk of fewer than 64 rows gets the per-row kernel either way (the same bits in
any piece of 2+ rows), so its rows stay llama-server's bit for bit; a chunk of 64+ rows cut in
pieces under 64 does not (equal up to float rounding: greedy output may part from
llama-server's where two tokens are that close). `--media-piece 0` decodes chunks whole, as
llama-server does, and gives up the latency bound. Measured in bench/bench_vision.py.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

_ROW_BITS = 20  # rows of one chunk: up to 2**20
_KEY_BITS = 40  # key and row fit an int64 (numpy token arrays): 61 bits with the sign


def media_key(data: bytes, chunk_index: int) -> int:
    """The key of an image's or audio's `chunk_index`-th chunk: 40 bits of a SHA-256 of the bytes."""
    digest = hashlib.sha256(data + chunk_index.to_bytes(4, "little")).digest()
    return int.from_bytes(digest[: _KEY_BITS // 8], "little")


def media_id(key: int, row: int) -> int:
    return -1 - ((key << _ROW_BITS) | row)


def is_media(token: int) -> bool:
    return token < 0


def split_id(token: int) -> tuple[int, int]:
    """(key, row) of a media id."""
    v = -1 - token
    return v >> _ROW_BITS, v & ((1 << _ROW_BITS) - 1)


def chunk_ids(key: int, n_rows: int) -> list[int]:
    return [media_id(key, j) for j in range(n_rows)]


def run_length(feed: Sequence[int], limit: int | None = None) -> int:
    """Rows of the leading run of `feed`: text tokens up to the next media id, or the
    consecutive rows of one chunk; counted up to `limit` at most (the engine asks every step)."""
    end = len(feed) if limit is None else min(len(feed), limit)
    if end <= 0:
        return 0
    if not is_media(feed[0]):
        return next((i for i in range(end) if is_media(feed[i])), end)
    key, row = split_id(feed[0])
    n = 1
    while n < end and feed[n] == media_id(key, row + n):
        n += 1
    return n


def run_piece(feed: Sequence[int], max_piece: int, media_piece: int = 0) -> int:
    """Rows of the next piece of a prompt with media: a text run whole, a chunk's rows in pieces
    of `media_piece` rows at fixed places (rows [0, p), [p, 2p), ... of the chunk, a last row
    left over going with the piece before it: a one-row piece is a decode row, another kernel),
    or whole with `media_piece` 0; everything cut at `max_piece` only."""
    if media_piece <= 0 or not feed or not is_media(feed[0]):
        return run_length(feed, max_piece)
    row = split_id(feed[0])[1]
    end = (row // media_piece + 1) * media_piece - row  # rows to the next boundary
    if end < 2:
        end += media_piece
    n = run_length(feed, end + 2)  # enough to see whether a single row would be left
    return min(n if n - end < 2 else end, max_piece)


def rows_of(media: dict[int, np.ndarray], tokens: Sequence[int]) -> np.ndarray:
    """The embeddings of a run of media ids (one chunk's consecutive rows)."""
    key, row = split_id(tokens[0])
    return media[key][row : row + len(tokens)]


class ChunkCache:
    """Encoded media chunks by media key, the least recently used dropped past `capacity`: what
    lets the same image or audio in a follow-up turn skip its encode (both vision sides; the
    caller locks)."""

    def __init__(self, capacity: int = 256) -> None:  # a tiny VLM's chunk is 4 KB, a SmolVLM tile's 150 KB
        self.capacity = capacity
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()

    def get(self, key: int, n_rows: int | None = None) -> np.ndarray | None:
        """The chunk's rows (None: not cached, or cached with another row count)."""
        rows = self._rows.get(key)
        if rows is None or (n_rows is not None and rows.shape[0] != n_rows):
            return None
        self._rows.move_to_end(key)
        return rows

    def put(self, key: int, rows: np.ndarray) -> None:
        self._rows[key] = rows
        self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


class MediaError(ValueError):
    """An image or audio the request sent cannot be used (undecodable, too large): a 400."""


def audio_format(data: bytes) -> str | None:
    """"wav", "mp3" or "flac" by libmtmd's helper's test (mtmd-helper.cpp `is_audio_file`, which
    sends such bytes to miniaudio): RIFF....WAVE, an ID3 tag or an MPEG frame sync, fLaC; at least
    12 bytes, as there. None: not audio libmtmd decodes."""
    if len(data) < 12:
        return None
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return "flac" if data[:4] == b"fLaC" else None


class AudioBytes(bytes):
    """The bytes of an audio part (`input_audio`): `Vision.prepare` decodes them as audio, never
    as an image (plain `bytes` are an image). A subclass, so hashing and the cache see bytes."""


class FrameBytes(bytes):
    """One frame sampled from a video (worker/backends/video.py), already decoded: `rgb` [height,
    width, 3] uint8, which `Vision.prepare` takes as an image's pixels. Its bytes stand for it in
    keys: a tag, the video's SHA-256, the frame's index in the video and its size, so the cache of
    encoded chunks and the media ids key a frame by the video's bytes and the frame index."""

    rgb: np.ndarray
    label: str  # how errors name it: "video 0 frame 2"

    @classmethod
    def of(cls, video_digest: bytes, index: int, rgb: np.ndarray, label: str) -> FrameBytes:
        h, w = rgb.shape[:2]
        frame = cls(b"omni-video-frame" + video_digest + index.to_bytes(4, "little")
                    + w.to_bytes(4, "little") + h.to_bytes(4, "little"))
        frame.rgb = np.ascontiguousarray(rgb)
        frame.label = label
        return frame


@dataclass(slots=True)
class MediaPrompt:
    """A prompt with its media tokenized: ids (text and media), the chunks' embeddings, and
    how many chunks were encoded now and how many came from the cache of encoded chunks."""

    tokens: list[int]
    media: dict[int, np.ndarray] = field(default_factory=dict)
    n_encoded: int = 0
    n_cached: int = 0
    encode_seconds: float = 0.0


class Vision(Protocol):
    """A model's media side (its mmproj: images, audio or both), thread-safe: what the HTTP layer
    calls, off the event loop, before the task goes to the engine. The engine thread never waits
    for an encode."""

    marker: str  # where an image or an audio goes in the prompt text
    has_vision: bool  # takes images
    has_audio: bool  # takes audio (`AudioBytes`)

    def prepare(self, text: str, media: Sequence[bytes]) -> MediaPrompt:
        """Tokenize `text`, whose markers stand for `media` in order (each an image's bytes, an
        `AudioBytes` or a video's `FrameBytes`), and encode them (cached by their bytes). Raises
        MediaError for media it cannot use."""
        ...
