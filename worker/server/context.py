"""What every handler needs first: the worker state, a ready (or awake) backend, and the
request's text as checked token ids. Shared by the handler modules (app, embeddings)."""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio.to_thread
from starlette.requests import Request

from worker.backends.base import Vocab
from worker.protocol.errors import APIError
from worker.protocol.wire import NativePrompt
from worker.server.state import WorkerState

K = TypeVar("K")
V = TypeVar("V")

_LONG_TEXT = 8192  # characters: above this, tokenize off the event loop


class BackendLRU(Generic[K, V]):
    """A small LRU of values derived from one backend's vocabulary (bounded in entries and in
    the keys' total weight); it empties itself when asked about another backend object (a new
    model). Event-loop thread only."""

    def __init__(
        self, max_entries: int, max_weight: int = 1 << 62, weight: Callable[[K], int] = lambda k: 0
    ) -> None:
        self.max_entries = max_entries
        self.max_weight = max_weight
        self._weight = weight
        self._owner: weakref.ref[Vocab] | None = None
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._total = 0

    def _check_owner(self, backend: Vocab) -> None:
        if self._owner is None or self._owner() is not backend:
            self._entries.clear()
            self._total = 0
            self._owner = weakref.ref(backend)

    def get(self, backend: Vocab, key: K) -> V | None:
        self._check_owner(backend)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, backend: Vocab, key: K, value: V) -> None:
        self._check_owner(backend)
        w = self._weight(key)
        if key in self._entries or w > self.max_weight:
            return
        self._entries[key] = value
        self._total += w
        while len(self._entries) > self.max_entries or self._total > self.max_weight:
            old, _ = self._entries.popitem(last=False)
            self._total -= self._weight(old)


# The token ids of recently tokenized texts. A chat UI, an agent loop or a client that retries
# sends the same rendered prompt again, and a cached answer is sampled from saved logits:
# tokenizing the prompt (~0.3 ms for 30 tokens with special-token parsing on llama.cpp) was a
# large share of such a request's worker time. Tokenization is a function of the vocabulary and
# the text, so a hit gives the same ids.
_token_cache: BackendLRU[tuple[str, bool, bool], tuple[int, ...]] = BackendLRU(
    256, max_weight=1 << 20, weight=lambda key: len(key[0])
)


def worker_state(request: Request) -> WorkerState:
    state: WorkerState = request.app.state.worker
    return state


def loading_error(state: WorkerState) -> APIError | None:
    st = state.engine.status
    if st.error is not None:
        return APIError(f"Model failed to load: {st.error}", status_code=500, type="server_error", code=500)
    if not st.is_ready:
        return APIError(
            "Loading model",
            status_code=503,
            type="unavailable_error",
            code=503,
            extra={"progress": {"phase": st.phase, "fraction": round(st.fraction, 4)}},
        )
    return None


def ready_backend(state: WorkerState) -> Vocab:
    err = loading_error(state)
    if err is not None:
        raise err
    backend = state.engine.backend
    assert backend is not None
    return backend


async def tokenize_text(backend: Vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    key = (text, add_special, parse_special)
    hit = _token_cache.get(backend, key)
    if hit is not None:
        return list(hit)
    if len(text) > _LONG_TEXT:
        tokens = await anyio.to_thread.run_sync(backend.tokenize, text, add_special, parse_special)
    else:
        tokens = backend.tokenize(text, add_special, parse_special)
    _token_cache.put(backend, key, tuple(tokens))
    return tokens


def check_prompt(tokens: list[int], backend: Vocab) -> None:
    if not tokens:
        raise APIError("The prompt is empty (no tokens)", param="prompt")
    if len(tokens) >= backend.n_ctx_seq:
        raise APIError(
            f"the request exceeds the available context size ({len(tokens)} prompt tokens, "
            f"n_ctx {backend.n_ctx_seq}); "
            "try increasing --ctx-size",
            type="exceed_context_size_error",
            extra={"n_prompt_tokens": len(tokens), "n_ctx": backend.n_ctx_seq},
        )


def check_token_ids(tokens: list[int], backend: Vocab, param: str) -> None:
    n_vocab = backend.meta.n_vocab
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is out of range [0, {n_vocab})", param=param)


async def native_tokens(backend: Vocab, prompt: NativePrompt, param: str, *, add_special: bool = True,
                         parse_special: bool = True) -> list[int]:
    """llama-server's tokenize_mixed: specials for the first text part only; ids as they are."""
    if isinstance(prompt, str):
        return await tokenize_text(backend, prompt, add_special, parse_special)
    tokens: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            tokens += await tokenize_text(backend, part, add_special and i == 0, parse_special)
        else:
            check_token_ids([part], backend, param)
            tokens.append(part)
    return tokens


async def awake_backend(state: WorkerState) -> Vocab:
    """The backend, woken first if it sleeps: as llama-server, any request but the read-only
    ones (/health, /props, /models, /metrics, /slots) wakes the server."""
    backend = ready_backend(state)
    if backend.is_sleeping:
        await asyncio.wrap_future(state.engine.call(state.engine.wake))
    return backend


def not_enabled(endpoint: str, flag: str) -> APIError:
    """llama-server's answer for an endpoint its command line left off."""
    return APIError(f"This server does not support {endpoint} endpoint. Start it with `{flag}`",
                    status_code=501, type="not_supported_error", code=501)
