"""A code model's fill-in-the-middle token texts, as llama.cpp finds them in a vocabulary without
FIM metadata: shared by the worker's tokenizers (worker/text/fim.py) and the router's
`/api/show`, which tells from a GGUF header whether a model fills in the middle before a load."""

from __future__ import annotations

# llama.cpp's names for FIM tokens in a vocabulary without FIM metadata (llama-vocab.cpp)
FIM_TOKEN_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<|fim▁begin|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<|fim▁hole|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<|fim▁end|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
