"""Models from a stand-in hub through a real router and real workers: a preset of `hf-repo`
models only; the first chat waits for the download, /v1/models, /models/sse and /metrics show
`downloading` with growing bytes on the way (the stand-in hub holds each transfer at a byte
count the test moves: observed by condition, never by timing); the VLM's projector came along
and takes an image; the safetensors repo runs on torch; the GGUF repo's recommended sampling
reaches the worker."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.hub.conftest import GGUF_REPO, HF_REPO, SPLIT_REPO, VLM_REPO, hub_env
from tests.router.conftest import RouterProc
from tests.util import preset_defaults, wait_until
from worker.testing.stand_in_hub import StandInHub
from worker.testing.tiny_vlm import data_url, png

PRESET = f'''{preset_defaults(512)}
[models.tiny]
hf-repo = "{GGUF_REPO}:q8_0"

[models.vlm]
hf-repo = "{VLM_REPO}"
ctx-size = 2048

[models.tiny-torch]
hf-repo = "{HF_REPO}"
'''


def _downloaded(r: RouterProc, name: str, at_least: int) -> dict[str, Any]:
    status = r.models()[name]["status"]
    ok = status["value"] == "downloading" and status.get("progress", {}).get("bytes_done", 0) >= at_least
    return dict(status) if ok else {}


def _sse_downloading(lines: Iterator[str], at_least: int) -> dict[str, Any]:
    """The first models-SSE status of `tiny` downloading with `at_least` bytes done."""
    for line in lines:
        if line.startswith("data: "):
            data = json.loads(line[6:])
            status = data.get("status", {})
            if (data.get("model") == "tiny" and status.get("value") == "downloading"
                    and status.get("progress", {}).get("bytes_done", 0) >= at_least):
                return dict(status)
    raise AssertionError("the models stream ended")


def test_a_router_of_hub_models_downloads_at_first_load_and_serves(
        router_factory: Callable[..., RouterProc], model_hub: StandInHub, tmp_path: Path) -> None:
    r = router_factory(PRESET, env=hub_env(model_hub, tmp_path / "hub"))
    cards = r.models()
    assert cards["tiny"]["status"]["value"] == "unloaded" and cards["tiny"]["hf_repo"] == f"{GGUF_REPO}:q8_0"
    model_hub.hold_after(64 * 1024)
    answers: list[httpx.Response] = []
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{r.base}/v1/chat/completions", json=body, timeout=120)))
    chat.start()
    first = wait_until(lambda: _downloaded(r, "tiny", 64 * 1024), 30, what="downloading, 64 KiB done")
    total = first["progress"]["bytes_total"]
    assert total == (model_hub.repos[GGUF_REPO].files["tiny-llama-Q8_0.gguf"].data.__len__() + len(
        model_hub.repos[GGUF_REPO].files["generation_config.json"].data))
    metrics = httpx.get(f"{r.base}/metrics", timeout=10).text
    assert f'omni_router:model_download_bytes{{kind="total",model="tiny"}} {float(total)}' in metrics
    with httpx.stream("GET", f"{r.base}/models/sse", timeout=httpx.Timeout(10, read=60)) as sse:
        events = sse.iter_lines()
        seen = _sse_downloading(events, 64 * 1024)  # the snapshot on connecting
        assert seen["progress"]["bytes_done"] < 256 * 1024
        model_hub.hold_after(256 * 1024)
        _sse_downloading(events, 256 * 1024)  # a status_change as the bytes move on
    later = wait_until(lambda: _downloaded(r, "tiny", 256 * 1024), 30, what="downloading, 256 KiB done")
    assert later["progress"]["bytes_done"] > first["progress"]["bytes_done"]
    assert not answers  # the chat still waits for its model
    model_hub.release()
    chat.join(120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    card = r.models()["tiny"]
    assert card["status"]["value"] == "loaded" and card["path"].endswith("/tiny-llama-Q8_0.gguf")
    assert "/models--omni--tiny-llama-GGUF/snapshots/" in card["path"]
    assert card["hf"]["sampling"] == {"temp": "0.2", "top-p": "0.9"}
    assert "--temp" in card["status"]["args"] and "0.2" in card["status"]["args"]  # the repo's sampling

    image = {"type": "image_url", "image_url": {"url": data_url(png(80, 50, 5))}}
    question = [image, {"type": "text", "text": "what?"}]
    vlm = httpx.post(f"{r.base}/v1/chat/completions", timeout=120, json={
        "model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": question}]})
    assert vlm.status_code == 200, vlm.text  # the projector came with the pull: a text model says 400
    assert r.models()["vlm"]["modalities"]["vision"] is True

    torch = httpx.post(f"{r.base}/v1/chat/completions", json={**body, "model": "tiny-torch"}, timeout=120)
    assert torch.status_code == 200, torch.text
    assert r.models()["tiny-torch"]["resolved_backend"] == "torch"


def test_hub_down_fails_the_model_transiently_and_a_later_request_loads_it(
        router_factory: Callable[..., RouterProc], model_hub: StandInHub, tmp_path: Path) -> None:
    """The hub down fails the model transiently; an unknown tag is the preset's fault (a 503 naming
    the tags); a real split GGUF (three parts, as gguf-split writes them) comes whole and serves."""
    r = router_factory(f'{preset_defaults(512)}\n[models.tiny]\nhf-repo = "{GGUF_REPO}:F16"\n'
                       f'\n[models.nope]\nhf-repo = "{GGUF_REPO}:Q2_K"\n'
                       f'\n[models.split]\nhf-repo = "{SPLIT_REPO}"\n',
                       env=hub_env(model_hub, tmp_path / "hub"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    model_hub.fail_with = 503
    down = httpx.post(f"{r.base}/v1/chat/completions", json=body, timeout=60)
    assert down.status_code == 503 and "the hub answered 503" in down.json()["error"]["message"].replace(
        f"{model_hub.url} answered 503", "the hub answered 503"), down.text
    status = r.models()["tiny"]["status"]  # failed, transiently (unloaded again after FAILED_SHOWN_S)
    assert (status["value"] == "failed" and status["permanent"] is False) or "last_failure" in status, status
    model_hub.fail_with = None
    up = httpx.post(f"{r.base}/v1/chat/completions", json=body, timeout=120)
    assert up.status_code == 200, up.text
    # an unknown tag: permanent, the preset's fault (503, not retried), the message lists the tags there are
    for _ in range(2):  # the first ask fails the load; the second is answered from the failure
        nope = httpx.post(f"{r.base}/v1/chat/completions", json={**body, "model": "nope"}, timeout=60)
        err = nope.json()["error"]
        assert nope.status_code == 503 and nope.headers["x-should-retry"] == "false", nope.text
        assert err["type"] == "unavailable_error" and err["code"] == "model_misconfigured", nope.text
        assert "is misconfigured" in err["message"] and "tags: F16, Q4_K_M, Q8_0" in err["message"], nope.text
    assert r.models()["nope"]["status"]["permanent"] is True
    # a real split: llama.cpp loads parts 2 and 3 from the first part's name
    split = httpx.post(f"{r.base}/v1/chat/completions", json={**body, "model": "split"}, timeout=120)
    assert split.status_code == 200 and split.json()["usage"]["completion_tokens"] > 0, split.text
    path = Path(r.models()["split"]["path"])
    assert path.name == "tiny-split-Q8_0-00001-of-00003.gguf", path
    assert sorted(p.name for p in path.parent.glob("tiny-split-*")) == [
        f"tiny-split-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
