"""The speech worker's /metrics: Prometheus text, `omni:speech_*` (the router adds `model`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpeechMetrics:
    requests_total: int = 0
    sentences_total: int = 0
    input_chars_total: int = 0
    audio_seconds_total: float = 0.0
    synthesis_seconds_total: float = 0.0
    requests_processing: int = 0
    requests_waiting: int = 0
    load_seconds: float = 0.0
    t_start: float = field(default_factory=time.time)

    def add(self, chars: int, audio_s: float, synth_s: float) -> None:
        self.sentences_total += 1
        self.input_chars_total += chars
        self.audio_seconds_total += audio_s
        self.synthesis_seconds_total += synth_s

    def render(self) -> bytes:
        series = [
            ("counter", "requests_total", "Speech requests received", self.requests_total),
            ("counter", "sentences_total", "Sentences synthesised", self.sentences_total),
            ("counter", "input_chars_total", "Characters of input synthesised", self.input_chars_total),
            ("counter", "audio_seconds_total", "Seconds of audio produced", self.audio_seconds_total),
            ("counter", "synthesis_seconds_total", "Seconds spent synthesising",
             self.synthesis_seconds_total),
            ("gauge", "requests_processing", "Requests being synthesised", self.requests_processing),
            ("gauge", "requests_deferred", "Requests waiting for the voice", self.requests_waiting),
            ("gauge", "load_seconds", "Seconds the voice took to load", self.load_seconds),
        ]
        lines = []
        for kind, name, help_text, value in series:
            lines += [f"# HELP omni:speech_{name} {help_text}", f"# TYPE omni:speech_{name} {kind}",
                      f"omni:speech_{name} {value:g}"]
        return ("\n".join(lines) + "\n").encode()
