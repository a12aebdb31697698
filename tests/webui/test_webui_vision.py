"""The web UI attaches an image to a vision model (the tiny SmolVLM, known to take images from
its /v1/models card before it loads) and gets an answer, in Chromium; a text-only model refuses
the image in the page, before anything is sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.util import ROOT, preset_defaults
from tests.webui.conftest import API_KEY, Router, _why_no_browser, start_router
from worker.testing.tiny_video import shapes_video
from worker.testing.tiny_vlm import ensure_vlm, png

pytest.importorskip("playwright")
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """Overrides the package's router: the tiny VLM and the tiny text model."""
    reason = _why_no_browser()
    if reason:
        pytest.skip(reason)
    vlm = ensure_vlm(ROOT / "models")
    tmp = tmp_path_factory.mktemp("webui-vision")
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(1024)}
[models.vlm]
model = "{vlm.gguf}"
mmproj = "{vlm.mmproj}"

[models.tiny]
model = "{ROOT / 'models' / 'tiny-llama-f32.gguf'}"
""")
    with start_router(tmp, preset) as r:
        yield r


def _pick(page: Page, model: str) -> None:
    page.click("#model-button")
    page.locator(f'.model-item[data-model="{model}"]').click()
    expect(page.locator("#model-button")).to_have_attribute("data-state", "loaded", timeout=30_000)


def test_attach_an_image_and_get_an_answer(page: Page, router: Router, tmp_path: Path) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(png(80, 50, 9))
    page.goto(router.base)
    page.fill("#apikey-form [name=key]", API_KEY)
    page.press("#apikey-form [name=key]", "Enter")

    _pick(page, "tiny")  # text only: the page refuses the image itself
    page.set_input_files("#file-input", str(image))
    expect(page.locator("#attachments .chip")).to_have_count(0)

    _pick(page, "vlm")
    page.set_input_files("#file-input", str(image))
    expect(page.locator("#attachments .chip")).to_have_count(1)
    page.fill("#input", "What is in this image?")
    page.press("#input", "Enter")
    expect(page.locator(".msg.user img.thumb")).to_have_count(1)
    expect(page.locator("#send")).to_be_visible(timeout=30_000)
    expect(page.locator(".msg.assistant").last.locator(".markdown")).not_to_be_empty()
    metrics = httpx.get(f"{router.base}/metrics", params={"model": "vlm"},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    assert "omni:image_chunks_encoded_total 2.0" in metrics  # the image went through the encoder


def test_attach_a_video_and_get_an_answer(page: Page, router: Router, tmp_path: Path) -> None:
    """A video goes as a `video_url` part: the worker samples 2 frames (1 a second of 2 s), each
    one slice and an overview through the encoder; a text-only model refuses it in the page."""
    video = tmp_path / "clip.mp4"
    video.write_bytes(shapes_video(4, fps=2))
    page.goto(router.base)
    page.evaluate("key => localStorage.setItem('omni.apiKey', key)", API_KEY)  # run alone: no key yet
    page.reload()
    page.get_by_role("button", name="+ New chat").click()

    _pick(page, "tiny")
    page.set_input_files("#file-input", str(video))
    expect(page.locator("#attachments .chip")).to_have_count(0)

    _pick(page, "vlm")
    page.set_input_files("#file-input", str(video))
    expect(page.locator("#attachments .chip video")).to_have_count(1)
    encoded = _metric(router, "omni:image_chunks_encoded_total")
    page.fill("#input", "What happens in this video?")
    page.press("#input", "Enter")
    expect(page.locator(".msg.user video.thumb")).to_have_count(1)
    expect(page.locator("#send")).to_be_visible(timeout=30_000)
    expect(page.locator(".msg.assistant").last.locator(".markdown")).not_to_be_empty()
    assert _metric(router, "omni:image_chunks_encoded_total") == encoded + 4


def _metric(router: Router, name: str) -> float:
    text = httpx.get(f"{router.base}/metrics", params={"model": "vlm"},
                     headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)
