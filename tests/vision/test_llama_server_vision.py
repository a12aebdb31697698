"""The generated tiny SmolVLM's GGUF + mmproj also load in llama.cpp's own llama-server (built by
scripts/build_llama_server.sh from the pinned sources), and its greedy answer to an image prompt
is ours, token for token, with the same prompt length (the same template flattening of text and
image parts, the same libmtmd tiles)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.util import greedy_chat, run_llama_server, run_worker
from worker.testing.tiny_vlm import VlmPaths, data_url, png

ARGS = ["-np", "1", "-c", "2048", "-t", "1"]


@pytest.fixture(scope="module")
def llama_server(tiny_vlm: VlmPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("llama-server") / "log"
    with run_llama_server(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), *ARGS, log_path=log) as base:
        yield base


def test_llama_server_gives_our_greedy_answer(llama_server: str, tiny_vlm: VlmPaths) -> None:
    prompts = [
        [{"type": "text", "text": "What is in this image?"},
         {"type": "image_url", "image_url": {"url": data_url(png(80, 50, 1))}}],
        [{"type": "image_url", "image_url": {"url": data_url(png(64, 100, 2))}},
         {"type": "text", "text": "Describe it."},
         {"type": "image_url", "image_url": {"url": data_url(png(30, 30, 3))}}],
    ]
    theirs = [greedy_chat(llama_server, p) for p in prompts]
    with run_worker(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), *ARGS) as base:
        ours = [greedy_chat(base, p) for p in prompts]
    for a, b in zip(ours, theirs, strict=True):
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
