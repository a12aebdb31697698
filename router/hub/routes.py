"""Pulling while serving: `POST /models/pull` (ours) and `POST /api/pull` (Ollama's), both
through `Pulls.fetch`, so a pull already under way (a model's first load, another client) is
joined, not repeated.

`POST /models/pull {"model": "org/repo[:TAG]", "hf_file"?, "stream"?: true}`: NDJSON lines
`{"status": "downloading", "file", "bytes_done", "bytes_total"}`, then `{"status": "success",
"model", "path", ...}` (what was pulled; `served_as`: the name it is served under once the
presets are read again, with discovery of the hub cache on). A failure found before any byte
moved is the HTTP status itself in the error envelope (404 lists the repo's `tags`; 503 the hub
unreachable); a failure after is a last line `{"error": {...}}`. `stream: false`: one JSON answer.

`POST /api/pull {"model": "hf.co/org/repo[:TAG]"}` (or `org/repo[:TAG]`; `name` as older
clients send it): Ollama's NDJSON, `pulling manifest`, `pulling <digest>` with `digest`, `total`
and `completed` per file, `verifying sha256 digest`, `writing manifest`, `success`; an error is
`{"error": "..."}` (with the HTTP status when nothing was sent yet). Only hub repos can be
pulled: a name from Ollama's own library is a 404 saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.hub.choice import Ref, parse_ref
from router.hub.download import HubError, Progress, Pulled, describe
from router.hub.pulls import Pulls
from worker.protocol.errors import APIError, parse_model
from worker.protocol.strict import StrictModel

log = logging.getLogger("omni.router.hub")
NDJSON = "application/x-ndjson"
_HUB_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")


class PullRequest(StrictModel):
    model: str
    hf_file: str | None = None
    stream: bool = True


class OllamaPullRequest(StrictModel):
    model: str | None = None
    name: str | None = None  # older clients
    insecure: bool = False  # inert (strict.INERT): no registry of ours to be insecure with
    stream: bool = True


@dataclass(frozen=True)
class _Step:
    progress: Progress | None = None
    pulled: Pulled | None = None
    error: HubError | None = None


def _hub_error(e: HubError) -> APIError:
    extra = {"tags": list(e.tags)} if e.status == 404 else None
    if e.status == 404:
        return APIError(str(e), status_code=404, type="not_found_error", param="model",
                        code="model_not_found", extra=extra)
    if e.status == 503:
        return APIError(str(e), status_code=503, type="unavailable_error", param="model",
                        code="hub_unavailable")
    code = "insufficient_storage" if e.status == 507 else "hub_error"
    return APIError(str(e), status_code=e.status, type="server_error", param="model", code=code)


class PullRoutes:
    def __init__(self, pulls: Pulls, after_pull: Callable[[Pulled], Awaitable[str | None]]) -> None:
        """`after_pull`: makes the pulled model servable (a preset reload), returns its name."""
        self.pulls = pulls
        self.after_pull = after_pull

    def routes(self) -> list[Route]:
        return [Route("/models/pull", self.pull, methods=["POST"]),
                Route("/api/pull", self.ollama_pull, methods=["POST"])]

    async def _steps(self, ref: Ref) -> AsyncIterator[_Step]:
        """The pull's progress, then its end; the pull goes on if the caller stops listening."""
        queue: asyncio.Queue[_Step] = asyncio.Queue()
        task = asyncio.ensure_future(self.pulls.fetch(ref, lambda p: queue.put_nowait(_Step(progress=p))))

        def finished(t: asyncio.Future[Pulled]) -> None:
            if t.cancelled():
                queue.put_nowait(_Step(error=HubError("the pull was cancelled", 503)))
            elif isinstance(error := t.exception(), HubError):
                queue.put_nowait(_Step(error=error))
            elif error is not None:
                queue.put_nowait(_Step(error=HubError(f"{type(error).__name__}: {error}", 500)))
            else:
                queue.put_nowait(_Step(pulled=t.result()))

        task.add_done_callback(finished)
        while True:
            step = await queue.get()
            yield step
            if step.progress is None:
                return

    async def _first(self, ref: Ref) -> tuple[_Step, AsyncIterator[_Step]]:
        steps = self._steps(ref)
        return await anext(steps), steps

    async def _served_as(self, pulled: Pulled) -> str | None:
        try:
            return await self.after_pull(pulled)
        except Exception as e:  # the pull itself succeeded: say so, and why it is not served yet
            log.warning("pulled %s, but the presets could not be read again: %s", pulled.name, e)
            return None

    # ---- ours

    async def pull(self, request: Request) -> Response:
        body = parse_model(PullRequest, await request.body())
        try:
            ref = parse_ref(body.model, body.hf_file)
        except ValueError as e:
            raise APIError(str(e), param="model") from None
        first, steps = await self._first(ref)
        if first.error is not None:
            raise _hub_error(first.error)
        if not body.stream:
            last = first
            async for step in steps:
                last = step
            if last.error is not None:
                raise _hub_error(last.error)
            assert last.pulled is not None
            return JSONResponse(await self._success(last.pulled))

        async def lines() -> AsyncIterator[bytes]:
            async for step in _chain(first, steps):
                if step.progress is not None:
                    p = step.progress
                    yield _line({"status": "downloading", "file": p.file, "bytes_done": p.done,
                                 "bytes_total": p.total})
                elif step.error is not None:
                    yield _line(_hub_error(step.error).body())
                elif step.pulled is not None:
                    yield _line(await self._success(step.pulled))

        return StreamingResponse(lines(), media_type=NDJSON)

    async def _success(self, pulled: Pulled) -> dict[str, Any]:
        return {"status": "success", **describe(pulled), "served_as": await self._served_as(pulled)}

    # ---- Ollama's

    async def ollama_pull(self, request: Request) -> Response:
        try:
            data = json.loads(await request.body() or b"{}")
            body = OllamaPullRequest.model_validate(data)
        except ValueError as e:  # (pydantic's ValidationError is a ValueError)
            return JSONResponse({"error": f"invalid request: {str(e).splitlines()[0]}"}, status_code=400)
        name = (body.model or body.name or "").strip()
        if not name:
            return JSONResponse({"error": "model is required"}, status_code=400)
        try:
            ref = _ollama_ref(name)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=404)
        first, steps = await self._first(ref)
        if first.error is not None:
            return JSONResponse({"error": str(first.error)}, status_code=first.error.status)
        if not body.stream:
            last = first
            async for step in steps:
                last = step
            if last.error is not None:
                return JSONResponse({"error": str(last.error)}, status_code=last.error.status)
            assert last.pulled is not None
            await self._served_as(last.pulled)
            return JSONResponse({"status": "success"})

        async def lines() -> AsyncIterator[bytes]:
            yield _line({"status": "pulling manifest"})
            complete: set[str] = set()  # layers shown complete
            async for step in _chain(first, steps):
                p = step.progress
                if p is not None:
                    if p.digest:
                        yield _line(_ollama_layer(p.digest, p.file_total, p.file_done))
                        if p.file_done == p.file_total:
                            complete.add(p.digest)
                elif step.error is not None:
                    yield _line({"error": str(step.error)})
                elif step.pulled is not None:
                    for _file, digest, size in step.pulled.layers:  # (progress is thinned: some never shown)
                        if digest and digest not in complete:
                            yield _line(_ollama_layer(digest, size, size))
                    yield _line({"status": "verifying sha256 digest"})
                    yield _line({"status": "writing manifest"})
                    await self._served_as(step.pulled)
                    yield _line({"status": "success"})

        return StreamingResponse(lines(), media_type=NDJSON)


def _ollama_ref(name: str) -> Ref:
    """`hf.co/org/repo[:TAG]` as Ollama pulls from Hugging Face, or `org/repo[:TAG]`."""
    for prefix in _HUB_PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
            break
    if "/" not in name:
        raise ValueError(f"pull model manifest: {name!r} is not a hub repo: this server pulls from a "
                         "Hugging Face hub only (hf.co/ORG/REPO[:TAG])")
    repo, _, tag = name.partition(":")
    return parse_ref(repo if tag.lower() in ("", "latest") else name)


def _ollama_layer(digest: str, total: int, completed: int) -> dict[str, Any]:
    return {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": total,
            "completed": completed}


async def _chain(first: _Step, rest: AsyncIterator[_Step]) -> AsyncIterator[_Step]:
    yield first
    if first.progress is not None:
        async for step in rest:
            yield step


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
