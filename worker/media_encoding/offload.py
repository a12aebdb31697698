"""Audio encoding off the event loop (issue 47): `AudioEncoder` runs `audio.encode` /
`audio.encode_piece` (and the base64 a JSON answer needs) in threads of its own, at most
`max_concurrent` at once; the rest wait in arrival order. LAME, libopus and FFmpeg release the
GIL while they encode, so the loop keeps serving every other stream meanwhile (60 s of 22 kHz
speech takes about 1.2 s as opus, 0.4 s as mp3 or aac on a laptop core).

The bound keeps a burst of spoken answers from taking every core from the decode threads:
`DEFAULT_MAX_ENCODES` (2) unless the owner says otherwise. The router and the speech worker each
hold one encoder (docs/speech.md).
"""

from __future__ import annotations

import asyncio
import base64
import threading
from concurrent.futures import ThreadPoolExecutor

from worker.media_encoding.audio import Samples, encode, encode_piece

DEFAULT_MAX_ENCODES = 2  # encodes at once per process; more wait for one of these threads


class AudioEncoder:
    """Encodes in a pool of `max_concurrent` threads (created on first use, named `audio-encode`)."""

    def __init__(self, max_concurrent: int = DEFAULT_MAX_ENCODES) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.max_concurrent = max_concurrent
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="audio-encode")
            return self._pool

    async def encode(self, samples: Samples, rate: int, fmt: str) -> bytes:
        """One whole file of `samples` in `fmt`, encoded off the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), encode, samples, rate, fmt)

    async def encode_piece(self, samples: Samples, rate: int, fmt: str, is_first: bool) -> bytes:
        """One sentence of a stream (`audio.encode_piece`), encoded off the loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor(), encode_piece, samples, rate, fmt, is_first)

    async def encode_base64(self, samples: Samples, rate: int, fmt: str, is_first: bool | None = None) -> str:
        """The base64 of a whole file (`is_first` None) or of a stream's piece, off the loop."""
        def work() -> str:
            if is_first is None:
                return base64.b64encode(encode(samples, rate, fmt)).decode()
            data = encode_piece(samples, rate, fmt, is_first)
            return base64.b64encode(data).decode()

        return await asyncio.get_running_loop().run_in_executor(self._executor(), work)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
