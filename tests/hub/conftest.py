"""A stand-in hub (worker/testing/stand_in_hub.py) serving the project's tiny models as hub repos:
a GGUF repo with several quantisation files (the names say the quantisation; the bytes are the
tiny model's F32 or F16 twin), a VLM repo with its projector, a repo of a real split GGUF (the
tiny model in three parts, as llama.cpp's gguf-split writes them) and a safetensors repo."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.conftest import router_factory  # the real-router fixture, for these tests too
from worker.testing.stand_in_hub import StandInHub
from worker.testing.tiny_models import ModelPaths, write_split_variant
from worker.testing.tiny_vlm import VlmPaths

GGUF_REPO = "omni/tiny-llama-GGUF"
VLM_REPO = "omni/tiny-smolvlm-GGUF"
HF_REPO = "omni/tiny-llama"
SPLIT_REPO = "omni/tiny-split-GGUF"
__all__ = ["router_factory"]


@pytest.fixture(scope="session")
def tiny_split(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The tiny model (F16) split in three GGUF parts: `tiny-split-Q8_0-0000i-of-00003.gguf`."""
    return write_split_variant(tmp_path_factory.mktemp("split") / "tiny-split-Q8_0.gguf", 3)


@pytest.fixture
def model_hub(tiny_models: ModelPaths, tiny_vlm: VlmPaths, tiny_split: list[Path]) -> Iterator[StandInHub]:
    with StandInHub() as hub:
        hub.add_repo(GGUF_REPO, {
            "tiny-llama-Q4_K_M.gguf": tiny_models.gguf_f16, "tiny-llama-Q8_0.gguf": tiny_models.gguf_f32,
            "tiny-llama-F16.gguf": tiny_models.gguf_f16, "README.md": "# tiny llama\n",
            "generation_config.json": '{"temperature": 0.2, "top_p": 0.9}'})
        hub.add_repo(VLM_REPO, {"tiny-smolvlm-F32.gguf": tiny_vlm.gguf,
                                "mmproj-tiny-smolvlm-F32.gguf": tiny_vlm.mmproj})
        hub.add_repo(SPLIT_REPO, {p.name: p for p in tiny_split})
        hub.add_repo(HF_REPO, {p.name: p for p in sorted(Path(tiny_models.hf_dir).iterdir()) if p.is_file()})
        yield hub


def hub_env(hub: StandInHub, cache: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}
