"""What an image or audio file will decode to, read from its header alone: the decode-bomb check.

A 446 KB PNG can hold 144 megapixels (432 MB of RGB once decoded) and a 900 KB FLAC ten hours
of samples. The decoders (stb_image and miniaudio, in libmtmd's helper) allocate all of it
before anyone can look at the size, so the limits (`--image-max-pixels`, `--audio-max-seconds`)
are checked here first, on the few bytes that state it: an image's width and height (PNG's
IHDR, JPEG's frame header, GIF's screen, BMP's info header: the four formats the worker takes)
and an audio file's length (WAV: its data chunk at its byte rate; FLAC: STREAMINFO's total
samples; MP3: its frames walked header to header, each stating its own size and samples, the
bytes between them counted at the densest MPEG audio can be, so a first frame cannot speak for
the rest). A header that says nothing (a FLAC stream of unknown length, a free-format MP3, a
truncated file) gives None; under a limit such audio is refused before decoding (mtmd.py,
worker/server/media.py).
"""

from __future__ import annotations

import functools
import struct

_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xDA)})

# MPEG audio: kbps by (version is MPEG-1, layer index) and bitrate index; sample rates by version
_MP3_KBPS = {
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1 layer III
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),  # MPEG-1 layer II
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),  # MPEG-1 layer I
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2/2.5 layer II, III
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits
# The most audio a byte of MPEG audio can hold: a free-format MPEG-2.5 layer III frame of 576
# samples at 8 kHz (72 ms) in its 4-byte header and 9 bytes of side information.
_DENSEST_S_PER_BYTE = 576 / 8000 / 13
_TRAILER_BYTES = 128  # an ID3v1 tag


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, JPEG, GIF or BMP header; None if the header does not say."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            w, h = struct.unpack_from(">II", data, 16)
            return int(w), int(h)
        if data.startswith((b"GIF87a", b"GIF89a")):
            w, h = struct.unpack_from("<HH", data, 6)
            return int(w), int(h)
        if data.startswith(b"BM"):
            header = struct.unpack_from("<I", data, 14)[0]
            if header == 12:  # BITMAPCOREHEADER
                w, h = struct.unpack_from("<HH", data, 18)
            else:
                w, h = struct.unpack_from("<ii", data, 18)
            return abs(int(w)), abs(int(h))
        if data.startswith(b"\xff\xd8"):
            return _jpeg_size(data)
    except struct.error:
        return None
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        length = struct.unpack_from(">H", data, i + 2)[0]
        if marker in _JPEG_SOF:
            h, w = struct.unpack_from(">HH", data, i + 5)
            return int(w), int(h)
        if marker == 0xDA:  # start of scan before any frame header
            return None
        i += 2 + length
    return None


def audio_seconds(data: bytes) -> float | None:
    """The length of a WAV, FLAC or MP3 file from its header, in seconds; None if it does not say."""
    try:
        if data.startswith(b"RIFF") and data[8:12] == b"WAVE":
            return _wav_seconds(data)
        if data.startswith(b"fLaC"):
            return _flac_seconds(data)
        return _mp3_seconds(data)
    except struct.error:
        return None


def _wav_seconds(data: bytes) -> float | None:
    i, byte_rate = 12, 0
    while i + 8 <= len(data):
        tag, size = data[i : i + 4], struct.unpack_from("<I", data, i + 4)[0]
        if tag == b"fmt ":
            byte_rate = struct.unpack_from("<I", data, i + 16)[0]
        elif tag == b"data":
            if byte_rate <= 0:
                return None
            present = min(int(size), len(data) - i - 8)  # a streamed WAV may say 0xFFFFFFFF
            return present / int(byte_rate)
        i += 8 + size + (size & 1)
    return None


def _flac_seconds(data: bytes) -> float | None:
    if len(data) < 8 + 18 or data[4] & 0x7F != 0:  # the first metadata block is STREAMINFO
        return None
    bits = int.from_bytes(data[8 + 10 : 8 + 18], "big")
    rate = bits >> 44
    total = bits & ((1 << 36) - 1)
    if rate == 0 or total == 0:
        return None  # a stream of unknown length
    return total / rate


def _mp3_seconds(data: bytes) -> float | None:
    """The frames' own length, walked header to header: each frame's header states its size and
    its samples (a first frame's bit rate or a Xing count would be only a claim about the rest:
    a 320 kbps first frame before 19 MiB of 8 kbps ones reads as minutes and decodes to hours).
    Bytes between frames (junk, a tag, frames whose size is not stated: free format) count at
    the densest any decoder could find there (`_DENSEST_S_PER_BYTE`), so the sum bounds what
    a decoder gets from the file. None: not one frame states its size (a free-format file)."""
    i, n = 0, len(data)
    if data.startswith(b"ID3") and n >= 10:
        i = 10 + (data[6] << 21 | data[7] << 14 | data[8] << 7 | data[9])
    seconds, skipped, found = 0.0, 0, False
    while i + 4 <= n:
        shape = _frame_shape(data[i + 1], data[i + 2]) if data[i] == 0xFF else None
        if shape is None:  # not a frame here: skip to the next sync byte
            j = data.find(b"\xff", i + 1)
            j = n if j < 0 else j
            skipped += j - i
            i = j
            continue
        size, pad, frame_s = shape
        i += size + (pad if data[i + 2] & 2 else 0)
        seconds += frame_s
        found = True
    if not found:
        return None
    if skipped > _TRAILER_BYTES:  # an ID3v1 tag (128 bytes) at the end is no audio
        seconds += skipped * _DENSEST_S_PER_BYTE
    return seconds


@functools.cache
def _frame_shape(b1: int, b2: int) -> tuple[int, int, float] | None:
    """(bytes without padding, padding bytes, seconds) of an MPEG audio frame from its header's
    second and third bytes; None where they are not a frame header that states its size (a
    reserved value, or bitrate index 0: free format)."""
    version, layer_bits, index, rate_index = (b1 >> 3) & 3, (b1 >> 1) & 3, b2 >> 4, (b2 >> 2) & 3
    if b1 & 0xE0 != 0xE0 or version == 1 or layer_bits == 0 or index in (0, 15) or rate_index == 3:
        return None
    layer = 4 - layer_bits  # 1, 2 or 3
    is_v1 = version == 3
    bps = _MP3_KBPS[(is_v1, layer)][index] * 1000
    rate = _MP3_RATES[version][rate_index]
    if layer == 1:
        return 12 * bps // rate * 4, 4, 384 / rate
    per_frame = 1152 if is_v1 or layer == 2 else 576
    return per_frame // 8 * bps // rate, 1, per_frame / rate
