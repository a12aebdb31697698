"""Qwen3-Reranker, as llama.cpp's converter (conversion/qwen.py) recognizes and converts it.

A Qwen3-Reranker is a plain Qwen3ForCausalLM: its relevance score is the probability of "yes"
against "no" as the next token after a fixed prompt. The converter spots one by its README
title or its name, and writes the GGUF with rank pooling, a two-row classifier head (`cls.output`
= the LM head's "yes" and "no" rows, softmaxed by llama.cpp) and this "rerank" template. The
torch backend does the same from the HF folder, so both backends give the same scores.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages "
    "that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
RERANK_LABELS = ("yes", "no")  # the classifier's outputs, in order: the score is the first


def is_qwen3_reranker(model_dir: Path) -> bool:
    """The converter's test: a qwen3 model whose README or name says Qwen3-Reranker."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if cfg.get("model_type") != "qwen3":
        return False
    try:
        readme = (model_dir / "README.md").read_text(encoding="utf-8").lower()
    except OSError:
        readme = ""
    if "# qwen3-reranker" in readme:
        return True
    hints = [
        model_dir.resolve().name,
        str(cfg.get("_name_or_path", "")),
        *map(str, cfg.get("architectures") or []),
    ]
    return any("qwen3-reranker" in h.lower() for h in hints)
