"""Request-level profiling (SGLang-Omni's `/start_profile` / `/stop_profile`): the contract,
which the router's endpoints (router/observability/profiling.py) follow too, and the worker's side.

    POST /start_profile          {"run_id", "event_dir", "trace_path_template", "enable_torch",
                                  "token_interval"}: append request events to
                                  <event_dir>/events_<component>_<pid>.jsonl until stopped
    POST /stop_profile           {"run_id"} (optional; omitted: stop every run)
    POST /start_request_profile  the same, events only (`enable_torch` ignored)
    POST /stop_request_profile   the same as /stop_profile

One JSON object a line: `ts` (wall clock, seconds), `event`, `request_id` (the router's
`X-Request-Id`, so the router's and the worker's lines of one request join), `component`,
`pid`, and the event's own fields. The worker writes, per task (a choice of a request):

    received       the HTTP request arrived (any POST, from `RequestContext`)
    queued         the task was handed to the engine
    slot_assigned  first admitted to a slot (`TaskStats.t_start`)
    prefill_done   the prompt is in the KV cache and the first token sampled
    first_token    the first token left the engine
    tokens         every `token_interval` generated tokens (`n`)
    finished       with reason and counts; or `error`, or `cancelled`

Engine-thread events are written from the engine thread (worker/protocol/profile_log.py: one
`json.dumps` and a line write under a lock), and nothing is written when no run is active (one
attribute read per generation). With `enable_torch` on the torch backend, `torch.profiler`
runs on the engine thread (started and stopped there) and its Chrome trace goes to
`trace_path_template` (fields `{event_dir}`, `{run_id}`, `{component}`, `{pid}`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from worker.engine.task import ErrorEvent, Event, FinishEvent, Task, TokenEvent
from worker.protocol.errors import APIError
from worker.protocol.profile_log import SAFE_NAME, Profiler, ProfileRun, parse_start, parse_stop, wall

if TYPE_CHECKING:
    from worker.server.state import WorkerState

log = logging.getLogger("worker.profiling")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
PROFILER = Profiler("worker")  # renamed worker-<model> by routes()


class GenerationTrace:
    """The profiling events of one `Generation` (its tasks'); engine thread, but `cancel`."""

    def __init__(self, profiler: Profiler, request_id: str, tasks: list[Task]) -> None:
        self._p = profiler
        self._rid = request_id
        self._tasks = tasks
        self._interval = profiler.token_interval
        self._n_tokens = [0] * len(tasks)
        self._is_done = [False] * len(tasks)

    def on_start(self) -> None:
        for i, t in enumerate(self._tasks):
            self._p.record("queued", self._rid, index=i, task_id=t.id, n_prompt=len(t.prompt))

    def on_event(self, index: int, event: Event) -> None:
        task = self._tasks[index]
        if isinstance(event, TokenEvent):
            n = self._n_tokens[index] = self._n_tokens[index] + 1
            if n == 1:
                self._first_token(index, task)
            elif n % self._interval == 0:
                self._p.record("tokens", self._rid, index=index, task_id=task.id, n=n)
            return
        self._is_done[index] = True
        if isinstance(event, FinishEvent):
            if self._n_tokens[index] == 0 and task.stats.t_first_token:  # ended at its first token
                self._first_token(index, task)
            st = event.stats
            self._p.record("finished", self._rid, wall(st.t_end) if st.t_end else None, index=index,
                           task_id=task.id, reason=event.reason, n_prompt=st.n_prompt, n_cached=st.n_cached,
                           n_decoded=st.n_decoded, prompt_ms=round(st.prompt_ms, 3),
                           predicted_ms=round(st.predicted_ms, 3))
        elif isinstance(event, ErrorEvent):
            self._p.record("error", self._rid, index=index, task_id=task.id, message=event.message,
                           status=event.status_code)

    def _first_token(self, index: int, task: Task) -> None:
        st = task.stats
        if st.t_start:
            self._p.record("slot_assigned", self._rid, wall(st.t_start), index=index, task_id=task.id,
                           n_cached=st.n_cached)
        if st.t_first_token:
            self._p.record("prefill_done", self._rid, wall(st.t_first_token), index=index, task_id=task.id,
                           n_evaluated=st.n_evaluated)
        self._p.record("first_token", self._rid, index=index, task_id=task.id)

    def on_cancel(self) -> None:
        for i, t in enumerate(self._tasks):
            if not self._is_done[i]:
                self._is_done[i] = True
                self._p.record("cancelled", self._rid, index=i, task_id=t.id, n_decoded=self._n_tokens[i])


def generation_trace(tasks: list[Task]) -> GenerationTrace | None:
    """A trace for a new generation, or None when no run is active (the usual case)."""
    if not PROFILER.is_active:
        return None
    return GenerationTrace(PROFILER, REQUEST_ID.get() or f"task-{tasks[0].id if tasks else 0}", tasks)


class RequestContext:
    """ASGI: the request's `X-Request-Id` in `REQUEST_ID`; a `received` event while profiling."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        rid = ""
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode("latin-1")
                break
        token = REQUEST_ID.set(rid)
        try:
            if PROFILER.is_active and scope["method"] == "POST" and not scope["path"].endswith("_profile"):
                PROFILER.record("received", rid, path=scope["path"])
            await self._app(scope, receive, send)
        finally:
            REQUEST_ID.reset(token)


class _TorchProfile:
    """At most one `torch.profiler` session, started and stopped on the engine thread."""

    def __init__(self) -> None:
        self.run: ProfileRun | None = None
        self._prof: Any = None

    def start(self, run: ProfileRun) -> None:
        import torch.profiler

        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  *([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])],
                                      record_shapes=True)
        prof.start()
        self._prof, self.run = prof, run

    def stop(self, component: str) -> str:
        assert self._prof is not None and self.run is not None
        path = self.run.trace_path(component)
        self._prof.stop()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(path))
        self._prof, self.run = None, None
        return str(path)


_TORCH = _TorchProfile()


async def _start(request: Request, *, events_only: bool) -> Response:
    state: WorkerState = request.app.state.worker
    run = ProfileRun.from_request(parse_start(await request.body()), events_only=events_only)
    try:
        path = PROFILER.start(run)
    except OSError as e:
        raise APIError(f"cannot write to event_dir: {e}", param="event_dir") from None
    out: dict[str, Any] = {"run_id": run.run_id, "events": str(path), "torch": False}
    if run.enable_torch:
        if state.backend_kind != "torch":
            out["torch_skipped"] = f"the {state.backend_kind} backend has no torch profiler"
        elif _TORCH.run is not None:
            out["torch_skipped"] = f"run {_TORCH.run.run_id!r} already records a torch trace"
        else:
            await asyncio.wrap_future(state.engine.call(lambda: _TORCH.start(run)))
            out["torch"] = True
    log.info("profiling run %s: events to %s", run.run_id, path)
    return JSONResponse(out)


async def _stop(request: Request) -> Response:
    state: WorkerState = request.app.state.worker
    stopped = PROFILER.stop(parse_stop(await request.body()).run_id)
    out: dict[str, Any] = {"stopped": [r.run_id for r in stopped]}
    torch_run = _TORCH.run
    if torch_run is not None and any(r.run_id == torch_run.run_id for r in stopped):
        out["torch_trace"] = await asyncio.wrap_future(
            state.engine.call(lambda: _TORCH.stop(PROFILER.component))
        )
    return JSONResponse(out)


async def start_profile(request: Request) -> Response:
    return await _start(request, events_only=False)


async def start_request_profile(request: Request) -> Response:
    return await _start(request, events_only=True)


def routes(model_id: str) -> list[Route]:
    """The worker's profiling routes; its events files are named after `model_id`."""
    PROFILER.component = SAFE_NAME.sub("_", f"worker-{model_id}")
    return [Route("/start_profile", start_profile, methods=["POST"]),
            Route("/stop_profile", _stop, methods=["POST"]),
            Route("/start_request_profile", start_request_profile, methods=["POST"]),
            Route("/stop_request_profile", _stop, methods=["POST"])]
