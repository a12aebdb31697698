"""What an HF model folder takes as input, one rule for both sides: the router reports it in
/v1/models without loading the model (router/lifecycle/modalities.py), and the torch backend
loads the vision side by it (worker/backends/torch_backend.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Architectures whose vision side the torch backend runs (worker/torch_model/vision.py).
IMAGE_ARCHITECTURES = frozenset({"Idefics3ForConditionalGeneration"})
IMAGE_MODEL_TYPES = frozenset({"idefics3"})


def config_takes_images(config: dict[str, Any]) -> bool:
    """Whether a config.json's model is one the torch backend serves images for."""
    archs = config.get("architectures") or []
    return bool(IMAGE_ARCHITECTURES.intersection(archs)) or config.get("model_type") in IMAGE_MODEL_TYPES


def folder_takes_images(model_dir: str | Path) -> bool:
    """`config_takes_images` of the folder's config.json; False when there is none to read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config_takes_images(config)
