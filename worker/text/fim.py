"""A code model's fill-in-the-middle tokens, as llama.cpp finds them: from the GGUF's FIM
metadata, or by the token texts below in a vocabulary without it. Read by both backends'
tokenizers and by /infill (worker/server/infill.py)."""

from __future__ import annotations

from dataclasses import dataclass


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


# llama.cpp's names for FIM tokens in a vocabulary without FIM metadata (llama-vocab.cpp)
FIM_TOKEN_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<|fim▁begin|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<|fim▁hole|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<|fim▁end|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
