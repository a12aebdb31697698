"""The HF folder and the GGUF files written by the factory are the same model.

transformers' LlamaForCausalLM on the HF dir and llama.cpp (llama-cpp-python, F32 GGUF,
F32 KV cache, flash attention off) must give the same logits for every position of a
20-token prompt to 1e-4, and the two tokenizers must agree on the ids.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from worker.testing.tiny_models import ModelPaths, ensure_model

PROMPTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "café naïve 東京 🙂 def f(x):\n    return x + 1\n",
    "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\tand tabs\n\nand   runs of   spaces 12345 67",
]


def _hf_logits(hf_dir: Path, ids: list[int]) -> np.ndarray:
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _llama_cpp_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp as lc

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    assert model, "llama.cpp failed to load the GGUF"
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = 256
    cparams.n_batch = 256
    cparams.n_ubatch = 256
    cparams.n_threads = cparams.n_threads_batch = 1
    cparams.type_k = cparams.type_v = lc.GGML_TYPE_F32
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cparams)
    try:
        n = len(ids)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, t in enumerate(ids):
                batch.token[i] = t
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            assert lc.llama_decode(ctx, batch) == 0
            n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
            ptr = lc.llama_get_logits(ctx)
            flat = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n * n_vocab,)
            )
            return flat.reshape(n, n_vocab).copy()
        finally:
            lc.llama_batch_free(batch)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def _llama_cpp_tokenize(gguf: Path, text: str) -> list[int]:
    import llama_cpp as lc

    mparams = lc.llama_model_default_params()
    mparams.vocab_only = True
    model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
    try:
        vocab = lc.llama_model_get_vocab(model)
        raw = text.encode()
        buf = (lc.llama_token * (len(raw) + 8))()
        n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, True)
        assert n >= 0
        return list(buf[:n])
    finally:
        lc.llama_model_free(model)


@pytest.fixture(scope="module")
def models(tiny_models: ModelPaths) -> ModelPaths:
    pytest.importorskip("llama_cpp")
    return tiny_models


@pytest.mark.parametrize("text", PROMPTS)
def test_tokenizers_agree(models: ModelPaths, text: str) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(models.hf_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert _llama_cpp_tokenize(models.gguf_f32, text) == hf
    assert _llama_cpp_tokenize(models.gguf_f16, text) == hf


def test_logits_agree_f32(models: ModelPaths) -> None:
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(3, 1000, size=20)]
    hf = _hf_logits(models.hf_dir, ids)
    cpp = _llama_cpp_logits(models.gguf_f32, ids)
    assert hf.shape == cpp.shape
    np.testing.assert_allclose(cpp, hf, atol=1e-4, rtol=0)


def test_f16_gguf_is_close(models: ModelPaths) -> None:
    """The F16 twin rounds the weights, so only the ranking of the top token is compared."""
    ids = list(range(10, 30))
    f32 = _llama_cpp_logits(models.gguf_f32, ids)
    f16 = _llama_cpp_logits(models.gguf_f16, ids)
    assert np.abs(f32 - f16).max() < 0.1
    assert (f32.argmax(-1) == f16.argmax(-1)).mean() >= 0.9


def test_factory_is_deterministic(tmp_path: Path, tiny_models: ModelPaths) -> None:
    again = ensure_model(tmp_path, "tiny")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again.hf_dir / name).read_bytes() == (tiny_models.hf_dir / name).read_bytes()
    assert again.gguf_f32.read_bytes() == tiny_models.gguf_f32.read_bytes()
