"""libmtmd (llama.cpp's multimodal library) through the pinned llama-cpp-python's ctypes bindings
(`llama_cpp.mtmd_cpp`): a model's mmproj, images and audio decoded, tokenized and encoded.

`MtmdVision.prepare` runs on an HTTP worker thread, never on the engine thread: it decodes the
images (stb_image, in libmtmd's helper) and the audio (WAV, MP3, FLAC: miniaudio, in the same
helper, resampled to the projector's rate), checks their size, tokenizes the prompt with
libmtmd (its layout of media chunks and the text around them, e.g. idefics3's tiles with
<row_R_col_C> tokens; a Whisper encoder's 30 s windows), and encodes each media chunk with the
projector's encoder, unless a chunk of the same bytes is in the cache of encoded chunks (an LRU
keyed like the media ids, see worker/backends/media.py). Audio chunks take the same path as
image chunks from there: media ids, embeddings, runs. One lock serializes libmtmd: its context
holds one output buffer. The encoder runs beside the engine's decode, on half the cores, while
the engine decodes on the rest (`EncodeShare`): an encode never stops the engine, which only
ever sees finished embeddings.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from worker.backends import media_probe
from worker.backends.llama_lib import ll, mt
from worker.backends.media import (
    AudioBytes,
    ChunkCache,
    FrameBytes,
    MediaError,
    MediaPrompt,
    audio_format,
    chunk_ids,
    media_key,
)

log = logging.getLogger("worker.mtmd")

_CHUNK_TEXT = mt.MTMD_INPUT_CHUNK_TYPE_TEXT
_CHUNK_IMAGE = mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
_CHUNK_AUDIO = mt.MTMD_INPUT_CHUNK_TYPE_AUDIO
# PNG, JPEG, GIF, BMP: what stb_image decodes. libmtmd's helper hands any other bytes to ffprobe
# and ffmpeg (a video), which must not run on whatever a client sends.
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")


def is_audio_file(data: bytes) -> bool:
    """Whether libmtmd's helper would decode these bytes as audio (see `audio_format`)."""
    return audio_format(data) is not None


def _on_mtmd_log(level: int, text: bytes, _user: Any) -> None:
    if level >= 3 and level != 5 and text:  # warnings and errors only, as the llama.cpp backend
        msg = text.decode(errors="replace").rstrip()
        if msg:
            log.warning("mtmd: %s", msg)


_LOG_CALLBACK = ll.llama_log_callback(_on_mtmd_log)  # module-level: must outlive every call


@functools.cache
def _route_logs() -> None:
    """libmtmd's and its helper's messages into our log (warnings and errors), once a process."""
    mt.mtmd_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    mt.mtmd_helper_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def _decode(ctx: Any, where: str, data: bytes, max_pixels: int) -> Any:
    """An mtmd bitmap of the image bytes (stb_image, in libmtmd's helper); MediaError for bytes
    that are not an image, audio, or more than `max_pixels` pixels (0: no limit)."""
    if not data:
        raise MediaError(f"{where}: no bytes")
    if not data.startswith(_IMAGE_MAGIC):  # stb_image's formats; anything else would go to ffmpeg
        raise MediaError(f"{where}: not a PNG, JPEG, GIF or BMP image")
    size = media_probe.image_size(data)  # before decoding: a small file may hold a huge image
    if max_pixels and size is not None and size[0] * size[1] > max_pixels:
        nx, ny = size
        raise MediaError(f"{where}: {nx}x{ny} = {nx * ny} pixels is over this server's "
                         f"--image-max-pixels {max_pixels} (read from its header, not decoded)")
    bitmap = _helper_bitmap(ctx, data)
    if not bitmap:
        raise MediaError(f"{where}: the bytes are not an image this server can decode")
    if mt.mtmd_bitmap_is_audio(bitmap):
        mt.mtmd_bitmap_free(bitmap)
        raise MediaError(f"{where}: audio, not an image")
    nx, ny = int(mt.mtmd_bitmap_get_nx(bitmap)), int(mt.mtmd_bitmap_get_ny(bitmap))
    if max_pixels and nx * ny > max_pixels:
        mt.mtmd_bitmap_free(bitmap)
        raise MediaError(f"{where}: {nx}x{ny} = {nx * ny} pixels is over this server's "
                         f"--image-max-pixels {max_pixels}")
    return bitmap


def _decode_audio(ctx: Any, where: str, data: bytes, max_seconds: float) -> Any:
    """An mtmd bitmap of the audio bytes (miniaudio, in libmtmd's helper: mono float samples at
    the projector's rate); MediaError for bytes that are not WAV, MP3 or FLAC audio, that do not
    decode, that hold no samples, or more than `max_seconds` of them (0: no limit). Under a limit,
    audio whose header states no length (a free-format MP3, a FLAC stream of unknown length) is
    refused before decoding: miniaudio decodes a whole file before anyone can count its samples,
    and 19 MiB of free-format MP3 is hours of them (1.4 GB)."""
    if not is_audio_file(data):  # anything else would go to stb_image, then to ffmpeg
        raise MediaError(f"{where}: not WAV, MP3 or FLAC audio")
    said = media_probe.audio_seconds(data)  # before decoding: a small file may hold hours
    if max_seconds and said is None:
        raise MediaError(f"{where}: its length cannot be read from its header (a free-format MP3, a "
                         "FLAC stream of unknown length, a cut file?), and under this server's "
                         f"--audio-max-seconds {max_seconds:g} audio is measured before it is decoded: "
                         "send WAV, FLAC or MP3 that states its length")
    if max_seconds and said is not None and said > max_seconds:
        raise MediaError(f"{where}: {said:.1f} s is over this server's --audio-max-seconds {max_seconds:g} "
                         "(read from its header, not decoded)")
    bitmap = _helper_bitmap(ctx, data)
    if not bitmap:
        raise MediaError(f"{where}: the bytes are not audio this server can decode")
    if not mt.mtmd_bitmap_is_audio(bitmap):
        mt.mtmd_bitmap_free(bitmap)
        raise MediaError(f"{where}: an image, not audio")
    n_samples = int(mt.mtmd_bitmap_get_n_bytes(bitmap)) // 4  # float32
    seconds = n_samples / max(1, int(mt.mtmd_get_audio_sample_rate(ctx)))
    if n_samples == 0 or (max_seconds and seconds > max_seconds):
        mt.mtmd_bitmap_free(bitmap)
        why = "no samples" if n_samples == 0 else (
            f"{seconds:.1f} s is over this server's --audio-max-seconds {max_seconds:g}")
        raise MediaError(f"{where}: {why}")
    return bitmap


def _frame_bitmap(frame: FrameBytes) -> Any:
    """An mtmd bitmap of a video frame's pixels (decoded already, by PyAV: worker/backends/video.py)."""
    h, w = frame.rgb.shape[:2]
    buf = (ctypes.c_uint8 * frame.rgb.size).from_buffer_copy(frame.rgb.tobytes())
    bitmap = mt.mtmd_bitmap_init(w, h, buf)
    if not bitmap:
        raise MediaError(f"{frame.label}: libmtmd could not take the frame")
    return bitmap


def _helper_bitmap(ctx: Any, data: bytes) -> Any:
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return mt.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)


def decode_rgb(index: int, data: bytes, max_pixels: int = 0) -> np.ndarray:
    """The image as RGB uint8 [height, width, 3], decoded as the llama.cpp backend decodes it
    (stb_image through libmtmd's helper: the same pixels for JPEG too), for a vision side that
    is not libmtmd's (worker/backends/torch_vision.py). No model is needed: the helper's context
    is NULL, which it reads only for audio (refused by the magic check first); bytes stb_image
    cannot decode go on to its video path, which keeps the context without reading it and gives
    no pixels (a MediaError here)."""
    _route_logs()
    bitmap = _decode(None, f"image {index}", data, max_pixels)
    try:
        nx, ny = int(mt.mtmd_bitmap_get_nx(bitmap)), int(mt.mtmd_bitmap_get_ny(bitmap))
        if nx <= 0 or ny <= 0:
            raise MediaError(f"image {index}: the bytes are not an image this server can decode")
        ptr = mt.mtmd_bitmap_get_data(bitmap)
        rgb: np.ndarray = np.ctypeslib.as_array(ptr, shape=(ny * nx * 3,)).copy().reshape(ny, nx, 3)
        return rgb
    finally:
        mt.mtmd_bitmap_free(bitmap)


class EncodeShare:
    """The cores, split between image encodes and the engine's decode steps while both run.

    The encoder runs on an HTTP worker thread on the same cores as the engine's decode. Two
    thread pools that each take every core and spin-wait at their barriers oversubscribe them and
    both crawl (measured: 7 decoders fell from ~2 to ~0.8 steps a second on 2 cores beside one
    encode). Taking turns instead (an encode between two steps) stalls every decoder for a
    whole chunk's encode (~1 s for a 576-patch tile here: libmtmd encodes a chunk in one graph,
    there is no smaller piece to schedule). So while an encode runs, the engine decodes on the
    cores the encoder leaves (`decode_threads`), and takes them all back after: the decoders go
    on at about half speed instead of stopping (bench/bench_vision.py: during encodes, 5x the
    tokens and a p99 gap of ~0.6 s instead of ~1-1.8 s, measured side by side)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads  # the engine's
        self.encode_threads = max(1, threads // 2)
        self._n_encoding = 0
        self._lock = threading.Lock()
        self._step = threading.Lock()  # held by the engine through each decode step

    def decode_threads(self) -> int:
        return max(1, self.threads - self.encode_threads) if self._n_encoding else self.threads

    @contextmanager
    def step(self) -> Iterator[int]:
        """Around one decode step of the engine: its thread count, read where no encode starts."""
        with self._step:
            yield self.decode_threads()

    @contextmanager
    def encoding(self) -> Iterator[None]:
        """Around an encode (and the decoding of the image or audio before it): the engine's
        steps from the next one on leave the encoder its cores, and the encode waits for the end
        of a step that began with all of them (measured: that step took 110-310 ms instead of
        ~25, the two thread pools spinning on the same cores)."""
        with self._lock:
            self._n_encoding += 1
        try:
            with self._step:
                pass
            yield
        finally:
            with self._lock:
                self._n_encoding -= 1


class MtmdVision:
    """The `Vision` of a GGUF model (worker/backends/media.py) from its mmproj file: images when
    it has a vision encoder, audio when it has an audio encoder (`has_vision`, `has_audio`)."""

    def __init__(self, mmproj_path: str, text_model: Any, n_embd: int, *, threads: int = 1,
                 max_pixels: int = 0, max_audio_seconds: float = 0.0, use_gpu: bool = True,
                 share: EncodeShare | None = None) -> None:
        _route_logs()
        params = mt.mtmd_context_params_default()
        params.use_gpu = use_gpu
        self._share = share or EncodeShare(2 * threads)
        params.n_threads = self._share.encode_threads
        params.print_timings = False
        params.warmup = False
        ctx = mt.mtmd_init_from_file(mmproj_path.encode(), text_model, params)
        if not ctx:
            raise RuntimeError(f"libmtmd failed to load the mmproj {mmproj_path!r}")
        self._ctx = ctx
        self.path = mmproj_path
        self.has_vision = bool(mt.mtmd_support_vision(ctx))
        self.has_audio = bool(mt.mtmd_support_audio(ctx))
        self.marker = (mt.mtmd_default_marker() or b"<__media__>").decode()
        self.n_embd = n_embd
        self.max_pixels = max_pixels
        self.max_audio_seconds = max_audio_seconds
        self._lock = threading.Lock()
        self._cache = ChunkCache()

    def prepare(self, text: str, media: Sequence[bytes]) -> MediaPrompt:
        with self._lock:
            if self._ctx is None:
                raise RuntimeError("the model is closed")
            bitmaps: list[Any] = []
            try:
                with self._share.encoding():
                    for i, (where, data) in enumerate(zip(labels(media), media, strict=True)):
                        bitmaps.append(self._bitmap(i, where, data))
                    return self._tokenize_and_encode(text, media, bitmaps)
            finally:
                for b in bitmaps:
                    mt.mtmd_bitmap_free(b)

    def _bitmap(self, index: int, where: str, data: bytes) -> Any:
        is_audio = isinstance(data, AudioBytes)
        if not (self.has_audio if is_audio else self.has_vision):  # the HTTP side refuses it first
            raise MediaError(f"{where}: this projector has no {'audio' if is_audio else 'vision'} encoder")
        if is_audio:
            bitmap = _decode_audio(self._ctx, where, data, self.max_audio_seconds)
        elif isinstance(data, FrameBytes):
            bitmap = _frame_bitmap(data)
        else:
            bitmap = _decode(self._ctx, where, data, self.max_pixels)
        mt.mtmd_bitmap_set_id(bitmap, str(index).encode())
        return bitmap

    def _tokenize_and_encode(self, text: str, media: Sequence[bytes], bitmaps: list[Any]) -> MediaPrompt:
        data = text.encode()
        inp = mt.mtmd_input_text(data, len(data), True, True)
        chunks = mt.mtmd_input_chunks_init()
        try:
            arr = (mt.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            ret = mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if ret == 1:
                raise MediaError(f"the prompt has {text.count(self.marker)} media markers "
                                 f"for {len(media)} images and audio parts")
            if ret != 0:
                raise MediaError(f"libmtmd could not preprocess the images or audio (status {ret})")
            return self._walk(chunks, media)
        finally:
            mt.mtmd_input_chunks_free(chunks)

    def _walk(self, chunks: Any, media: Sequence[bytes]) -> MediaPrompt:
        out = MediaPrompt(tokens=[])
        seen: dict[int, int] = {}  # media index -> its chunks so far
        for i in range(int(mt.mtmd_input_chunks_size(chunks))):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            kind = mt.mtmd_input_chunk_get_type(chunk)
            if kind == _CHUNK_TEXT:
                n = ctypes.c_size_t()
                ptr = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                out.tokens.extend(ptr[j] for j in range(n.value))
                continue
            if kind not in (_CHUNK_IMAGE, _CHUNK_AUDIO):
                raise MediaError(f"libmtmd made a chunk of unknown type {kind}")
            index = int((mt.mtmd_input_chunk_get_id(chunk) or b"0").decode())  # the bitmap's id: its index
            key = media_key(media[index], seen.get(index, 0))
            seen[index] = seen.get(index, 0) + 1
            n_rows = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
            if int(mt.mtmd_input_chunk_get_n_pos(chunk)) != n_rows:
                raise MediaError("this projector's media use M-RoPE positions, which are not supported")
            if mt.mtmd_decode_use_non_causal(self._ctx, chunk):  # e.g. Gemma 3's
                raise MediaError("this projector's media need non-causal attention over their rows, "
                                 "which is not supported yet")
            out.media[key] = self._embeddings(chunk, key, n_rows, out)
            out.tokens.extend(chunk_ids(key, n_rows))
        return out

    def _embeddings(self, chunk: Any, key: int, n_rows: int, out: MediaPrompt) -> np.ndarray:
        cached = self._cache.get(key, n_rows)
        if cached is not None:
            out.n_cached += 1
            return cached
        t0 = time.perf_counter()
        status = int(mt.mtmd_encode_chunk(self._ctx, chunk))
        seconds = time.perf_counter() - t0
        if status != 0:
            raise RuntimeError("libmtmd failed to encode a media chunk")
        ptr = mt.mtmd_get_output_embd(self._ctx)
        emb = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd)).copy()
        out.encode_seconds += seconds
        out.n_encoded += 1
        self._cache.put(key, emb)
        return emb

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                mt.mtmd_free(self._ctx)
                self._ctx = None


def labels(media: Sequence[bytes]) -> list[str]:
    """How errors name each item: "image 0", "audio 0", ... counted per kind, in order; a video's
    frames by their video ("video 0 frame 2")."""
    counts = {"image": 0, "audio": 0}
    out = []
    for data in media:
        if isinstance(data, FrameBytes):
            out.append(data.label)
            continue
        kind = "audio" if isinstance(data, AudioBytes) else "image"
        out.append(f"{kind} {counts[kind]}")
        counts[kind] += 1
    return out
