"""Incremental UTF-8 detokenization: token pieces are bytes, clients get whole characters.

A token's piece may end in the middle of a multi-byte character (byte-fallback tokens carry one
byte each). `feed` returns only complete characters and keeps the incomplete tail for the next
piece; invalid bytes become U+FFFD instead of raising. `flush` returns what is left at the end.
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Bytes in, complete UTF-8 text out."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
