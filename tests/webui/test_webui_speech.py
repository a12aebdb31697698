"""Speech in the web UI (issue 41), in Chromium: a chat model paired with the tiny voice speaks its
answer ("Speak answers" on: the chat asks for audio, the answer's WAV plays under it), and the
"Speak" button reads any answer aloud through /v1/audio/speech."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.util import ROOT, preset_defaults
from tests.webui.conftest import API_KEY, CHROMIUM, Router, _why_no_browser, start_router

pytest.importorskip("playwright")
from playwright.sync_api import Browser, Page, expect, sync_playwright

pytestmark = pytest.mark.slow
VOICE = ROOT / "models" / "tiny-voice.onnx"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """Overrides the package's router: a chat model paired with the tiny voice."""
    reason = _why_no_browser() or (None if VOICE.exists() else "no tiny voice (make models)")
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("webui-speech")
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(1024)}
[models.chat]
model = "{ROOT / 'models' / 'tiny-llama-f32.gguf'}"
speech-model = "voice"

[models.voice]
model = "{VOICE}"
""")
    with start_router(tmp, preset) as r:
        yield r


@pytest.fixture(scope="module")
def browser(router: Router) -> Iterator[Browser]:
    """Overrides the package's browser: audio may play without a click (headless, no speakers)."""
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                                     "--autoplay-policy=no-user-gesture-required"])
        try:
            yield b
        finally:
            b.close()


# Loads the player's audio and plays it: its duration, and whether playing moved it forward.
PLAYS = """async (a) => {
  if (a.readyState < 1) {
    await new Promise((ok, bad) => { a.onloadedmetadata = ok; a.onerror = () => bad(a.error); });
  }
  a.currentTime = 0;
  await a.play();
  const t0 = a.currentTime;
  await new Promise((ok) => setTimeout(ok, 300));
  a.pause();
  return [a.duration, a.currentTime > t0];
}"""


def test_a_spoken_answer_plays_and_any_answer_can_be_spoken(page: Page, router: Router) -> None:
    page.goto(router.base)
    page.fill("#apikey-form [name=key]", API_KEY)
    page.press("#apikey-form [name=key]", "Enter")
    page.click("#model-button")
    page.locator('.model-item[data-model="chat"]').click()
    toggle = page.locator("#speak-answers")
    expect(toggle).to_be_visible()
    toggle.click()
    expect(toggle).to_have_attribute("aria-pressed", "true")

    page.fill("#input", "Say something.")
    page.press("#input", "Enter")
    answer = page.locator(".msg.assistant").last
    expect(answer).not_to_have_class("msg assistant streaming", timeout=60_000)
    player = answer.locator(".speech-audio")
    expect(player).to_have_count(1, timeout=60_000)
    duration, moved = player.evaluate(PLAYS)
    assert duration > 0 and moved

    answer.locator("button.speak").click()  # the same answer, read aloud through /v1/audio/speech
    spoken = answer.locator(".speech-audio.spoken")
    expect(spoken).to_have_count(1, timeout=30_000)
    duration, moved = spoken.evaluate(PLAYS)
    assert duration > 0 and moved
    assert not page.errors  # type: ignore[attr-defined]
