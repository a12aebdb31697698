"""Pulls in flight in this process: one download per reference, however many ask for it.

`Pulls.fetch(ref, on_progress)` is the one function the router (a model's first load, POST
/models/pull, Ollama's /api/pull) calls. The blocking pull runs in a thread; its progress (a
report per chunk received) comes back to the event loop thinned out: the latest report is given
to every asker at most every `PUBLISH_S`, and always the last one before a stall. A second ask
for the same reference joins the pull under way; an asker that leaves (client gone, model
unloaded) does not stop it: the bytes are wanted anyway, and the next ask finds them in the
cache. Two references that share a file (a projector) share its download through the cache's
file lock (`download.fetch_file`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from router.hub.choice import Ref
from router.hub.download import HubConfig, Progress, Pulled, pull

Listener = Callable[[Progress], None]


PUBLISH_S = 0.1


@dataclass(eq=False)
class _Pull:
    future: asyncio.Future[Pulled]
    loop: asyncio.AbstractEventLoop
    listeners: set[Listener] = field(default_factory=set)
    last: Progress | None = None  # the last one given to the askers
    _latest: Progress | None = None  # the last one from the pull's thread
    _is_due: bool = False  # a publish is scheduled (the thread's reports ride on it)

    def report(self, progress: Progress) -> None:
        """From the pull's thread: one hop to the loop per `PUBLISH_S` at most."""
        self._latest = progress
        if not self._is_due:
            self._is_due = True
            self.loop.call_soon_threadsafe(self.loop.call_later, PUBLISH_S, self._publish)

    def _publish(self) -> None:
        self._is_due = False  # (set before reading: a report racing this schedules the next)
        progress = self._latest
        if progress is None or progress == self.last:
            return
        self.last = progress
        for listener in list(self.listeners):
            listener(progress)


@dataclass
class Pulls:
    config: Callable[[], HubConfig] = HubConfig.from_env
    _inflight: dict[Ref, _Pull] = field(default_factory=dict)

    def in_flight(self) -> dict[str, Progress | None]:
        """Each reference being pulled now and its last progress (for /metrics)."""
        return {str(ref): p.last for ref, p in self._inflight.items()}

    async def fetch(self, ref: Ref, on_progress: Listener | None = None) -> Pulled:
        """`ref`'s files in the cache, downloaded first if need be (raises `HubError`)."""
        entry = self._inflight.get(ref)
        if entry is None:
            loop = asyncio.get_running_loop()
            entry = _Pull(loop.create_future(), loop)
            self._inflight[ref] = entry
            task = asyncio.ensure_future(asyncio.to_thread(pull, ref, entry.report, self.config()))
            task.add_done_callback(lambda t: self._finished(ref, entry, t))
        if on_progress is not None:
            entry.listeners.add(on_progress)
            if entry.last is not None:
                on_progress(entry.last)
        try:
            return await asyncio.shield(entry.future)
        finally:
            if on_progress is not None:
                entry.listeners.discard(on_progress)

    def _finished(self, ref: Ref, entry: _Pull, task: asyncio.Future[Pulled]) -> None:
        if self._inflight.get(ref) is entry:
            del self._inflight[ref]
        entry._publish()  # the last report, before the result
        if entry.future.done():
            return
        if task.cancelled():
            entry.future.cancel()
        elif (error := task.exception()) is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(task.result())
        with contextlib.suppress(BaseException):
            entry.future.exception()  # retrieved: nobody may be waiting any more


PULLS = Pulls()  # the router's one registry (its routes and every model's first load share it)
