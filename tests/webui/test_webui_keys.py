"""Keys in the web UI (issue 52), in a real headless Chromium against a real router started with
`--keys`: the page asks for a key, keeps it in localStorage, lists only the key's models, and a
user key chats (the model loads with the message: the key may not load it by hand)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router.keys.keyfile import hash_key
from tests.util import preset_defaults
from tests.webui.conftest import GGUF, Router, _why_no_browser, start_router

pytest.importorskip("playwright")
from playwright.sync_api import Page, expect

USER_KEY = "sk-webui-user"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    reason = _why_no_browser()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("webui-keys")
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"

[models.hidden]
model = "{GGUF}"
""")
    keys = tmp / "keys.toml"
    keys.write_text(f'[keys.ann]\nsha256 = "{hash_key(USER_KEY)}"\nrole = "user"\nmodels = ["tiny"]\n')
    with start_router(tmp, preset, api_key=None, args=("--keys", str(keys))) as r:
        yield r


def test_a_user_key_entered_in_the_web_ui_sees_its_models_and_chats(page: Page, router: Router) -> None:
    page.goto(router.base)
    expect(page.locator("#apikey-dialog")).to_be_visible()
    page.fill("#apikey-form [name=key]", USER_KEY)
    page.press("#apikey-form [name=key]", "Enter")
    expect(page.locator("#apikey-dialog")).to_be_hidden()
    assert page.evaluate("localStorage.getItem('omni.apiKey')") == USER_KEY
    expect(page.locator("#model-name")).to_have_text("tiny")  # its only model, picked for it
    page.click("#model-button")
    expect(page.locator(".model-item")).to_have_count(1)
    expect(page.locator('.model-item[data-model="hidden"]')).to_have_count(0)
    page.click("#model-button")
    page.fill("#input", "hello")
    page.press("#input", "Enter")
    expect(page.locator("#send")).to_be_visible(timeout=60_000)  # idle again: the reply is in
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".markdown")).not_to_be_empty()
    expect(reply.locator(".stats")).to_contain_text("tok")
    page.reload()  # the key is remembered: no dialog the second time
    expect(page.locator("#model-name")).to_have_text("tiny")
    expect(page.locator("#apikey-dialog")).to_be_hidden()
    assert not page.errors  # type: ignore[attr-defined]
