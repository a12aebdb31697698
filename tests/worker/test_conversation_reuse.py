"""A conversation's KV is reused turn after turn (issue 24): real workers with their DEFAULT
flags (llama.cpp: flash attention auto, f16 KV cache; torch on the CPU) but one thread (as in
test_determinism: two spinning threads of a nice-19 worker crawl beside a busy process; this
file took 113 s that way beside two, 6 s on an idle box), chat completions
rendered by the model's template, the rows evaluated read from `timings.prompt_n` and
`usage.prompt_tokens_details.cached_tokens`.

Turn N's prompt is turn N-1's prompt, its answer and the new user message. The worker holds
turn N-1's prompt and every generated token but the last (the one sampled last is never fed
back), so what is left to compute is that token, the template's glue and the new message.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.util import run_worker
from tests.worker.conftest import require_backend
from worker.testing.tiny_models import ModelPaths

SYSTEM = "You are a terse assistant. Answer in one short sentence. " * 6
QUESTIONS = ["What is a slot?", "And a prompt cache?", "Why reuse rows?", "What is a turn?", "Say it again."]


@pytest.fixture(scope="module", params=["llama_cpp", "torch"])
def chat_worker(request: pytest.FixtureRequest, tiny_models: ModelPaths) -> Iterator[tuple[str, str]]:
    backend = str(request.param)
    require_backend(backend)
    model = tiny_models.gguf_f32 if backend == "llama_cpp" else tiny_models.hf_dir
    args = ["--parallel", "2", "--ctx-size", "4096", "--backend", backend, "--threads", "1"]
    if backend == "torch":
        args += ["--device", "cpu"]
    with run_worker(model, *args, timeout=120) as url:
        yield backend, url


def chat(url: str, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens(url: str, messages: list[dict[str, str]]) -> list[int]:
    prompt = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=30).json()["prompt"]
    r = httpx.post(
        url + "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}, timeout=30
    )
    return list(r.json()["tokens"])


def complete(url: str, prompt: list[int], **kw: Any) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "n_predict": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        **kw,
    }
    r = httpx.post(url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_each_turn_computes_only_its_new_tokens(chat_worker: tuple[str, str]) -> None:
    """Token ids (the native /completion): the answer goes back exactly as generated."""
    backend, url = chat_worker
    prompt = list(range(20, 120))  # a 100-token system prompt
    for turn in range(5):
        new = [300 + turn, *range(140, 150 + 7 * turn)]  # the glue and the next user message
        prompt = prompt + new if turn else prompt
        r = complete(url, prompt)
        if turn:  # the last sampled token, never fed back, and the new message; no 64-row piece
            assert r["timings"]["prompt_n"] == 1 + len(new), (backend, turn, r["timings"])
        prompt = prompt + r["tokens"]
    if backend == "torch":  # every row bitwise alike: the reused rows are a fresh prompt's
        assert (
            complete(url, prompt[:-8])["tokens"] == complete(url, prompt[:-8], cache_prompt=False)["tokens"]
        )


def test_each_chat_turn_reuses_the_previous_turn(chat_worker: tuple[str, str]) -> None:
    """Chat turns through the template. The tiny random model's answers may not tokenize back
    to the tokens it generated (a lone byte of a UTF-8 character comes back as U+FFFD), so this
    checks the previous prompt and what matches of the answer, not the exact count."""
    backend, url = chat_worker
    messages = [{"role": "system", "content": SYSTEM}]
    n_previous = 0
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        r = chat(url, messages)
        usage, timings = r["usage"], r["timings"]
        assert usage["prompt_tokens_details"]["cached_tokens"] + timings["prompt_n"] == usage["prompt_tokens"]
        if i:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= n_previous, (backend, i, usage)
        n_previous = usage["prompt_tokens"]
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})


def test_a_new_question_reuses_the_shared_system_prompt(chat_worker: tuple[str, str]) -> None:
    _, url = chat_worker
    system = {"role": "system", "content": "You answer questions about the weather. " * 8}
    first = [system, {"role": "user", "content": "Will it rain?"}]
    second = [system, {"role": "user", "content": "Is it windy out there today, would you say?"}]
    chat(url, first)
    r = chat(url, second)
    a, b = tokens(url, first), tokens(url, second)
    n_shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    # llama.cpp with flash attention redoes a last piece of 64 rows where the cached rows are of
    # the kernels this prompt would run (then the answer is bitwise a fresh one's).
    assert r["usage"]["prompt_tokens"] == len(b)
    bound = max(len(b) - n_shared, 64)
    assert r["timings"]["prompt_n"] <= bound, (r["usage"], r["timings"])
