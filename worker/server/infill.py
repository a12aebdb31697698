"""/infill's prompt: llama-server's format_prompt_infill (tools/server/server-common.cpp), token for token.

The repo-level FIM layout (https://arxiv.org/pdf/2409.12186), with the model's FIM tokens:

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra chunk 0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]prefix [prompt] [FIM_SUF]suffix [FIM_MID]

Without a repo token there is no repo line; without a file separator, each extra chunk starts with
"\\n\\n--- snippet ---\\n\\n" and there is no final file line. To fit a batch, the prefix keeps its last
3/4 of n_batch tokens and the suffix its first n_batch/4 - 2 - len(prompt); the extra chunks fill
what is left of the context (n_ctx - n_batch - 2 n_predict), their last tokens kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from worker.backends.base import ModelMeta

_SNIPPET = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True, slots=True)
class InfillParts:
    prefix: list[int]
    suffix: list[int]
    prompt: list[int]
    extra: list[tuple[str, str]]  # (filename, text)


def infill_prompt(meta: ModelMeta, tokenize: Callable[[str], list[int]], parts: InfillParts, *, n_batch: int,
                  n_predict: int, n_ctx: int) -> list[int]:
    """The prompt tokens; `tokenize`: text -> ids, no specials added or parsed. The model has
    FIM prefix, suffix and middle tokens (the caller checked)."""
    fim = meta.fim
    extra: list[int] = []
    if fim.rep >= 0:
        extra += [fim.rep, *tokenize("myproject\n")]
    for filename, text in parts.extra:
        extra += [fim.sep, *tokenize(filename + "\n")] if fim.sep >= 0 else tokenize(_SNIPPET)
        extra += tokenize(text)
    if fim.sep >= 0:
        extra += [fim.sep, *tokenize("filename\n")]

    n_prefix = min(len(parts.prefix), 3 * (n_batch // 4))
    n_suffix = min(len(parts.suffix), max(0, n_batch // 4 - (2 + len(parts.prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))

    head = [fim.pre, *parts.prefix[len(parts.prefix) - n_prefix :], *parts.prompt]
    tail = [fim.suf, *parts.suffix[:n_suffix]]
    bos = [meta.bos_token_id] if meta.add_bos and meta.bos_token_id >= 0 else []
    return [*extra[len(extra) - n_extra :], *bos, *head, *tail, fim.mid]
