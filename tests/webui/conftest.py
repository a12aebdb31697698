"""Fixtures for the web UI tests: one real router (with --api-key) on the tiny GGUF model and a
broken model, and one headless Debian Chromium driven by Playwright, both shared by the module.

Playwright cannot download its own browsers here; it drives /usr/bin/chromium (`make test`
installs Debian's `chromium` where apt and root are available). Without it the tests skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.util import ROOT, free_port, preset_defaults, stop_process, wait_healthy

CHROMIUM = os.environ.get("OMNI_CHROMIUM", "/usr/bin/chromium")
if not os.access(CHROMIUM, os.X_OK):
    CHROMIUM = shutil.which("chromium") or CHROMIUM
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
API_KEY = "webui-test-key"
# The tiny model's context in test_webui's router: 131072 cells a slot (2 slots; 64 MiB of KV
# cache for this 2-layer model, flash attention needs no n_ctx-sized score buffer), so the stop
# test's 100000-token answer cannot end by itself (~880 tok/s here: ~2 minutes) before Escape,
# on a fast machine or a loaded one. At 1024 (512 a slot) it ran out after ~475 tokens, in
# under half a second, racing the browser's reaction.
STOP_TEST_CTX = 2 * 131072

try:
    from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None


def _why_no_browser() -> str | None:
    if sync_playwright is None:
        return "playwright is not installed (pip install -e '.[test]')"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; needs root and the Debian registry)"
    if not GGUF.exists():
        return "tiny models not generated (make models)"
    return None


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    base: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def models(self) -> dict[str, dict[str, Any]]:
        import httpx

        resp = httpx.get(f"{self.base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        return {m["id"]: m for m in resp.json()["data"]}


@contextlib.contextmanager
def start_router(tmp: Path, preset: Path, api_key: str | None = API_KEY,
                 env: dict[str, str] | None = None, args: Sequence[str] = ()) -> Iterator[Router]:
    """A real router on `preset` with `args` (the API key set, unless None; `env` over ours),
    healthy; stopped on leaving."""
    port = free_port()
    log_path = tmp / "router.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "router.cli", "--preset", str(preset), "--port", str(port),
           *(["--api-key", api_key] if api_key else []), *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    r = Router(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(proc, r.base, 30, lambda: r.log()[-3000:])
        yield r
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    reason = _why_no_browser()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("webui")
    broken = tmp / "broken.gguf"
    broken.write_bytes(b"this is not a GGUF file\n" * 4)
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"
alias = ["tiny-alias"]
ctx-size = {STOP_TEST_CTX}

[models.broken]
model = "{broken}"
backend = "llama_cpp"
""")
    with start_router(tmp, preset) as r:
        yield r


@pytest.fixture(scope="module")
def browser(router: Router) -> Iterator[Browser]:
    assert sync_playwright is not None
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def context(browser: Browser) -> Iterator[BrowserContext]:
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    ctx.set_default_timeout(20_000)
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture(scope="module")
def page(context: BrowserContext, router: Router) -> Iterator[Page]:
    """One page for the module's story; every dialog it raises is recorded (none should be)."""
    p = context.new_page()
    dialogs: list[str] = []
    p.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.dialogs = dialogs  # type: ignore[attr-defined]
    p.errors = errors  # type: ignore[attr-defined]
    yield p
    p.close()
