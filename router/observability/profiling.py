"""The router's side of request-level profiling (see worker/server/profiling.py for the
endpoints' contract and the event format).

`POST /start_profile` starts a run in the router and forwards the same body to every worker
with a process; a worker that becomes ready while a run is active gets it too (a
`status_change` subscriber, alive only while a run is). `POST /stop_profile` stops the run here
and in every worker. The router writes, per proxied request, from its `RequestTrace` when the
request ends: `received`, `queued` (with the model's state then), `model_ready`, `first_token`
(first response byte), then `finished` (status, tokens) or `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.events import Event, EventBus
from router.lifecycle.state import ModelState
from worker.protocol.errors import APIError
from worker.protocol.profile_log import Profiler, ProfileRun, parse_start, parse_stop

if TYPE_CHECKING:
    from router.lifecycle.model import ModelHandle
    from router.observability.request_trace import RequestTrace

log = logging.getLogger("omni.router.profiling")
WORKER_TIMEOUT_S = 10.0


def record_trace(profiler: Profiler, t: RequestTrace) -> None:
    rid = t.request_id
    profiler.record("received", rid, t.t_received, model=t.model, route=t.route)
    if t.t_queued:
        profiler.record("queued", rid, t.t_queued, state=t.state_when_queued)
    if t.t_ready:
        profiler.record("model_ready", rid, t.t_ready)
    if t.t_first_byte:
        profiler.record("first_token", rid, t.t_first_byte)
    if t.is_cancelled:
        profiler.record("cancelled", rid, t.t_end)
    else:
        profiler.record("finished", rid, t.t_end, status=t.status, prompt_tokens=t.prompt_tokens,
                        completion_tokens=t.completion_tokens)


class RouterProfiling:
    def __init__(self, events: EventBus, handles: Mapping[str, ModelHandle], client: httpx.AsyncClient,
                 data_dir: Path | None = None) -> None:
        self.profiler = Profiler("router")
        self._data_dir = data_dir
        self._events = events
        self._handles = handles
        self._client = client
        self._follower: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[Event] | None = None
        self._joins: dict[str, asyncio.Future[Any]] = {}  # model -> its start broadcast in flight
        self._bodies: dict[str, dict[str, Any]] = {}  # run_id -> the start body, for late workers

    def routes(self) -> list[Route]:
        return [Route("/start_profile", self.start_profile, methods=["POST"]),
                Route("/stop_profile", self.stop_profile, methods=["POST"]),
                Route("/start_request_profile", self.start_request_profile, methods=["POST"]),
                Route("/stop_request_profile", self.stop_profile, methods=["POST"])]

    async def start_profile(self, request: Request) -> Response:
        return await self._start(await request.body(), events_only=False)

    async def start_request_profile(self, request: Request) -> Response:
        return await self._start(await request.body(), events_only=True)

    async def _start(self, raw: bytes, *, events_only: bool) -> Response:
        req = parse_start(raw)
        run = ProfileRun.from_request(req, events_only=events_only, profiles_dir=self._profiles_dir())
        self._check_paths(run)
        try:
            path = self.profiler.start(run)
        except OSError as e:
            raise APIError(f"cannot write to event_dir: {e}", param="event_dir") from None
        body = {**req.model_dump(exclude_none=True), "run_id": run.run_id, "enable_torch": run.enable_torch,
                "event_dir": str(run.event_dir)}  # absolute: a worker's cwd need not be ours
        self._bodies[run.run_id] = body
        self._follow()
        kind = "/start_request_profile" if events_only else "/start_profile"
        workers = await self._broadcast(kind, body, self._workers())
        log.info("profiling run %s: events to %s", run.run_id, run.event_dir)
        return JSONResponse({"run_id": run.run_id, "events": str(path), "workers": workers})

    def _check_paths(self, run: ProfileRun) -> None:
        """An HTTP client picks where a run writes: never into the data dir, and a trace only as a
        `.json` file inside `event_dir` (a template could otherwise name any file, a preset too)."""
        event_dir = run.event_dir.resolve()
        if (self._data_dir is not None and event_dir.is_relative_to(self._data_dir.resolve())
                and not event_dir.is_relative_to(self._profiles_dir().resolve())):
            raise APIError("event_dir must not be inside the router's data dir (but for its profiles/)",
                           param="event_dir")
        try:
            trace = run.trace_path("router").resolve()
        except (KeyError, IndexError, AttributeError, ValueError) as e:
            raise APIError(f"invalid trace_path_template: {e!r}", param="trace_path_template") from None
        if not trace.is_relative_to(event_dir) or not trace.name.endswith((".json", ".json.gz")):
            raise APIError("trace_path_template must name a .json file inside event_dir",
                           param="trace_path_template")

    def _profiles_dir(self) -> Path:
        """Where a run without `event_dir` writes: `<data dir>/profiles/<run_id>/events`."""
        return (self._data_dir or Path(".")) / "profiles"

    async def stop_profile(self, request: Request) -> Response:
        req = parse_stop(await request.body())
        self._drain()  # requests that ended before the stop are in the run
        stopped = self.profiler.stop(req.run_id)
        for r in stopped:
            self._bodies.pop(r.run_id, None)
        if not self.profiler.is_active and self._follower is not None:
            self._follower.cancel()
            self._follower = None
        body = {"run_id": req.run_id} if req.run_id else {}
        workers = await self._broadcast("/stop_profile", body, self._workers())
        return JSONResponse({"stopped": [r.run_id for r in stopped], "workers": workers})

    def _workers(self) -> list[ModelHandle]:
        return [
            h
            for h in self._handles.values()
            if h.process is not None
            and h.base_url
            and h.preset.backend != "cmd"
            and not h.preset.is_remote
            and h.state in (ModelState.READY, ModelState.SLEEPING)
        ]

    async def _broadcast(self, path: str, body: dict[str, Any], handles: list[ModelHandle]) -> dict[str, Any]:
        async def one(h: ModelHandle) -> Any:
            try:
                r = await self._client.post(f"{h.base_url}{path}", json=body, timeout=WORKER_TIMEOUT_S)
                return r.json() if r.status_code == 200 else {"error": r.text[:300], "status": r.status_code}
            except (httpx.HTTPError, ValueError) as e:
                return {"error": repr(e)}

        results = await asyncio.gather(*(one(h) for h in handles))
        return {h.name: res for h, res in zip(handles, results, strict=True)}

    # ---- while a run is active

    def _follow(self) -> None:
        if self._follower is None or self._follower.done():
            self._follower = asyncio.create_task(self._run(), name="profiling")

    async def _run(self) -> None:
        """Record finished requests; start the active runs in workers that become ready."""
        async with self._events.subscribe(frozenset({"request", "status_change"})) as queue:
            self._queue = queue
            try:
                while True:
                    event, data = await queue.get()
                    if event == "request":
                        record_trace(self.profiler, data["trace"])
                    elif data["status"]["value"] == ModelState.READY.value:
                        await self._start_in(data["model"])
            finally:
                self._queue = None

    def _drain(self) -> None:
        q = self._queue
        while q is not None and not q.empty():
            event, data = q.get_nowait()
            if event == "request":
                record_trace(self.profiler, data["trace"])

    async def _start_in(self, model: str) -> None:
        """A worker that became ready during a run joins it (requests admitted meanwhile wait in
        `joined()`, so that the worker records the requests that waited for its load too)."""
        workers = [h for h in self._workers() if h.name == model]
        bodies = list(self._bodies.values())
        join = asyncio.ensure_future(
            asyncio.gather(*(self._broadcast("/start_profile", b, workers) for b in bodies))
        )
        self._joins[model] = join
        try:
            await join
        finally:
            if self._joins.get(model) is join:
                del self._joins[model]

    async def joined(self, model: str) -> None:
        """Return once `model`'s worker has joined the active runs (at once, nearly always).

        Its READY event reaches `_run` before the waiting requests resume (both are woken by
        the owner's one synchronous transition, the subscriber first), so a request that
        waited for the load finds the join here and waits for it."""
        join = self._joins.get(model)
        if join is not None:
            await asyncio.shield(join)

    async def close(self) -> None:
        self.profiler.stop(None)
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
