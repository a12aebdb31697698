"""The inference backends, and choosing one. Imports are lazy: the GGUF path never imports torch
(fast start).

    media          images and audio in a prompt: media ids (keyed by the bytes), the `Vision` contract
    base           the contract: `Vocab` (thread-safe, the HTTP side) and `Backend` (the engine's)
    lora           LoRA adapters: what a loaded one is, GGUF checks against the base model, --lora-scaled
    mtmd           libmtmd (an mmproj): images and audio decoded, tokenized and encoded, an LRU of encodings
    media_probe    an image's size and an audio's length from the header: decode bombs refused first
    video          a video's header checked against the limits, then frames sampled and decoded (PyAV)
    llama_cpp      GGUF files through llama-cpp-python's ctypes API
    llama_lib      llama-cpp-python, imported once the C++ runtime is settled (cxx_runtime)
    cxx_runtime    one C++ runtime per worker process: the system's libstdc++ first where needed
    weight_buffers --repack: which CPU buffer types the weights may take (AMX left out), and which they took
    torch_backend  HF folders through our own PyTorch model (worker/torch_model/)
    torch_vision   an Idefics3 folder's images on the torch backend: libmtmd's prompt, our tower's rows
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from worker.backends.base import Backend, Pooling

BackendKind = Literal["auto", "llama_cpp", "torch"]


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """`n_ctx` KV cells in all (0: the model's training context), for `n_slots` slots: each slot
    gets a KV stream of n_ctx / n_slots cells (llama-server's default) or, with `kv_unified`,
    every slot may fill one pool of n_ctx. A backend has n_slots + 1 sequences: the last one is
    the engine's staging sequence (a stream of the same size, or a share of the pool).

    Each field is a keyword argument of both backends' constructors, but for those marked with
    the one backend that takes them (`kwargs_for`)."""

    n_ctx: int = 4096
    n_slots: int = 4
    kv_unified: bool = False
    n_batch: int = 2048
    n_ubatch: int = 512
    threads: int | None = None
    embedding: bool = False  # an embedding model (llama-server's --embedding): pooled outputs, no sampling
    pooling: Pooling | None = None  # with `embedding`: None = the model's own (llama-server's default)
    # None: all layers when the build can offload
    n_gpu_layers: int | None = field(default=None, metadata={"only": "llama_cpp"})
    # over several GPUs (llama-server's --split-mode, --tensor-split, --main-gpu)
    split_mode: str = field(default="layer", metadata={"only": "llama_cpp"})
    tensor_split: tuple[float, ...] = field(default=(), metadata={"only": "llama_cpp"})
    main_gpu: int = field(default=0, metadata={"only": "llama_cpp"})
    mmproj: str | None = field(default=None, metadata={"only": "llama_cpp"})  # image/audio input (libmtmd)
    image_max_pixels: int = 0  # a vision model's decoded images at most (0: no limit)
    # an audio model's decoded audio at most, in seconds (0: no limit)
    audio_max_seconds: float = field(default=0.0, metadata={"only": "llama_cpp"})
    cache_type_k: str = field(default="f16", metadata={"only": "llama_cpp"})
    cache_type_v: str = field(default="f16", metadata={"only": "llama_cpp"})
    flash_attn: str = field(default="auto", metadata={"only": "llama_cpp"})
    # the CPU's extra weight buffer types (llama-server's --repack/--no-repack; weight_buffers.py)
    repack: str = field(default="auto", metadata={"only": "llama_cpp"})
    device: str | None = field(default=None, metadata={"only": "torch"})
    dtype: str | None = field(default=None, metadata={"only": "torch"})
    # CUDA graphs / torch.compile for decode steps
    compile: bool = field(default=False, metadata={"only": "torch"})

    def kwargs_for(self, kind: Literal["llama_cpp", "torch"]) -> dict[str, Any]:
        """The constructor keywords of backend `kind`: every field, less the other backend's own."""
        other = {f.name for f in fields(self) if f.metadata.get("only", kind) != kind}
        return {k: v for k, v in asdict(self).items() if k not in other}


def resolve_kind(kind: BackendKind, model_path: str) -> Literal["llama_cpp", "torch"]:
    """`auto`: a *.gguf file -> llama_cpp; a directory with config.json -> torch."""
    if kind != "auto":
        return kind
    if os.path.isdir(model_path):
        if os.path.isfile(os.path.join(model_path, "config.json")):
            return "torch"
        raise ValueError(f"{model_path}: a model directory needs a config.json (HF format)")
    if model_path.lower().endswith(".gguf"):
        return "llama_cpp"
    raise ValueError(f"{model_path}: cannot tell the backend; pass --backend llama_cpp or torch")


def load_backend(
    kind: BackendKind,
    model_path: str,
    options: BackendOptions,
    progress: Callable[[str, float], None] | None = None,
) -> Backend:
    resolved = resolve_kind(kind, model_path)
    if resolved == "llama_cpp":
        from worker.backends.llama_cpp import LlamaCppBackend

        return LlamaCppBackend(model_path, progress=progress, **options.kwargs_for("llama_cpp"))
    # torch's CPU allocator reads this once, at its first allocation: 2 MiB pages for large
    # tensors (weights, KV). Decode streams every weight each step; with 4 KiB pages the TLB
    # misses cost ~10% of the matmul time (this box's THP mode is "madvise", the common default).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from worker.backends.torch_backend import TorchBackend  # type: ignore[import-not-found,unused-ignore]  # torch is optional at type-check time

    backend: Backend = TorchBackend(model_path, progress=progress, **options.kwargs_for("torch"))
    return backend
