"""How a client names a model's LoRA adapter, for both sides: `"<model>:<adapter>"`, where an
adapter's default name is its file name without `.gguf` (or its folder's name). The worker
resolves it (worker/server/prepare.py); the router routes `"<model>:<adapter>"` only to a model
that has that adapter (router/lifecycle/pool.py)."""

from __future__ import annotations

from pathlib import Path


def adapter_name(path: str) -> str:
    """An adapter's default name: its file name without .gguf, or its folder's name."""
    p = Path(path.rstrip("/"))
    return p.name[: -len(".gguf")] if p.name.lower().endswith(".gguf") else p.name
