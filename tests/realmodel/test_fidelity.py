"""Greedy output of both backends equals an unbatched reference on the same weights.

- llama.cpp worker vs llama-cpp-python's own `Llama` API: 8 prompts x 64 tokens sent at once
  through the worker's 4 slots (so rows are batched), against one prompt at a time through
  `Llama.eval` and an argmax over `Llama.scores`.
- torch worker vs transformers' greedy `generate` on the HF twin: 4 of the prompts x 16 tokens
  (torch f32 decodes a few tokens a second on 2 shared cores).

Both sides ban the end-of-generation tokens (the worker's `ignore_eos`, the reference by masking
them) so every prompt yields its full length. How often torch f32 and llama.cpp Q4_1 agree is
reported in the terminal summary, not asserted: they run different kernels on different weights.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
import pytest

from tests.realmodel.conftest import LLAMA, REPORT, TORCH, RealRouter
from worker.testing.smollm2 import SmolPaths
from worker.torch_model.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name three primary colors.",
    "What is the capital of Japan?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one paragraph.",
    "List five fruits.",
    "Why is the sky blue?",
    "Give me a tip for learning to code.",
    "What is the chemical symbol for gold?",
]
N_LLAMA, N_TORCH, N_TORCH_PROMPTS = 64, 16, 4


@cache
def _tokenizer(hf_dir: str) -> HFTokenizer:
    return HFTokenizer(hf_dir)


def prompt_tokens(smollm2: SmolPaths, question: str) -> list[int]:
    """The question through the model's own chat template, tokenized (the twin's tokenizer gives
    llama.cpp's tokens: tests/realmodel/test_text.py checks that)."""
    import jinja2

    tok = _tokenizer(str(smollm2.hf_dir))
    assert tok.chat_template is not None
    text = jinja2.Environment().from_string(tok.chat_template).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    return tok.tokenize(text, add_special=True, parse_special=True)


def worker_greedy(router: RealRouter, model: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    def one(prompt: list[int]) -> list[int]:
        with router.client() as c:
            resp = c.post("/completion", json={
                "model": model, "prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False})
        assert resp.status_code == 200, resp.text
        tokens: list[int] = resp.json()["tokens"]
        return tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def llama_cpp_reference(
    smollm2: SmolPaths, prompts: list[list[int]], n: int, eog: list[int]
) -> list[list[int]]:
    from llama_cpp import Llama

    # flash attention on, as the worker's default (auto) is on the CPU: without it llama.cpp runs
    # other attention kernels and one of the 8 answers parts at float rounding level. One thread:
    # the result does not depend on it, and spinning threads crawl on a shared 2-core box.
    llm = Llama(str(smollm2.gguf), n_ctx=1024, n_batch=512, n_threads=1, flash_attn=True, verbose=False)
    n_vocab = llm.n_vocab()
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        generated: list[int] = []
        for _ in range(n):
            # the last decode's one row of logits (Llama.scores is only kept with logits_all)
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()
            logits[eog] = -np.inf
            generated.append(int(np.argmax(logits)))
            llm.eval([generated[-1]])
        out.append(generated)
    llm.close()
    return out


def transformers_reference(
    smollm2: SmolPaths, prompts: list[list[int]], n: int, eog: list[int]
) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.hf_dir), dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 suppress_tokens=eog, pad_token_id=eog[0])
            out.append(gen[0, len(prompt):].tolist())
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_llama_cpp_worker_batched_equals_llama_cpp_python_unbatched(
    real_router: RealRouter, smollm2: SmolPaths
) -> None:
    prompts = [prompt_tokens(smollm2, q) for q in QUESTIONS]
    eog = sorted(_tokenizer(str(smollm2.hf_dir)).eog_ids)
    got = worker_greedy(real_router, LLAMA, prompts, N_LLAMA)
    want = llama_cpp_reference(smollm2, prompts, N_LLAMA, eog)
    tok = _tokenizer(str(smollm2.hf_dir))
    for q, g, w in zip(QUESTIONS, got, want, strict=True):
        text = b"".join(tok.token_to_piece(t) for t in g).decode(errors="replace")
        assert g == w, f"{q!r}: worker and Llama part at token {_common_prefix(g, w)}; worker said {text!r}"


def test_torch_worker_equals_transformers_greedy(real_router: RealRouter, smollm2: SmolPaths) -> None:
    pytest.importorskip("transformers")
    prompts = [prompt_tokens(smollm2, q) for q in QUESTIONS[:N_TORCH_PROMPTS]]
    eog = sorted(_tokenizer(str(smollm2.hf_dir)).eog_ids)
    got = worker_greedy(real_router, TORCH, prompts, N_TORCH)
    # reported, not asserted: the same prompts on llama.cpp's Q4_1 kernels
    q4 = worker_greedy(real_router, LLAMA, prompts, N_TORCH)
    agree = [_common_prefix(g, w) for g, w in zip(got, q4, strict=True)]
    same = sum(x == y for g, w in zip(got, q4, strict=True) for x, y in zip(g, w, strict=True))
    REPORT.append(
        f"torch f32 vs llama.cpp Q4_1, greedy, {len(prompts)} prompts x {N_TORCH} tokens: "
        f"{same}/{len(prompts) * N_TORCH} tokens equal position by position, "
        f"common prefixes {agree}, {sum(a == N_TORCH for a in agree)}/{len(prompts)} identical")
    want = transformers_reference(smollm2, prompts, N_TORCH, eog)
    for q, g, w in zip(QUESTIONS[:N_TORCH_PROMPTS], got, want, strict=True):
        assert g == w, f"{q!r}: torch worker and transformers part at token {_common_prefix(g, w)}"
