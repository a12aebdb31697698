"""Pulling while serving (POST /models/pull, Ollama's POST /api/pull) and the models of other
tools found on disk (a stand-in Ollama store, LM Studio folder and the hub cache the pull
fills), through a real router: served under their tools' names, a preset winning a clash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hub.conftest import GGUF_REPO, VLM_REPO, hub_env
from tests.router.conftest import RouterProc
from tests.util import preset_defaults
from worker.testing.stand_in_hub import StandInHub
from worker.testing.tiny_models import ModelPaths


def ollama_store(root: Path, model: Path, tags: list[str]) -> None:
    """Ollama's layout: blobs/sha256-HEX, manifests/registry.ollama.ai/library/NAME/TAG."""
    (root / "blobs").mkdir(parents=True)

    def blob(data: bytes, media: str) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    layers = [blob(model.read_bytes(), "application/vnd.ollama.image.model"),
              blob(b"{{ .Prompt }}", "application/vnd.ollama.image.template"),
              blob(json.dumps({"temperature": 0.3, "top_k": 20, "num_ctx": 1024,
                               "stop": ["<|im_end|>"]}).encode(), "application/vnd.ollama.image.params")]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": blob(b"{}", "application/vnd.docker.container.image.v1+json"), "layers": layers}
    for tag in tags:
        path = root / "manifests" / "registry.ollama.ai" / "library" / tag.replace(":", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))


def ndjson(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_pull_while_serving_and_discovered_stores(router_factory: Callable[..., RouterProc],
                                                  model_hub: StandInHub, tiny_models: ModelPaths,
                                                  tmp_path: Path) -> None:
    ollama_store(tmp_path / "ollama", tiny_models.gguf_f16, ["tiny:1b", "tiny:latest"])
    lms = tmp_path / "lmstudio" / "omni-lab" / "tiny-GGUF"
    lms.mkdir(parents=True)
    (lms / "tiny-llama-F16.gguf").symlink_to(tiny_models.gguf_f16)
    env = {**hub_env(model_hub, tmp_path / "hub"), "OLLAMA_MODELS": str(tmp_path / "ollama"),
           "LMSTUDIO_MODELS_DIR": str(tmp_path / "lmstudio")}
    preset = f'{preset_defaults(512)}\n[models."tiny:1b"]\nmodel = "{tiny_models.gguf_f32}"\n'
    r = router_factory(preset, env=env)
    cards = r.models()
    assert {"tiny:1b", "tiny:latest", "omni-lab/tiny-GGUF:F16"} <= set(cards)
    assert cards["tiny:1b"]["path"] == str(tiny_models.gguf_f32.resolve())  # the preset won the clash ...
    assert "the preset [tiny:1b]" in r.log()  # ... and said so
    assert cards["tiny:latest"]["path"].startswith(str(tmp_path / "ollama" / "blobs" / "sha256-"))

    with r.client(timeout=120) as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ollama_model = c.post("/v1/chat/completions", json={**chat, "model": "tiny:latest"})
        assert ollama_model.status_code == 200, ollama_model.text
        args = r.models()["tiny:latest"]["status"]["args"]
        assert args[args.index("--temp") + 1] == "0.3" and args[args.index("--ctx-size") + 1] == "1024"
        lm_studio = c.post("/v1/chat/completions", json={**chat, "model": "omni-lab/tiny-GGUF:F16"})
        assert lm_studio.status_code == 200 and lm_studio.json()["usage"]["completion_tokens"], lm_studio.text
        card = r.models()["omni-lab/tiny-GGUF:F16"]  # the LM Studio folder's file, loaded by its worker
        assert card["status"]["value"] == "loaded", card
        assert card["path"] == str(tiny_models.gguf_f16.resolve()), card

        # ours: NDJSON progress, then what it pulled and the name it is served under now
        pulled = c.post("/models/pull", json={"model": f"{GGUF_REPO}:Q8_0"})
        assert pulled.status_code == 200 and pulled.headers["content-type"] == "application/x-ndjson"
        lines = ndjson(pulled)
        assert lines[0]["status"] == "downloading" and lines[-1]["status"] == "success", lines
        assert lines[-1]["served_as"] == f"{GGUF_REPO}:Q8_0"
        assert lines[-1]["bytes"] == lines[-2]["bytes_total"]
        served = c.post("/v1/chat/completions", json={**chat, "model": f"{GGUF_REPO}:Q8_0"})
        assert served.status_code == 200, served.text  # the hub cache, discovered after the pull

        unknown = c.post("/models/pull", json={"model": f"{GGUF_REPO}:Q2_K", "stream": False})
        assert unknown.status_code == 404 and unknown.json()["error"]["tags"] == ["F16", "Q4_K_M", "Q8_0"]
        assert c.post("/models/pull", json={"model": "x", "what": 1}).status_code == 400

        # Ollama's
        ollama = c.post("/api/pull", json={"model": f"hf.co/{VLM_REPO}"})
        lines = ndjson(ollama)
        statuses = [line["status"] for line in lines]
        assert statuses[0] == "pulling manifest" and statuses[-3:] == [
            "verifying sha256 digest", "writing manifest", "success"], statuses
        layers = [line for line in lines if "digest" in line]
        files = model_hub.repos[VLM_REPO].files
        assert {line["digest"] for line in layers} == {f"sha256:{f.sha256}" for f in files.values()}
        assert all(line["status"] == f"pulling {line['digest'][7:19]}" for line in layers)
        assert {line["total"] for line in layers if line["completed"] == line["total"]} == {
            len(f.data) for f in files.values()}
        assert f"{VLM_REPO}:F32" in r.models()
        missing = c.post("/api/pull", json={"model": f"hf.co/{GGUF_REPO}:Q2_K"})
        assert missing.status_code == 404 and "tags: F16, Q4_K_M, Q8_0" in missing.json()["error"]
        library = c.post("/api/pull", json={"model": "llama3.2", "stream": False})
        assert library.status_code == 404 and "hf.co/ORG/REPO" in library.json()["error"]
        named = c.post("/api/pull", json={"name": "llama3.2", "stream": False})  # older clients' field
        assert named.status_code == 404 and "llama3.2" in named.json()["error"]
        no_file = c.post("/models/pull", json={"model": GGUF_REPO, "hf_file": "nope.gguf", "stream": False})
        assert no_file.status_code == 404 and "nope.gguf" in no_file.text


def test_the_ollama_sdk_pulls(router_factory: Callable[..., RouterProc], model_hub: StandInHub,
                              tiny_models: ModelPaths, tmp_path: Path) -> None:
    ollama = pytest.importorskip("ollama")
    r = router_factory(f'{preset_defaults(512)}\n[models.tiny]\nmodel = "{tiny_models.gguf_f32}"\n',
                       env=hub_env(model_hub, tmp_path / "hub"))
    client = ollama.Client(host=r.base)
    events = list(client.pull(f"hf.co/{GGUF_REPO}:F16", stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    assert any(e.completed == e.total and e.total for e in events if e.digest)
    assert client.pull(f"hf.co/{GGUF_REPO}:F16").status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull(f"hf.co/{GGUF_REPO}:Q2_K")
    assert e.value.status_code == 404
