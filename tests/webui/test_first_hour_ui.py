"""Issue 25's web UI points in a real headless Chromium against a real router: a wrong API key
is said so in the dialog; with one model loaded it is selected on the first visit; the Models
tab's Memory column shows figures, not raw keys, and Backend the resolved backend; a loading
model offers Cancel, not Unload; a spinner says what a reply waits for (a load, the first token).

Its own router (module scope): `tiny` (loaded at startup, backend auto), `slow` (a fake worker
that takes 4 s to load) and `other` (a second GGUF preset, never loaded).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.router.conftest import fake_cmd
from tests.util import preset_defaults, wait_until
from tests.webui.conftest import API_KEY, GGUF, Router, _why_no_browser, start_router

pytest.importorskip("playwright")
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    reason = _why_no_browser()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("webui-first-hour")
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"
load-on-startup = true

[models.other]
model = "{GGUF}"

[models.slow]
backend = "cmd"
cmd = "{fake_cmd('--model', 'slow', '--load-time', '4')}"
""")
    with start_router(tmp, preset) as r:
        wait_until(
            lambda: r.models()["tiny"]["status"]["value"] == "loaded", 60, what="tiny loaded at startup"
        )
        yield r


def test_a_wrong_api_key_is_said_so_in_the_dialog_bug_it_stayed_open_silently(
    page: Page, router: Router
) -> None:
    page.goto(router.base)
    dialog = page.locator("#apikey-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#apikey-error")).to_be_hidden()  # first visit: just asked
    page.fill("#apikey-form [name=key]", "wrong-key")
    page.press("#apikey-form [name=key]", "Enter")
    expect(page.locator("#apikey-error")).to_be_visible()
    expect(page.locator("#apikey-error")).to_contain_text("not accepted")
    expect(dialog).to_be_visible()
    page.fill("#apikey-form [name=key]", API_KEY)
    page.press("#apikey-form [name=key]", "Enter")
    expect(dialog).to_be_hidden()


def test_the_one_loaded_model_is_selected_on_the_first_visit_bug_nothing_was(page: Page) -> None:
    expect(page.locator("#model-name")).to_have_text("tiny")
    expect(page.locator("#model-button")).to_have_attribute("data-state", "loaded")


def test_models_tab_shows_memory_figures_and_the_resolved_backend_bug_raw_keys_and_auto(page: Page) -> None:
    page.click("#nav-models")
    tiny = page.locator('tr[data-model="tiny"]')
    expect(tiny).to_contain_text("RAM")
    expect(tiny).to_contain_text("llama_cpp")
    other = page.locator('tr[data-model="other"]')
    expect(other).to_contain_text("needs ~")  # not loaded: the estimate
    table = page.locator("#models-table").inner_text()
    assert "_bytes" not in table and "auto" not in table.split("Backend")[1].split("\n")[0]
    page.click("#nav-chat")


def test_a_reply_waiting_for_a_load_shows_a_spinner_that_says_so(page: Page) -> None:
    page.click("#model-button")
    page.locator('.model-item[data-model="slow"]').click()
    page.fill("#input", "hello")
    page.press("#input", "Enter")
    waiting = page.locator(".msg.assistant .waiting")
    expect(waiting).to_be_visible()
    expect(waiting.locator(".spinner")).to_be_visible()
    expect(waiting).to_contain_text("loading slow")
    expect(page.locator("#send")).to_be_visible(timeout=30_000)  # answered
    expect(page.locator(".msg.assistant .waiting")).to_have_count(0)
    expect(page.locator(".msg.assistant").last.locator(".markdown")).to_contain_text("t0")


def test_a_loading_model_offers_cancel_not_unload(page: Page, router: Router) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    httpx.post(f"{router.base}/models/unload", json={"model": "slow"}, headers=headers, timeout=30)
    wait_until(lambda: router.models()["slow"]["status"]["value"] == "unloaded", 30, what="slow unloaded")
    page.click("#nav-models")
    row = page.locator('tr[data-model="slow"]')
    row.locator('button[data-action="load"]').click()
    expect(row).to_have_attribute("data-state", "loading")
    expect(row.locator("button", has_text="Unload")).to_have_count(0)
    row.locator("button", has_text="Cancel").click()
    expect(row).to_have_attribute("data-state", "unloaded", timeout=20_000)
    assert page.errors == []  # type: ignore[attr-defined]
