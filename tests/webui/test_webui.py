"""The bundled web UI in a real headless Chromium against a real router on the tiny model.

One router and one page for the module; the tests run in order as one user's story:
key prompt -> pick a model (it loads) -> chat (streamed, stats) -> stop a long answer ->
reload and find the conversation -> edit/regenerate and switch branches -> hostile output
runs nothing -> a failed model shows its error -> 375 px wide. Set OMNI_WEBUI_SCREENSHOTS=DIR
to also write light and dark screenshots there (docs/ holds the ones in the README).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.util import wait_until
from tests.webui.conftest import API_KEY, Router

pytest.importorskip("playwright")
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.slow
XSS = '<img src=x onerror="window.__xss=1;alert(1)"><script>window.__xss=2;alert(2)</script>'
MARKDOWN = "| a | b |\\n|---|---|\\n| 1 | 2 |\\n\\n```python\\nx = 1\\n```\\n"


def configure(page: Page, **fields: str) -> None:
    """Fill the settings dialog (empty string clears a field) and save."""
    page.click("#open-settings")
    page.locator("#settings-form details").evaluate("d => { d.open = true; }")
    for name, value in fields.items():
        if name == "theme":
            page.select_option("#settings-form [name=theme]", value)
        else:
            page.fill(f"#settings-form [name={name}]", value)
    page.click("#settings-save")
    expect(page.locator("#settings-dialog")).not_to_be_visible()


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_idle(page: Page) -> None:
    expect(page.locator("#send")).to_be_visible(timeout=30_000)


def last_assistant(page: Page):  # type: ignore[no-untyped-def]
    return page.locator(".msg.assistant").last


def test_static_files_are_served_public_gzipped_and_cached(router: Router) -> None:
    with httpx.Client(base_url=router.base, timeout=10) as c:
        index = c.get("/", headers={"accept": "text/html"})  # no API key: the page is public, the API is not
        assert index.status_code == 200 and "text/html" in index.headers["content-type"]
        assert index.headers["cache-control"] == "no-cache"
        assert "script-src 'self'" in index.headers["content-security-policy"]
        app = c.get("/static/app.js", headers={"accept-encoding": "gzip"})
        assert app.headers["content-encoding"] == "gzip" and "javascript" in app.headers["content-type"]
        assert c.get("/static/app.js", headers={"if-none-match": app.headers["etag"]}).status_code == 304
        vendor = c.get("/static/vendor/purify-3.4.18.min.js")
        assert "immutable" in vendor.headers["cache-control"]
        assert c.get("/static/../../pyproject.toml").status_code in (401, 404)  # httpx drops the ..
        assert c.get("/static/%2e%2e/%2e%2e/pyproject.toml").status_code == 404
        assert c.get("/v1/models").status_code == 401


def test_asks_for_the_key_then_picking_a_model_loads_it(page: Page, router: Router) -> None:
    page.goto(router.base)
    expect(page.locator("#apikey-dialog")).to_be_visible()
    page.fill("#apikey-form [name=key]", API_KEY)
    page.press("#apikey-form [name=key]", "Enter")
    page.click("#model-button")
    item = page.locator('.model-item[data-model="tiny"]')
    expect(item).to_have_attribute("data-state", "unloaded")
    expect(page.locator(".group-title").first).to_have_text("Available")
    item.click()
    # the status stream drives the picker: loading (with a progress bar) then loaded
    expect(page.locator("#model-button")).to_have_attribute("data-state", "loaded", timeout=30_000)
    assert router.models()["tiny"]["status"]["value"] == "loaded"
    page.click("#model-button")
    expect(page.locator(".group-title").first).to_have_text("Loaded")
    page.click("#model-button")


def test_send_streams_a_reply_with_its_stats(page: Page) -> None:
    configure(page, max_tokens="8", extra='{"ignore_eos": true}')
    send(page, "hello there")
    expect(page.locator(".msg.user .plain")).to_have_text("hello there")
    wait_idle(page)
    reply = last_assistant(page)
    expect(reply.locator(".markdown")).not_to_be_empty()
    stats = reply.locator(".stats")
    expect(stats.locator('[data-k="generated"]')).to_have_text("generated 8 tok")
    expect(stats.locator('[data-k="prompt"]')).to_contain_text("tok")
    expect(stats.locator('[data-k="speed"]')).to_contain_text("tok/s")
    expect(stats.locator('[data-k="TTFT"]')).to_contain_text("ms")
    expect(page.locator("#conversations .conv-item")).to_have_count(1)


def test_stop_cancels_a_long_generation(page: Page, router: Router) -> None:
    # 100000 tokens fit the tiny model's slot (conftest.STOP_TEST_CTX): the answer cannot end by
    # itself (length) before Escape lands, however fast or loaded the machine
    configure(page, max_tokens="100000", extra='{"ignore_eos": true}')
    send(page, "write forever")
    expect(page.locator("#stop")).to_be_visible()
    expect(last_assistant(page).locator(".markdown")).not_to_be_empty()
    assert router.models()["tiny"]["in_flight"] == 1  # tokens are streaming and it is still running
    page.keyboard.press("Escape")  # Esc stops, as the Stop button does
    wait_idle(page)
    expect(last_assistant(page).locator(".stats")).to_contain_text("stopped")  # the UI aborted it
    wait_until(lambda: router.models()["tiny"]["in_flight"] == 0, 10, what="the request to be cancelled")


def test_reload_finds_the_conversation(page: Page) -> None:
    n_messages = page.locator(".msg").count()
    page.reload()
    expect(page.locator("#conversations .conv-item")).to_have_count(1)
    expect(page.locator(".conv-item.active .conv-open")).to_have_text("hello there")
    expect(page.locator(".msg")).to_have_count(n_messages)
    expect(page.locator("#model-name")).to_have_text("tiny")  # the last used model is remembered


def test_regenerate_and_edit_make_branches_to_switch_between(page: Page) -> None:
    configure(page, max_tokens="4", extra='{"ignore_eos": true}')
    first = last_assistant(page).locator(".markdown").inner_text()
    last_assistant(page).hover()
    last_assistant(page).locator(".regen").click()
    wait_idle(page)
    nav = last_assistant(page).locator(".branch-nav")
    expect(nav.locator(".branch-pos")).to_have_text("2/2")
    nav.locator(".prev").click()
    expect(last_assistant(page).locator(".branch-pos")).to_have_text("1/2")
    expect(last_assistant(page).locator(".markdown")).to_have_text(first)

    user = page.locator(".msg.user").last
    user.hover()
    user.locator(".edit").click()
    page.fill(".edit-box", "an edited question")
    page.press(".edit-box", "Enter")
    wait_idle(page)
    user = page.locator(".msg.user").last
    expect(user.locator(".plain")).to_have_text("an edited question")
    expect(user.locator(".branch-pos")).to_have_text("2/2")
    user.locator(".prev").click()
    expect(page.locator(".msg.user").last.locator(".plain")).to_have_text("write forever")


def test_model_output_with_html_executes_nothing_and_markdown_renders(page: Page) -> None:
    grammar = f'root ::= "{MARKDOWN}" {json.dumps(XSS)}'
    configure(page, max_tokens="200", extra=json.dumps({"grammar": grammar}))
    page.click("#new-chat")
    send(page, "say something nasty")
    wait_idle(page)
    reply = last_assistant(page)
    expect(reply.locator(".markdown")).to_contain_text("<script>window.__xss=2")  # shown as text
    assert page.evaluate("window.__xss") is None
    assert reply.locator(".markdown img, .markdown script").count() == 0
    expect(reply.locator(".markdown table td").first).to_have_text("1")
    expect(reply.locator("pre code.hljs")).to_contain_text("x = 1")
    expect(reply.locator(".copy-code")).to_be_visible()
    assert page.dialogs == []  # type: ignore[attr-defined]
    configure(page, extra="")


def test_a_failed_model_shows_its_exit_code_and_log(page: Page, router: Router) -> None:
    page.click("#model-button")
    page.locator('.model-item[data-model="broken"]').click()
    expect(page.locator("#model-button")).to_have_attribute("data-state", "failed", timeout=30_000)
    page.click("#model-button")
    err = page.locator('.model-item[data-model="broken"] .model-error')
    expect(err).to_contain_text("exit code")
    page.click("#nav-models")
    card = page.locator('.failed-card[data-model="broken"]')
    expect(card).to_contain_text("exit code")
    assert card.locator(".log-tail").inner_text().strip()
    expect(page.locator('tr[data-model="tiny"]')).to_contain_text("loaded")
    expect(page.locator('tr[data-model="tiny"]')).to_contain_text("tiny-alias")


def test_works_375px_wide_and_takes_screenshots(page: Page) -> None:
    out = os.environ.get("OMNI_WEBUI_SCREENSHOTS")
    page.click("#nav-chat")
    page.click("#model-button")
    page.locator('.model-item[data-model="tiny"]').click()
    if out:
        page.locator("#conversations .conv-open", has_text="nasty").click()
        page.set_viewport_size({"width": 1200, "height": 760})
        for theme in ("light", "dark"):
            configure(page, theme=theme)
            page.screenshot(path=str(Path(out) / f"webui-{theme}.png"))
        page.click("#model-button")
        page.screenshot(path=str(Path(out) / "webui-models-dark.png"))
        page.click("#model-button")
        configure(page, theme="system")
    page.locator("#conversations .conv-open", has_text="hello").click()
    page.set_viewport_size({"width": 375, "height": 740})
    expect(page.locator("#input")).to_be_visible()
    expect(page.locator("#send")).to_be_in_viewport()
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    assert page.errors == []  # type: ignore[attr-defined]
