"""The requests in flight, as the router traces them: one `RequestTrace` each, from the moment a
model is picked until the answer ends. Proxied requests (router.http.forwarding) and translated
ones (the Responses bridge) both go through here, so metrics, the request log and profiling see
every request the same way.

    trace = requests.begin(rid, handle, route)   # registered, counted in flight
    base = await requests.admit(handle, trace)   # the model's ensure_ready(), queueing marked
    ...                                          # forward; then handle.release()
    requests.end(trace)                          # emits the `request` event
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.events import EventBus
from router.observability.profiling import RouterProfiling
from router.observability.request_trace import RequestTrace

if TYPE_CHECKING:
    from router.lifecycle.model import ModelHandle


class ActiveRequests:
    def __init__(self, events: EventBus, profiling: RouterProfiling) -> None:
        self._events = events
        self._profiling = profiling
        self.active: dict[int, RequestTrace] = {}

    def begin(self, rid: str, handle: ModelHandle, route: str) -> RequestTrace:
        trace = RequestTrace(rid, handle.name, route)
        self.active[id(trace)] = trace
        return trace

    async def admit(self, handle: ModelHandle, trace: RequestTrace, requeued: bool = False) -> str:
        """`handle.ensure_ready()`, marking whether (and in which model state) the request waited.
        `requeued`: its worker died before answering it; it waits for the respawn."""
        is_waiting = not handle.can_admit()
        if is_waiting:
            trace.queued(handle.state.value)
        base = await handle.ensure_ready(requeued)
        if is_waiting and self._profiling.profiler.is_active:
            try:
                await self._profiling.joined(handle.name)  # a worker that just loaded joins the run first
            except BaseException:
                handle.release()  # admitted, but the client left
                raise
        trace.ready()
        return base

    def end(self, trace: RequestTrace) -> None:
        del self.active[id(trace)]
        trace.end()
        self._events.emit("request", trace.event())
