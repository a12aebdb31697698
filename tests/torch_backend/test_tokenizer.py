"""HF tokenizer folder handling: pieces as bytes, special-token parsing, BOS/EOS/EOG, templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.testing.tiny_models import ModelPaths
from worker.torch_model.tokenizer import HFTokenizer


@pytest.fixture
def tok(tiny_models: ModelPaths) -> HFTokenizer:
    return HFTokenizer(tiny_models.hf_dir)


def test_pieces_concatenate_to_the_utf8_text(tok: HFTokenizer) -> None:
    text = "Héllo wörld 🙂 def f(x):\n    return x"
    ids = tok.tokenize(text, False, True)
    assert b"".join(tok.token_to_piece(i) for i in ids) == text.encode()


def test_special_tokens_parse_only_when_asked(tok: HFTokenizer) -> None:
    assert tok.tokenize("<|im_end|>", False, True) == [2]
    literal = tok.tokenize("<|im_end|>", False, False)
    assert 2 not in literal and len(literal) > 1
    # a control token renders as llama.cpp renders it: empty in generated text, its text on request
    assert (tok.token_to_piece(2), tok.token_to_piece(2, special=True)) == (b"", b"<|im_end|>")


def test_meta_from_tokenizer_config(tok: HFTokenizer) -> None:
    assert (tok.bos_token, tok.bos_token_id, tok.add_bos) == ("<|endoftext|>", 0, False)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.is_eog(2) and tok.is_eog(0) and not tok.is_eog(1)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.tokenize("hi", True, True) == tok.tokenize("hi", False, True)


def test_add_bos_and_template_file(tiny_models: ModelPaths, tmp_path: Path) -> None:
    root = tmp_path / "m"
    shutil.copytree(tiny_models.hf_dir, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    del cfg["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = HFTokenizer(root)
    assert tok.tokenize("hi", True, True) == [0, *tok.tokenize("hi", False, True)]
    assert tok.chat_template == "{{ messages[0]['content'] }}"


def test_sentencepiece_style_pieces(tmp_path: Path) -> None:
    """Llama-2 / Mistral tokenizer.json: '▁' marks a space, <0xNN> tokens are raw bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xE2>": 4, "▁hello": 5, "▁world": 6, "▁": 7}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    hf = HFTokenizer(tmp_path)
    assert (hf.token_to_piece(5), hf.token_to_piece(3), hf.token_to_piece(4)) == (b" hello", b"\n", b"\xe2")
    assert hf.token_to_piece(2, special=True) == b"</s>" and hf.is_eog(2)
    assert hf.tokenize("hello", True, True)[0] == 1 and hf.add_bos
