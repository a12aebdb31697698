"""LoRA adapters through the router (router/presets.py): the preset key `lora` starts the worker
with its adapters; a client reaches one through `model` with the openai SDK, as
"<model>:<adapter>" or as a `lora-alias` name (rewritten to the former before forwarding,
on the Responses API too); an unknown adapter of a known model is a 400 naming `model`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.router.conftest import RouterProc
from tests.util import ROOT, preset_defaults
from worker.testing.tiny_lora import ensure_loras, lora_paths

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module", autouse=True)
def _adapters() -> None:
    ensure_loras(ROOT / "models")


def test_adapters_by_model_name_and_preset_alias(router_factory: Factory) -> None:
    a, b = lora_paths(ROOT / "models", "a").gguf, lora_paths(ROOT / "models", "b").gguf
    r = router_factory(f"""
{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"
lora = ["{a}", "{b}"]
lora-init-without-apply = true
lora-alias = {{ poet = "tiny-llama-lora-a" }}
""")
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="none", timeout=120)

    def complete(model: str) -> str:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        return out.choices[0].text

    base, adapted = complete("tiny"), complete("tiny:tiny-llama-lora-a")
    other = complete("tiny:tiny-llama-lora-b")
    assert len({base, adapted, other}) == 3
    assert complete("poet") == adapted
    card = r.models()["tiny"]["lora"]
    assert [Path(f).name for f in card["files"]] == [a.name, b.name]
    assert card["aliases"] == {"poet": "tiny:tiny-llama-lora-a"}
    with r.client(timeout=120) as c:
        scales = c.get("/lora-adapters", params={"model": "tiny"})
        assert scales.status_code == 200 and [x["scale"] for x in scales.json()] == [0.0, 0.0]
        body = {"model": "tiny", "prompt": PROMPT, "n_predict": 12, "temperature": 0,
                "lora": [{"id": 1, "scale": 1.0}]}
        assert c.post("/completion", json=body).json()["content"] == other
        resp = c.post("/v1/responses", json={"model": "poet", "input": PROMPT, "max_output_tokens": 8,
                                             "temperature": 0})
        assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError):  # no such adapter: no such model (issue 47)
        complete("tiny:nope")
