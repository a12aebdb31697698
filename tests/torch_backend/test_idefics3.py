"""Idefics3 (SmolVLM) in our own model code, on the generated tiny VLM (worker/testing/tiny_vlm.py):
the vision tower + connector (worker/torch_model/vision.py) and the text model fed its rows give
transformers' numbers to 1e-4 on an image prompt; and the GGUF twin (llama.cpp + libmtmd on the
mmproj) encodes the same image to the same rows and answers with the same first greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.backends.base import BatchEntry, DecodeStatus
from worker.backends.media import is_media, rows_of, run_length, split_id
from worker.backends.torch_backend import TorchBackend
from worker.testing.tiny_vlm import VISION, VlmPaths, png
from worker.torch_model.vision import Idefics3Vision, load_vision_config
from worker.torch_model.weights import checkpoint_files, iter_tensors

TOL = 1e-4
SIDE = VISION.image_size  # an image of exactly one tile: libmtmd's overview and its one slice are it


def _pixels(seed: int) -> np.ndarray:
    """The image libmtmd decodes from png(SIDE, SIDE, seed), normalized as the preprocessor does."""
    rgb = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    out: np.ndarray = ((rgb.astype(np.float32) / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)
    return out


@pytest.fixture(scope="module")
def ours(tiny_vlm: VlmPaths) -> Idefics3Vision:
    v = Idefics3Vision(load_vision_config(tiny_vlm.hf_dir))
    files = checkpoint_files(tiny_vlm.hf_dir)
    v.load_weights(iter_tensors(files, dtype=torch.float32, device=torch.device("cpu")))
    return v


@pytest.fixture(scope="module")
def hf(tiny_vlm: VlmPaths) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model: torch.nn.Module = transformers.Idefics3ForConditionalGeneration.from_pretrained(
        str(tiny_vlm.hf_dir), dtype=torch.float32)
    return model.eval()


def _prompt(tiny_vlm: VlmPaths) -> tuple[list[int], int]:
    """A chat turn with one image of two tiles (16 image tokens each), as token ids; and the
    image token id."""
    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(str(tiny_vlm.hf_dir))
    tile = "<image>" * VISION.tokens_per_tile
    text = ("<|im_start|>user\nWhat is this?\n\n<fake_token_around_image><global-img>" + tile
            + "<fake_token_around_image><row_1_col_1>" + tile
            + "<fake_token_around_image><|im_end|>\n<|im_start|>assistant\n")
    ids: list[int] = tok(text)["input_ids"]
    return ids, int(tok.convert_tokens_to_ids("<image>"))


def test_vision_tower_matches_transformers(ours: Idefics3Vision, hf: torch.nn.Module) -> None:
    tiles = torch.from_numpy(np.stack([_pixels(1), _pixels(2)]))
    with torch.no_grad():
        theirs = hf.model.get_image_features(tiles[None])
    theirs = getattr(theirs, "pooler_output", theirs)
    if isinstance(theirs, list | tuple):
        theirs = torch.cat([t.reshape(-1, t.shape[-1]) for t in theirs])
    torch.testing.assert_close(ours(tiles).reshape(-1, ours.cfg.text_hidden_size),
                               theirs.reshape(-1, ours.cfg.text_hidden_size), atol=TOL, rtol=0)


def test_image_prompt_logits_match_transformers(tiny_vlm: VlmPaths, ours: Idefics3Vision,
                                                hf: torch.nn.Module) -> None:
    ids, image_id = _prompt(tiny_vlm)
    tiles = torch.from_numpy(np.stack([_pixels(3), _pixels(3)]))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids]), pixel_values=tiles[None]).logits[0, -1]
    backend = TorchBackend(str(tiny_vlm.hf_dir), n_ctx=512, n_slots=1, n_batch=256, device="cpu")
    rows = ours(tiles).reshape(-1, ours.cfg.text_hidden_size).numpy()
    at = [i for i, t in enumerate(ids) if t == image_id]
    assert len(at) == rows.shape[0]
    feed, pos, k = list(ids), 0, 0
    while feed:  # text and image rows in runs, as the scheduler feeds them
        is_img = feed[0] == image_id
        n = next((i for i, t in enumerate(feed) if (t == image_id) != is_img), len(feed))
        embd = rows[k : k + n] if is_img else None
        k += n if is_img else 0
        assert backend.decode([BatchEntry(0, feed[:n], pos, n == len(feed), embd=embd)]) is DecodeStatus.OK
        pos, feed = pos + n, feed[n:]
    torch.testing.assert_close(backend._logits[0], theirs, atol=TOL, rtol=0)


def _greedy(backend: object, tokens: list[int], media: dict[int, np.ndarray], n: int) -> list[int]:
    feed, pos, out = list(tokens), 0, []
    while feed:
        k = run_length(feed)
        embd = rows_of(media, feed[:k]) if is_media(feed[0]) else None
        assert backend.decode([BatchEntry(0, feed[:k], pos, k == len(feed), embd=embd)]) is DecodeStatus.OK  # type: ignore[attr-defined]
        pos, feed = pos + k, feed[k:]
    for _ in range(n):
        out.append(int(np.argmax(backend.logits_row(0))))  # type: ignore[attr-defined]
        assert backend.decode([BatchEntry(0, [out[-1]], pos, True)]) is DecodeStatus.OK  # type: ignore[attr-defined]
        pos += 1
    return out


def test_gguf_twin_encodes_the_same_rows_and_answers_the_same(
    tiny_vlm: VlmPaths, ours: Idefics3Vision
) -> None:
    from worker.backends.llama_cpp import LlamaCppBackend

    gguf = LlamaCppBackend(str(tiny_vlm.gguf), n_ctx=512, n_slots=1, mmproj=str(tiny_vlm.mmproj), threads=1,
                           cache_type_k="f32", cache_type_v="f32", flash_attn="off")
    assert gguf.vision is not None
    text = f"<|im_start|>user\nWhat is this?{gguf.vision.marker}<|im_end|>\n<|im_start|>assistant\n"
    prompt = gguf.vision.prepare(text, [png(SIDE, SIDE, 4)])
    assert len(prompt.media) == 2  # the overview and its one slice
    rows = ours(torch.from_numpy(_pixels(4)[None])).reshape(-1, ours.cfg.text_hidden_size).numpy()
    for emb in prompt.media.values():  # ggml's CPU GELU reads an F16 table: ~1e-3 apart after 2 blocks
        np.testing.assert_allclose(emb, rows, atol=5e-3, rtol=0)
    ours_media = dict.fromkeys(prompt.media, rows)
    torch_backend = TorchBackend(str(tiny_vlm.hf_dir), n_ctx=512, n_slots=1, n_batch=256, device="cpu")
    assert all(split_id(t)[0] in prompt.media for t in prompt.tokens if is_media(t))
    expected = _greedy(torch_backend, prompt.tokens, ours_media, 8)
    assert _greedy(gguf, prompt.tokens, prompt.media, 8) == expected
    gguf.close()


def test_image_rows_beside_token_rows_in_one_step(tiny_vlm: VlmPaths, ours: Idefics3Vision) -> None:
    """`decode` with an image run (BatchEntry.embd) and another sequence's token rows in one forward
    pass: the image sequence's logits are the ones it gets alone (bitwise on the exact CPU recipe)."""
    backend = TorchBackend(str(tiny_vlm.hf_dir), n_ctx=512, n_slots=2, n_batch=256, device="cpu")
    rows = ours(torch.from_numpy(_pixels(5)[None])).reshape(-1, ours.cfg.text_hidden_size).numpy()
    head, image = [1, 5, 6, 7], [0] * rows.shape[0]  # media ids become token 0 in decode anyway
    other = BatchEntry(1, list(range(10, 40)), 0, True)

    def image_logits(beside: bool) -> torch.Tensor:
        backend.seq_rm(-1, 0)
        assert backend.decode([BatchEntry(0, head, 0, False)]) is DecodeStatus.OK
        entries = [BatchEntry(0, image, len(head), True, embd=rows), *([other] if beside else [])]
        assert backend.decode(entries) is DecodeStatus.OK
        return torch.from_numpy(backend.logits_row(0))

    alone, beside = image_logits(False), image_logits(True)
    if backend.recipe.exact_rows:
        assert torch.equal(alone, beside)
    torch.testing.assert_close(alone, beside, atol=1e-5, rtol=0)
