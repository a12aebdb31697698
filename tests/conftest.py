"""Session fixtures shared by every test package: the generated tiny models."""

from __future__ import annotations

import pytest

from tests.util import ROOT
from worker.testing.tiny_models import ModelPaths, ensure_model
from worker.testing.tiny_vlm import VlmPaths, ensure_vlm


@pytest.fixture(scope="session")
def tiny_models() -> ModelPaths:
    """The tiny HF model and its GGUF twins under models/ (generated once, reused after)."""
    return ensure_model(ROOT / "models", "tiny")


@pytest.fixture(scope="session")
def tiny_reranker() -> ModelPaths:
    """The tiny Qwen3-Reranker look-alike (HF folder and GGUF twins with a classifier head)."""
    return ensure_model(ROOT / "models", "tiny-reranker")


@pytest.fixture(scope="session")
def tiny_vlm() -> VlmPaths:
    """The tiny SmolVLM (Idefics3): HF folder, text GGUF and mmproj GGUF of the same weights."""
    return ensure_vlm(ROOT / "models")
