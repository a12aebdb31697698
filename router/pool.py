"""The model pool: every model by name and alias, admission, the shared clients, events.

Each model's lifecycle is its own owner task (`router.model.ModelHandle`); `--models-max` is
kept by `router.admission.Slots`. The pool wires them together, starts and stops them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from router.admission import Slots
from router.events import EventBus
from router.model import ModelHandle
from router.presets import ModelPreset
from router.upstream import UpstreamClient


@dataclass
class PoolConfig:
    models_max: int = 4
    max_queue: int = 256
    sleep_idle_seconds: float = 0.0  # 0 = never (per-model `ttl` overrides)
    autoload: bool = True
    host: str = "127.0.0.1"



class Pool:
    """All models by name and alias, the shared HTTP client, admission and events."""

    def __init__(self, presets: list[ModelPreset], config: PoolConfig, events: EventBus | None = None) -> None:
        self.config = config
        self.events = events or EventBus()
        self.created = int(time.time())
        self.handles: dict[str, ModelHandle] = {}
        self.by_name: dict[str, ModelHandle] = {}
        self.num_waiting = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=30.0),
            trust_env=False,
        )
        self.upstream = UpstreamClient()  # the proxy's keep-alive connections to workers
        self.slots = Slots(config.models_max, self.handles)
        for p in presets:
            h = ModelHandle(p, self)
            self.handles[p.name] = h
            for n in p.names:
                self.by_name[n] = h
        self._slots_task: asyncio.Task[None] | None = None

    def get(self, name: str) -> ModelHandle | None:
        return self.by_name.get(name)

    async def start(self) -> None:
        self._slots_task = asyncio.create_task(self.slots.run(), name="slots")
        for h in self.handles.values():
            h.start()
        for h in self.handles.values():
            if h.preset.load_on_startup and not h.preset.is_remote:
                h.load()

    async def load(self, h: ModelHandle) -> None:
        """Start loading `h` (not bound by `--max-queue`: that limits waiting requests, not loads)."""
        h.load()

    async def close(self) -> None:
        """Stop every worker (concurrently, each with its stop-timeout), then the tasks."""
        tasks = [*(h._task for h in self.handles.values() if h._task), self._slots_task]
        for t in tasks:
            if t is not None:
                t.cancel()
        for h in self.handles.values():
            h._cancel_effect()
        procs = [(h.process, h.preset.stop_timeout) for h in self.handles.values() if h.process is not None]
        await asyncio.gather(*(p.stop(t) for p, t in procs), return_exceptions=True)
        self.upstream.close()
        await self.client.aclose()

    def models(self) -> list[dict[str, Any]]:
        return [h.card() for h in self.handles.values()]
