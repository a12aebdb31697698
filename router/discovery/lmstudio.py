"""LM Studio's models folder ($LMSTUDIO_MODELS_DIR, else ~/.lmstudio/models, else
~/.cache/lm-studio/models): `publisher/repo/file.gguf`, served as `publisher/repo:TAG` (the
quantisation its name states; the file's stem when it states none), with a `mmproj*.gguf` of the
same folder as its projector. A split model is its first part."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.discovery import is_gguf_model
from router.hub.choice import quant_of
from router.presets import ModelPreset, discovered_preset


def folder() -> Path | None:
    env = os.environ.get("LMSTUDIO_MODELS_DIR")
    if env:
        return Path(os.path.expanduser(env))
    for candidate in ("~/.lmstudio/models", "~/.cache/lm-studio/models"):
        p = Path(os.path.expanduser(candidate))
        if p.is_dir():
            return p
    return None


def scan(overrides: Mapping[str, Any] | None = None) -> list[ModelPreset]:
    root = folder()
    if root is None or not root.is_dir():
        return []
    found = []
    for repo in sorted(p for p in root.glob("*/*") if p.is_dir()):
        files = sorted(repo.glob("*.gguf"))
        mmproj = next((f for f in files if not is_gguf_model(f)), None)
        for f in files:
            if not is_gguf_model(f) or ("-of-" in f.name and "-00001-of-" not in f.name):
                continue
            tag = quant_of(f.name) or f.stem
            found.append(discovered_preset(f"{repo.parent.name}/{repo.name}:{tag}", f,
                                           f"lm studio {f}", mmproj=mmproj, overrides=overrides))
    return found
