"""Embeddings and rerank on an embedding model (`omni-worker --embedding`), llama-server's shapes.

Routes: OpenAI's `/v1/embeddings`; llama-server's native `/embedding` and `/embeddings` (a list
of `{"index", "embedding": [[...]]}`: one vector, or one per token with pooling none); and
`/rerank` with its aliases `/v1/rerank`, `/reranking`, `/v1/reranking` (Jina's request and
response, with `top_n` and `return_documents`; TEI's when the body has `texts`, with `return_text`).

Every input becomes one engine task (`Task.is_embedding`): the engine evaluates its prompt in one
piece, batched with whatever else is in the step, and emits its pooled vector; nothing is
sampled. Pooled vectors are normalized here as llama-server's `embd_normalize` says (default 2,
Euclidean); with pooling none the per-token rows go out raw. A rerank score is the first element
of the rank-pooled output of `query` + `document` (llama-server's format_prompt_rerank).

A worker started with `--embedding` answers only these (and the tokenizer and status routes):
generation gets 501, as llama-server's `--embedding` ("restrict to only support embedding use
case"); a worker without it answers these with llama-server's 501.
"""

from __future__ import annotations

import asyncio
import base64
from functools import partial
from typing import Any, cast

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from worker.backends.base import Vocab
from worker.engine.engine import Engine
from worker.engine.task import EmbeddingEvent, ErrorEvent, Event, Task
from worker.protocol.errors import APIError, ErrorType, parse_model
from worker.protocol.sampling import SamplingParams
from worker.protocol.strict import StrictModel
from worker.server.context import native_tokens, ready_backend, worker_state
from worker.server.generation import _relay

_PARAMS = SamplingParams(temperature=0.0, cache_prompt=False)  # stateless: no prefix reuse
GENERATION_PATHS = frozenset({
    "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completion", "/completions", "/infill",
    "/v1/responses", "/responses",
})


class EmbeddingRequest(StrictModel):
    input: Any = None  # a string, ids, a mixed list, an object or a list of those (see _input_prompts)
    content: Any = None  # llama-server's native field (the answer is then native)
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    embd_normalize: int | None = None


class RerankRequest(StrictModel):
    """llama-server's rerank body (Jina / Cohere names) or TEI's (`texts`, `return_text`); the
    values are checked by `rerank` itself, with llama-server's messages."""

    query: Any = None
    documents: Any = None
    texts: Any = None  # TEI's name for `documents`: the answer is then TEI's list
    top_n: Any = None
    return_documents: bool = False  # each result carries its document
    return_text: bool = False  # TEI's: each result carries its text
    model: str | None = None


# --------------------------------------------------------------------------- engine tasks


class EmbeddingJob:
    """One request's inputs as engine tasks; `results()` submits them and waits for every one."""

    def __init__(self, engine: Engine, prompts: list[list[int]]) -> None:
        self._engine = engine
        self._relay = _relay(asyncio.get_running_loop(), engine)
        self._queue: asyncio.Queue[tuple[int, Event | EmbeddingEvent]] = asyncio.Queue()
        self.tasks = [
            Task(p, _PARAMS, 0, partial(self._emit, i), on_embedding=partial(self._emit, i))
            for i, p in enumerate(prompts)
        ]

    def _emit(self, index: int, event: Event | EmbeddingEvent) -> None:  # engine thread
        self._relay.push(self._queue, (index, event))  # type: ignore[arg-type]  # the relay only moves items

    async def results(self) -> list[EmbeddingEvent]:
        self._engine.submit_many(self.tasks)
        out: list[EmbeddingEvent | None] = [None] * len(self.tasks)
        pending = len(self.tasks)
        try:
            while pending:
                index, event = await self._queue.get()
                if isinstance(event, ErrorEvent):
                    raise APIError(
                        event.message, status_code=event.status_code, type=cast(ErrorType, event.type)
                    )
                if isinstance(event, EmbeddingEvent):
                    out[index] = event
                    pending -= 1
        finally:
            if pending:  # an error, or the client went away: the rest is not wanted
                for t in self.tasks:
                    t.cancel()
        return [e for e in out if e is not None]


def normalize(v: np.ndarray, kind: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 max-abs to int16 range, 2 Euclidean, p > 0 p-norm."""
    x = v.astype(np.float64)
    if kind < 0:
        return v
    if kind == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif kind == 2:
        total = float(np.sqrt((x * x).sum()))
    else:
        total = float((np.abs(x) ** kind).sum() ** (1.0 / kind))
    scale = 1.0 / total if total > 0.0 else 0.0
    out: np.ndarray = (v * np.float32(scale)).astype(np.float32)
    return out


# --------------------------------------------------------------------------- validation


def _not_enabled(what: str, flag: str) -> APIError:
    return APIError(f"This server does not support {what}. Start it with `{flag}`", status_code=501,
                    type="not_supported_error", code=501)


def _check_input(tokens: list[int], backend: Vocab) -> None:
    """llama-server's checks: an input pooled over all its rows (mean, cls, none) is evaluated in
    one ubatch; one read at its last row (last, causal rank) may go in pieces, like a prompt."""
    n = len(tokens)
    if n == 0:
        raise APIError("Input content cannot be empty", param="input")
    if backend.pools_in_pieces:
        if n >= backend.n_ctx_seq:
            raise APIError(
                f"request ({n} tokens) exceeds the available context size ({backend.n_ctx_seq} tokens), "
                "try increasing it",
                type="exceed_context_size_error", extra={"n_prompt_tokens": n, "n_ctx": backend.n_ctx_seq},
            )
        return
    if n > backend.n_ubatch:
        raise APIError(
            f"input ({n} tokens) is too large to process. increase the physical batch size "
            f"(current batch size: {backend.n_ubatch})", status_code=500, type="server_error",
        )
    if n > backend.n_ctx_seq:
        raise APIError(
            f"input ({n} tokens) is larger than the max context size ({backend.n_ctx_seq} tokens). skipping",
            type="exceed_context_size_error", extra={"n_prompt_tokens": n, "n_ctx": backend.n_ctx_seq},
        )


_BAD_INPUT = ("each input must be a string, a list of token ids, a list of both, "
              '{"prompt_string": ...} or {"content": [text parts]}')


async def _input_prompts(backend: Vocab, value: Any) -> list[list[int]]:
    """As llama-server's tokenize_input_prompts: a string, an array holding a number (text and
    ids mixed) or an object is one input; any other array is a list of inputs."""
    if not isinstance(value, list) or any(_is_id(x) for x in value):
        items: list[Any] = [value]
    else:
        items = value
    if not items:
        raise APIError('"input" must not be empty', param="input")
    prompts = []
    for i, item in enumerate(items):
        prompts.append(await _one_input(backend, item, f"input[{i}]" if len(items) > 1 else "input"))
    for tokens in prompts:
        _check_input(tokens, backend)
    return prompts


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


async def _one_input(backend: Vocab, item: Any, param: str) -> list[int]:
    """llama-server's tokenize_input_subprompt, plus OpenAI content arrays (text parts only)."""
    if isinstance(item, dict):
        if "content" in item:
            parts = item["content"]
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                raise APIError('"content" must be an array of content parts', param=param)
            kinds = {p.get("type", "text") for p in parts} - {"text"}
            if kinds:
                raise APIError(
                    f"content part type {sorted(kinds)[0]!r} is not supported by this model (text only)",
                    param=param,
                    type="not_supported_error",
                )
            text = "".join(str(p.get("text", "")) for p in parts)
            return await native_tokens(backend, text, param)
        if "multimodal_data" in item:
            raise APIError(
                "Multimodal data provided, but model does not support multimodal requests.", param=param
            )
        item = item.get("prompt_string")
    if isinstance(item, str) or (
        isinstance(item, list) and all(isinstance(x, str) or _is_id(x) for x in item)
    ):
        return await native_tokens(backend, item, param)
    raise APIError(_BAD_INPUT, param=param)


# --------------------------------------------------------------------------- embeddings


async def embeddings_oai(request: Request) -> Response:
    return await _embeddings(request, is_oai=True)


async def embeddings_native(request: Request) -> Response:
    return await _embeddings(request, is_oai=False)


async def _embeddings(request: Request, *, is_oai: bool) -> Response:
    state = worker_state(request)
    if not state.is_embedding:
        raise _not_enabled("embeddings", "--embeddings")
    backend = ready_backend(state)
    req = parse_model(EmbeddingRequest, await request.body())
    if is_oai and backend.pooling == "none":
        raise APIError("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
    if req.input is None and req.content is None:
        raise APIError('"input" or "content" must be provided', param="input")
    if req.input is None:
        is_oai = False  # "content" is not OpenAI's: llama-server answers natively
    if req.encoding_format not in ("float", "base64"):
        raise APIError("The format to return the embeddings in. Can be either float or base64",
                       param="encoding_format")
    if req.dimensions is not None:
        raise APIError(
            "dimensions is not supported: this model's embeddings have a fixed size", param="dimensions"
        )
    prompts = await _input_prompts(backend, req.input if req.input is not None else req.content)
    events = await EmbeddingJob(state.engine, prompts).results()
    kind = req.embd_normalize if req.embd_normalize is not None else state.embd_normalize
    vectors = [
        e.vectors if backend.pooling == "none" else normalize(e.vectors[0], kind)[None] for e in events
    ]
    if not is_oai:
        return JSONResponse([{"index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)])
    is_b64 = req.encoding_format == "base64"
    data = []
    for i, v in enumerate(vectors):
        item: dict[str, Any] = {
            "embedding": _b64(v[0]) if is_b64 else v[0].tolist(),
            "index": i,
            "object": "embedding",
        }
        if is_b64:
            item["encoding_format"] = "base64"
        data.append(item)
    n_tokens = sum(len(p) for p in prompts)
    return JSONResponse({
        "model": req.model or state.model_id, "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data,
    })


def _b64(v: np.ndarray) -> str:
    return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")


# --------------------------------------------------------------------------- rerank


def rerank_prompt(backend: Vocab, query: str, document: str) -> list[int]:
    """llama-server's format_prompt_rerank: the model's rerank template, else
    [BOS] query [EOS] [SEP] document [EOS] as the vocabulary's add_* flags say."""
    m = backend.meta
    if m.rerank_template is not None:
        text = m.rerank_template.replace("{query}", query).replace("{document}", document)
        return backend.tokenize(text, False, True)
    eos = m.eos_token_id if m.eos_token_id >= 0 else m.sep_token_id
    out = [m.bos_token_id] if m.add_bos and m.bos_token_id >= 0 else []
    out += backend.tokenize(query, False, False)
    out += [eos] if m.add_eos else []
    out += [m.sep_token_id] if m.add_sep else []
    out += backend.tokenize(document, False, False)
    out += [eos] if m.add_eos else []
    return out


async def rerank(request: Request) -> Response:
    state = worker_state(request)
    if not state.is_embedding:
        raise _not_enabled("reranking", "--reranking")
    backend = ready_backend(state)
    if backend.pooling != "rank":
        raise _not_enabled("reranking", "--reranking")
    req = parse_model(RerankRequest, await request.body())
    is_tei = req.texts is not None
    query = req.query
    if query is None:
        raise APIError('"query" must be provided', param="query")
    if not isinstance(query, str):
        raise APIError('"query" must be a string', param="query")
    docs = req.texts if is_tei else req.documents
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise APIError('"documents" must be a non-empty string array', param="documents")
    top_n = len(docs) if req.top_n is None else req.top_n
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise APIError('"top_n" must be a non-negative integer', param="top_n")
    prompts = [rerank_prompt(backend, query, d) for d in docs]
    for p in prompts:
        _check_input(p, backend)
    events = await EmbeddingJob(state.engine, prompts).results()
    label = "score" if is_tei else "relevance_score"
    results: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        item: dict[str, Any] = {"index": i, label: float(e.vectors[0, 0])}
        if is_tei and req.return_text:
            item["text"] = docs[i]
        elif not is_tei and req.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    results.sort(key=lambda r: -r[label])  # stable: equal scores keep input order
    results = results[:top_n]
    if is_tei:
        return JSONResponse(results)
    n_tokens = sum(len(p) for p in prompts)
    return JSONResponse({
        "model": req.model or state.model_id, "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results,
    })


# --------------------------------------------------------------------------- wiring


def routes() -> list[Route]:
    return [
        Route("/v1/embeddings", embeddings_oai, methods=["POST"]),
        Route("/embeddings", embeddings_native, methods=["POST"]),
        Route("/embedding", embeddings_native, methods=["POST"]),
        *(
            Route(p, rerank, methods=["POST"])
            for p in ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking")
        ),
    ]


class RefuseGeneration:
    """An embedding worker answers the generation routes with 501 (llama-server's `--embedding`)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in GENERATION_PATHS:
            err = APIError("This server does not support completions. Start it without `--embeddings`",
                           status_code=501, type="not_supported_error", code=501)
            await JSONResponse(err.body(), status_code=501, headers=err.headers)(scope, receive, send)
            return
        await self._app(scope, receive, send)

