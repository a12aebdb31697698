"""Images through the router on the tiny SmolVLM (worker/testing/tiny_vlm.py): the preset's
`mmproj`, /v1/models' modalities before any load, and every API: chat image_url parts,
sglang-omni's `images`, Responses' input_image, Anthropic Messages' image blocks; a text-only
model still answers 400 not_supported naming itself."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from tests.router.conftest import RouterProc
from tests.util import preset_defaults
from worker.testing.tiny_models import ModelPaths
from worker.testing.tiny_vlm import VlmPaths, data_url, png

IMAGE = png(80, 50, 5)


def _preset(vlm: VlmPaths, plain: ModelPaths) -> str:
    return (f'{preset_defaults(2048)}\n[models.vlm]\nmodel = "{vlm.gguf}"\nmmproj = "{vlm.mmproj}"\n'
            f'\n[models.plain]\nmodel = "{plain.gguf_f32}"\n')


def test_every_api_takes_an_image(router_factory: Callable[..., RouterProc], tiny_vlm: VlmPaths,
                                  tiny_models: ModelPaths) -> None:
    r = router_factory(_preset(tiny_vlm, tiny_models))
    cards = r.models()
    assert cards["vlm"]["status"]["value"] == "unloaded"  # known from the mmproj's header, not a load
    assert cards["vlm"]["modalities"] == {"vision": True, "audio": False}
    assert cards["plain"]["modalities"] == {"vision": False, "audio": False}
    question = "What is in this image?"
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                                   {"type": "text", "text": question}]
    body = {"model": "vlm", "max_tokens": 8, "temperature": 0}
    with r.client(timeout=60) as c:
        chat = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": parts}]})
        assert chat.status_code == 200, chat.text
        answer = chat.json()["choices"][0]["message"]["content"]
        assert c.get("/props", params={"model": "vlm"}).json()["modalities"]["vision"] is True

        sglang = c.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": question}], "images": [data_url(IMAGE)]})
        assert sglang.status_code == 200, sglang.text
        assert sglang.json()["choices"][0]["message"]["content"] == answer

        resp = c.post("/v1/responses", json={
            "model": "vlm", "max_output_tokens": 8, "temperature": 0, "store": False,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGE)},
                                                   {"type": "input_text", "text": question}]}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]

        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()}
        msg = c.post("/v1/messages", json={
            "model": "vlm", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source},
                                                      {"type": "text", "text": question}]}]})
        assert msg.status_code == 200, msg.text
        usage = msg.json()["usage"]  # the same prompt as the chat's: cached, as Anthropic counts it
        n_prompt = chat.json()["usage"]["prompt_tokens"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == n_prompt

        plain = c.post("/v1/chat/completions", json={**body, "model": "plain",
                                                     "messages": [{"role": "user", "content": parts}]})
        assert plain.status_code == 400
        assert plain.json()["error"]["type"] == "not_supported_error"
        assert "'plain'" in plain.json()["error"]["message"]
