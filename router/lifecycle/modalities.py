"""What a model takes as input, known without loading it: text always; images and audio when its
preset names a projector (`mmproj`) whose GGUF header says it has a vision or an audio encoder
(`clip.has_vision_encoder`, `clip.has_audio_encoder`, as llama.cpp's converter writes them);
images for an HF folder on the torch backend whose config.json is a model the torch backend
serves images for (an Idefics3: worker/protocol/modalities.py, the rule the worker loads by).
Speech out: a Piper voice (`.onnx`) speaks; a chat model with a `speech-model` answers in audio.
Read once per file version (path, size, mtime) and cached."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from router.lifecycle.gguf_header import GGUFHeaderError, read_keys
from router.presets import ModelPreset
from worker.protocol.modalities import folder_takes_images

log = logging.getLogger("router.modalities")
_KEYS = ("clip.has_vision_encoder", "clip.has_audio_encoder")


def modalities(preset: ModelPreset) -> dict[str, bool]:
    """llama-server's /props `modalities`: {"vision": ..., "audio": ...} (what goes in), and, only
    where the model has them, what comes out besides text: `speech: true` (a voice: it serves
    /v1/audio/speech) and `audio_output: true` (a chat model whose preset names a `speech-model`:
    it answers chats with `modalities: ["text", "audio"]`)."""
    out = {k: True for k, v in (("speech", preset.resolved_backend == "piper"),
                                ("audio_output", preset.speech_model is not None)) if v}
    p = preset.mmproj
    if p is None:
        return {"vision": _hf_vision(preset), "audio": False, **out}
    try:
        st = p.stat()
    except OSError:
        return {"vision": False, "audio": False, **out}
    vision, audio = _read(p, st.st_size, st.st_mtime_ns)
    return {"vision": vision, "audio": audio, **out}


def _hf_vision(preset: ModelPreset) -> bool:
    if preset.model is None or preset.resolved_backend != "torch" or preset.embedding:
        return False
    try:
        st = (preset.model / "config.json").stat()
    except OSError:
        return False
    return _folder_vision(preset.model, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _folder_vision(path: Path, size: int, mtime_ns: int) -> bool:
    return folder_takes_images(path)


@functools.lru_cache(maxsize=256)
def _read(path: Path, size: int, mtime_ns: int) -> tuple[bool, bool]:
    try:
        found = read_keys(path, lambda k: k in _KEYS, stop_when=lambda f: all(k in f for k in _KEYS))
    except (GGUFHeaderError, OSError, ValueError) as e:
        log.warning("%s: cannot read the projector's header: %s", path, e)
        return False, False
    return bool(found.get(_KEYS[0], False)), bool(found.get(_KEYS[1], False))
