"""The bundled web UI in headless Chromium, asking the real model "Name three primary colors."
on both backends: the streamed answer names red, blue and yellow."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.realmodel.conftest import BACKENDS, RealRouter
from tests.webui.conftest import CHROMIUM

playwright = pytest.importorskip("playwright.sync_api")
from playwright.sync_api import Page, expect  # noqa: E402

from tests.webui.test_webui import configure, last_assistant, send  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def page(real_router: RealRouter) -> Iterator[Page]:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(
            f"no Chromium at {CHROMIUM} (apt-get install chromium; needs root and the Debian registry)"
        )
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            ctx = browser.new_context(viewport={"width": 1200, "height": 800})
            ctx.set_default_timeout(30_000)
            p = ctx.new_page()
            p.goto(real_router.base)
            configure(p, temperature="0", max_tokens="24")
            yield p
        finally:
            browser.close()


@pytest.mark.parametrize("model", BACKENDS)
def test_the_web_ui_answer_names_the_three_primary_colors(page: Page, model: str) -> None:
    page.click("#new-chat")
    page.click("#model-button")
    page.locator(f'.model-item[data-model="{model}"]').click()
    expect(page.locator("#model-button")).to_have_attribute("data-state", "loaded", timeout=60_000)
    send(page, "Name three primary colors.")
    expect(last_assistant(page).locator(".markdown")).not_to_be_empty(timeout=180_000)
    expect(page.locator("#send")).to_be_visible(timeout=180_000)  # the answer is complete
    answer = last_assistant(page).locator(".markdown").inner_text().lower()
    print(f"web UI, {model}: {answer!r}")
    assert all(color in answer for color in ("red", "blue", "yellow")), answer
