"""The memory estimate, the size and budget parsers: table tests on the tiny models' real files."""

from __future__ import annotations

import pytest

from router.lifecycle.estimate import OVERHEAD_BYTES, VOICE_OVERHEAD_BYTES, MemoryBook, compute
from router.lifecycle.memory import budget
from router.presets import ModelPreset, parse_size
from tests.util import ROOT

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
HF = ROOT / "models" / "tiny-llama"
M = 1 << 20
needs_models = pytest.mark.skipif(not (GGUF.exists() and (HF / "config.json").exists()),
                                   reason="tiny models not generated (make models)")
# tiny-llama: 2 layers, 2 KV heads, head dim 16; K and V per cell = 2 * 2 * (16 + 16) values
KV_VALUES_PER_CELL = 2 * 2 * (16 + 16)


@needs_models
@pytest.mark.parametrize(("backend", "ctx", "cache_ram", "kv_bytes_per_value"), [
    ("llama_cpp", 1024, None, 2),  # f16 cache
    ("llama_cpp", 4096, 64, 2),    # the prompt cache's bound counts when the preset sets it
    ("auto", None, None, 2),       # a GGUF is llama.cpp's; no ctx-size: the worker's default 4096
])
def test_gguf_estimate_is_file_plus_kv_plus_overhead(backend: str, ctx: int | None, cache_ram: int | None,
                                                      kv_bytes_per_value: int) -> None:
    p = ModelPreset("t", backend=backend, model=GGUF, ctx_size=ctx, cache_ram=cache_ram)  # type: ignore[arg-type]
    est = compute(p, has_gpu=False)
    kv = (ctx or 4096) * KV_VALUES_PER_CELL * kv_bytes_per_value
    assert (est.ram_bytes, est.vram_bytes, est.source) == (
        GGUF.stat().st_size + kv + OVERHEAD_BYTES["llama_cpp"] + (cache_ram or 0) * M, 0, "computed")


@needs_models
def test_hf_estimate_uses_config_json_and_the_models_dtype() -> None:
    est = compute(ModelPreset("t", backend="torch", model=HF, ctx_size=512), has_gpu=False)
    weights = (HF / "model.safetensors").stat().st_size
    assert est.ram_bytes == weights + 512 * KV_VALUES_PER_CELL * 4 + OVERHEAD_BYTES["torch"]  # float32


@pytest.mark.skipif(not (ROOT / "models" / "tiny-voice.onnx").exists(), reason="make models")
def test_a_voice_is_its_weights_and_onnx_runtimes_arenas_on_the_host() -> None:
    voice = ROOT / "models" / "tiny-voice.onnx"
    est = compute(ModelPreset("v", model=voice, ctx_size=4096), has_gpu=True)  # no KV cache, no GPU
    assert (est.ram_bytes, est.vram_bytes) == (voice.stat().st_size * 5 // 2 + VOICE_OVERHEAD_BYTES, 0)


@needs_models
def test_on_a_gpu_the_offloaded_share_is_vram() -> None:
    est = compute(ModelPreset("t", backend="llama_cpp", model=GGUF, ctx_size=1024), has_gpu=True)
    assert est.vram_bytes > GGUF.stat().st_size and est.ram_bytes == OVERHEAD_BYTES["llama_cpp"]
    cpu = compute(
        ModelPreset("t", backend="llama_cpp", model=GGUF, ctx_size=1024, n_gpu_layers=0), has_gpu=True
    )
    assert cpu.vram_bytes == 0


def test_the_memory_key_replaces_the_estimate_and_the_learned_peak() -> None:
    book = MemoryBook(has_gpu=False)
    p = ModelPreset("t", backend="cmd", cmd="x ${PORT}", memory=3 * M)
    assert book.estimate(p).ram_bytes == 3 * M
    book.learn(p, 9 * M, None)
    assert book.estimate(p).source == "preset"
    q = ModelPreset("u", backend="cmd", cmd="x ${PORT}")
    book.learn(q, 9 * M, 2 * M)
    assert (book.estimate(q).ram_bytes, book.estimate(q).vram_bytes, book.estimate(q).source) == (
        9 * M,
        2 * M,
        "measured",
    )


@pytest.mark.parametrize(("text", "expected"), [("512M", 512 * M), ("20GiB", 20 << 30), ("1.5g", 3 << 29),
                                                ("4096", 4096), ("0", 0), ("2 MiB", 2 * M), ("1T", 1 << 40)])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "ten", "5X", "-1G", "1.2.3M"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)


@pytest.mark.parametrize(("text", "total", "expected"), [
    ("auto", 100 << 30, 90 << 30),  # 10% margin
    ("auto", 4 << 30, 3 << 30),     # at least 1 GiB left
    ("auto", None, 0),              # no GPU: no limit
    ("0", 100 << 30, 0),
    ("8G", None, 8 << 30),
])
def test_budget(text: str, total: int | None, expected: int) -> None:
    assert budget(text, total) == expected
