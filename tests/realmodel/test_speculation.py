"""Speculative decoding on the real SmolLM2 (issue 29), through the router: greedy answers with
prompt-lookup speculation (requests opt in with OVMS's num_assistant_tokens / max_ngram_size)
equal the answers without, token for token, one at a time and 8 at once, on llama.cpp (Q4_1)
and on torch (f32, short answers: it decodes a few tokens a second here). The workload is the
one speculation is for: "rewrite this text with one change", whose answer copies the prompt.

Every request sends `cache_prompt: false`: on llama.cpp a prompt that reuses rows another
request computed (the template's system prompt, say) may answer differently at float rounding
level from one computed whole (docs/internals.md, *Same input, same output*), and which rows a
slot holds depends on what ran before. Computed whole, an answer depends on neither, so a
difference here can only come from speculation. (Without it, CI once saw the first token of one
of the 8 answers differ: speculation cannot cause that, the first token is sampled before any
draft.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.realmodel.conftest import LLAMA, REPORT, TORCH, RealRouter

TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night "
    "its keeper climbed the narrow stairs and watched the beam sweep across the dark water.",
    "Our team meets every Monday morning to plan the week. We review the open tickets and write "
    "the plan on the whiteboard next to the kitchen.",
]
SPEC = {"num_assistant_tokens": 16, "max_ngram_size": 3}


def _ask(
    router: RealRouter, model: str, i: int, max_tokens: int, **extra: Any
) -> tuple[list[str], dict[str, Any]]:
    """The answer's tokens (as text pieces) and its timings."""
    change = ("night into evening", "Monday into Tuesday")[i % 2]
    msg = f"Rewrite the following text exactly as it is, but change {change}:\n\n{TEXTS[i % 2]}"
    out = router.chat(model, msg, max_tokens=max_tokens, logprobs=True, cache_prompt=False, **extra)
    tokens = [t["token"] for t in out["choices"][0]["logprobs"]["content"]]
    return tokens, out.get("timings", {})


def test_llama_cpp_greedy_answers_equal_with_speculation(real_router: RealRouter) -> None:
    plain = [_ask(real_router, LLAMA, i, 48)[0] for i in range(2)]
    alone = [_ask(real_router, LLAMA, i, 48, **SPEC) for i in range(2)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: _ask(real_router, LLAMA, i, 48, **SPEC)[0], range(8)))
    assert [t for t, _ in alone] == plain
    assert together == [plain[i % 2] for i in range(8)]
    drafted = sum(t.get("draft_n", 0) for _, t in alone)
    accepted = sum(t.get("draft_n_accepted", 0) for _, t in alone)
    assert accepted > 0
    REPORT.append(f"speculation, SmolLM2 Q4_1 rewrite: {accepted}/{drafted} drafted tokens accepted")


def test_torch_greedy_answer_equals_with_speculation(real_router: RealRouter) -> None:
    plain, _ = _ask(real_router, TORCH, 0, 12)
    spec, _ = _ask(real_router, TORCH, 0, 12, **SPEC)
    assert spec == plain
