"""The tiny HF model and its F32 GGUF twin give the same greedy tokens through both backends."""

from __future__ import annotations

import importlib.util

import pytest

from tests.torch_backend.test_model import greedy, new_backend, random_tokens
from worker.testing.tiny_models import ModelPaths

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp not built")


def test_same_greedy_tokens_as_llama_cpp(tiny_models: ModelPaths) -> None:
    from worker.backends import BackendOptions, load_backend

    prompts = [random_tokens(n, seed=n) for n in (5, 12, 21)]
    options = BackendOptions(n_ctx=256, n_slots=4, n_batch=128, cache_type_k="f32", cache_type_v="f32")
    gguf = load_backend("llama_cpp", str(tiny_models.gguf_f32), options)
    torch_backend = new_backend(tiny_models.hf_dir)
    text = "Hello world, the quick brown fox <|im_end|>"
    try:
        assert torch_backend.tokenize(text, True, True) == gguf.tokenize(text, True, True)
        assert greedy(torch_backend, prompts, 16) == greedy(gguf, prompts, 16)  # type: ignore[arg-type]
    finally:
        gguf.close()
