"""Session fixtures shared by every test package: the generated tiny models, and a state dir of
the session's own for every router the tests start."""

from __future__ import annotations

import os
from collections.abc import Iterator

# OpenMP threads that wait for work sleep instead of spinning: torch in this process (and in any
# worker left at its default thread count) runs two threads on this 2-core box, and when another
# process holds a core a spinning waiter only keeps its partner from running. Measured on
# tests/torch_backend/test_determinism.py: 70 s -> 12 s beside one busy nice-0 process, at a cost
# of 12 s -> 15 s on an idle box (GOMP_SPINCOUNT=10000 instead: 17 s and 13 s). Read once, when
# torch loads its OpenMP runtime: so here, before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.util import ROOT
from worker.testing.tiny_audio import AudioModelPaths, ensure_audio_model
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


@pytest.fixture(scope="session")
def tiny_audio() -> AudioModelPaths:
    """The tiny Ultravox-style audio model: text GGUF and audio mmproj (Whisper encoder)."""
    return ensure_audio_model(ROOT / "models")


@pytest.fixture(scope="session", autouse=True)
def _no_model_stores_of_this_box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A router discovers the models of other tools on its box (router/discovery): the routers
    the tests start see empty stores of this session's own instead (a test that wants one sets
    its own), so what this box happens to hold never changes what they serve."""
    empty = tmp_path_factory.mktemp("no-stores")
    # HF_ENDPOINT: a closed port on loopback, so a test that forgets its stand-in hub
    # (worker/testing/stand_in_hub.py) fails here at once instead of reaching a real hub.
    names = {"HF_HUB_CACHE": empty / "hub", "OLLAMA_MODELS": empty / "ollama",
             "LMSTUDIO_MODELS_DIR": empty / "lmstudio", "HF_ENDPOINT": "http://127.0.0.1:9"}
    old = {k: os.environ.get(k) for k in names}
    os.environ.update({k: str(v) for k, v in names.items()})
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A router keeps state under $XDG_STATE_HOME/omni-router unless given --data-dir: the
    Responses store and each model's disk prompt cache, which a later run would find and reuse
    (a prompt then answered from restored rows, not computed). Routers started by the tests
    inherit this session's own folder instead."""
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old
