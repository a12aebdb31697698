"""Ollama's store ($OLLAMA_MODELS, else ~/.ollama/models): `manifests/HOST/NAMESPACE/NAME/TAG`
are JSON manifests whose layers are blobs (`blobs/sha256-HEX`): the layer of media type
`application/vnd.ollama.image.model` is the GGUF, `...image.projector` its projector, and
`...image.params` a JSON of Ollama's options (temperature, top_p, top_k, min_p, repeat_penalty,
num_ctx), read into the worker's flags. `...image.template` is a Go template, which we cannot
render: the GGUF's own chat template serves instead. Named as Ollama names them: `NAME:TAG` for
the library (`registry.ollama.ai/library`), `NAMESPACE/NAME:TAG` for a user's, `HOST/...` for
another registry (`hf.co/org/repo:TAG`)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from router.presets import ModelPreset, discovered_preset

log = logging.getLogger("omni.router.discovery")
MODEL = "application/vnd.ollama.image.model"
PROJECTOR = "application/vnd.ollama.image.projector"
PARAMS = "application/vnd.ollama.image.params"
DEFAULT_REGISTRY = "registry.ollama.ai"
_PARAMS = {"temperature": "temp", "top_p": "top-p", "top_k": "top-k", "min_p": "min-p",
           "repeat_penalty": "repeat-penalty", "seed": "seed"}


def store() -> Path:
    return Path(os.path.expanduser(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models"))


def _name(rel: Path) -> str | None:
    parts = rel.parts
    if len(parts) < 4:
        return None
    host, *path, name, tag = parts
    if host == DEFAULT_REGISTRY and path == ["library"]:
        return f"{name}:{tag}"
    prefix = "/".join(path) if host == DEFAULT_REGISTRY else "/".join([host, *path])
    return f"{prefix}/{name}:{tag}"


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")


def scan(overrides: Mapping[str, Any] | None = None) -> list[ModelPreset]:
    root = store()
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    found = []
    for path in sorted(p for p in manifests.rglob("*") if p.is_file()):
        name = _name(path.relative_to(manifests))
        if name is None:
            continue
        try:
            layers = json.loads(path.read_text(encoding="utf-8")).get("layers", [])
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ollama store: %s is not a manifest we can read (%s)", path, e)
            continue
        by_type = {layer.get("mediaType"): layer for layer in layers if isinstance(layer, dict)}
        model = by_type.get(MODEL)
        if model is None or not _blob(root, str(model.get("digest", ""))).is_file():
            continue
        projector = by_type.get(PROJECTOR)
        mmproj = _blob(root, str(projector.get("digest", ""))) if projector else None
        found.append(discovered_preset(
            name, _blob(root, str(model["digest"])), f"ollama store {path}",
            mmproj=mmproj if mmproj is not None and mmproj.is_file() else None,
            worker_args=_params(root, by_type.get(PARAMS)), ctx_size=_num_ctx(root, by_type.get(PARAMS)),
            overrides=overrides))
    return found


def _read_params(root: Path, layer: Mapping[str, Any] | None) -> dict[str, Any]:
    if layer is None:
        return {}
    try:
        data = json.loads(_blob(root, str(layer.get("digest", ""))).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _params(root: Path, layer: Mapping[str, Any] | None) -> dict[str, str]:
    out = {}
    for key, flag in _PARAMS.items():
        value = _read_params(root, layer).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[flag] = f"{value:g}"
    return out


def _num_ctx(root: Path, layer: Mapping[str, Any] | None) -> int | None:
    value = _read_params(root, layer).get("num_ctx")
    return value if isinstance(value, int) and value > 0 else None
