"""The translated APIs' way to a model (the Responses API's, Anthropic's Messages API's): one
chat-completions stream through the router's own admission, as if a client had sent it
(autoload, queue, `--models-max`, request traces), or one call (`call_json`: a token count;
`call_bytes`: a speech model's audio, router/speech/).

`ChatBridge.open_chat` is what `ResponsesService` is given; the translated request goes to
the worker's `/v1/chat/completions` over the pool's httpx client, and its SSE chunks come back
parsed. Leaving the context closes the upstream stream (the worker cancels the request) and
releases the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx

from router.lifecycle.model import ModelHandle
from router.lifecycle.pool import Pool, upstream_model
from router.lifecycle.request_queue import is_slot_free
from router.observability.request_trace import RequestTrace, request_id
from router.observability.requests import ActiveRequests
from worker.protocol.errors import APIError, ErrorType, not_found


class ChatBridge:
    def __init__(self, pool: Pool, requests: ActiveRequests) -> None:
        self._pool = pool
        self._requests = requests

    @contextlib.asynccontextmanager
    async def open_chat(self, model: str, body: dict[str, Any], route: str = "/v1/responses",
                        rid: str | None = None, path: str = "/v1/chat/completions",
                        ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Admit one chat-completions stream for `model` and yield its parsed SSE chunks
        (`rid`: the client's X-Request-Id, else a new one; `path`: another streaming route of
        the worker, /v1/completions or /infill, for Ollama's generate).

        An upstream error status comes out as its own `APIError`; a cut stream as a final
        `{"error"}` chunk.
        """
        handle = self._pool.get(model)
        if handle is None:
            raise not_found(f"model {model!r} not found (see GET /v1/models)")
        if (upstream := upstream_model(handle.preset, model)) is not None:  # a LoRA alias, `:latest`
            body = {**body, "model": upstream}
        body = self._pool.with_defaults(model, body, "/v1/chat/completions")  # a variant's (router/variants)
        trace = self._requests.begin(rid or request_id([]), handle, route)
        try:
            async with self._open_chat(model, handle, body, trace, path) as chunks:
                yield chunks
        except APIError as e:
            trace.status = e.status_code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.is_cancelled = True
            raise
        finally:
            self._requests.end(trace)

    async def call_json(self, model: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Admit one JSON request for `model` (as `open_chat`), POST it to the upstream's `path`
        and return its answer; an upstream error status comes out as its own `APIError`."""
        return cast(dict[str, Any], json.loads(await self.call_bytes(model, path, body)))

    async def call_bytes(self, model: str, path: str, body: dict[str, Any], rid: str | None = None) -> bytes:
        """`call_json`'s request, the answer's bytes as they are (a speech model's audio)."""
        handle = self._pool.get(model)
        if handle is None:
            raise not_found(f"model {model!r} not found (see GET /v1/models)")
        if (upstream := upstream_model(handle.preset, model)) is not None:  # a LoRA alias, `:latest`
            body = {**body, "model": upstream}
        body = self._pool.with_defaults(model, body, path)  # a variant's (router/variants.py)
        trace = self._requests.begin(rid or request_id([]), handle, path)
        occupies_slot = not is_slot_free(path)  # a token count does not wait behind generations
        try:
            base = await self._requests.admit(handle, trace, occupies_slot=occupies_slot)
            try:
                resp = await self._pool.client.post(
                    base + path, json=body, headers={"x-request-id": trace.request_id}
                )
            except httpx.TransportError as e:
                raise APIError(
                    f"upstream for model {model!r} is unreachable: {e!r}",
                    status_code=503,
                    type="unavailable_error",
                    code=503,
                ) from None
            finally:
                handle.release(occupies_slot)
            trace.status = resp.status_code
            if resp.status_code != 200:
                raise upstream_error(resp.status_code, resp.content)
            return resp.content
        except APIError as e:
            trace.status = e.status_code
            raise
        finally:
            self._requests.end(trace)

    @contextlib.asynccontextmanager
    async def _open_chat(self, model: str, handle: ModelHandle, body: dict[str, Any],
                         trace: RequestTrace, path: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        base = await self._requests.admit(handle, trace)
        client = self._pool.client
        try:
            req = client.build_request("POST", base + path, json=body,
                                       headers={"x-request-id": trace.request_id})
            try:
                resp = await client.send(req, stream=True)
            except httpx.TransportError as e:
                raise APIError(f"upstream for model {model!r} is unreachable: {e!r}", status_code=503,
                               type="unavailable_error", code=503, headers={"Retry-After": "1"}) from None
            try:
                trace.status = resp.status_code
                if resp.status_code != 200:
                    raise upstream_error(resp.status_code, await resp.aread())
                if body.get("stream") is False:  # one body (translate.is_whole), replayed as chunks
                    yield _replayed(json.loads(await resp.aread()))
                else:
                    yield _sse_chunks(resp, model, trace)
            finally:
                await resp.aclose()
        finally:
            handle.release()


def chunk_error(chunk: dict[str, Any]) -> str | None:
    """The message of a chunk `open_chat` yields for a failed upstream (a final `{"error"}`), else None."""
    err = chunk.get("error")
    if err is None:
        return None
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def upstream_error(status: int, raw: bytes) -> APIError:
    """An upstream's error answer, as the same envelope (a non-JSON body becomes the message)."""
    try:
        err = json.loads(raw)["error"]
        if not isinstance(err, dict):
            err = {"message": str(err)}
    except (ValueError, KeyError, TypeError):
        err = {"message": raw.decode(errors="replace")[:500] or f"upstream status {status}"}
    extra = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
    kind = cast(ErrorType, err.get("type") or ("invalid_request_error" if status < 500 else "server_error"))
    return APIError(str(err.get("message", "")), status_code=status, type=kind, param=err.get("param"),
                    code=err.get("code"), extra=extra)


async def _replayed(completion: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A chat completion as the chunks its stream would have had: per choice its message as one
    delta, then its finish; then the usage (and llama-server's timings, when it has them)."""
    for choice in completion.get("choices") or []:
        msg = choice.get("message") or {}
        calls = [{"index": k, **c} for k, c in enumerate(msg.get("tool_calls") or [])]
        delta = {"role": "assistant", "content": msg.get("content"),
                 **({"reasoning_content": msg["reasoning_content"]} if msg.get("reasoning_content") else {}),
                 **({"tool_calls": calls} if calls else {})}
        index = choice.get("index", 0)
        yield {"choices": [{"index": index, "delta": delta, "logprobs": choice.get("logprobs"),
                            "finish_reason": None}]}
        yield {"choices": [{"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")}]}
    yield {"choices": [], "usage": completion.get("usage"),
           **({"timings": completion["timings"]} if completion.get("timings") else {})}  # llama-server's


async def _sse_chunks(resp: httpx.Response, model: str, trace: RequestTrace) -> AsyncIterator[dict[str, Any]]:
    try:
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            trace.chunk(data.encode())
            yield json.loads(data)
    except (httpx.TransportError, ValueError) as e:
        yield {"error": {"message": f"upstream for model {model!r} stopped mid-stream ({e!r})"}}
