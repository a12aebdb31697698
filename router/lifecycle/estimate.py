"""How much memory a model will need before it is loaded, and what we learned from measuring it.

Estimate = weights (the GGUF file, or the Hugging Face folder's *.safetensors / *.bin)
  + KV cache for `ctx-size` cells in all (every slot; K and V each n_layers * n_kv_heads *
    head_dim values per cell, in the cache type: f16 for llama.cpp, the model's dtype for torch)
  + `cache-ram` when the preset sets it (the prompt cache's bound; unset, it fills with use)
  + a per-backend overhead (the worker's Python runtime and libraries, measured on the tiny models).
With a GPU, llama.cpp's offloaded share (all layers unless `n-gpu-layers` says fewer) and all of
a torch model count as VRAM, plus a CUDA context. A preset's `memory = SIZE` replaces the
estimate. Once a model has run, the peak it was measured at (tree USS, VRAM) replaces the
computed figure for the next load of the same preset (kept in memory only).

Blocking (reads file headers): call `MemoryBook.estimate` in a thread; `peek` never blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from router.lifecycle.gguf_header import Value, read_keys
from router.presets import ModelPreset

log = logging.getLogger("omni.router.estimate")

MIB = 1 << 20
OVERHEAD_BYTES = {"llama_cpp": 96 * MIB, "torch": 384 * MIB}  # measured: ~65 and ~300 MiB USS idle
# A speech worker (Python, onnxruntime, espeak-ng) beside its voice, and ONNX Runtime's arenas at
# about 1.5x the weights: measured USS after a request, tiny voice (24 KB) 78 MiB, en_US-joe-medium
# (60 MiB) 236 MiB.
VOICE_OVERHEAD_BYTES = 96 * MIB
# On a GPU: the CUDA context and library workspaces in VRAM, and the CUDA libraries in the
# worker's host memory. torch measured on an H100 (tiny model, ctx 1024): 720 MiB of VRAM, and
# 1.31 GiB tree USS against ~0.3 GiB on the CPU. llama.cpp's CUDA build is not measured yet.
GPU_CONTEXT_BYTES = {"llama_cpp": 512 * MIB, "torch": 720 * MIB}
GPU_HOST_BYTES = {"torch": 1024 * MIB}
DEFAULT_CTX = 4096  # the worker's --ctx-size default
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Estimate:
    ram_bytes: int
    vram_bytes: int
    source: str  # "preset" (memory = SIZE), "measured" (the last run's peak), "computed", "unknown"

    @property
    def total_bytes(self) -> int:
        return self.ram_bytes + self.vram_bytes


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    dtype_bytes: float = 2.0  # KV element size when the backend uses the model's dtype


_GGUF_KEYS = ("block_count", "attention.head_count", "attention.head_count_kv", "attention.key_length",
              "attention.value_length", "embedding_length", "context_length")


_shapes: dict[
    tuple[str, int, int], Shape | None
] = {}  # (path, size, mtime_ns) -> shape: a changed file is read again


def cached_shape(model: Path, is_gguf: bool) -> Shape | None:
    """`gguf_shape` / `hf_shape`, read once per version of the file (path, size and mtime)."""
    try:
        st = (model if is_gguf else model / "config.json").stat()
    except OSError:
        return None
    key = (str(model), st.st_size, st.st_mtime_ns)
    if key not in _shapes:
        _shapes[key] = gguf_shape(model) if is_gguf else hf_shape(model)
    return _shapes[key]


def gguf_shape(path: Path) -> Shape | None:
    """The KV-cache shape from the GGUF header (router.lifecycle.gguf_header: a few keys, no vocabulary)."""
    def wanted(key: str) -> bool:
        return key == "general.architecture" or key.partition(".")[2] in _GGUF_KEYS

    def has_all(found: dict[str, Value]) -> bool:
        arch = found.get("general.architecture")
        return arch is not None and all(f"{arch}.{k}" in found for k in _GGUF_KEYS)

    try:
        fields = read_keys(path, wanted, stop_when=has_all)
        arch = str(fields["general.architecture"])

        def num(key: str, default: int | None = None) -> int:
            value = fields.get(f"{arch}.{key}")
            if value is None:
                if default is None:
                    raise KeyError(key)
                return default
            return int(max(value) if isinstance(value, list) else value)  # per-layer arrays: the largest

        n_heads = num("attention.head_count")
        head_dim = num("embedding_length") // max(1, n_heads)
        return Shape(num("block_count"), num("attention.head_count_kv", n_heads),
                     num("attention.key_length", head_dim), num("attention.value_length", head_dim),
                     num("context_length", DEFAULT_CTX))
    except Exception as e:  # not a GGUF we can read: the load will say why
        log.debug("%s: no GGUF shape: %r", path, e)
        return None


def hf_shape(folder: Path) -> Shape | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        n_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
        return Shape(
            int(cfg["num_hidden_layers"]),
            int(cfg.get("num_key_value_heads") or n_heads),
            head_dim,
            head_dim,
            int(cfg.get("max_position_embeddings") or DEFAULT_CTX),
            TORCH_DTYPE_BYTES.get(dtype, 2),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.debug("%s: no HF shape: %r", folder, e)
        return None


def weights_bytes(model: Path) -> int:
    if model.is_file():
        return model.stat().st_size
    total = 0
    with contextlib.suppress(OSError):
        for pattern in ("*.safetensors", "*.bin", "*.gguf"):
            total += sum(f.stat().st_size for f in model.glob(pattern))
            if total:
                break
    return total


def kv_bytes(shape: Shape, cells: int, k_bytes: float, v_bytes: float) -> int:
    per_cell = shape.n_layers * shape.n_kv_heads * (shape.head_dim_k * k_bytes + shape.head_dim_v * v_bytes)
    return int(cells * per_cell)


def compute(p: ModelPreset, has_gpu: bool) -> Estimate:
    """The figure from the files and the preset, before anything was measured."""
    if p.memory is not None:
        return Estimate(p.memory, 0, "preset")
    if p.is_remote or p.model is None or not p.model.exists():
        return Estimate(0, 0, "unknown")
    weights = weights_bytes(p.model)
    if p.backend == "cmd":  # someone else's server: only its weights are known
        return Estimate(weights, 0, "computed")
    if p.resolved_backend == "piper":  # a voice: ONNX Runtime holds the weights and its arenas
        return Estimate(weights * 5 // 2 + VOICE_OVERHEAD_BYTES, 0, "computed")
    is_gguf = p.model.is_file()
    backend = p.backend if p.backend != "auto" else ("llama_cpp" if is_gguf else "torch")
    shape = cached_shape(p.model, is_gguf)
    kv = 0
    if shape is not None:
        cells = p.ctx_size if p.ctx_size else (DEFAULT_CTX if p.ctx_size is None else shape.n_ctx_train)
        if backend == "llama_cpp":
            k = CACHE_TYPE_BYTES.get(p.worker_arg("cache-type-k") or "f16", 2.0)
            v = CACHE_TYPE_BYTES.get(p.worker_arg("cache-type-v") or "f16", 2.0)
        else:
            k = v = shape.dtype_bytes
        kv = kv_bytes(shape, cells, k, v)
    cache = p.cache_ram * MIB if p.cache_ram and p.cache_ram > 0 else 0
    ram = OVERHEAD_BYTES.get(backend, 0) + cache
    on_gpu = 0.0
    if has_gpu and p.n_gpu_layers != 0:
        n_layers = shape.n_layers if shape is not None else 0
        layers = p.n_gpu_layers
        on_gpu = 1.0 if layers is None or layers < 0 or layers > n_layers else layers / max(1, n_layers + 1)
    vram = int(on_gpu * (weights + kv))
    ram += weights + kv - vram
    if not vram:
        return Estimate(ram, 0, "computed")
    return Estimate(
        ram + GPU_HOST_BYTES.get(backend, 0), vram + GPU_CONTEXT_BYTES.get(backend, 512 * MIB), "computed"
    )


def _describe(e: Estimate) -> str:
    if e.source == "unknown":
        return "unknown"
    return f"{e.ram_bytes / MIB:.0f} MiB RAM" + (
        f" + {e.vram_bytes / MIB:.0f} MiB VRAM" if e.vram_bytes else ""
    )


def _key(p: ModelPreset) -> ModelPreset:
    return replace(p, source="")  # the same settings, wherever they were written


class MemoryBook:
    """Estimates per preset, computed once, replaced by the peak measured on the last run."""

    def __init__(self, has_gpu: bool) -> None:
        self.has_gpu = has_gpu
        self._computed: dict[ModelPreset, Estimate] = {}
        self._learned: dict[ModelPreset, Estimate] = {}

    def estimate(self, p: ModelPreset) -> Estimate:
        """Blocking (stats the files; reads the model's header once per version of the file)."""
        t0 = time.perf_counter()
        computed = self._computed[_key(p)] = compute(p, self.has_gpu)
        est = self.peek(p) or computed
        log.info("model %s: memory estimate %s (%s) in %.0f ms", p.name, _describe(est), est.source,
                 (time.perf_counter() - t0) * 1000)
        return est

    def peek(self, p: ModelPreset) -> Estimate | None:
        k = _key(p)
        if p.memory is None and k in self._learned:
            return self._learned[k]
        return self._computed.get(k)

    def learn(self, p: ModelPreset, ram_bytes: int, vram_bytes: int | None) -> None:
        """The peak of the current run so far (the owner keeps the peak; the last run wins)."""
        self._learned[_key(p)] = Estimate(ram_bytes, vram_bytes or 0, "measured")
