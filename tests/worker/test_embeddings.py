"""Embeddings and rerank on our own workers (`omni-worker --embedding` / `--rerank`), both backends.

Real worker processes on the tiny model: the F32 GGUF (llama.cpp, F32 KV, no flash attention)
and its HF twin (torch, float32). With random weights nothing is semantic, so the checks are
exact ones: the twins agree, the OpenAI SDK's float and base64 answers agree, a rerank score is
the rank-pooled output of the prompt llama-server builds (read back through /embedding on the
same worker), an input's vector does not depend on what was batched with it, and N inputs of one
request take fewer engine steps than N. Rerank runs on two models: the tiny llama (no classifier
head: llama.cpp's score is the last row's first element) and the tiny Qwen3-Reranker look-alike
(a yes/no classifier head: in the GGUF as llama.cpp's converter writes it, from the LM head in
the HF folder).
"""

from __future__ import annotations

import base64
import contextlib
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.util import run_worker, wait_until
from tests.worker.conftest import EXACT_GGUF_ARGS, require_backend
from worker.server.cli import main as worker_main
from worker.testing.tiny_models import ModelPaths
from worker.text.rerank import QWEN3_RERANK_TEMPLATE

BACKENDS = ("llama_cpp", "torch")
N_SLOTS = 4
COMMON = ["--parallel", str(N_SLOTS), "--ctx-size", "1024", "--threads", "1"]  # 256 cells a slot
TEXTS = ["Hello world, the quick brown fox", "router worker slot batch", "café naïve 東京 🙂", "a",
         "def f(x):\n    return x + 1\n"]
DOCS = ["the model token router", "hello world yes no maybe", "SELECT id, name FROM users WHERE id = 7;",
        "quick brown fox jumps over lazy dog"]
QUERY = "quick brown fox"


def _args(backend: str, models: ModelPaths) -> tuple[Path, list[str]]:
    if backend == "llama_cpp":
        return models.gguf_f32, EXACT_GGUF_ARGS
    return models.hf_dir, ["--backend", "torch", "--dtype", "float32"]


class Workers:
    """Workers started on first use and kept to the end of the module, one per (backend, model,
    flags): the fixtures and the twin tests that want the same worker share its process (a torch
    worker takes seconds to start). Tests only send requests to them; none changes a worker's
    state, and the engine-step counts are read as differences."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._urls: dict[tuple[str, str, tuple[str, ...]], str] = {}

    def get(self, backend: str, models: ModelPaths, *flags: str) -> str:
        require_backend(backend)
        model, extra = _args(backend, models)
        key = (backend, str(model), flags)
        if key not in self._urls:
            self._urls[key] = self._stack.enter_context(
                run_worker(model, *COMMON, *extra, *flags, timeout=120)
            )
        return self._urls[key]


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    with contextlib.ExitStack() as stack:
        yield Workers(stack)


EMBED_FLAGS = ("--embedding", "--pooling", "mean", "--ubatch-size", "512")


@pytest.fixture(scope="module", params=BACKENDS)
def embed(request: pytest.FixtureRequest, tiny_models: ModelPaths, workers: Workers) -> str:
    """An embedding worker, mean pooling; its ubatch (512, 510 on llama.cpp) is above its 256 cells a slot."""
    return workers.get(request.param, tiny_models, *EMBED_FLAGS)


RERANKERS = [(b, m) for m in ("llama", "qwen3-reranker") for b in BACKENDS]


@pytest.fixture(scope="module", params=RERANKERS, ids=[f"{b}-{m}" for b, m in RERANKERS])
def reranker(
    request: pytest.FixtureRequest, tiny_models: ModelPaths, tiny_reranker: ModelPaths, workers: Workers
) -> str:
    backend, kind = request.param
    return workers.get(backend, tiny_models if kind == "llama" else tiny_reranker, "--reranking")


def _is_qwen3_reranker(url: str) -> bool:
    return "reranker" in httpx.get(url + "/props", timeout=10).json()["model_path"]


def _post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _tokens(url: str, text: str) -> list[int]:
    tokens: list[int] = _post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    return tokens


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _vectors(url: str, inputs: object, **extra: object) -> np.ndarray:
    r = _post(url, "/v1/embeddings", {"input": inputs, **extra})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


# --------------------------------------------------------------------------- embeddings


def test_openai_sdk_float_and_base64(embed: str) -> None:
    client = openai.OpenAI(base_url=embed + "/v1", api_key="unused")
    floats = client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    b64 = client.embeddings.create(model="m", input=TEXTS, encoding_format="base64")
    default = client.embeddings.create(model="m", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.model == "m"
    a = np.array([d.embedding for d in floats.data])
    assert a.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)  # L2 by default, as llama-server
    decoded = [
        np.frombuffer(base64.b64decode(str(d.embedding)), "<f4") for d in b64.data
    ]  # asked for: left encoded
    assert np.array_equal(np.array(decoded), a.astype(np.float32))
    assert np.array_equal(
        np.array([d.embedding for d in default.data], dtype=np.float32), a.astype(np.float32)
    )
    n_tokens = sum(len(_tokens(embed, t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n_tokens
    raw = _post(embed, "/v1/embeddings", {"input": "a", "encoding_format": "base64"}).json()["data"][0]
    assert raw["encoding_format"] == "base64" and raw["object"] == "embedding"
    assert np.frombuffer(base64.b64decode(raw["embedding"]), "<f4").shape == (64,)


def test_native_shapes_and_normalization(embed: str) -> None:
    r = _post(embed, "/embedding", {"content": TEXTS[:2]})
    assert r.status_code == 200
    body = r.json()
    assert [x["index"] for x in body] == [0, 1]
    assert all(len(x["embedding"]) == 1 and len(x["embedding"][0]) == 64 for x in body)  # one pooled vector
    native = np.array([x["embedding"][0] for x in body])
    assert np.array_equal(native, _vectors(embed, TEXTS[:2]))
    assert (
        r.json() == _post(embed, "/embeddings", {"input": TEXTS[:2]}).json()
    )  # llama-server: /embeddings is native
    raw = np.array(
        _post(embed, "/embedding", {"content": TEXTS[0], "embd_normalize": -1}).json()[0]["embedding"][0]
    )
    np.testing.assert_allclose(raw / np.linalg.norm(raw), native[0], atol=1e-6)
    taxicab = np.array(_vectors(embed, TEXTS[0], embd_normalize=1)[0])
    np.testing.assert_allclose(np.abs(taxicab).sum(), 1.0, atol=1e-5)
    # "content" on /v1/embeddings is llama-server's native request: the answer is native too
    assert isinstance(_post(embed, "/v1/embeddings", {"content": "a"}).json(), list)


def test_token_inputs_as_openai_allows(embed: str) -> None:
    ids = [_tokens(embed, t) for t in TEXTS[:3]]
    text_vectors = _vectors(embed, TEXTS[:3])
    assert np.array_equal(_vectors(embed, ids[0]), text_vectors[:1])  # one list of ids: one input
    assert np.array_equal(_vectors(embed, ids), text_vectors)  # a list of lists: several
    assert np.array_equal(_vectors(embed, [TEXTS[0], ids[1]]), text_vectors[:2])  # mixed


def test_object_inputs_as_llama_server_takes(embed: str) -> None:
    hello = _vectors(embed, "hello world")
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    assert np.array_equal(_vectors(embed, parts), hello)
    assert np.array_equal(
        _vectors(embed, ["a", {"prompt_string": "hello world"}, parts])[1:], np.vstack([hello, hello])
    )
    r = _post(
        embed, "/v1/embeddings", {"input": {"content": [{"type": "image_url", "image_url": {"url": "x"}}]}}
    )
    assert r.status_code == 400 and "not supported by this model" in r.json()["error"]["message"]


def test_same_vector_alone_or_batched(embed: str) -> None:
    """Determinism: an input's vector does not depend on what shares its engine step."""
    alone = _vectors(embed, TEXTS[0], embd_normalize=-1)[0]
    n = len(_tokens(embed, TEXTS[0]))
    same_length = [[7 + i] * n for i in range(3)]  # on llama.cpp these share one llama_decode
    batched = _vectors(embed, [*TEXTS[1:], TEXTS[0], *same_length], embd_normalize=-1)[len(TEXTS) - 1]
    diff = float(np.abs(batched - alone).max())
    print(f"alone vs batched: max abs diff {diff:.3g}")
    assert (
        diff == 0.0
    )  # torch on the CPU: batch-invariant rows; llama.cpp: mean-pooled sequences never share a call
    one = _vectors(embed, [[42]], embd_normalize=-1)[
        0
    ]  # one-token inputs: llama.cpp's one-row kernel either way
    assert np.array_equal(_vectors(embed, [[42], [43], [44], TEXTS[1]], embd_normalize=-1)[0], one)


def test_inputs_of_one_request_share_engine_steps(embed: str) -> None:
    """8 inputs on 4 slots: 2 engine steps (each evaluates 4 prompts in one batch), not 8."""
    steps, done = _metric(embed, "llamacpp:n_decode_total"), _metric(embed, "omni:embeddings_total")
    _vectors(embed, [f"{t} {i}" for i, t in enumerate(TEXTS + TEXTS[:3])])
    assert _metric(embed, "omni:embeddings_total") - done == 8
    assert _metric(embed, "llamacpp:n_decode_total") - steps == 2

    steps = _metric(embed, "llamacpp:n_decode_total")
    with ThreadPoolExecutor(8) as ex:  # concurrent requests: whatever waits at a step shares it
        codes = list(
            ex.map(lambda i: _post(embed, "/v1/embeddings", {"input": [i + 1] * 120}).status_code, range(8))
        )
    assert codes == [200] * 8
    n_steps = _metric(embed, "llamacpp:n_decode_total") - steps
    print(f"8 concurrent one-input requests: {n_steps:.0f} engine steps")  # timing: not asserted


@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_requests_share_an_engine_step(backend: str, tiny_models: ModelPaths) -> None:
    """Inputs of three requests that wait together are evaluated in one engine step (in-process:
    the engine is held in a command while they arrive, so the test does not race the engine)."""
    require_backend(backend)
    from worker.backends import BackendOptions, load_backend
    from worker.engine.engine import Engine
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.task import EmbeddingEvent, Task
    from worker.server.embeddings import _PARAMS

    options = BackendOptions(
        n_ctx=1024,
        n_slots=N_SLOTS,
        n_batch=125,
        n_ubatch=125,
        threads=1,
        cache_type_k="f32",
        cache_type_v="f32",
        flash_attn="off",
        dtype="float32",
        embedding=True,
        pooling="mean",
    )
    model = _args(backend, tiny_models)[0]
    metrics = WorkerMetrics()
    engine = Engine(lambda progress: load_backend(backend, str(model), options, progress), N_SLOTS, metrics)  # type: ignore[arg-type]
    engine.start()
    try:
        wait_until(lambda: engine.status.is_ready, 60, what="model loaded")
        gate = threading.Event()
        held = engine.call(gate.wait)
        done: list[EmbeddingEvent] = []
        for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):  # three requests, submitted one by one
            engine.submit(Task(prompt, _PARAMS, 0, lambda e: None, on_embedding=done.append))
        gate.set()
        held.result(10)
        wait_until(lambda: len(done) == 3, 30, what="three embeddings")
        assert metrics.n_decode.value == 1  # one step evaluated all three
    finally:
        engine.stop()


def test_gguf_and_hf_twins_agree(tiny_models: ModelPaths, workers: Workers) -> None:
    """Normalized embeddings of the F32 GGUF and the HF folder agree to 1e-4, every pooling; with
    last pooling an input longer than the ubatch goes in pieces (as llama-server's can_split).
    Mean pooling on the `embed` workers (ubatch 512: these inputs fit either way)."""
    require_backend("torch")
    long_input = [(7 * i) % 1000 + 3 for i in range(200)]
    for pooling in ("mean", "last", "cls"):
        out = []
        for backend in BACKENDS:
            flags = EMBED_FLAGS if pooling == "mean" else (
                "--embedding", "--pooling", pooling, "--ubatch-size", "128")
            url = workers.get(backend, tiny_models, *flags)
            inputs: list[object] = [*TEXTS, long_input] if pooling == "last" else list(TEXTS)
            steps = _metric(url, "llamacpp:n_decode_total")
            out.append(_vectors(url, inputs))
            if pooling == "last":
                assert _metric(url, "llamacpp:n_decode_total") - steps >= 2  # the long one took 2 steps
                r = _post(url, "/v1/embeddings", {"input": [5] * 256})
                assert r.status_code == 400
                assert "exceeds the available context size (256 tokens)" in r.json()["error"]["message"]
        diff = float(np.abs(out[0] - out[1]).max())
        print(f"pooling {pooling}: GGUF vs HF max abs diff {diff:.3g}")
        assert diff < 1e-4


def test_pooling_none_gives_token_vectors(tiny_models: ModelPaths, workers: Workers) -> None:
    url = workers.get("llama_cpp", tiny_models, "--embedding", "--pooling", "none")
    n = len(_tokens(url, TEXTS[0]))
    rows = _post(url, "/embedding", {"content": TEXTS[0]}).json()[0]["embedding"]
    assert len(rows) == n and all(len(r) == 64 for r in rows)
    r = _post(url, "/v1/embeddings", {"input": TEXTS[0]})
    assert (
        r.status_code == 400
        and "Pooling type 'none' is not OAI compatible" in r.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"input": ""}, 400, "Input content cannot be empty"),
        ({"input": []}, 400, '"input" must not be empty'),
        ({"input": ["a", ""]}, 400, "Input content cannot be empty"),
        ({}, 400, '"input" or "content" must be provided'),
        ({"input": [5] * 300}, 400, "is larger than the max context size (256 tokens)"),
        ({"input": [5] * 600}, 500, "too large to process. increase the physical batch size"),
        ({"input": "a", "dimensions": 32}, 400, "dimensions is not supported"),
        ({"input": "a", "encoding_format": "int8"}, 400, "Can be either float or base64"),
        ({"input": [1, 99999]}, 400, "out of range"),
        ({"input": [{"type": "image_url"}]}, 400, "each input must be"),
        ({"input": [True, False]}, 400, "each input must be"),
    ],
)
def test_bad_requests(embed: str, body: dict[str, object], status: int, needle: str) -> None:
    r = _post(embed, "/v1/embeddings", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    if status == 400 and "context size" in needle:
        assert (
            err["type"] == "exceed_context_size_error"
            and err["n_ctx"] == 256
            and err["n_prompt_tokens"] == 300
        )


def test_an_embedding_worker_does_not_generate(embed: str) -> None:
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/completion", {"prompt": "hi"})]:
        r = _post(embed, path, body)
        assert r.status_code == 501
        assert (
            r.json()["error"]["message"]
            == "This server does not support completions. Start it without `--embeddings`"
        )
    r = _post(embed, "/rerank", {"query": "a", "documents": ["b"]})
    assert r.status_code == 501 and "Start it with `--reranking`" in r.json()["error"]["message"]
    assert _post(embed, "/tokenize", {"content": "hi"}).status_code == 200


def test_a_generating_worker_has_no_embeddings(tiny_models: ModelPaths) -> None:
    with run_worker(tiny_models.gguf_f32, "--threads", "1", "--parallel", "1") as url:
        r = _post(url, "/v1/embeddings", {"input": "a"})
        assert r.status_code == 501
        assert r.json()["error"] == {
            "message": "This server does not support embeddings. Start it with `--embeddings`",
            "type": "not_supported_error", "param": None, "code": 501,
        }
        assert _post(url, "/v1/rerank", {"query": "a", "documents": ["b"]}).status_code == 501


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--pooling", "mean"], "add --embedding"),
        (["--embedding", "--pooling", "max"], "'max' is not one of none, mean, cls, last, rank"),
        (["--rerank", "--pooling", "mean"], "--rerank pools with rank"),
    ],
)
def test_cli_refuses_pooling_it_cannot_honour(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        worker_main(["-m", "models/tiny-llama-f32.gguf", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


# --------------------------------------------------------------------------- rerank


def _scores(url: str, **extra: object) -> list[float]:
    """Scores in document order."""
    r = _post(url, "/v1/rerank", {"model": "m", "query": QUERY, "documents": DOCS, **extra})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    scores = [0.0] * len(DOCS)
    for x in results:
        scores[x["index"]] = x["relevance_score"]
    return scores


def test_rerank_scores_are_the_rank_pooled_prompt(reranker: str) -> None:
    """Each score is the rank-pooled output of llama-server's rerank prompt (the model's rerank
    template; else query then document, no special tokens for this vocabulary), read back
    through /embedding, un-normalized: one number, or P(yes), P(no) with a classifier head."""
    r = _post(reranker, "/v1/rerank", {"model": "m", "query": QUERY, "documents": DOCS})
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m"
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    assert [x["relevance_score"] for x in results] == sorted(
        (x["relevance_score"] for x in results), reverse=True
    )
    is_qwen = _is_qwen3_reranker(reranker)
    q = _post(reranker, "/tokenize", {"content": QUERY, "parse_special": False}).json()["tokens"]
    n_tokens = 0
    for x in results:
        doc = DOCS[x["index"]]
        if is_qwen:
            text = QWEN3_RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", doc)
            prompt = _post(reranker, "/tokenize", {"content": text, "parse_special": True}).json()["tokens"]
        else:
            prompt = (
                q + _post(reranker, "/tokenize", {"content": doc, "parse_special": False}).json()["tokens"]
            )
        n_tokens += len(prompt)
        direct = _post(reranker, "/embedding", {"content": prompt, "embd_normalize": -1}).json()[0][
            "embedding"
        ]
        assert len(direct) == 1 and len(direct[0]) == (2 if is_qwen else 1)
        assert direct[0][0] == pytest.approx(x["relevance_score"], abs=1e-6)
        if is_qwen:
            assert 0.0 < x["relevance_score"] < 1.0 and sum(direct[0]) == pytest.approx(1.0, abs=1e-6)
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}


def test_rerank_top_n_documents_aliases_and_tei(reranker: str) -> None:
    scores = _scores(reranker)
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    r = _post(reranker, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True})
    results = r.json()["results"]
    assert [x["index"] for x in results] == best[:2]
    assert [x["document"]["text"] for x in results] == [DOCS[i] for i in best[:2]]
    for path in ("/reranking", "/v1/reranking"):
        assert _post(reranker, path, {"query": QUERY, "documents": DOCS}).json()["results"] == _post(
            reranker, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
    tei = _post(reranker, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert [x["index"] for x in tei] == best and [x["text"] for x in tei] == [DOCS[i] for i in best]
    assert [x["score"] for x in tei] == pytest.approx([scores[i] for i in best], abs=1e-6)


@pytest.mark.parametrize(
    "body",
    [
        {"documents": ["a"]},
        {"query": 1, "documents": ["a"]},
        {"query": "q", "documents": []},
        {"query": "q", "documents": None},
        {"query": "q", "documents": 123},
        {"query": "q", "documents": [1, 2]},
        {"query": "q", "documents": ["a"], "top_n": -1},
    ],
)
def test_rerank_bad_requests(reranker: str, body: dict[str, object]) -> None:
    r = _post(reranker, "/rerank", body)
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize("kind", ["llama", "qwen3-reranker"])
def test_rerank_gguf_and_hf_twins_agree(
    kind: str, tiny_models: ModelPaths, tiny_reranker: ModelPaths, workers: Workers
) -> None:
    require_backend("torch")
    out = []
    for backend in BACKENDS:
        url = workers.get(backend, tiny_models if kind == "llama" else tiny_reranker, "--reranking")
        out.append(np.array(_scores(url)))
    diff = float(np.abs(out[0] - out[1]).max())
    print(
        f"rerank scores ({kind}): GGUF vs HF max abs diff {diff:.3g}; scores {np.round(out[0], 4).tolist()}"
    )
    assert diff < 1e-4
