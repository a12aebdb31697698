"""One Piper voice on ONNX Runtime: the network (`.onnx`) and its config (`.onnx.json`), loaded
with piper-tts's own classes (its phonemizer is espeak-ng, bundled in its wheel), run with the
worker's thread count. Only the synthesizer's thread (worker/speech/synth.py) calls `speak`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from worker.media_encoding.audio import Samples
from worker.protocol.speech import config_path

# Control characters carry no speech, and espeak-ng's bridge refuses a NUL: they become spaces.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class Voice:
    def __init__(self, model: str | Path, threads: int | None = None) -> None:
        try:
            import onnxruntime
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError as e:  # an extra (GPL-3.0 piper-tts): not installed with the package itself
            raise RuntimeError(f"a Piper voice needs piper-tts and onnxruntime ({e.name} is not installed): "
                               "pip install 'omni-router[speech]'") from None

        config = json.loads(config_path(model).read_text(encoding="utf-8"))
        options = onnxruntime.SessionOptions()
        if threads is not None and threads > 0:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(str(model), sess_options=options,
                                               providers=["CPUExecutionProvider"])
        self._voice = PiperVoice(session=session, config=PiperConfig.from_dict(config))
        self.sample_rate: int = self._voice.config.sample_rate
        self._length_scale: float = self._voice.config.length_scale

    def speak(self, text: str, speaker_id: int, speed: float) -> Samples:
        """16-bit samples of `text` (usually one sentence; Piper cuts longer text itself)."""
        from piper.config import SynthesisConfig

        config = SynthesisConfig(speaker_id=speaker_id, length_scale=self._length_scale / speed)
        chunks = [c.audio_int16_array for c in self._voice.synthesize(_CONTROL.sub(" ", text), config)]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
