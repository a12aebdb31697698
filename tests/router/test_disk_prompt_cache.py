"""Issue 28: the disk prompt cache survives eviction, a router restart, sleep and a preset reload,
and reuses nothing of a changed model file. A router with real workers on each tiny model.

One scenario per backend (a router and its workers are shared by every step): a reference model
(`ref`, the same file with the disk tier off) answers each question after the shared ~2,300-token
prefix without any eviction; then model `a` (the disk tier on) sees the prefix once, and each
step (evict by `--models-max 1`, restart the router, sleep, reload a changed unrelated key)
asks another question with it. Its greedy answer must equal the reference's, with the prefix
restored from disk (`cached_tokens`, the worker's disk-hit counter).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.presets import ModelPreset
from router.prompt_cache_dir import with_default_cache_dirs
from tests.router.conftest import RouterProc
from tests.util import HTTP, ROOT, run_worker, wait_until

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f16.gguf"
GGUF_OTHER = ROOT / "models" / "tiny-llama-f32.gguf"
HF = ROOT / "models" / "tiny-llama"

pytestmark = pytest.mark.skipif(not (GGUF.exists() and (HF / "config.json").exists()),
                                reason="tiny models not generated (make models)")

PREFIX = "Shared system prompt. " + " ".join(f"word{i}" for i in range(600)) + "\n"
QUESTIONS = {step: f"{step} asks: what comes next?" for step in ("evict", "restart", "sleep", "reload")}


def _preset(model: Path, backend: str, extra_a: str = "") -> str:
    return f"""
[defaults]
ctx-size = 6144
parallel = 2
threads = 1
stop-timeout = 10
backend = "{backend}"

[models.ref]
model = "{model}"
cache-disk = "0"

[models.a]
model = "{model}"
{extra_a}

[models.b]
model = "{model}"
cache-disk = "0"
"""


def _ask(r: RouterProc, model: str, prompt: str) -> tuple[str, int]:
    with r.client(timeout=120) as c:
        resp = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                "temperature": 0})
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _disk_hits(r: RouterProc) -> float:
    text = httpx.get(f"{r.base}/metrics", params={"model": "a"}, timeout=10).text
    m = re.search(r"^omni:prompt_cache_disk_hits_total (\S+)$", text, re.M)
    assert m is not None, text[-2000:]
    return float(m.group(1))


def _restored(r: RouterProc, question: str, expected: str) -> None:
    """Model `a` answers PREFIX + question as the reference did, with the prefix read from disk."""
    answer, cached = _ask(r, "a", PREFIX + question)
    assert cached >= 2000
    assert _disk_hits(r) == 1  # a fresh worker each time: its one hit is this prompt
    assert answer == expected


# The torch worker starts in ~5 s here (torch import): its nine starts in this scenario take a
# minute, so on torch it runs in `make soak`; test_torch_worker_restores_after_restart_and_sleep
# below covers torch in `make test`.
@pytest.mark.parametrize("backend", ["llama_cpp", pytest.param("torch", marks=pytest.mark.soak)])
def test_prompt_cache_survives_eviction_restart_sleep_and_reload(
    router_factory: Factory, tmp_path: Path, backend: str
) -> None:
    # A copy of the model: its file changes at the end.
    if backend == "llama_cpp":
        model = tmp_path / "a.gguf"
        shutil.copy(GGUF, model)
    else:
        model = tmp_path / "a-hf"
        shutil.copytree(HF, model)
    data = tmp_path / "data"
    args = ("--models-max", "1", "--data-dir", str(data))
    preset = _preset(model, backend)
    r = router_factory(preset, *args)

    # The reference: the prefix once, then each question, all in one worker.
    _, cached = _ask(r, "ref", PREFIX + "first question?")
    assert cached == 0
    expected = {step: _ask(r, "ref", PREFIX + q)[0] for step, q in QUESTIONS.items()}

    # Eviction: `a` computes the prefix, `b` evicts it, `a` comes back.
    _ask(r, "a", PREFIX + "first question?")
    _ask(r, "b", "hello")
    _restored(r, QUESTIONS["evict"], expected["evict"])
    card = r.models()["a"]["prompt_cache_disk"]
    assert card["dir"] == str(data / "prompt-cache" / "a") and card["bytes"] > 0

    # A router restart (its shutdown stops `a`), with a damaged file beside the good ones.
    r.proc.terminate()
    r.proc.wait(30)
    folder = data / "prompt-cache" / "a"
    good = max(folder.glob("*.kv"), key=lambda f: f.stat().st_size)
    bad = folder / f"{good.name[:16]}-{'0' * 24}.kv"
    bad.write_bytes(good.read_bytes()[:100])  # cut in its header
    r = router_factory(preset, *args)
    _restored(r, QUESTIONS["restart"], expected["restart"])
    # the router reads the worker's output as it comes: the line may trail the answer on a busy box
    def log() -> str:
        return HTTP.get(f"{r.base}/logs", params={"model": "a"}, timeout=10).text

    wait_until(lambda: f"skipping {bad.name}" in log(), 30, interval=0.2, what="the line on the damaged file")
    assert not bad.exists()

    # Sleep and wake.
    assert httpx.post(f"{r.base}/models/sleep", json={"model": "a"}, timeout=30).status_code == 200
    r.wait_status("a", "sleeping")
    answer, cached = _ask(r, "a", PREFIX + QUESTIONS["sleep"])
    assert cached >= 2000 and answer == expected["sleep"]

    # A preset reload that changes an unrelated key restarts the worker.
    preset_path = sorted(tmp_path.glob("preset*.toml"))[-1]
    preset_path.write_text(_preset(model, backend, extra_a="temp = 0.5"))
    with r.client() as c:
        assert c.post("/models/reload").status_code == 200
    _restored(r, QUESTIONS["reload"], expected["reload"])

    # The same path with new weights reuses nothing.
    with r.client() as c:
        assert c.post("/models/unload", json={"model": "a"}).status_code == 200
    r.wait_status("a", "unloaded")
    if backend == "llama_cpp":
        shutil.copy(GGUF_OTHER, model)
    else:
        weights = model / "model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[-4:] = bytes(4)  # the last weight, zeroed: same size, new mtime
        weights.write_bytes(raw)
    _, cached = _ask(r, "a", PREFIX + QUESTIONS["evict"])
    assert cached == 0 and _disk_hits(r) == 0


def _worker_ask(base: str, prompt: str, **extra: Any) -> tuple[str, int]:
    body = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                      **extra}, timeout=120).json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _worker_disk_hits(base: str) -> float:
    m = re.search(r"^omni:prompt_cache_disk_hits_total (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    assert m is not None
    return float(m.group(1))


def test_torch_worker_restores_after_restart_and_sleep(tmp_path: Path) -> None:
    """The torch backend's rows are exact (batch-invariant), so a restored prefix must give the
    answer of the same prompt computed from scratch (`cache_prompt: false`) in the same worker."""
    flags = ("--cache-dir", str(tmp_path / "cache"), "-c", "6144", "-np", "2", "--threads", "1",
             "--backend", "torch")
    with run_worker(HF, *flags) as base:
        _, cached = _worker_ask(base, PREFIX + "first question?")
        assert cached == 0
    with run_worker(HF, *flags) as base:  # SIGTERM wrote it; a new process reads it
        after_restart, cached = _worker_ask(base, PREFIX + QUESTIONS["restart"])
        assert cached >= 2000 and _worker_disk_hits(base) == 1
        assert httpx.post(f"{base}/sleep", timeout=30).status_code == 200
        after_sleep, cached = _worker_ask(base, PREFIX + QUESTIONS["sleep"])
        assert cached >= 2000 and _worker_disk_hits(base) == 2
        for question, answer in ((QUESTIONS["restart"], after_restart), (QUESTIONS["sleep"], after_sleep)):
            assert _worker_ask(base, PREFIX + question, cache_prompt=False) == (answer, 0)


M = Path("m.gguf")


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        (ModelPreset("org/m:q4", model=M), "DATA/prompt-cache/org_m_q4"),  # one folder, whatever the name
        (ModelPreset("m", model=M, cache_dir="/fast/disk"), "/fast/disk"),  # the preset's own wins
        (ModelPreset("m", model=M, backend="cmd", cmd="llama-server"), None),  # not our worker
        (ModelPreset("m", backend="remote", upstream="http://x"), None),
        (ModelPreset("m", model=M, embedding=True), None),  # stateless tasks: nothing to cache
    ],
)
def test_default_cache_dir(preset: ModelPreset, expected: str | None) -> None:
    (got,) = with_default_cache_dirs([preset], Path("DATA"))
    assert got.cache_dir == expected
