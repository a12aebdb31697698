"""libmtmd (llama.cpp's multimodal library) through the pinned llama-cpp-python's ctypes bindings
(`llama_cpp.mtmd_cpp`): a model's mmproj, images decoded, tokenized and encoded.

`MtmdVision.prepare` runs on an HTTP worker thread, never on the engine thread: it decodes the
images (stb_image, in libmtmd's helper), checks their size, tokenizes the prompt with libmtmd
(its layout of image chunks and the text around them, e.g. idefics3's tiles with
<row_R_col_C> tokens), and encodes each image chunk with the vision tower, unless a chunk of
the same bytes is in the cache of encoded chunks (an LRU keyed like the media ids, see
worker/backends/media.py). One lock serializes libmtmd: its context holds one output buffer.
The encoder runs beside the engine's decode, on half the cores, while the engine decodes on the
rest (`EncodeShare`): an encode never stops the engine, which only ever sees finished embeddings.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import llama_cpp as ll
import llama_cpp.mtmd_cpp as mt
import numpy as np

from worker.backends.media import ChunkCache, MediaError, MediaPrompt, chunk_ids, media_key

log = logging.getLogger("worker.mtmd")

_CHUNK_TEXT = mt.MTMD_INPUT_CHUNK_TYPE_TEXT
_CHUNK_IMAGE = mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
# PNG, JPEG, GIF, BMP: what stb_image decodes. libmtmd's helper hands any other bytes to ffprobe
# and ffmpeg (a video), which must not run on whatever a client sends.
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")


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


def _decode(ctx: Any, index: int, data: bytes, max_pixels: int) -> Any:
    """An mtmd bitmap of the image bytes (stb_image, in libmtmd's helper); MediaError for bytes
    that are not an image, audio, or more than `max_pixels` pixels (0: no limit)."""
    if not data:
        raise MediaError(f"image {index}: no bytes")
    if not data.startswith(_IMAGE_MAGIC):  # stb_image's formats; anything else would go to ffmpeg
        raise MediaError(f"image {index}: not a PNG, JPEG, GIF or BMP image")
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = mt.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
    if not bitmap:
        raise MediaError(f"image {index}: the bytes are not an image this server can decode")
    if mt.mtmd_bitmap_is_audio(bitmap):
        mt.mtmd_bitmap_free(bitmap)
        raise MediaError(f"image {index}: audio, not an image")
    nx, ny = int(mt.mtmd_bitmap_get_nx(bitmap)), int(mt.mtmd_bitmap_get_ny(bitmap))
    if max_pixels and nx * ny > max_pixels:
        mt.mtmd_bitmap_free(bitmap)
        raise MediaError(f"image {index}: {nx}x{ny} = {nx * ny} pixels is over this server's "
                         f"--image-max-pixels {max_pixels}")
    return bitmap


def decode_rgb(index: int, data: bytes, max_pixels: int = 0) -> np.ndarray:
    """The image as RGB uint8 [height, width, 3], decoded as the llama.cpp backend decodes it
    (stb_image through libmtmd's helper: the same pixels for JPEG too), for a vision side that
    is not libmtmd's (worker/backends/torch_vision.py). No model is needed: the helper's context
    is NULL, which it reads only for audio (refused by the magic check first); bytes stb_image
    cannot decode go on to its video path, which keeps the context without reading it and gives
    no pixels (a MediaError here)."""
    _route_logs()
    bitmap = _decode(None, index, data, max_pixels)
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

    def decode_threads(self) -> int:
        return max(1, self.threads - self.encode_threads) if self._n_encoding else self.threads

    def encoding(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            self._n_encoding += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._n_encoding -= 1


class MtmdVision:
    """The `Vision` of a GGUF model (worker/backends/media.py) from its mmproj file."""

    def __init__(self, mmproj_path: str, text_model: Any, n_embd: int, *, threads: int = 1,
                 max_pixels: int = 0, use_gpu: bool = True, share: EncodeShare | None = None) -> None:
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
        self._lock = threading.Lock()
        self._cache = ChunkCache()

    def prepare(self, text: str, images: Sequence[bytes]) -> MediaPrompt:
        with self._lock:
            if self._ctx is None:
                raise RuntimeError("the model is closed")
            bitmaps = [self._bitmap(i, data) for i, data in enumerate(images)]
            try:
                return self._tokenize_and_encode(text, images, bitmaps)
            finally:
                for b in bitmaps:
                    mt.mtmd_bitmap_free(b)

    def _bitmap(self, index: int, data: bytes) -> Any:
        bitmap = _decode(self._ctx, index, data, self.max_pixels)
        mt.mtmd_bitmap_set_id(bitmap, str(index).encode())
        return bitmap

    def _tokenize_and_encode(self, text: str, images: Sequence[bytes], bitmaps: list[Any]) -> MediaPrompt:
        data = text.encode()
        inp = mt.mtmd_input_text(data, len(data), True, True)
        chunks = mt.mtmd_input_chunks_init()
        try:
            arr = (mt.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            ret = mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if ret == 1:
                raise MediaError(f"the prompt has {text.count(self.marker)} image markers "
                                 f"for {len(images)} images")
            if ret != 0:
                raise MediaError(f"libmtmd could not preprocess the images (status {ret})")
            return self._walk(chunks, images)
        finally:
            mt.mtmd_input_chunks_free(chunks)

    def _walk(self, chunks: Any, images: Sequence[bytes]) -> MediaPrompt:
        out = MediaPrompt(tokens=[])
        seen: dict[int, int] = {}  # image index -> its chunks so far
        for i in range(int(mt.mtmd_input_chunks_size(chunks))):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            kind = mt.mtmd_input_chunk_get_type(chunk)
            if kind == _CHUNK_TEXT:
                n = ctypes.c_size_t()
                ptr = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                out.tokens.extend(ptr[j] for j in range(n.value))
                continue
            if kind != _CHUNK_IMAGE:
                raise MediaError("audio input is not supported")
            image = int((mt.mtmd_input_chunk_get_id(chunk) or b"0").decode())  # the bitmap's id: its index
            key = media_key(images[image], seen.get(image, 0))
            seen[image] = seen.get(image, 0) + 1
            n_rows = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
            if int(mt.mtmd_input_chunk_get_n_pos(chunk)) != n_rows:
                raise MediaError("this projector's images use M-RoPE positions, which are not supported")
            if mt.mtmd_decode_use_non_causal(self._ctx, chunk):  # e.g. Gemma 3's
                raise MediaError("this projector's images need non-causal attention over their rows, "
                                 "which is not supported yet")
            out.media[key] = self._embeddings(chunk, key, n_rows, out)
            out.tokens.extend(chunk_ids(key, n_rows))
        return out

    def _embeddings(self, chunk: Any, key: int, n_rows: int, out: MediaPrompt) -> np.ndarray:
        cached = self._cache.get(key, n_rows)
        if cached is not None:
            out.n_cached += 1
            return cached
        def encode() -> tuple[int, float]:
            t0 = time.perf_counter()
            return int(mt.mtmd_encode_chunk(self._ctx, chunk)), time.perf_counter() - t0

        status, seconds = self._share.encoding(encode)
        if status != 0:
            raise RuntimeError("libmtmd failed to encode an image")
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
