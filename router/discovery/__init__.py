"""Models already on this disk for other tools, served as those tools name them (docs/hub.md):

    hub_cache.py   the Hugging Face hub cache: every GGUF repo, `org/repo:TAG` (llama.cpp's router)
    ollama.py      Ollama's store: a manifest's model layer is a GGUF blob, `name:tag`
    lmstudio.py    LM Studio's models folder: `publisher/repo/file.gguf`, `publisher/repo:TAG`

Each is a leaf that reads its folder and returns presets; `discovered` puts them together. A
preset's own model (by name) wins a clash, with a warning; the first store wins between stores.
Discovered models are presets like any other: they load, sleep and evict the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.presets import NAME_RE, ModelPreset, PresetError

log = logging.getLogger("omni.router.discovery")


@dataclass(frozen=True)
class Discovery:
    """Which stores to look in (each on by default; `omni-router --no-discover-X` turns one off)."""

    hub_cache: bool = True
    ollama: bool = True
    lmstudio: bool = True


def discovered(which: Discovery, overrides: Mapping[str, Any] | None = None) -> list[ModelPreset]:
    from router.discovery import hub_cache, lmstudio, ollama

    stores: list[tuple[bool, Callable[[Mapping[str, Any] | None], list[ModelPreset]]]] = [
        (which.hub_cache, hub_cache.scan), (which.ollama, ollama.scan), (which.lmstudio, lmstudio.scan)]
    found: dict[str, ModelPreset] = {}
    for is_on, scan in stores:
        if not is_on:
            continue
        try:
            presets = scan(overrides)
        except (OSError, PresetError) as e:  # a store we cannot read: no store, not a router that fails
            log.warning("model discovery: %s", e)
            continue
        for p in presets:
            if not NAME_RE.match(p.name):
                log.warning("%s: %r is not a name a client can send: not served", p.source, p.name)
                continue
            if p.name in found:
                log.warning("%s: %r is also in %s: the first one is served", p.source, p.name,
                            found[p.name].source)
                continue
            found[p.name] = p
    return list(found.values())


def merge_discovered(presets: list[ModelPreset], found: list[ModelPreset]) -> list[ModelPreset]:
    """The presets, then each discovered model whose name is free (a clash: the preset wins, said)."""
    taken = {n for p in presets for n in p.names}
    out = list(presets)
    for p in found:
        if p.name in taken:
            owner = next(q for q in presets if p.name in q.names)
            log.warning("discovered %r (%s) is not served: the preset [%s] (%s) has that name",
                        p.name, p.source, owner.name, owner.source)
            continue
        out.append(p)
    return out


def is_gguf_model(path: Path) -> bool:
    """A GGUF model file (not a projector)."""
    return path.suffix.lower() == ".gguf" and "mmproj" not in path.name.lower()
