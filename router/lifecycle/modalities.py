"""What a model takes as input, known without loading it: text always; images and audio when its
preset names a projector (`mmproj`) whose GGUF header says it has a vision or an audio encoder
(`clip.has_vision_encoder`, `clip.has_audio_encoder`, as llama.cpp's converter writes them).
Read once per file version (path, size, mtime) and cached."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from router.lifecycle.gguf_header import GGUFHeaderError, read_keys
from router.presets import ModelPreset

log = logging.getLogger("router.modalities")
_KEYS = ("clip.has_vision_encoder", "clip.has_audio_encoder")


def modalities(preset: ModelPreset) -> dict[str, bool]:
    """llama-server's /props `modalities`: {"vision": ..., "audio": ...}."""
    p = preset.mmproj
    if p is None:
        return {"vision": False, "audio": False}
    try:
        st = p.stat()
    except OSError:
        return {"vision": False, "audio": False}
    vision, audio = _read(p, st.st_size, st.st_mtime_ns)
    return {"vision": vision, "audio": audio}


@functools.lru_cache(maxsize=256)
def _read(path: Path, size: int, mtime_ns: int) -> tuple[bool, bool]:
    try:
        found = read_keys(path, lambda k: k in _KEYS, stop_when=lambda f: all(k in f for k in _KEYS))
    except (GGUFHeaderError, OSError, ValueError) as e:
        log.warning("%s: cannot read the projector's header: %s", path, e)
        return False, False
    return bool(found.get(_KEYS[0], False)), bool(found.get(_KEYS[1], False))
