"""The Models tab says which GPUs a model runs on (docs/gpu-placement.md), in Chromium: a real
router with a stand-in `nvidia-smi` reporting two GPUs (tests/router/fake_nvidia_smi.py), the
tiny model loaded from the picker, then its row lists `GPU 0` with the device's name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router.fake_nvidia_smi import install
from tests.util import ROOT, preset_defaults
from tests.webui.conftest import API_KEY, Router, _why_no_browser, start_router

pytest.importorskip("playwright")
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.slow
GPUS = {"gpus": [
    {"index": 0, "uuid": "GPU-0000aaaa", "name": "Fake GPU A", "memory.total": 24576, "memory.used": 0},
    {"index": 1, "uuid": "GPU-1111bbbb", "name": "Fake GPU B", "memory.total": 24576, "memory.used": 8192},
], "apps": []}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """Overrides the package's router: one model, on a box that says it has two GPUs."""
    reason = _why_no_browser()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("webui-gpus")
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(512)}
[models.tiny]
model = "{ROOT / 'models' / 'tiny-llama-f32.gguf'}"
backend = "llama_cpp"
""")
    with start_router(tmp, preset, env=install(tmp, GPUS)) as r:
        yield r


def test_the_models_tab_shows_the_gpus_a_model_runs_on(page: Page, router: Router) -> None:
    page.goto(router.base)
    page.fill("#apikey-form [name=key]", API_KEY)
    page.press("#apikey-form [name=key]", "Enter")
    page.click("#model-button")
    page.locator('.model-item[data-model="tiny"]').click()
    expect(page.locator("#model-button")).to_have_attribute("data-state", "loaded", timeout=60_000)
    page.click("#nav-models")
    devices = page.locator('tr[data-model="tiny"] .devices')
    expect(devices).to_contain_text("GPU 0")  # the most free memory (spread)
    assert "Fake GPU A (GPU-0000aaaa)" in (devices.get_attribute("title") or "")
    assert [d["index"] for d in router.models()["tiny"]["devices"]] == [0]
