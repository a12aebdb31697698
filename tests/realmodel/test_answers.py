"""Factual questions answered correctly at temperature 0 by both backends, through the router.

The Q4_1 model is weaker than its float32 form: through llama.cpp (llama-server included) it
answers "What is the capital of France?" with nonsense, so these are questions the quantized
model does answer. Each answer must contain every expected word (case-insensitive); a short
max_tokens keeps the torch side (a few tokens a second here) quick.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.realmodel.conftest import BACKENDS, TORCH, RealRouter

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("Name three primary colors.", ("red", "blue", "yellow")),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the chemical symbol for gold?", ("au",)),
    ("What is the opposite of hot?", ("cold",)),
]
TORCH_QUESTIONS = QUESTIONS[:2]  # the torch twin decodes ~10x slower on the CPU


@pytest.mark.parametrize("model", BACKENDS)
def test_factual_answers_at_temperature_0(real_router: RealRouter, model: str) -> None:
    questions = TORCH_QUESTIONS if model == TORCH else QUESTIONS
    with ThreadPoolExecutor(len(questions)) as pool:  # all slots busy at once
        outs = list(pool.map(lambda q: real_router.chat(model, q[0], max_tokens=24), questions))
    for (question, words), out in zip(questions, outs, strict=True):
        answer = out["choices"][0]["message"]["content"]
        print(f"{model}: {question!r} -> {answer!r}")
        missing = [w for w in words if w not in answer.lower()]
        assert not missing, f"{model}: {question!r} -> {answer!r} lacks {missing}"
