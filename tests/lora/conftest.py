"""The tiny LoRA adapters (worker/testing/tiny_lora.py), generated once per session."""

from __future__ import annotations

import pytest

from tests.util import ROOT
from worker.testing.tiny_lora import ensure_loras
from worker.testing.tiny_models import ModelPaths


@pytest.fixture(scope="session")
def tiny_loras(tiny_models: ModelPaths) -> ModelPaths:
    """The tiny model's paths, once its adapters (models/tiny-llama-lora-*) are there too."""
    ensure_loras(ROOT / "models")
    return tiny_models
