"""worker.testing.gguf_to_hf on the tiny model, whose HF folder and F32 GGUF were written from the
same weights: converting the GGUF back must give that HF folder's tensors bit for bit (so the Q/K
un-permutation is exact) and a tokenizer that gives the same ids and text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from worker.testing.gguf_to_hf import ConversionError, convert, unpermute_qk
from worker.testing.tiny_models import ModelPaths, _permute_qk
from worker.torch_model.tokenizer import HFTokenizer


@pytest.mark.parametrize(("rows", "cols", "n_head"), [(8, 3, 2), (576, 4, 9), (192, 5, 3), (64, 64, 4)])
def test_unpermute_qk_undoes_llama_cpp_permute(rows: int, cols: int, n_head: int) -> None:
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    assert np.array_equal(unpermute_qk(_permute_qk(w, n_head), n_head), w)


@pytest.fixture(scope="module")
def twin(tiny_models: ModelPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("twin") / "tiny-twin"
    convert(tiny_models.gguf_f32, out)
    return out


def test_the_twin_of_the_tiny_gguf_has_the_original_weights(twin: Path, tiny_models: ModelPaths) -> None:
    want = load_file(str(tiny_models.hf_dir / "model.safetensors"))
    got = load_file(str(twin / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert np.array_equal(got[name], w), name


def test_the_twins_tokenizer_and_template_are_the_originals(twin: Path, tiny_models: ModelPaths) -> None:
    a, b = HFTokenizer(tiny_models.hf_dir), HFTokenizer(twin)
    text = "café 東京 🙂 12345 don't\n\n  <|im_start|>user\nhi<|im_end|>"
    for parse_special in (True, False):
        assert b.tokenize(text, True, parse_special) == a.tokenize(text, True, parse_special)
    ids = a.tokenize(text, False, True)
    assert b"".join(b.token_to_piece(t, special=True) for t in ids) == text.encode()
    assert (b.chat_template, b.bos_token_id, b.eos_token_id, b.add_bos, b.eog_ids) == (
        a.chat_template, a.bos_token_id, a.eos_token_id, a.add_bos, a.eog_ids)


def test_an_unsupported_tokenizer_pre_is_an_error_not_a_guess(
    tiny_models: ModelPaths, tmp_path: Path
) -> None:
    from worker.testing.gguf_to_hf import GGUFModel, hf_tokenizer_json, read_gguf

    model = read_gguf(tiny_models.gguf_f32)
    odd = GGUFModel({**model.meta, "tokenizer.ggml.pre": "qwen2"}, model.tensors)
    with pytest.raises(ConversionError, match=r"tokenizer\.ggml\.pre 'qwen2'"):
        hf_tokenizer_json(odd)
