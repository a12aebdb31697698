"""The router's side of one worker actor: a `Process` like a local `WorkerProcess`.

- Exit: a pending `actor.wait()` call returns the worker's exit code; if the actor dies instead
  (its node lost, `ray.kill` from outside), the call fails and the process ends with code -1 and
  an `exit_cause` that says so, which becomes the model's failure.
- Log tail: `actor.log_lines(cursor)` long-polls; each line goes to the 50-line tail (crash
  reports), the model's log ring (`GET /logs?model=`) and wakes readiness polling.
- `stop()`: the actor stops its worker (SIGTERM to the group, bounded wait, SIGKILL), then the
  actor is killed, which frees its Ray resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, NodeDiedError, RayError

from router.lifecycle.process import DRAIN_TIMEOUT_S, LOG_TAIL_LINES
from router.log_ring import WORKER_LOGS
from router.placement.nodes import Node

log = logging.getLogger("omni.router.ray")
STOP_GRACE_S = 5.0  # beyond the stop timeout: the actor's own answer may take this long
LOST = -1  # the exit code of a worker whose actor or node was lost (its own code is unknown)


def first_line(e: BaseException, limit: int = 300) -> str:
    """The line of a Ray error that says why ("... because its node has died"), else its first."""
    text = str(e).strip().splitlines()
    reason = next((line.strip() for line in text if "because" in line), text[0] if text else type(e).__name__)
    return reason[:limit]


def is_node_loss(e: BaseException) -> bool:
    """Whether an actor's failure says its node is gone or unreachable (not just its process)."""
    return isinstance(e, ActorUnavailableError | NodeDiedError) or "node has died" in str(e)


class RayProcess:
    def __init__(self, actor: Any, name: str, started: dict[str, Any], node: Node,
                 on_lost: Callable[[Node], None] = lambda node: None) -> None:
        self.actor = actor
        self._on_lost = on_lost
        self._node = node
        self.name = name
        self.pid = int(started["pid"])
        self.node = {**node.view(), "pid": self.pid, "actor_pid": int(started["actor_pid"])}
        self.node_name = node.short
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.log = WORKER_LOGS.ring(name)
        self.output = asyncio.Event()
        self.returncode: int | None = None
        self.exit_cause: str | None = None
        self._stop_code: int | None = None
        self._exit = asyncio.create_task(self._watch_exit(), name=f"ray-exit:{name}")
        self._reader = asyncio.create_task(self._read_log(), name=f"ray-log:{name}")

    async def _watch_exit(self) -> int:
        try:
            code = int(await self.actor.wait.remote())
        except RayError as e:
            if self._stop_code is not None:  # killed by our own stop, after the worker exited
                code = self._stop_code
            else:
                code = LOST
                self.exit_cause = f"its Ray actor on node {self.node_name} was lost: {first_line(e)}"
                log.error("model %s: %s", self.name, self.exit_cause)
                if is_node_loss(e):
                    self._on_lost(self._node)
                # Unavailable may be a blip: kill it for sure, so that its worker is gone too.
                with contextlib.suppress(RayError, ValueError):
                    ray.kill(self.actor, no_restart=True)
        self.returncode = code
        self.output.set()
        return code

    async def _read_log(self) -> None:
        cursor = 0
        while True:
            try:
                lines, cursor, is_done = await self.actor.log_lines.remote(cursor)
            except RayError:
                return
            for text in lines:
                self.log_tail.append(text)
                self.log.append(text)
                log.debug("[%s] %s", self.name, text)
            if lines:
                self.output.set()
            if is_done:
                return

    async def wait(self) -> int:
        """The exit code, once the last log lines are in (a bounded wait for them)."""
        code = await asyncio.shield(self._exit)
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._reader), DRAIN_TIMEOUT_S)
        return code

    async def stop(self, timeout: float) -> int:
        """The worker stopped by its actor, then the actor killed (its resources freed)."""
        if self.returncode is None:
            try:
                self._stop_code = int(await asyncio.wait_for(self.actor.stop.remote(timeout),
                                                             timeout + STOP_GRACE_S))
            except (RayError, TimeoutError) as e:
                log.warning("model %s: the actor did not stop its worker (%s): killing the actor",
                            self.name, first_line(e))
        with contextlib.suppress(RayError, ValueError):
            ray.kill(self.actor, no_restart=True)
        return await self.wait()

    def tail_text(self, lines: int = 5) -> str:
        return " | ".join(list(self.log_tail)[-lines:])
