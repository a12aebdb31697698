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

from collections.abc import Callable
from typing import TYPE_CHECKING

from router.events import EventBus
from router.keys.context import current_key
from router.observability.profiling import RouterProfiling
from router.observability.request_trace import RequestTrace

if TYPE_CHECKING:
    from router.lifecycle.model import ModelHandle


class ActiveRequests:
    def __init__(self, events: EventBus, profiling: RouterProfiling,
                 on_key_end: Callable[[str, str, int | None, int | None], None] | None = None) -> None:
        self._events = events
        self._profiling = profiling
        self._on_key_end = on_key_end  # a keyed request's usage (router.keys.book.KeyBook.record)
        self.active: dict[int, RequestTrace] = {}

    def begin(self, rid: str, handle: ModelHandle, route: str) -> RequestTrace:
        key = current_key()  # the request's API key, if the router has keys (router.keys.context)
        trace = RequestTrace(rid, handle.name, route, key="" if key is None else key.name)
        self.active[id(trace)] = trace
        return trace

    async def admit(self, handle: ModelHandle, trace: RequestTrace, requeued: bool = False,
                    occupies_slot: bool = True) -> str:
        """`handle.ensure_ready()`, marking whether (and in which model state) the request waited.
        `requeued`: its worker died before it reached it; it waits for the respawn. The caller
        releases with `handle.release(occupies_slot)`."""
        is_waiting = not handle.can_admit(occupies_slot)
        if is_waiting:
            trace.queued(handle.state.value)
        base = await handle.ensure_ready(requeued, occupies_slot)
        if is_waiting and self._profiling.profiler.is_active:
            try:
                await self._profiling.joined(handle.name)  # a worker that just loaded joins the run first
            except BaseException:
                handle.release(occupies_slot)  # admitted, but the client left
                raise
        trace.ready()
        return base

    def end(self, trace: RequestTrace) -> None:
        del self.active[id(trace)]
        trace.end()
        if trace.key and self._on_key_end is not None:
            self._on_key_end(trace.key, trace.model, trace.prompt_tokens, trace.completion_tokens)
        self._events.emit("request", trace.event())
