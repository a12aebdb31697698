"""llama.cpp's own web UI chats through the router (issue 38; make soak).

scripts/build_llama_ui.sh builds the UI of the pinned llama.cpp sources (tools/ui). llama-server
serves it at its own origin, so here a small front serves its files and passes every other
path to a real router on the tiny model, untouched: what the UI sends is what the router gets.
Headless Chromium types a message and sends it; the router must answer the UI's real chat
request (every sampler knob, `samplers`, `backend_sampling`, `max_tokens: -1`, ...) with a
200 stream, and the UI must show the answer.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from tests.util import ROOT, free_port, preset_defaults, wait_until
from tests.webui.conftest import CHROMIUM, GGUF, _why_no_browser, start_router, sync_playwright

pytestmark = pytest.mark.soak

_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class Front:
    """The UI's files at `/`, everything else proxied to `upstream` as it is, streamed back."""

    def __init__(self, dist: Path, upstream: str) -> None:
        self.dist = dist
        self.files = StaticFiles(directory=str(dist), html=True)
        self.upstream = upstream
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/" or (self.dist / path.lstrip("/")).is_file():
            await self.files(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=120)
        url = self.upstream + path + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.decode().lower() != "host"]
        try:
            async with self.client.stream(scope["method"], url, content=body, headers=headers) as r:
                await send({"type": "http.response.start", "status": r.status_code,
                            "headers": [(k.encode(), v.encode()) for k, v in r.headers.items()
                                        if k.lower() not in _HOP]})
                async for chunk in r.aiter_bytes():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError:  # the router went away (the end of the test): the stream ends
            pass
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def ui_dist() -> Path:
    why = _why_no_browser()
    if why:
        pytest.skip(why)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_ui.sh")], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800, check=False)
    if r.returncode == 3:
        pytest.skip(f"llama.cpp's web UI cannot be built here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def front(ui_dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("llama-ui")
    preset = tmp / "preset.toml"
    preset.write_text(f'{preset_defaults(1024)}\n[models.tiny]\nmodel = "{GGUF}"\nn-predict = 12\n')
    with start_router(tmp, preset, api_key=None) as router:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(Front(ui_dist, router.base), host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="off"))
        thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(base + "/", timeout=2).status_code == 200, timeout=20)
        yield base
        server.should_exit = True
        thread.join(10)


# The UI's sampler settings as a user who opened its settings would leave them (its storage key
# and setting names: tools/ui/src/lib/constants), so that its requests carry every sampler knob.
SETTINGS = {"samplers": "top_k;typ_p;top_p;min_p;temperature", "temperature": 0.7, "top_k": 40, "top_p": 0.95,
            "min_p": 0.05, "typ_p": 1, "repeat_penalty": 1, "repeat_last_n": 64, "dry_multiplier": 0,
            "xtc_probability": 0, "dynatemp_range": 0, "presence_penalty": 0, "frequency_penalty": 0,
            "max_tokens": 12}


def _chat(front: str, settings: dict[str, Any] | None) -> tuple[list[int], list[str], dict[str, Any], str]:
    """Open the UI (with `settings` stored first), send a message; (statuses, error bodies, the
    request body the UI sent, the page's text)."""
    assert sync_playwright is not None
    sent: list[dict[str, Any]] = []
    statuses: list[int] = []
    errors: list[str] = []

    def on_response(r: Any) -> None:
        if r.url.endswith("/v1/chat/completions"):
            statuses.append(r.status)
            if r.status != 200:
                errors.append(r.text())

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            context = browser.new_context()
            if settings is not None:
                stored = json.dumps(json.dumps(settings))
                context.add_init_script(f"localStorage.setItem('LlamaUi.config', {stored})")
            page = context.new_page()
            page.on("request", lambda r: sent.append(json.loads(r.post_data or "{}"))
                    if r.url.endswith("/v1/chat/completions") else None)
            page.on("response", on_response)
            page.goto(front)
            box = page.get_by_placeholder("Type a message")
            box.wait_for(timeout=30_000)
            box.click()
            page.keyboard.type("Name three colors.")
            page.keyboard.press("Enter")
            deadline = time.monotonic() + 60
            while not statuses and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            page.wait_for_timeout(3000)  # the stream's end
            shot = ROOT / "bench" / "results" / f"llama-cpp-ui{'-settings' if settings else ''}.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot))
            text = page.locator("body").inner_text()
        finally:
            browser.close()
    assert sent, "the UI sent no chat request"
    return statuses, errors, sent[0], text


@pytest.mark.parametrize("settings", [None, SETTINGS], ids=["defaults", "sampler-settings"])
def test_the_ui_chats_through_the_router(front: str, settings: dict[str, Any] | None) -> None:
    statuses, errors, body, text = _chat(front, settings)
    assert statuses and statuses[0] == 200, (statuses, errors, body)
    assert body["model"] == "tiny" and body["backend_sampling"] is False, body
    if settings is not None:  # the sampler settings went out as the UI sends them, and were served
        assert body["samplers"] == ["top_k", "typ_p", "top_p", "min_p", "temperature"], body
        assert body["max_tokens"] == 12 and body["typ_p"] == 1, body
    assert "Name three colors." in text
