"""Read a few scalar keys from a GGUF file's key-value header, and nothing else.

`gguf.GGUFReader` parses every key and every tensor descriptor into numpy objects, the
tokenizer's vocabulary and merges included: seconds of CPU for a 49k-token vocabulary, more for
128k. The estimate needs half a dozen integers, so this reads the header itself, skips every
array it is not asked for (numeric arrays in one jump, string arrays by their length prefixes)
and stops as soon as every wanted key has been seen.

Format (GGUF v2/v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64 KV count,
then per KV: a string key (u64 length + UTF-8), a u32 value type, the value. An array is a u32
element type, a u64 count, then the elements. v1 used u32 for the counts and string lengths.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path

_SCALARS: dict[int, tuple[str, int]] = {  # GGUF value type -> (struct format, size)
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
Value = int | float | bool | str | list[int | float | bool] | list[str]


class GGUFHeaderError(ValueError):
    """Not a GGUF file, or a header we cannot read."""


def read_keys(path: Path, wanted: Callable[[str], bool], *, stop_when: Callable[[dict[str, Value]], bool]
              ) -> dict[str, Value]:
    """The header's values for the keys `wanted` accepts (scalars, strings, numeric arrays);
    reading stops once `stop_when(found)` is true or the header ends."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _Reader(mm).keys(wanted, stop_when)


class _Reader:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0
        self.len_fmt, self.len_size = "<Q", 8

    def _unpack(self, fmt: str, size: int) -> int | float | bool:
        if self.pos + size > len(self.buf):
            raise GGUFHeaderError("the header ends early (truncated file?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value  # type: ignore[no-any-return]

    def _length(self) -> int:
        return int(self._unpack(self.len_fmt, self.len_size))

    def _string(self) -> str:
        n = self._length()
        if self.pos + n > len(self.buf):
            raise GGUFHeaderError("a string runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _skip_string(self) -> None:
        n = self._length()  # (not `self.pos += self._length()`: that adds to the position before the read)
        self.pos += n

    def keys(
        self, wanted: Callable[[str], bool], stop_when: Callable[[dict[str, Value]], bool]
    ) -> dict[str, Value]:
        if bytes(self.buf[:4]) != b"GGUF":
            raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = int(self._unpack("<I", 4))
        if version == 1:
            self.len_fmt, self.len_size = "<I", 4
        elif version not in (2, 3):
            raise GGUFHeaderError(f"unsupported GGUF version {version}")
        self._length()  # tensor count
        n_kv = self._length()
        found: dict[str, Value] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = int(self._unpack("<I", 4))
            if wanted(key):
                found[key] = self._value(vtype)
                if stop_when(found):
                    break
            else:
                self._skip(vtype)
        return found

    def _value(self, vtype: int) -> Value:
        if vtype in _SCALARS:
            return self._unpack(*_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = int(self._unpack("<I", 4)), self._length()
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype not in _SCALARS:
                raise GGUFHeaderError(f"array of type {etype} asked for")
            fmt, size = _SCALARS[etype]
            return [self._unpack(fmt, size) for _ in range(count)]
        raise GGUFHeaderError(f"unknown value type {vtype}")

    def _skip(self, vtype: int) -> None:
        if vtype in _SCALARS:
            self.pos += _SCALARS[vtype][1]
        elif vtype == _STRING:
            self._skip_string()
        elif vtype == _ARRAY:
            etype, count = int(self._unpack("<I", 4)), self._length()
            if etype in _SCALARS:
                self.pos = self.pos + count * _SCALARS[etype][1]
            elif etype == _STRING:
                self._skip_strings(count)
            else:  # nested arrays: rare, walk them
                for _ in range(count):
                    self._skip(etype)
        else:
            raise GGUFHeaderError(f"unknown value type {vtype}")
        if self.pos > len(self.buf):
            raise GGUFHeaderError("the header ends early (truncated file?)")

    def _skip_strings(self, count: int) -> None:
        """A vocabulary: hop over `count` length-prefixed strings (the hot loop of a full scan)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack, fmt, size = struct.unpack_from, self.len_fmt, self.len_size
        for _ in range(count):
            if pos + size > end:
                raise GGUFHeaderError("the header ends early (truncated file?)")
            pos += size + unpack(fmt, buf, pos)[0]
        self.pos = pos
