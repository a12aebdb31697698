"""What an image or audio file will decode to, read from its header alone: the decode-bomb check.

A 446 KB PNG can hold 144 megapixels (432 MB of RGB once decoded) and a 900 KB FLAC ten hours
of samples. The decoders (stb_image and miniaudio, in libmtmd's helper) allocate all of it
before anyone can look at the size, so the limits (`--image-max-pixels`, `--audio-max-seconds`)
are checked here first, on the few bytes that state it: an image's width and height (PNG's
IHDR, JPEG's frame header, GIF's screen, BMP's info header: the four formats the worker takes)
and an audio file's length (WAV: its data chunk at its byte rate; FLAC: STREAMINFO's total
samples; MP3: the Xing/Info or VBRI frame count, else the bytes at the first frame's bit rate).
A header that says nothing (a FLAC stream of unknown length, a truncated file) gives None; the
decoder then runs and its output is checked, as before.
"""

from __future__ import annotations

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
    i = 0
    if data.startswith(b"ID3") and len(data) >= 10:
        size = data[6] << 21 | data[7] << 14 | data[8] << 7 | data[9]
        i = 10 + size
    limit = min(len(data) - 4, i + 64 * 1024)  # the first frame is near the start
    while i < limit and not (data[i] == 0xFF and data[i + 1] & 0xE0 == 0xE0):
        i += 1
    if i >= limit:
        return None
    b1, b2 = data[i + 1], data[i + 2]
    version, layer_bits = (b1 >> 3) & 3, (b1 >> 1) & 3
    if version == 1 or layer_bits == 0:
        return None
    layer = 4 - layer_bits  # 1, 2 or 3
    is_v1 = version == 3
    kbps = _MP3_KBPS[(is_v1, layer)][(b2 >> 4) & 0xF] if (b2 >> 4) & 0xF != 0xF else 0
    rate_index = (b2 >> 2) & 3
    if rate_index == 3:
        return None
    rate = _MP3_RATES[version][rate_index]
    per_frame = 384 if layer == 1 else 1152 if is_v1 or layer == 2 else 576
    frames = _vbr_frames(data, i)
    if frames:
        return frames * per_frame / rate
    if kbps == 0:
        return None
    return (len(data) - i) * 8 / (kbps * 1000)


def _vbr_frames(data: bytes, frame: int) -> int | None:
    """The frame count of a Xing/Info or VBRI header in the first frame, if there is one."""
    window = data[frame : frame + 200]
    for tag in (b"Xing", b"Info"):
        at = window.find(tag)
        if at >= 0 and len(window) >= at + 12 and window[at + 7] & 1:
            return int(struct.unpack_from(">I", window, at + 8)[0])
    at = window.find(b"VBRI")
    if at >= 0 and len(window) >= at + 18:
        return int(struct.unpack_from(">I", window, at + 14)[0])
    return None
