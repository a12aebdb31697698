"""Images on the torch worker, on the generated tiny SmolVLM's HF folder (worker/testing/tiny_vlm.py),
against the llama.cpp worker on its GGUF twin and mmproj: the same prompt (ids, media keys, chunk
order) and the same greedy answer for the same image and text; the follow-up turn's image rows
come from the cache and the slot; the 400s. In process: the prompt `TorchVision` makes is the one
libmtmd makes, for images that need each kind of resize and for a grid of several tiles."""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.util import answer, metric, run_worker
from worker.backends.torch_vision import TorchVision
from worker.testing.tiny_vlm import TEXT, VISION, VlmPaths, data_url, make_vision_weights, png, write_mmproj
from worker.torch_model.image import idefics3_tiles
from worker.torch_model.tokenizer import HFTokenizer
from worker.torch_model.vision import Idefics3Vision, load_vision_config
from worker.torch_model.weights import checkpoint_files, iter_tensors

MAX_PIXELS = 200 * 200
ARGS = ["-np", "2", "-c", "2048", "--threads", "1", "--image-max-pixels", str(MAX_PIXELS)]
# Each needs another resize: none (one tile), the height only, both sides (width first), a tall image.
SIZES = [(64, 64, 7), (80, 50, 1), (150, 100, 2), (30, 90, 3)]
ROWS_TOL = 5e-3  # ggml's CPU GELU reads an F16 table (tests/torch_backend/test_idefics3.py)


@pytest.fixture(scope="module")
def torch_worker(tiny_vlm: VlmPaths) -> Iterator[str]:
    with run_worker(tiny_vlm.hf_dir, *ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def llama_worker(tiny_vlm: VlmPaths) -> Iterator[str]:
    with run_worker(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), *ARGS,
                    "--cache-type-k", "f32", "--cache-type-v", "f32") as base:
        yield base


def _chat(base: str, messages: list[dict[str, Any]], max_tokens: int = 12) -> httpx.Response:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def _turn(url: str, text: str = "What is in this image?") -> dict[str, Any]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"role": "user", "content": parts}




@pytest.mark.parametrize(("width", "height", "seed"), SIZES, ids=[f"{w}x{h}" for w, h, _ in SIZES])
def test_torch_worker_answers_an_image_as_the_llama_cpp_worker(
    torch_worker: str, llama_worker: str, width: int, height: int, seed: int
) -> None:
    """Greedy, 12 tokens: the same text and the same prompt size from both backends."""
    messages = [_turn(data_url(png(width, height, seed)))]
    ours, theirs = _chat(torch_worker, messages), _chat(llama_worker, messages)
    assert answer(ours) == answer(theirs)
    assert ours.json()["usage"]["prompt_tokens"] == theirs.json()["usage"]["prompt_tokens"]
    assert ours.json()["usage"]["completion_tokens"] == 12


def test_image_rows_batched_with_text_rows_give_the_answer_alone(torch_worker: str) -> None:
    """The image's runs go into steps shared with other slots' token rows (BatchEntry.embd beside
    token entries in one forward pass): its greedy answer is the one it gets alone."""
    messages = [_turn(data_url(png(90, 40, 8)), "Describe it.")]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "cache_prompt": False}
    url = f"{torch_worker}/v1/chat/completions"
    alone = answer(httpx.post(url, json=body, timeout=60))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        text = pool.submit(_chat, torch_worker, [{"role": "user", "content": "Tell me a story."}], 48)
        beside = pool.submit(httpx.post, url, json=body, timeout=60)
        assert answer(beside.result()) == alone
        assert text.result().status_code == 200


def test_torch_worker_says_it_takes_images(torch_worker: str) -> None:
    props = httpx.get(f"{torch_worker}/props", timeout=10).json()
    assert props["modalities"] == {"vision": True, "audio": False}


def test_a_follow_up_turn_reuses_the_image_rows(torch_worker: str) -> None:
    url = data_url(png(70, 70, 11))
    encoded = metric(torch_worker, "omni:image_chunks_encoded_total")
    cached = metric(torch_worker, "omni:image_chunks_cached_total")
    first = _chat(torch_worker, [_turn(url)])
    assert metric(torch_worker, "omni:image_chunks_encoded_total") == encoded + 2  # overview + one slice
    follow_up = [_turn(url), {"role": "assistant", "content": answer(first)},
                 {"role": "user", "content": "Say more."}]
    r = _chat(torch_worker, follow_up, 8)
    answer(r)
    assert metric(torch_worker, "omni:image_chunks_encoded_total") == encoded + 2
    assert metric(torch_worker, "omni:image_chunks_cached_total") == cached + 2
    # the first turn's KV rows, the image's among them, were reused, not computed again
    n_first = first.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_first


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (data_url(b"not an image at all"), "not a PNG, JPEG, GIF or BMP"),
        (data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), "not an image this server can decode"),
        (data_url(png(300, 200, 3)), "--image-max-pixels"),
    ],
    ids=["garbage", "broken-png", "too-many-pixels"],
)
def test_bad_images_are_400s_on_the_torch_worker(torch_worker: str, url: str, message: str) -> None:
    r = _chat(torch_worker, [_turn(url)])
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


# -- in process: TorchVision's prompt is libmtmd's ----------------------------------------------


def _tower(hf_dir: Path) -> Idefics3Vision:
    tower = Idefics3Vision(load_vision_config(hf_dir))
    tower.load_weights(iter_tensors(checkpoint_files(hf_dir), dtype=torch.float32, device="cpu"))
    return tower


def _same_prompt(gguf: Path, mmproj: Path, hf_dir: Path, images: list[bytes]) -> None:
    from worker.backends.llama_cpp import LlamaCppBackend

    llama = LlamaCppBackend(str(gguf), n_ctx=512, n_slots=1, mmproj=str(mmproj), threads=1)
    assert llama.vision is not None
    ours = TorchVision(hf_dir, _tower(hf_dir), HFTokenizer(hf_dir))
    markers = "".join(f"Image {i}: {ours.marker}\n" for i in range(len(images)))
    text = f"<|im_start|>user\n{markers}What are they?<|im_end|>\n<|im_start|>assistant\n"
    try:
        want, got = llama.vision.prepare(text, images), ours.prepare(text, images)
    finally:
        llama.close()
    assert got.tokens == want.tokens
    assert list(got.media) == list(want.media)
    for key, rows in want.media.items():
        np.testing.assert_allclose(got.media[key], rows, atol=ROWS_TOL, rtol=0)


def test_torch_vision_makes_libmtmds_prompt(tiny_vlm: VlmPaths) -> None:
    _same_prompt(tiny_vlm.gguf, tiny_vlm.mmproj, tiny_vlm.hf_dir, [png(w, h, s) for w, h, s in SIZES])


def test_torch_vision_makes_libmtmds_prompt_for_a_grid_of_tiles(tiny_vlm: VlmPaths, tmp_path: Path) -> None:
    """A longest edge of 3 tiles (the converter's clip.vision.preproc_image_size, from the
    preprocessor's size.longest_edge): a 150x100 image is 3x2 slices (rows, their <row_R_col_C>
    tokens and the "\\n" between rows) and the overview; a 40x130 one is 1x3."""
    longest = 3 * VISION.image_size
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for f in tiny_vlm.hf_dir.iterdir():
        if f.name != "preprocessor_config.json":
            os.symlink(f, hf_dir / f.name)
    pre = json.loads((tiny_vlm.hf_dir / "preprocessor_config.json").read_text())
    pre["size"] = {"longest_edge": longest}
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(pre))
    mmproj = tmp_path / "mmproj.gguf"
    vision = make_vision_weights(VISION, TEXT.hidden, TEXT.seed)
    write_mmproj(mmproj, vision, TEXT.hidden, longest_edge=longest)
    images = [png(150, 100, 5), png(40, 130, 6)]
    assert [idefics3_tiles(np.zeros((h, w, 3), np.uint8), VISION.image_size, longest).slices.shape[0]
            for w, h in ((150, 100), (40, 130))] == [6, 3]
    _same_prompt(tiny_vlm.gguf, mmproj, hf_dir, images)
