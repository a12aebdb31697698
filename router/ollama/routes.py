"""Ollama's routes (every `/api/*` route but `/api/pull`, which the hub's download owns).

Generation and embeddings reach a model through the router's bridge (router/responses/bridge.py:
the same admission, queue, autoload, request traces and metrics as a proxied request); list,
ps and show read the pool and the model files (router/ollama/catalog.py). Names are Ollama's:
`tiny` and `tiny:latest` are one model (`Pool.get`; stripped here too, so the worker is sent
our own name). Errors raised here are `APIError`s; router.ollama.errors puts every error answer
on `/api/*` into Ollama's `{"error": "..."}`.

`keep_alive` sets the model's idle unload from that request on (`ModelHandle.set_keep_alive`);
a request without one puts the preset's `unload-after` back. An empty prompt (or no messages)
loads the model, or with `keep_alive: 0` lets it unload now.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from router.keys import views
from router.lifecycle.model import ModelHandle
from router.lifecycle.pool import Pool
from router.lifecycle.state import ModelState
from router.ollama import catalog
from router.ollama.translate import CHAT_PATH, Answer, chat_body, generate_body
from router.ollama.wire import (
    KeepAlive,
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaDeleteRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    OllamaShowRequest,
    keep_alive_seconds,
)
from router.responses.bridge import chunk_error
from worker.protocol.defaults import DEFAULT_PARALLEL
from worker.protocol.errors import APIError, not_found, parse_model

Chunk = dict[str, Any]
OpenChat = Callable[..., AbstractAsyncContextManager[AsyncIterator[Chunk]]]
CallJSON = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]
ResolveModel = Callable[[str | None, Scope], str]
VERSION = "0.12.6"  # the Ollama API version whose shapes these routes follow (clients gate features on it)
RUNNING = "Ollama is running"
_PRESETS = (
    "omni-router serves the models its presets name (--preset, --models-dir); {what}: edit the "
    "preset file and POST /models/reload"
)


class OllamaRoutes:
    def __init__(
        self, pool: Pool, open_chat: OpenChat, call_json: CallJSON, resolve_model: ResolveModel
    ) -> None:
        self.pool = pool
        self.open_chat = open_chat
        self.call_json = call_json
        self.resolve_model = resolve_model

    def routes(self) -> list[Route]:
        return [
            Route("/", self.running, methods=["GET", "HEAD"]),  # for clients that do not ask for HTML
            Route("/api/version", self.version, methods=["GET"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/embed", self.embed, methods=["POST"]),
            Route("/api/embeddings", self.embeddings, methods=["POST"]),
            Route("/api/delete", self.delete, methods=["DELETE"]),
            Route("/api/copy", self.copy, methods=["POST"]),
            Route("/api/create", self.create, methods=["POST"]),
            Route("/api/push", self.push, methods=["POST"]),
        ]

    # ---- names

    def _handle(self, name: str) -> tuple[ModelHandle, str]:
        """The model `name` is (404 otherwise) and our name for it (`x:latest` is `x`)."""
        handle = self.pool.get(name)
        base = name.removesuffix(":latest")
        if name != base and (handle is None or self.pool.get(base) is handle):
            handle, name = self.pool.get(base), base
        if handle is None:
            raise not_found(f"model '{name}' not found")
        return handle, name

    def _model(self, name: str, scope: Scope) -> tuple[ModelHandle, str]:
        handle, ours = self._handle(name)
        self.resolve_model(ours, scope)  # autoload off and not loaded: the proxy's 400
        return handle, ours

    # ---- status routes

    async def running(self, request: Request) -> Response:
        return PlainTextResponse(RUNNING)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def tags(self, request: Request) -> Response:
        """The request's key's models (router.keys), each variant (docs/swaps.md) right after its
        base: a model of its own to a client, with its base's file (no load of its own)."""
        shown = [([h.name] if views.is_visible(h) else []) + self.pool.variant_names(h.name)
                 for h in self.pool.handles.values()]  # (a key may use a variant and not its base)
        handles = [h for h, names in zip(self.pool.handles.values(), shown, strict=True) if names]
        facts = await asyncio.to_thread(lambda: [catalog.facts(h.preset) for h in handles])
        models = []
        for h, f, names in zip(handles, facts, [n for n in shown if n], strict=True):
            for name in names:
                models.append({
                    "name": catalog.ollama_name(name),
                    "model": catalog.ollama_name(name),
                    "modified_at": catalog.iso(f.modified),
                    "size": f.size,
                    "digest": f.digest,
                    "details": catalog.details(f, _meta(h).get("n_params")),
                })
        return JSONResponse({"models": models})

    async def ps(self, request: Request) -> Response:
        handles = [  # the request's key's models (router.keys)
            h
            for h in views.visible(self.pool.handles.values())
            if h.state in (ModelState.READY, ModelState.SLEEPING)
        ]
        facts = await asyncio.to_thread(lambda: [catalog.facts(h.preset) for h in handles])
        out = []
        for h, f in zip(handles, facts, strict=True):
            ram, vram = h.charge()
            due = h.unload_at()
            meta = _meta(h)
            out.append(
                {
                    "name": catalog.ollama_name(h.name),
                    "model": catalog.ollama_name(h.name),
                    "size": ram + vram or f.size,
                    "digest": f.digest,
                    "details": catalog.details(f, meta.get("n_params")),
                    "expires_at": catalog.iso(due),
                    "size_vram": vram,
                    "context_length": _num_ctx(h, f.context_length),
                }
            )
        return JSONResponse({"models": out})

    async def show(self, request: Request) -> Response:
        req = parse_model(OllamaShowRequest, await request.body())
        name = req.model or req.name
        if not name:
            raise APIError("'model' is required", param="model")
        handle, _ = self._handle(name)
        f = await asyncio.to_thread(catalog.facts, handle.preset)
        info = {
            **f.model_info,
            **(await asyncio.to_thread(catalog.vocabulary, handle.preset) if req.verbose else {}),
        }
        meta = _meta(handle)
        num_ctx = _num_ctx(handle, f.context_length)
        params = [f"num_ctx {num_ctx}"] + ([f"stop {json.dumps(f.eos_text)}"] if f.eos_text else [])
        source = handle.preset.model or handle.preset.upstream
        if not views.sees_internals():  # the file's path: admin keys, or a router without keys
            source = name
        modelfile = (
            "\n".join(
                [
                    f"# Modelfile of {name}, from omni-router's preset",
                    f"FROM {source}",
                    *(f"PARAMETER {p}" for p in params),
                ]
            )
            + "\n"
        )
        return JSONResponse(
            {
                "license": "",
                "modelfile": modelfile,
                "parameters": "\n".join(params),
                "template": f.template,
                "details": catalog.details(f, meta.get("n_params")),
                "model_info": info,
                "capabilities": catalog.capabilities(handle.preset, f, meta),
                "modified_at": catalog.iso(f.modified),
            }
        )

    # ---- generation

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        req = parse_model(OllamaChatRequest, await request.body())
        handle, model = self._model(req.model, request.scope)
        _keep_alive(handle, req.keep_alive)
        answer = Answer(req.model, is_chat=True, started=started)
        if not req.messages:
            return await self._load_only(handle, answer, req.keep_alive)
        body = chat_body(req, model)
        await self._bound_context(handle, req.options, body)
        return await self._answer(model, CHAT_PATH, body, answer, req.stream)

    async def generate(self, request: Request) -> Response:
        started = time.monotonic()
        req = parse_model(OllamaGenerateRequest, await request.body())
        handle, model = self._model(req.model, request.scope)
        _keep_alive(handle, req.keep_alive)
        answer = Answer(req.model, is_chat=False, started=started)
        if not req.prompt and req.suffix is None and not req.images:
            return await self._load_only(handle, answer, req.keep_alive)
        path, body = generate_body(req, model)
        await self._bound_context(handle, req.options, body)
        return await self._answer(model, path, body, answer, req.stream)

    async def _bound_context(
        self, handle: ModelHandle, options: OllamaOptions | None, body: dict[str, Any]
    ) -> None:
        """`num_ctx` bounds the request's window: the context a model runs with is its preset's
        `ctx-size` (one worker serves every client; Ollama reloads the model per num_ctx, we do
        not), so a larger num_ctx (Home Assistant sends 8192, Continue its contextLength) runs in
        that context, and a smaller one also bounds the output to num_ctx tokens."""
        if options is None or options.num_ctx is None:
            return
        n_ctx = _num_ctx(handle, 0)
        if not n_ctx or options.num_ctx >= n_ctx:
            return
        key = "n_predict" if "input_prefix" in body else "max_tokens"
        body[key] = min(int(body.get(key) or options.num_ctx), options.num_ctx)

    async def _load_only(self, handle: ModelHandle, answer: Answer, keep_alive: KeepAlive | None) -> Response:
        """No prompt: load the model (Ollama's preload), or with keep_alive 0 let it unload now."""
        if keep_alive is not None and keep_alive_seconds(keep_alive) == 0:
            reason = "unload"  # set_keep_alive(0) poked the owner: an idle model unloads now
        else:
            await handle.ensure_ready()
            handle.release()  # the idle timer starts now
            reason = "load"
        done = answer.final(whole=True)
        done.update(done_reason=reason, eval_count=0, prompt_eval_count=0)
        return JSONResponse(done)

    async def _answer(
        self, model: str, path: str, body: dict[str, Any], answer: Answer, stream: bool
    ) -> Response:
        if not stream and path == CHAT_PATH:  # one body from the worker: no stream to fold
            body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        stack = AsyncExitStack()
        chunks = await stack.enter_async_context(
            self.open_chat(model, body, route="/api/" + ("chat" if answer.is_chat else "generate"), path=path)
        )
        answer.admitted = time.monotonic()
        if stream:
            return StreamingResponse(self._ndjson(answer, stack, chunks), media_type="application/x-ndjson")
        async with stack:
            async for chunk in chunks:
                failed = chunk_error(chunk)
                if failed is not None:
                    raise APIError(failed, status_code=500, type="server_error")
                answer.feed(chunk)
        return JSONResponse(answer.final(whole=True))

    async def _ndjson(
        self, answer: Answer, stack: AsyncExitStack, chunks: AsyncIterator[Chunk]
    ) -> AsyncIterator[bytes]:
        async with stack:
            async for chunk in chunks:
                failed = chunk_error(chunk)
                if failed is not None:
                    yield _line({"error": failed})  # as Ollama ends a stream that fails midway
                    return
                for obj in answer.feed(chunk):
                    yield _line(obj)
            yield _line(answer.final())

    # ---- embeddings

    async def embed(self, request: Request) -> Response:
        started = time.monotonic()
        req = parse_model(OllamaEmbedRequest, await request.body())
        handle, model = self._model(req.model, request.scope)
        _keep_alive(handle, req.keep_alive)
        _no_sampling(req.options)
        inputs = [req.input] if isinstance(req.input, str) else list(req.input)
        await handle.ensure_ready()  # loads it if need be: load_duration
        handle.release()
        loaded = time.monotonic()
        if not inputs:
            return JSONResponse({"model": req.model, "embeddings": []})
        out = await self._embed(model, inputs, req.truncate)
        vectors = [_shorten(v, req.dimensions) for v in out["vectors"]]
        return JSONResponse(
            {
                "model": req.model,
                "embeddings": vectors,
                "total_duration": int((time.monotonic() - started) * 1e9),
                "load_duration": int((loaded - started) * 1e9),
                "prompt_eval_count": out["prompt_tokens"],
            }
        )

    async def embeddings(self, request: Request) -> Response:
        req = parse_model(OllamaEmbeddingsRequest, await request.body())
        handle, model = self._model(req.model, request.scope)
        _keep_alive(handle, req.keep_alive)
        _no_sampling(req.options)
        if not req.prompt:
            await handle.ensure_ready()
            handle.release()
            return JSONResponse({"embedding": []})
        out = await self._embed(model, [req.prompt], truncate=True)
        return JSONResponse({"embedding": out["vectors"][0]})

    async def _embed(self, model: str, inputs: list[str], truncate: bool) -> dict[str, Any]:
        """The vectors; with `truncate`, an input longer than the model takes (its context, or
        for a pooled embedding one batch) is cut to fit, its first tokens kept as Ollama does,
        and sent again as token ids. Without it, such an input is a 400."""
        body: dict[str, Any] = {"model": model, "input": inputs}
        for attempt in range(3):
            try:
                data = await self.call_json(model, "/v1/embeddings", body)
                break
            except APIError as e:
                limit = _input_limit(e)
                if limit is None:
                    raise
                if not truncate or attempt == 2:
                    raise APIError(f"the input is longer than the model takes ({limit} tokens): {e.message}; "
                                   "truncate: true cuts it to fit", param="input") from None
                ids = []
                for text in inputs:
                    tok = await self.call_json(model, "/tokenize", {"content": text, "add_special": False})
                    ids.append(tok["tokens"][: max(1, limit - 2)])  # room for the BOS/EOS the worker adds
                body = {"model": model, "input": ids}
        rows = sorted(data["data"], key=lambda d: d["index"])
        return {
            "vectors": [r["embedding"] for r in rows],
            "prompt_tokens": int((data.get("usage") or {}).get("prompt_tokens", 0)),
        }

    # ---- model management: what fits presets, else a clear refusal

    async def delete(self, request: Request) -> Response:
        req = parse_model(OllamaDeleteRequest, await request.body())
        self._handle(req.model or req.name or "")
        raise APIError(
            _PRESETS.format(what="a model leaves by removing its preset (its file is yours to delete)"),
            param="model",
        )

    async def copy(self, request: Request) -> Response:
        req = parse_model(OllamaCopyRequest, await request.body())
        self._handle(req.source)
        raise APIError(
            _PRESETS.format(
                what=f"another name for a model is an `aliases` entry of its preset "
                f'(aliases = ["{req.destination}"])'
            ),
            param="destination",
        )

    async def create(self, request: Request) -> Response:
        raise APIError(
            _PRESETS.format(
                what="a model is created by a [models.NAME] table (model = the GGUF file, "
                "chat-template, ctx-size, sampling defaults)"
            ),
            param="model",
        )

    async def push(self, request: Request) -> Response:
        raise APIError(
            "omni-router does not push models to a registry (models come from files and hub "
            "pulls: POST /api/pull)",
            param="model",
        )


def _meta(h: ModelHandle) -> dict[str, Any]:
    """The loaded worker's own facts (n_ctx, n_params, fim), or nothing before a load."""
    if h.info is None or h.state is ModelState.UNLOADED:
        return {}
    meta = h.info.get("meta")
    return meta if isinstance(meta, dict) else {}


def _num_ctx(h: ModelHandle, trained: int) -> int:
    """The context one request runs in: the loaded worker's, else the preset's ctx-size shared by
    its slots (the worker's split), else the context the model was trained with."""
    loaded = _meta(h).get("n_ctx")
    if isinstance(loaded, int) and loaded > 0:
        return loaded
    if h.preset.ctx_size:
        return h.preset.ctx_size // (h.preset.parallel or DEFAULT_PARALLEL)
    return trained


def _keep_alive(handle: ModelHandle, value: KeepAlive | None) -> None:
    try:
        seconds = None if value is None else keep_alive_seconds(value)
    except ValueError as e:
        raise APIError(str(e), param="keep_alive") from None
    handle.set_keep_alive(seconds)


def _no_sampling(options: OllamaOptions | None) -> None:
    """An embedding takes no sampling option: one sent is refused, not ignored."""
    if options is not None and (sent := sorted(options.model_dump(exclude_none=True))):
        raise APIError(f"options {', '.join(sent)} do not apply to embeddings", param="options")


def _shorten(v: list[float], dimensions: int | None) -> list[float]:
    """Ollama's `dimensions`: the first n values, normalized again (Matryoshka embeddings)."""
    if dimensions is None:
        return v
    if dimensions > len(v):
        raise APIError(f"dimensions {dimensions} is larger than the model's {len(v)}", param="dimensions")
    head = v[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


_BATCH = re.compile(r"current batch size: (\d+)")


def _input_limit(e: APIError) -> int | None:
    """The tokens an embedding input may have, from the worker's refusal of a longer one (its
    context, or one physical batch for a pooled embedding: llama-server's messages); None when
    `e` is another error."""
    n_ctx = e.extra.get("n_ctx")
    if e.type == "exceed_context_size_error" and isinstance(n_ctx, int):
        return n_ctx
    m = _BATCH.search(e.message)
    return int(m.group(1)) if m else None



def _line(obj: Chunk) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"
