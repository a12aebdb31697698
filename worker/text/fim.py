"""A code model's fill-in-the-middle tokens, as llama.cpp finds them: from the GGUF's FIM
metadata, or by the token texts below in a vocabulary without it. Read by both backends'
tokenizers and by /infill (worker/server/infill.py)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.protocol.fim_tokens import FIM_TOKEN_TEXTS

__all__ = ["FIM_TOKEN_TEXTS", "FimTokens"]


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A code model's fill-in-the-middle tokens (llama.cpp's fim_pre/suf/mid/rep/sep; -1: none)."""

    pre: int = -1
    suf: int = -1
    mid: int = -1
    rep: int = -1  # repository name (optional)
    sep: int = -1  # file separator (optional)

    def missing(self) -> list[str]:
        """The kinds /infill needs that the model lacks (empty: infill works)."""
        return [
            kind for kind, t in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if t < 0
        ]
