"""The request queue's rules (router.lifecycle.request_queue) and strict model names
(router.lifecycle.pool.Pool.get), as tables. Pure: no worker, no HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.lifecycle.pool import Pool, PoolConfig, has_adapter, upstream_model
from router.lifecycle.request_queue import (
    FORWARD_MARGIN,
    forward_limit,
    is_slot_free,
    keeps_queue_after_crash,
)
from router.presets import ModelPreset
from worker.protocol.defaults import DEFAULT_PARALLEL


@pytest.mark.parametrize(("path", "free"), [
    ("/metrics", True), ("/props", True), ("/slots", True), ("/lora-adapters", True), ("/tokenize", True),
    ("/detokenize", True), ("/apply-template", True), ("/v1/chat/completions/input_tokens", True),
    ("/v1/responses/input_tokens", True), ("/chat/completions/input_tokens", True),
    ("/v1/chat/completions", False), ("/v1/completions", False), ("/completion", False),
    ("/v1/embeddings", False), ("/v1/rerank", False), ("/v1/audio/speech", False),
    ("/v1/audio/transcriptions", False), ("/infill", False), ("/slots/0", False),
    ("/v1/load_lora_adapter", False),
])
def test_which_calls_occupy_a_slot(path: str, free: bool) -> None:
    assert is_slot_free(path) is free


@pytest.mark.parametrize(("preset", "margin", "limit"), [
    (ModelPreset("a", backend="llama_cpp", model=Path("a.gguf")), FORWARD_MARGIN,
     DEFAULT_PARALLEL + FORWARD_MARGIN),
    (ModelPreset("a", backend="torch", model=Path("a"), parallel=1), 0, 1),
    (ModelPreset("a", backend="cmd", cmd="x"), FORWARD_MARGIN, None),
    (ModelPreset("a", backend="cmd", cmd="x", concurrency_limit=2), FORWARD_MARGIN, 2),  # stated
    (ModelPreset("a", backend="llama_cpp", model=Path("a.gguf"), parallel=4, concurrency_limit=3), 2, 3),
    (ModelPreset("a", backend="remote", upstream="http://h:1"), FORWARD_MARGIN, None),
])
def test_the_forwarding_bound_is_our_workers_slots_plus_the_margin(preset: ModelPreset, margin: int,
                                                                   limit: int | None) -> None:
    assert forward_limit(preset, margin) == limit


@pytest.mark.parametrize(("was_serving", "killed", "box", "failures", "keeps"), [
    (True, False, False, 5, True),  # crashed while serving: what waits here was never forwarded
    (False, True, False, 0, True),  # a load killed by a signal (the OOM killer): a few times
    (False, True, False, 3, False),  # ... then it is a crash loop
    (False, False, True, 1, True),  # the box (a taken port)
    (False, False, False, 0, False),  # a load that failed by itself fails them
])
def test_which_crashes_keep_the_queue(was_serving: bool, killed: bool, box: bool, failures: int,
                                      keeps: bool) -> None:
    assert keeps_queue_after_crash(was_serving=was_serving, killed_by_signal=killed, is_the_box=box,
                                   failures=failures, killed_loads_kept=3) is keeps


PRESETS = [
    ModelPreset("tiny", backend="llama_cpp", model=Path("/m/tiny.gguf"), aliases=("small",),
                lora=(Path("/m/style.gguf"), Path("/m/adapters/tone")),
                lora_aliases=(("tiny-pirate", "style"),)),
    ModelPreset("llama3", backend="cmd", cmd="llama-server --port ${PORT}"),
    ModelPreset("far", backend="remote", upstream="http://far:8080"),
    ModelPreset("qwen:latest", backend="llama_cpp", model=Path("/m/qwen.gguf")),
    ModelPreset("scaled", backend="llama_cpp", model=Path("/m/s.gguf"),
                worker_args=(("lora-scaled", "/m/x.gguf:0.5"),)),
    ModelPreset("runtime", backend="llama_cpp", model=Path("/m/r.gguf"),
                worker_args=(("lora-runtime", "true"),)),
]


@pytest.mark.parametrize(("name", "model", "upstream"), [
    ("tiny", "tiny", None),
    ("small", "tiny", None),  # an alias
    ("tiny-pirate", "tiny", "tiny:style"),  # a LoRA alias
    ("tiny:style", "tiny", None),  # an adapter the preset lists
    ("tiny:tone", "tiny", None),  # an adapter folder's name
    ("small:style", "tiny", None),
    ("tiny:latest", "tiny", "tiny"),  # Ollama's naming: no tag is `latest`
    ("small:latest", "tiny", "tiny"),
    ("qwen", "qwen:latest", None),
    ("qwen:latest", "qwen:latest", None),
    ("scaled:x", "scaled", None),  # a lora-scaled file
    ("runtime:anything", "runtime", None),  # lora-runtime: the worker decides
    ("tiny:unknown", None, None),
    ("tiny:style:extra", None, None),
    ("llama3:70b", None, None),  # a cmd upstream: a tag it does not declare is a 404
    ("llama3:latest", "llama3", "llama3"),
    ("far:big", None, None),
    ("qwen:7b", None, None),
    ("nope", None, None),
    ("nope:latest", None, None),
    (":latest", None, None),
])
@pytest.mark.asyncio
async def test_a_model_name_resolves_strictly(name: str, model: str | None, upstream: str | None) -> None:
    pool = Pool(PRESETS, PoolConfig())
    try:
        handle = pool.get(name)
        assert (handle.name if handle is not None else None) == model
        if handle is not None:
            assert upstream_model(handle.preset, name) == upstream
    finally:
        await pool.close()


def test_has_adapter_reads_the_preset() -> None:
    tiny = PRESETS[0]
    found = [a for a in ("style", "tone", "pirate", "tiny-pirate") if has_adapter(tiny, a)]
    assert found == ["style", "tone"]
