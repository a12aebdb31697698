"""What a model's owner (`router.lifecycle.model.ModelHandle`) receives on its one queue: commands from
callers (most carry a reply future) and reports from the effect tasks it started. Reports of a
load, wake or sleep carry the attempt they belong to, and the owner ignores a stale one."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from router.hub.download import Pulled
from router.lifecycle.effects import Process
from router.lifecycle.estimate import Estimate
from router.lifecycle.memory import TreeMemory
from router.presets import ModelPreset

# --------------------------------------------------------------------------- commands (callers)


@dataclass
class EnsureReady:
    reply: asyncio.Future[str]
    requeued: bool = False  # its worker died before it reached it: it waits through the backoff
    occupies_slot: bool = True  # False: /tokenize, /metrics, ... (router.lifecycle.request_queue)


@dataclass
class Load:
    """Load (or wake) with no request waiting: load-on-startup, `POST /models/load`, a queue-full request."""


@dataclass
class Sleep:
    reply: asyncio.Future[bool]


@dataclass
class Unload:
    reply: asyncio.Future[bool]


@dataclass
class Evict:
    reply: asyncio.Future[bool]


@dataclass
class Drain:
    is_on: bool
    reply: asyncio.Future[bool]


@dataclass
class Reconfigure:
    """A preset reload changed this model (`preset`) or removed it (None)."""

    preset: ModelPreset | None


@dataclass
class Sync:
    reply: asyncio.Future[bool]


@dataclass
class Settle:
    """A transient failure's time is over with nobody waiting: unloaded again (if still that failure)."""

    attempt: int


@dataclass
class Poke:
    """Something changed (a waiter left, the last request finished, an idle timer fired): re-examine."""


# --------------------------------------------------------------------------- messages (effects)


@dataclass
class Estimated:
    attempt: int
    need: Estimate


@dataclass
class Granted:
    attempt: int


@dataclass
class Refused:
    """No slot can ever be had (pinned models, or the budget): not a failure of the model."""

    attempt: int
    reason: str


@dataclass
class Spawned:
    attempt: int
    proc: Process
    base_url: str
    argv: list[str]


@dataclass
class Progress:
    attempt: int
    progress: dict[str, Any]


@dataclass
class Ready:
    attempt: int
    can_sleep: bool | None  # None: a wake (what the load found still holds)
    info: dict[str, Any] | None


@dataclass
class LoadFailed:
    attempt: int
    error: str
    can_retry: bool = False  # a spawn that may work next time (a Ray node lost while it started)


@dataclass
class Fetched:
    """An `hf-repo` model's files are in the hub cache (router/hub)."""

    attempt: int
    pulled: Pulled


@dataclass
class FetchFailed:
    attempt: int
    error: str
    is_transient: bool  # the hub down, the disk full: a later load tries again
    is_misconfigured: bool = False  # the hub has no such repo, tag or file (its 404): the preset is wrong


@dataclass
class SleepDone:
    attempt: int
    ok: bool


@dataclass
class Exited:
    proc: Process
    code: int


@dataclass
class Measured:
    proc: Process
    memory: TreeMemory


Command = (
    EnsureReady
    | Load
    | Sleep
    | Unload
    | Evict
    | Drain
    | Reconfigure
    | Sync
    | Settle
    | Poke
    | Estimated
    | Granted
    | Refused
    | Spawned
    | Progress
    | Ready
    | LoadFailed
    | Fetched
    | FetchFailed
    | SleepDone
    | Exited
    | Measured
)
