"""Text handling with the real 49k-token byte-level vocabulary.

Emoji, accented Latin and CJK come out of several tokens each (a byte-level BPE splits a
character's UTF-8 bytes): the streamed deltas must join to exactly the non-streamed text, with
no U+FFFD. A stop string that starts and ends inside tokens is cut exactly in both. And the
twin's tokenizer (built from the GGUF's vocabulary and merges) tokenizes as llama.cpp does.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest

from tests.realmodel.conftest import LLAMA, TORCH, RealRouter

pytestmark = pytest.mark.slow


def streamed(router: RealRouter, body: dict[str, Any]) -> tuple[str, list[str]]:
    """The joined content deltas of a streamed chat completion, and the finish reasons seen."""
    parts, reasons = [], []
    with (
        router.client() as c,
        c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if choice:
                parts.append(choice[0]["delta"].get("content") or "")
                if choice[0].get("finish_reason"):
                    reasons.append(choice[0]["finish_reason"])
    return "".join(parts), reasons


def body(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": LLAMA, "messages": [{"role": "user", "content": question}], "temperature": 0, **extra}


def is_emoji(ch: str) -> bool:
    return unicodedata.category(ch) == "So" and ord(ch) > 0x2000


def is_cjk(ch: str) -> bool:
    return "CJK" in unicodedata.name(ch, "") or "\u3040" <= ch <= "\u30ff"


def is_accented(ch: str) -> bool:
    return ch.isalpha() and ord(ch) > 0x7F and unicodedata.decomposition(ch) != ""


@pytest.mark.parametrize(("question", "max_tokens", "kind"), [
    ("Say hello with an emoji.", 30, is_emoji),  # 🌟 is 3 tokens: 30 ends on a character
    ("Write 'thank you' in Chinese characters only.", 60, is_cjk),
    ("Spell the French word for coffee with its accent.", 60, is_accented),
])
def test_multibyte_text_streams_to_exactly_the_non_streamed_text(
    real_router: RealRouter, question: str, max_tokens: int, kind: Any,
) -> None:
    whole = real_router.chat(LLAMA, question, max_tokens=max_tokens)["choices"][0]["message"]["content"]
    joined, _ = streamed(real_router, body(question, max_tokens=max_tokens))
    assert joined == whole
    assert "\ufffd" not in whole
    assert any(kind(ch) for ch in whole), f"{question!r} -> {whole!r}: no {kind.__name__[3:]} character"


def test_a_stop_string_spanning_tokens_is_cut_exactly(real_router: RealRouter) -> None:
    question = "What is the capital of Japan?"
    full = real_router.chat(LLAMA, question, max_tokens=16)["choices"][0]["message"]["content"]
    assert full.startswith("The capital of Japan is Tokyo")
    # "of Jap" starts after the space of the token " of" and ends inside the token " Japan"
    out = real_router.chat(LLAMA, question, max_tokens=16, stop=["of Jap"])["choices"][0]
    assert (out["message"]["content"], out["finish_reason"]) == ("The capital ", "stop")
    joined, reasons = streamed(real_router, body(question, max_tokens=16, stop=["of Jap"]))
    assert (joined, reasons) == ("The capital ", ["stop"])


def test_the_twins_tokenizer_tokenizes_as_llama_cpp(real_router: RealRouter) -> None:
    text = "café naïve 東京 こんにちは 🙂🚀 12345 don't  <|im_start|>user\n  x"
    with real_router.client() as c:
        ids = [c.post("/tokenize", json={"model": m, "content": text, "parse_special": True}).json()["tokens"]
               for m in (LLAMA, TORCH)]
        assert ids[0] == ids[1]
        back = [
            c.post("/detokenize", json={"model": m, "tokens": ids[0]}).json()["content"]
            for m in (LLAMA, TORCH)
        ]
    assert back == [text, text]
