"""The generated tiny audio model's GGUF + mmproj (worker/testing/tiny_audio.py: a Whisper encoder
and Ultravox projector) also load in llama.cpp's own llama-server (built by
scripts/build_llama_server.sh from the pinned sources), and its greedy answer to a prompt with
`input_audio` parts is ours, token for token, with the same prompt length (the same flattening
of text and audio parts, the same libmtmd mel windows and rows)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest

from tests.util import greedy_chat, run_llama_server, run_worker
from worker.testing.tiny_audio import AudioModelPaths, wav

ARGS = ["-np", "1", "-c", "2048", "-t", "1"]


@pytest.fixture(scope="module")
def llama_server(tiny_audio: AudioModelPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("llama-server") / "log"
    with run_llama_server(tiny_audio.gguf, "--mmproj", str(tiny_audio.mmproj), *ARGS, log_path=log) as base:
        yield base


def _audio(data: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def test_llama_server_gives_our_greedy_answer(llama_server: str, tiny_audio: AudioModelPaths) -> None:
    prompts = [
        [{"type": "text", "text": "What do you hear?"}, _audio(wav(1.0, 1, 440.0))],
        [_audio(wav(2.5, 2, 300.0)), {"type": "text", "text": "Transcribe it."}, _audio(wav(0.7, 3, 1500.0))],
        [{"type": "text", "text": "A long one:"}, _audio(wav(31.0, 4, 800.0))],  # two 30 s windows
    ]
    theirs = [greedy_chat(llama_server, p) for p in prompts]
    with run_worker(tiny_audio.gguf, "--mmproj", str(tiny_audio.mmproj), *ARGS) as base:
        ours = [greedy_chat(base, p) for p in prompts]
    for a, b in zip(ours, theirs, strict=True):
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 24
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert len({a["choices"][0]["message"]["content"] for a in ours}) == len(prompts)  # the audio matters
