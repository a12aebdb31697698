"""The Models tab pulls a repo (POST /models/pull) with a progress bar, in Chromium: a real router
and the stand-in hub (worker/testing/stand_in_hub.py) holding the transfer at a byte count, so
the bar is seen part-way by condition; then the pulled model is listed, and an unknown tag shows
the router's message listing the tags."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub.conftest import GGUF_REPO, hub_env
from tests.util import ROOT, preset_defaults
from tests.webui.conftest import API_KEY, Router, _why_no_browser, start_router
from worker.testing.stand_in_hub import StandInHub

pytest.importorskip("playwright")
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.slow
GGUF = ROOT / "models" / "tiny-llama-f16.gguf"


@pytest.fixture(scope="module")
def hub() -> Iterator[StandInHub]:
    with StandInHub() as h:
        h.add_repo(GGUF_REPO, {"tiny-llama-Q4_K_M.gguf": GGUF, "tiny-llama-Q8_0.gguf": GGUF})
        yield h


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, hub: StandInHub) -> Iterator[Router]:
    """Overrides the package's router: one model, and the stand-in hub as HF_ENDPOINT."""
    reason = _why_no_browser()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("webui-pull")
    preset = tmp / "preset.toml"
    preset.write_text(f'{preset_defaults(512)}\n[models.tiny]\nmodel = "{GGUF}"\n')
    with start_router(tmp, preset, env=hub_env(hub, Path(tmp) / "hub")) as r:
        yield r


def test_the_models_tab_pulls_a_repo_with_a_progress_bar(page: Page, router: Router, hub: StandInHub) -> None:
    page.goto(router.base)
    page.fill("#apikey-form [name=key]", API_KEY)
    page.press("#apikey-form [name=key]", "Enter")
    page.click("#nav-models")
    hub.hold_after(192 * 1024)
    page.fill("#pull-repo", f"{GGUF_REPO}:Q8_0")
    page.click("#pull-button")
    bar = page.locator("#pull-progress .progress")
    expect(bar).to_have_attribute("aria-valuenow", str(round(192 * 1024 * 100 / GGUF.stat().st_size)),
                                  timeout=30_000)
    expect(page.locator("#pull-progress")).to_contain_text("192.0 KiB")
    hub.release()
    expect(page.locator("#pull-progress .pull-done")).to_contain_text(f"served as {GGUF_REPO}:Q8_0",
                                                                     timeout=30_000)
    expect(page.locator(f'tr[data-model="{GGUF_REPO}:Q8_0"]')).to_be_visible()
    page.fill("#pull-repo", f"{GGUF_REPO}:Q2_K")
    page.click("#pull-button")
    expect(page.locator("#pull-progress .pull-error")).to_contain_text("tags: Q4_K_M, Q8_0")
