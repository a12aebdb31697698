"""A model's request queue: who waits for its worker, who is forwarded, and what a crash requeues.

Admission (issue 39, issue 47): one of our workers runs `parallel` slots; the router forwards at
most slots + `--forward-margin` requests that occupy a slot (a generation, an embedding, a
transcription) and keeps the rest here, in arrival order, so that a worker that crashes fails
only what it was running and what waits here is served by the respawned worker. A request that
occupies no slot (`/metrics?model=`, `/props`, `/slots`, `/lora-adapters`, `/tokenize`,
`/detokenize`, token counting: `is_slot_free`) never counts against that bound and never waits
behind it: it waits only for the model to be up.

The crash requeue (`REQUEUES`, `WorkerGone`): a request goes back to this queue only when the
worker provably never read it (its connection was refused, or reset with the request unread:
`never_sent`, router.upstream), to be served by the respawned worker. A request the worker read
before it died is failed (502), never replayed: it may be the request that crashed it, and a
replay would crash it again.

The queue is state of the model's owner (`router.lifecycle.model.ModelHandle`): only the owner
task (and the synchronous hot path, `can_admit`/`admit`) touches it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.lifecycle.load_failure import FAILED_SHOWN_S, KILLED_LOADS_KEPT
from router.lifecycle.state import ModelState
from router.presets import ModelPreset
from worker.protocol.defaults import DEFAULT_PARALLEL
from worker.protocol.errors import APIError

# Requests forwarded to one of our workers at most: its slots and this many more (the default of
# --forward-margin), so that a slot that frees is refilled from the worker's own queue without a
# round trip to the router.
FORWARD_MARGIN = 2
# A request whose connection to its worker was refused (the worker had just died) goes back to
# the model's queue this many times at most, and is served by the respawned worker.
REQUEUES = 2
_GONE_WAIT_S = 2.0  # how long to wait for the model's owner to see the worker's exit

# Worker routes that occupy no slot: answered from the worker's state or its vocabulary, at once.
# Anything else (a generation, an embedding, speech, a transcription, an image) occupies one.
SLOT_FREE_PATHS = frozenset({
    "/metrics", "/props", "/slots", "/tools", "/lora-adapters",
    "/tokenize", "/detokenize", "/apply-template",
    "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens", "/v1/responses/input_tokens",
    "/v1/messages/count_tokens",
})


def is_slot_free(upstream_path: str) -> bool:
    """Whether a request to this worker path occupies no slot (it bypasses the forwarding bound)."""
    return upstream_path.partition("?")[0] in SLOT_FREE_PATHS


def forward_limit(preset: ModelPreset, margin: int) -> int | None:
    """Slot-occupying requests forwarded to the model's worker at once at most: its slots +
    `margin`, or the preset's `concurrency-limit` if lower (None: no bound, for a `cmd` or
    remote upstream whose capacity we do not know and that states none)."""
    if preset.is_remote or preset.backend == "cmd":
        return preset.concurrency_limit
    limit = (preset.parallel or DEFAULT_PARALLEL) + margin
    return limit if preset.concurrency_limit is None else min(limit, preset.concurrency_limit)


@dataclass
class Waiting:
    """`--max-queue`: requests allowed to wait for a model, all models together."""

    max_queue: int = 256
    num_waiting: int = 0


@dataclass
class RequestQueue:
    """One model's waiting requests (slot-occupying ones in arrival order, with their arrival
    times, slot-free ones apart) and the count of slot-occupying requests forwarded."""

    num_occupying: int = 0  # forwarded requests that occupy a slot (bounded by `forward_limit`)
    _slot: deque[tuple[float, asyncio.Future[str]]] = field(default_factory=deque)  # (arrival, reply)
    _free: deque[asyncio.Future[str]] = field(default_factory=deque)

    def __bool__(self) -> bool:
        return bool(self._slot or self._free)

    def __len__(self) -> int:
        return len(self._slot) + len(self._free)

    def has_room(self, limit: int | None) -> bool:
        return limit is None or self.num_occupying < limit

    def can_admit(self, limit: int | None, occupies_slot: bool, before: float | None = None) -> bool:
        """A new request may be admitted now (the model being up): a slot-free one always; a
        slot-occupying one when nobody waits before it (FIFO), the bound has room, and no
        admission bound holds it (`before`: the swap rule "fifo", `Slots.admits_before`)."""
        return not occupies_slot or (not self._slot and self.has_room(limit) and before is None)

    def add(self, reply: asyncio.Future[str], occupies_slot: bool) -> None:
        if occupies_slot:
            self._slot.append((time.monotonic(), reply))
        else:
            self._free.append(reply)

    def prune(self) -> None:
        """Drop the requests whose clients left."""
        self._slot = deque(w for w in self._slot if not w[1].done())
        self._free = deque(w for w in self._free if not w.done())

    def admit_waiting(self, limit: int | None, admit: Callable[[bool], str],
                      before: float | None = None) -> None:
        """Admit every slot-free request, then slot-occupying ones in arrival order while there
        is room and they arrived before `before` (`admit(occupies_slot)` counts it and returns
        the worker's base URL)."""
        while self._free:
            w = self._free.popleft()
            if not w.done():
                w.set_result(admit(False))
        while self._slot and self.has_room(limit) and (before is None or self._slot[0][0] < before):
            _, w = self._slot.popleft()
            if not w.done():
                w.set_result(admit(True))

    def oldest_arrival(self) -> float | None:
        """When the oldest slot-occupying request still waiting here arrived (monotonic)."""
        return next((at for at, w in self._slot if not w.done()), None)

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        waiters = [*(w for _, w in self._slot), *self._free]
        self._slot, self._free = deque(), deque()
        for w in waiters:
            if not w.done():
                w.set_exception(error())

    def num_waiting(self) -> int:
        """Requests still waiting (those whose clients left are not counted)."""
        return sum(1 for _, w in self._slot if not w.done()) + sum(1 for w in self._free if not w.done())

    def has_slot_waiters(self) -> bool:
        return bool(self._slot)


def keeps_queue_after_crash(*, was_serving: bool, killed_by_signal: bool, is_the_box: bool,
                            failures: int, killed_loads_kept: int) -> bool:
    """Whether the requests still waiting here survive the worker's exit (they were never
    forwarded to it) and wait for the respawn after the backoff: a worker that crashed while
    serving, or a load killed by a signal or by the box (the OOM killer, a full disk) a few times
    in a row at most; a load that fails by itself fails them."""
    return was_serving or ((killed_by_signal or is_the_box) and failures < killed_loads_kept)


@dataclass(frozen=True)
class RespawnFor:
    """Load again after `delay` s: for the requests still queued (`is_for_queue`), or because the
    preset keeps the model up (pinned, load-on-startup)."""

    delay: float
    is_for_queue: bool = False


@dataclass(frozen=True)
class ShowFailed:
    """Nobody waits: show `failed` for `delay` s, then unload (the next request loads it)."""

    delay: float


def after_failure(is_permanent: bool, has_kept_queue: bool, is_kept_up: bool, failures: int,
                  backoff: float) -> RespawnFor | ShowFailed | None:
    """What follows a model's failure (None: nothing until it is asked for, a permanent one).
    `has_kept_queue`: requests wait here that were never forwarded (`keeps_queue_after_crash`);
    a crash loop is still paced by the backoff. A model kept up by its preset is respawned
    KILLED_LOADS_KEPT times in a row at most."""
    if is_permanent:
        return None
    if has_kept_queue:
        return RespawnFor(backoff, is_for_queue=True)
    if is_kept_up and failures <= KILLED_LOADS_KEPT:
        return RespawnFor(backoff)
    return ShowFailed(max(backoff, FAILED_SHOWN_S))


class WorkerGone(Exception):
    """The request never reached its worker, which has gone: it goes back to the model's queue."""


def died_on_it(model: str, cause: Exception) -> APIError:
    """The answer to a request whose worker died after the request reached it: a 502 that clients
    do not retry (`x-should-retry: false`, obeyed by the openai and anthropic SDKs), since the
    request may be what crashed it."""
    return APIError(
        f"the worker of model {model!r} died while handling this request ({cause}); it is not "
        "retried, in case the request itself crashed it",
        status_code=502, type="server_error", code="worker_died", headers={"x-should-retry": "false"},
    )


class _Serving(Protocol):
    """What `is_gone` reads of a model (its `ModelHandle`)."""

    @property
    def state(self) -> ModelState: ...

    @property
    def base_url(self) -> str | None: ...


async def is_gone(handle: _Serving, base: str) -> bool:
    """Whether the worker at `base` has gone: its model left READY or moved to another worker
    (the exit is seen by the owner's watcher, a moment after the connection failed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _GONE_WAIT_S
    while True:
        if handle.state is not ModelState.READY or handle.base_url != base:
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)
