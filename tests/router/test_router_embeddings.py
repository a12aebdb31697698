"""End to end: the router serving embeddings and rerank from real `omni-worker --embedding` /
`--reranking` processes it spawns from preset keys, through the OpenAI SDK, both backends."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openai
import pytest

from router.presets import PresetError, load_presets
from tests.router.conftest import RouterProc
from tests.util import ROOT, preset_defaults

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
HF = ROOT / "models" / "tiny-llama"

pytestmark = pytest.mark.skipif(not (GGUF.exists() and (HF / "config.json").exists()),
                                reason="tiny models not generated (make models)")

PRESET = f"""
{preset_defaults(1024)}
[models.embed-gguf]
model = "{GGUF}"
backend = "llama_cpp"
embedding = true
pooling = "mean"

[models.embed-hf]
model = "{HF}"
backend = "torch"
embeddings = true
pooling = "mean"

[models.rerank-gguf]
model = "{GGUF}"
backend = "llama_cpp"
reranking = true
"""
TEXTS = ["Hello world, the quick brown fox", "router worker slot batch", "a"]


def test_embeddings_and_rerank_through_the_router(router_factory: Factory) -> None:
    r = router_factory(PRESET)
    client = openai.OpenAI(base_url=f"{r.base}/v1", api_key="unused", timeout=120)
    vectors = {}
    for model in ("embed-gguf", "embed-hf"):
        floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        decoded = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire, decoded by the SDK
        assert floats.model == model and [d.index for d in floats.data] == [0, 1, 2]
        vectors[model] = np.array([d.embedding for d in floats.data])
        assert np.array_equal(
            np.array([d.embedding for d in decoded.data], np.float32), vectors[model].astype(np.float32)
        )
        assert floats.usage.prompt_tokens > 0
        assert "--embedding" in r.models()[model]["status"]["args"]
    assert (
        np.abs(vectors["embed-gguf"] - vectors["embed-hf"]).max() < 1e-4
    )  # the twins agree through the router

    with r.client(timeout=120) as c:
        native = c.post("/embedding", json={"model": "embed-gguf", "content": TEXTS[0]}).json()
        assert np.allclose(native[0]["embedding"][0], vectors["embed-gguf"][0], atol=1e-7)
        docs = ["the model token router", "quick brown fox jumps", "SELECT id FROM users;"]
        body = c.post("/v1/rerank", json={"model": "rerank-gguf", "query": "brown fox", "documents": docs,
                                          "top_n": 2}).json()
        assert body["model"] == "rerank-gguf" and len(body["results"]) == 2
        scores = [x["relevance_score"] for x in body["results"]]
        assert scores == sorted(scores, reverse=True)
        assert (
            c.post("/rerank", json={"model": "rerank-gguf", "query": "q", "documents": docs}).status_code
            == 200
        )
        # a model that does not rerank says so, in llama-server's words, through the router
        refused = c.post("/v1/rerank", json={"model": "embed-gguf", "query": "q", "documents": docs})
        assert (
            refused.status_code == 501
            and "Set `reranking = true` in the preset" in refused.json()["error"]["message"]
        )
        chat = c.post(
            "/v1/chat/completions",
            json={"model": "embed-hf", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 501


def test_preset_pooling_is_checked(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "p.toml"
    path.write_text(f'[models.x]\nmodel = "{GGUF}"\nembedding = true\npooling = "max"\n')
    with pytest.raises(PresetError, match="expected one of none, mean, cls, last, rank"):
        load_presets(path)
