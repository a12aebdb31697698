"""Images on the llama.cpp worker, on the generated tiny SmolVLM (worker/testing/tiny_vlm.py):
every way in (image_url data URLs, file:// under --allowed-local-media-path, sglang-omni's
`images`), the 400s (bad bytes, too many, too large, remote, local without the flag, a text-only
model), greedy output independent of what else runs, and one encode per image bytes."""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.util import answer, metric, run_worker
from worker.testing.tiny_models import ModelPaths
from worker.testing.tiny_vlm import VlmPaths, data_url, png

MAX_PIXELS = 200 * 200
# F32 KV, one thread: the tiny models' usual exact setup (tests/worker/conftest.py).
ARGS = ["-np", "4", "-c", "4096", "--threads", "1", "--cache-type-k", "f32", "--cache-type-v", "f32",
        "--image-max-pixels", str(MAX_PIXELS), "--max-images", "3"]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "a.png").write_bytes(png(80, 50, 1))
    return d


@pytest.fixture(scope="module")
def vlm(tiny_vlm: VlmPaths, media_dir: Path) -> Iterator[str]:
    with run_worker(tiny_vlm.gguf, "--mmproj", str(tiny_vlm.mmproj), *ARGS,
                    "--allowed-local-media-path", str(media_dir)) as base:
        yield base


def _chat(base: str, content: Any, max_tokens: int = 12, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def _image_turn(url: str, text: str = "What is in this image?") -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]




def test_image_changes_the_answer_and_counts_as_prompt_rows(vlm: str) -> None:
    a = _chat(vlm, _image_turn(data_url(png(80, 50, 1))))
    b = _chat(vlm, _image_turn(data_url(png(80, 50, 2))))
    text = _chat(vlm, "What is in this image?")
    # two tiles (overview + one slice) of 16 rows each, plus the tile tokens around them
    assert a.json()["usage"]["prompt_tokens"] > text.json()["usage"]["prompt_tokens"] + 32
    assert answer(a) != answer(b)


def test_greedy_output_is_the_same_whatever_else_runs(vlm: str) -> None:
    """An image request alone, beside 3 text requests, and beside another image request."""
    img = _image_turn(data_url(png(64, 64, 7)), "Describe it.")
    other = _image_turn(data_url(png(90, 40, 8)), "And this one?")
    alone = answer(_chat(vlm, img, cache_prompt=False))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = [pool.submit(_chat, vlm, f"Tell me about slot {i}", 24) for i in range(3)]
        beside_text = pool.submit(_chat, vlm, img, cache_prompt=False)
        assert answer(beside_text.result()) == alone
        assert all(f.result().status_code == 200 for f in texts)
        two = [pool.submit(_chat, vlm, img, cache_prompt=False), pool.submit(_chat, vlm, other)]
        assert answer(two[0].result()) == alone
        assert answer(two[1].result()) == answer(_chat(vlm, other, cache_prompt=False))


def test_the_same_image_twice_is_encoded_once(vlm: str) -> None:
    url = data_url(png(70, 70, 11))
    encoded = metric(vlm, "omni:image_chunks_encoded_total")
    cached = metric(vlm, "omni:image_chunks_cached_total")
    first = _chat(vlm, _image_turn(url))
    assert metric(vlm, "omni:image_chunks_encoded_total") == encoded + 2  # overview + one slice
    follow_up = [{"role": "user", "content": _image_turn(url)},
                 {"role": "assistant", "content": answer(first)},
                 {"role": "user", "content": "Say more."}]
    r = httpx.post(f"{vlm}/v1/chat/completions",
                   json={"messages": follow_up, "max_tokens": 8, "temperature": 0}, timeout=60)
    answer(r)
    assert metric(vlm, "omni:image_chunks_encoded_total") == encoded + 2
    assert metric(vlm, "omni:image_chunks_cached_total") == cached + 2
    # and the image's KV rows were reused from the first turn's slot, not computed again
    n_first = first.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_first


def test_local_file_and_sglang_images_give_the_data_url_answer(vlm: str, media_dir: Path) -> None:
    expected = answer(_chat(vlm, _image_turn(data_url((media_dir / "a.png").read_bytes()))))
    assert answer(_chat(vlm, _image_turn(f"file://{media_dir / 'a.png'}"))) == expected
    # sglang-omni's `images`: the images go first in the last user message
    first = [{"type": "image_url", "image_url": {"url": data_url((media_dir / "a.png").read_bytes())}},
             {"type": "text", "text": "What is in this image?"}]
    assert answer(_chat(vlm, "What is in this image?", images=[str(media_dir / "a.png")])) == answer(
        _chat(vlm, first))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (data_url(b"not an image at all"), "not a PNG, JPEG, GIF or BMP"),
        (data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), "not an image this server can decode"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png,rawbytes", "must be base64"),
        (data_url(png(300, 200, 3)), "--image-max-pixels"),
        ("http://127.0.0.1:9/x.png", "--allow-remote-media"),
        ("file:///etc/hostname", "outside --allowed-local-media-path"),
    ],
    ids=["garbage", "broken-png", "bad-base64", "not-base64", "too-many-pixels", "remote", "outside-dir"],
)
def test_bad_images_are_400s(vlm: str, url: str, message: str) -> None:
    r = _chat(vlm, _image_turn(url))
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_too_many_images_is_a_400(vlm: str) -> None:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(20, 20, i))}} for i in range(4)]
    r = _chat(vlm, parts)
    assert r.status_code == 400
    assert "at most 3 (--max-images)" in r.json()["error"]["message"]


def test_a_text_only_model_refuses_images_naming_itself(tiny_models: ModelPaths) -> None:
    with run_worker(tiny_models.gguf_f32, "-np", "1", "-c", "512", "--threads", "1", "-a", "plain") as base:
        r = _chat(base, _image_turn(data_url(png(20, 20, 1))))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "not_supported_error" and "'plain'" in err["message"]


def test_rows_do_not_depend_on_the_thread_count(tiny_vlm: VlmPaths) -> None:
    """What EncodeShare (worker/backends/mtmd.py) relies on: the engine decodes on fewer threads
    while an image is encoded beside it, and llama.cpp's CPU rows, a prompt piece's and a decode
    row's, are bitwise the same on 1 thread as on 2."""
    import llama_cpp as ll
    import numpy as np

    from worker.backends.base import BatchEntry
    from worker.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(str(tiny_vlm.gguf), n_ctx=512, n_slots=1, threads=2)
    rows = []
    for n in (2, 1):
        ll.llama_set_n_threads(b._ctx, n, n)
        b.seq_rm(0, 0)
        b.decode([BatchEntry(0, list(range(5, 105)), 0, True)])
        prompt_row = b.logits_row(0)
        b.decode([BatchEntry(0, [7], 100, True)])
        rows.append(np.concatenate([prompt_row, b.logits_row(0)]))
    b.close()
    np.testing.assert_array_equal(rows[0], rows[1])


def test_a_chunk_under_64_rows_gives_the_same_rows_whole_or_in_pieces(tiny_vlm: VlmPaths) -> None:
    """What `--media-piece` relies on (worker/backends/media.py): llama.cpp decodes a media chunk
    of fewer than 64 rows with flash attention's per-row kernel whether it goes whole (as
    llama-server does) or in pieces of 2+ rows, so its rows, and the next decode row, are bitwise
    the same either way."""
    import numpy as np

    from worker.backends.base import BatchEntry
    from worker.backends.llama_cpp import LlamaCppBackend
    from worker.backends.media import chunk_ids

    b = LlamaCppBackend(str(tiny_vlm.gguf), n_ctx=512, n_slots=1, threads=2, mmproj=str(tiny_vlm.mmproj))
    n_embd = b._ebuf.embd.shape[1]  # type: ignore[union-attr]
    emb = np.random.default_rng(0).standard_normal((63, n_embd)).astype(np.float32)
    ids = chunk_ids(12345, 63)
    rows = []
    for cuts in ([0, 63], [0, 16, 32, 48, 63], [0, 2, 9, 40, 61, 63]):
        b.seq_rm(0, 0)
        b.decode([BatchEntry(0, [5, 6, 7], 0, False)])
        for lo, hi in itertools.pairwise(cuts):
            b.decode([BatchEntry(0, ids[lo:hi], 3 + lo, hi == 63, embd=emb[lo:hi])])
        last_media_row = b.logits_row(0)
        b.decode([BatchEntry(0, [9], 66, True)])
        rows.append(np.concatenate([last_media_row, b.logits_row(0)]))
    b.close()
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], rows[2])
