"""Where each model's disk prompt cache lives (the worker's `--cache-dir`, preset key `cache-dir`).

By default a folder per model under the router's data dir (`--data-dir`):
`<data dir>/prompt-cache/<model name>`, for the models the router runs as omni-workers that
generate (not `cmd` or `remote` ones, not embedding models: their tasks keep no cache). A preset's
`cache-dir` replaces it; `cache-disk = 0` turns the tier off (the worker's `--cache-disk`).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from router.presets import ModelPreset

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def with_default_cache_dirs(presets: list[ModelPreset], data_dir: Path) -> list[ModelPreset]:
    return [
        replace(p, cache_dir=str(data_dir / "prompt-cache" / _UNSAFE.sub("_", p.name)))
        if p.cache_dir is None and p.model is not None and p.backend in ("auto", "llama_cpp", "torch")
        and not p.embedding and not p.reranking
        else p
        for p in presets
    ]


def folder_bytes(path: str) -> int:
    """The size of a cache folder's entries (0 when it does not exist yet)."""
    total = 0
    try:
        with os.scandir(path) as it:
            for d in it:
                if d.name.endswith(".kv"):
                    try:
                        total += d.stat().st_size
                    except OSError:
                        pass  # evicted while we looked
    except OSError:
        return 0
    return total
