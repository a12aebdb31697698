"""Generation semantics over real HTTP on a shared worker (both backends).

The tiny models produce gibberish, so outputs are only ever compared with other runs.
"""

from __future__ import annotations

import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.util import wait_until
from tests.worker.conftest import N_SLOTS, Worker, check_wire, worker_process
from worker.testing.tiny_models import ModelPaths

PROMPTS = ["The quick brown fox", "Once upon a time in", "1 2 3 4 5 6", "hello world, how are you"]


def complete(w: Worker, prompt: str | list[int], **kw: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 24, "ignore_eos": True, **kw}
    r = w.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def metric(w: Worker, name: str) -> float:
    text = w.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def stream_texts(w: Worker, path: str, body: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """(content deltas, all chunks) of a streamed request."""
    deltas: list[str] = []
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", w.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            check_wire(path, chunk, stream=True)
            chunks.append(chunk)
            for c in chunk.get("choices", []):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    deltas.append(piece)
    return deltas, chunks


def test_greedy_output_does_not_depend_on_batching(worker: Worker) -> None:
    n = 200 if worker.backend == "llama_cpp" else 80
    kw = {"cache_prompt": False, "max_tokens": n, "logprobs": 0}

    def run(p: str) -> tuple[str, list[float]]:
        choice = complete(worker, p, **kw)["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]

    solo = [run(p) for p in PROMPTS]
    # One request with four prompts: the four tasks reach the engine together and share every step.
    decodes_before = metric(worker, "llamacpp:n_decode_total")
    batched = complete(worker, PROMPTS, **kw)["choices"]
    assert metric(worker, "llamacpp:n_decode_total") - decodes_before <= n + 1
    # Four concurrent HTTP requests (overlapping as they happen to).
    with ThreadPoolExecutor(N_SLOTS) as pool:
        concurrent = list(pool.map(run, PROMPTS))
    for together in ([(c["text"], c["logprobs"]["token_logprobs"]) for c in batched], concurrent):
        assert [t for t, _ in together] == [t for t, _ in solo]
        # Not bit-exact (kernels depend on the batch's row count), but float-rounding close.
        for (_, a), (_, b) in zip(solo, together, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_same_seed_same_output(worker: Worker) -> None:
    kw = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 1234, "max_tokens": 16}
    a = complete(worker, "Sampling with a seed", **kw)["choices"][0]["text"]
    b = complete(worker, "Sampling with a seed", **kw)["choices"][0]["text"]
    assert a == b


def test_n_choices(worker: Worker) -> None:
    body = {"messages": [{"role": "user", "content": "n choices"}], "n": 3, "max_tokens": 12,
            "temperature": 1.0, "top_k": 0, "min_p": 0.0, "seed": 7, "ignore_eos": True}
    r = worker.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 36
    # Different seeds per choice: with a random model and no truncation they differ.
    assert len({c["message"]["content"] for c in data["choices"]}) > 1
    greedy = worker.post("/v1/chat/completions", {**body, "temperature": 0, "n": 2}).json()
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]


def _boundary_stop(w: Worker, prompt: str) -> tuple[str, str]:
    """(full greedy text, a stop string made of the end of one token and the start of the next)."""
    data = complete(w, prompt, logprobs=0, max_tokens=24)
    text = data["choices"][0]["text"]
    toks = data["choices"][0]["logprobs"]["tokens"]
    for a, b in itertools.pairwise(toks[3:]):
        if a and b and "\ufffd" not in a + b and a.strip() and b.strip():
            return text, a[-1] + b[0]
    raise AssertionError(f"no usable token boundary in {toks!r}")


def test_stop_string_across_token_boundary(worker: Worker) -> None:
    prompt = "Stop strings across tokens"
    full, stop = _boundary_stop(worker, prompt)
    expected = full[: full.index(stop)]
    data = complete(worker, prompt, stop=[stop], max_tokens=24)
    assert data["choices"][0]["text"] == expected
    assert data["choices"][0]["finish_reason"] == "stop"
    deltas, _ = stream_texts(
        worker,
        "/v1/completions",
        {"prompt": prompt, "temperature": 0, "max_tokens": 24, "ignore_eos": True, "stop": stop},
    )
    # No delta ever carried the beginning of the stop string: the stream is exactly the prefix.
    assert "".join(deltas) == expected


def test_logprobs(worker: Worker) -> None:
    body = {"messages": [{"role": "user", "content": "logprobs"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    data = worker.post("/v1/chat/completions", body).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        lps = [t["logprob"] for t in tops]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # Greedy picks the most likely token.
        assert entry["logprob"] == lps[0]
        assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"]
    comp = complete(worker, "logprobs", logprobs=2, max_tokens=5)["choices"][0]["logprobs"]
    assert len(comp["tokens"]) == len(comp["token_logprobs"]) == len(comp["top_logprobs"]) == 5
    assert all(len(t) <= 2 for t in comp["top_logprobs"])
    assert comp["text_offset"] == sorted(comp["text_offset"])


def test_prefix_reuse_evaluates_only_new_tokens(worker: Worker) -> None:
    prefix = list(range(300, 500))  # 200 tokens
    complete(worker, [*prefix, 11, 12, 13], max_tokens=2)
    second = complete(worker, [*prefix, 21, 22, 23, 24], max_tokens=2)
    assert second["timings"]["cache_n"] == 200
    assert second["timings"]["prompt_n"] == 4


def test_prefix_reuse_survives_an_unrelated_request(worker: Worker) -> None:
    """The unrelated request takes the same (lowest idle) slot; what it overwrites goes to the RAM
    prompt cache first, and the matching prompt gets it back (restored, or copied from a slot)."""
    prefix = list(range(600, 800))
    complete(worker, [*prefix, 11, 12], max_tokens=2)
    complete(worker, list(range(900, 950)), max_tokens=2)
    assert metric(worker, "omni:prompt_cache_entries") >= 1
    assert metric(worker, "omni:prompt_cache_bytes") > 0
    third = complete(worker, [*prefix, 21, 22, 23], max_tokens=2)
    assert third["timings"]["cache_n"] == 200
    assert third["timings"]["prompt_n"] == 3


def test_cache_ram_zero_keeps_idle_slots_in_a_shared_kv_cache(tiny_models: ModelPaths) -> None:
    args = ("--parallel", "2", "--cache-ram", "0", "--kv-unified")
    with worker_process(tiny_models.gguf_f32, *args) as (_, url):
        w = Worker(url, "llama_cpp")
        complete(w, list(range(300, 340)), max_tokens=2)
        complete(w, list(range(400, 440)), max_tokens=2, id_slot=1)
        assert all(s["n_cached_tokens"] > 0 for s in w.get("/slots").json())
        assert metric(w, "omni:prompt_cache_entries") == 0


def _slots_idle(w: Worker) -> bool:
    return not any(s["is_processing"] for s in w.get("/slots").json())


def test_stream_disconnect_frees_slot(worker: Worker) -> None:
    finished_before = metric(worker, 'omni:requests_total{reason="length"}')
    body = {"prompt": "cancel me", "ignore_eos": True, "stream": True}  # runs until the context is full
    with httpx.stream("POST", worker.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert any(s["is_processing"] for s in worker.get("/slots").json())
    wait_until(lambda: _slots_idle(worker), timeout=5, what="the slot to be freed")
    w_finished = metric(worker, 'omni:requests_total{reason="length"}')
    assert w_finished == finished_before  # cancelled, not run to the end


def test_non_stream_disconnect_frees_slot(worker: Worker) -> None:
    body = {"prompt": "cancel me too", "ignore_eos": True}
    try:
        httpx.post(worker.url + "/v1/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    wait_until(lambda: _slots_idle(worker), timeout=5, what="the slot to be freed")


def test_include_usage_and_timings_in_stream(worker: Worker) -> None:
    body = {"messages": [{"role": "user", "content": "usage"}], "max_tokens": 5, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    _, chunks = stream_texts(worker, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals[0]["choices"][0]["finish_reason"] == "length"
    assert finals[0]["timings"]["predicted_n"] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_nvext_fields_accepted(worker: Worker) -> None:
    a = complete(worker, "nvext", max_tokens=8, temperature=0.7, nvext={"greedy_sampling": True, "top_k": 5})
    b = complete(worker, "nvext", max_tokens=8)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
