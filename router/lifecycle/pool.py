"""The model pool: every model by name and alias, admission, the shared clients, events, reload.

Each model's lifecycle is its own owner task (`router.lifecycle.model.ModelHandle`), which gets the few
services it needs (`ModelDeps`), never the pool. `--models-max` and the memory budgets are kept
by `router.lifecycle.admission.Slots`. The pool wires them together, starts and stops them, and applies a
preset reload: new models appear, removed ones finish their requests and stop, changed ones
restart once idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from router import variants
from router.events import EventBus
from router.keys.context import can_see
from router.lifecycle.admission import Admission, Slots
from router.lifecycle.effects import Effects, WorkerEffects
from router.lifecycle.estimate import MemoryBook
from router.lifecycle.eviction import Limits
from router.lifecycle.idle import IdleDefaults
from router.lifecycle.memory import has_gpu
from router.lifecycle.model import ModelDeps, ModelHandle
from router.lifecycle.preset_change import needs_restart, settings
from router.lifecycle.request_queue import Waiting
from router.lifecycle.swap import SwapRule
from router.lifecycle.views import card
from router.presets import ModelPreset, PresetError
from router.upstream import UpstreamClient
from worker.protocol.model_names import adapter_name

log = logging.getLogger("omni.router.pool")


@dataclass
class PoolConfig:
    models_max: int = 4
    max_queue: int = 256
    sleep_idle_seconds: float = 0.0  # 0 = never (per-model `ttl` overrides)
    unload_idle_seconds: float = 0.0  # 0 = never (per-model `unload-after` overrides)
    ram_budget: int = 0  # bytes; 0 = no limit
    vram_budget: int = 0
    autoload: bool = True
    host: str = "127.0.0.1"
    forward_margin: int = 2  # requests forwarded to a worker beyond its slots (--forward-margin)
    swap: SwapRule = field(default_factory=SwapRule)  # --swap-policy, --swap-max-wait, --swap-max-passes


def has_adapter(p: ModelPreset, adapter: str) -> bool:
    """Whether `"<p.name>:<adapter>"` names one of the model's LoRA adapters: a `lora` file's (or
    `lora-scaled`'s) default name, or an adapter a `lora-alias` names. With `lora-runtime` on,
    any name may be an adapter loaded at run time: the worker decides (a 400 if it is not)."""
    if p.worker_arg("lora-runtime") == "true":
        return True
    scaled = p.worker_arg("lora-scaled")
    files = [*map(str, p.lora), *(f.rpartition(":")[0] for f in (scaled or "").split(",") if f)]
    return adapter in {adapter_name(f) for f in files} | {a for _, a in p.lora_aliases}


def upstream_model(p: ModelPreset, name: str) -> str | None:
    """The `model` a request that named `name` must carry to the worker, when it differs: a LoRA
    alias becomes "<model>:<adapter>", and `name:latest` of a model named `name` becomes `name`
    (the worker would read `latest` as an adapter); None: `name` goes as it is."""
    adapter = p.adapter_for(name)
    if adapter is not None:
        return adapter
    if name.endswith(":latest") and name not in p.names:
        return p.name
    return None


class Placement(Protocol):
    """Where workers run: on a Ray cluster besides this box (router.placement.ray_cluster), or on
    this box's GPUs (router.lifecycle.gpu_admission). Wraps the local effects and admission so
    that each model goes to its own; `close` once every worker has stopped."""

    def wire(self, local: WorkerEffects, slots: Slots) -> tuple[Effects, Admission]: ...

    async def close(self) -> None: ...

    def devices(self, name: str) -> list[dict[str, Any]] | None: ...  # its GPUs, for its card (None: no GPUs)


class Pool:
    """All models by name and alias, the shared HTTP clients, admission, events and reload."""

    def __init__(
        self,
        presets: list[ModelPreset],
        config: PoolConfig,
        events: EventBus | None = None,
        *,
        source: Callable[[], list[ModelPreset]] | None = None,
        effects: Effects | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.config = config
        self.events = events or EventBus()
        self.created = int(time.time())
        self.source = source  # re-reads the preset files and --models-dir (blocking)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=30.0),
            trust_env=False,
        )
        self.upstream = UpstreamClient()  # the proxy's keep-alive connections to workers
        self.slots = Slots(Limits(config.models_max, config.ram_budget, config.vram_budget), rule=config.swap)
        self.book = MemoryBook(has_gpu())
        self.placement = placement
        admission: Admission = self.slots
        if effects is None:
            effects = WorkerEffects(self.client, self.upstream, config.host)
            if placement is not None:
                effects, admission = placement.wire(effects, self.slots)
        self.deps = ModelDeps(
            admission,
            self.events,
            effects,
            self.book,
            Waiting(config.max_queue),
            IdleDefaults(config.sleep_idle_seconds, config.unload_idle_seconds),
            self.created,
            config.forward_margin,
        )
        self.handles: dict[str, ModelHandle] = {}
        self.by_name: dict[str, ModelHandle] = {}
        self.retired: set[ModelHandle] = set()  # removed by a reload, finishing their requests
        self.variants: dict[str, ModelPreset] = {}  # names and aliases -> the variant (router/variants.py)
        for p in presets:
            if p.variant_of is None:
                self.handles[p.name] = ModelHandle(p, self.deps)
        self._index_with({p.name: p for p in presets})
        self._slots_task: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def num_waiting(self) -> int:
        return self.deps.waiting.num_waiting

    def get(self, name: str) -> ModelHandle | None:
        """The model `name` routes to (None: a 404 on every route), strictly:
        1. a name or alias (LoRA aliases and variants included);
        2. `name:latest` and `name` answer for each other (Ollama's naming: no tag is `latest`);
        3. `"<model>:<adapter>"` when `<model>` really has that LoRA adapter per its preset
           (`has_adapter`: the worker resolves it).
        Any other suffix is no model: `llama3:70b` never reaches the `llama3` upstream. None too
        for a model the request's API key may not use (router.keys.context): every API then
        answers 404. A variant's name: its base's worker, for a key that may use the variant or
        its base."""
        handle = self._resolve(name)
        v = self.variants.get(name)
        if handle is not None and v is not None and can_see(v.names):
            return handle
        return _if_visible(handle)

    def _resolve(self, name: str) -> ModelHandle | None:
        handle = self.by_name.get(name)
        if handle is not None:
            return handle
        base, sep, suffix = name.rpartition(":")
        if not sep:
            return self.by_name.get(name + ":latest")
        handle = self.by_name.get(base)
        if handle is not None and (suffix == "latest" or has_adapter(handle.preset, suffix)):
            return handle
        return None

    def variant(self, name: str) -> ModelPreset | None:
        """The variant `name` is (its defaults go into each request: router/variants.py), or None."""
        return self.variants.get(name)

    def variant_names(self, base: str) -> list[str]:
        """The names of `base`'s variants the request's API key may use (router.keys), in preset order."""
        seen = {v.name: v for v in self.variants.values() if v.variant_of == base}
        return [name for name, v in seen.items() if can_see(v.names)]

    def with_defaults(self, name: str, body: dict[str, Any], path: str) -> dict[str, Any]:
        """`body` (a request for `name`, to the worker route `path`) with the request defaults of
        `name` written under its own fields: a variant's over its base's (router/variants.py).
        A variant's name stays in `model` for our worker (it echoes it back); a `cmd` or remote
        upstream gets its base's name, the one it serves."""
        v = self.variants.get(name)
        handle = self.get(name)
        if handle is None:
            return body
        defaults = v.request_defaults if v is not None else handle.preset.request_defaults
        out = variants.apply(body, defaults, path)
        if v is not None and (handle.preset.is_remote or handle.preset.backend == "cmd"):
            out = {**out, "model": handle.name}
        return out

    async def start(self) -> None:
        self._slots_task = asyncio.create_task(self.deps.slots.run(), name="slots")
        for h in self.handles.values():
            h.start()
        for h in self.handles.values():
            if h.preset.load_on_startup and not h.preset.is_remote:
                h.load()
        self._estimate_all()

    def _estimate_all(self) -> None:
        """Figure each model's estimate in the background, so /v1/models shows it before a load:
        one thread each (a slow disk or a large header delays no other model, nor a load)."""
        presets = [h.preset for h in self.handles.values() if not h.preset.is_remote]
        async def each() -> None:
            await asyncio.gather(
                *(asyncio.to_thread(self.book.estimate, p) for p in presets), return_exceptions=True
            )

        task = asyncio.create_task(each(), name="estimates")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def load(self, h: ModelHandle) -> None:
        """Start loading `h` (not bound by `--max-queue`: that limits waiting requests, not loads)."""
        h.load()

    async def reload(self) -> dict[str, list[str]]:
        """Re-read the presets; PresetError (nothing changed) if they are broken."""
        if self.source is None:
            raise PresetError("nothing to reload: the router was started without --preset or --models-dir")
        async with self._reload_lock:
            presets = await asyncio.to_thread(self.source)
            return self.apply(presets)

    def apply(self, presets: list[ModelPreset]) -> dict[str, list[str]]:
        """Make the pool serve `presets` (already validated as a whole)."""
        everything = {p.name: p for p in presets}
        presets = [p for p in presets if p.variant_of is None]
        new = {p.name: p for p in presets}
        added: list[str] = []
        removed: list[str] = []
        changed: list[str] = []
        for name, h in list(self.handles.items()):
            p = new.get(name)
            if p is None:
                removed.append(name)
                del self.handles[name]
                self.retired.add(h)
                h.reconfigure(None)
                h.when_ended(self._forget_retired(h))
            elif settings(p) != settings(h.preset):
                if needs_restart(h.preset, p):
                    changed.append(name)
                h.reconfigure(p)
        for p in presets:
            if p.name not in self.handles:
                added.append(p.name)
                h = self.handles[p.name] = ModelHandle(p, self.deps)
                h.start()
                if p.load_on_startup and not p.is_remote:
                    h.load()
        self.handles = {p.name: self.handles[p.name] for p in presets}  # the files' order
        self._index_with(everything)
        self._estimate_all()
        log.info("presets reloaded: added %s, removed %s, restarting %s", added or "none", removed or "none",
                 changed or "none")
        return {"added": added, "removed": removed, "changed": changed}

    def _forget_retired(self, h: ModelHandle) -> Callable[[], None]:
        return lambda: self.retired.discard(h)

    def _index_with(self, presets: dict[str, ModelPreset]) -> None:
        """Names and aliases from the new presets (a handle takes its new preset a moment later);
        a variant's names route to its base's handle."""
        self.by_name = {n: self.handles[p.variant_of or name] for name, p in presets.items() for n in p.names}
        self.variants = {n: p for p in presets.values() if p.variant_of is not None for n in p.names}

    async def close(self) -> None:
        """Stop every worker (concurrently, each with its stop-timeout), then the tasks."""
        handles = [*self.handles.values(), *self.retired]
        for h in handles:
            h.cancel()
        for t in (self._slots_task, *self._background):
            if t is not None:
                t.cancel()
        procs = [(h.process, h.preset.stop_timeout) for h in handles if h.process is not None]
        await asyncio.gather(*(p.stop(t) for p, t in procs), return_exceptions=True)
        if self.placement is not None:
            await self.placement.close()
        self.upstream.close()
        await self.client.aclose()

    def models(self) -> list[dict[str, Any]]:
        """Each model's card, each variant's right after its base's."""
        by_base: dict[str, list[ModelPreset]] = {}
        for v in {v.name: v for v in self.variants.values()}.values():
            by_base.setdefault(v.variant_of or "", []).append(v)
        out = []
        for h in self.handles.values():
            base = card(h)
            if self.placement is not None and (devices := self.placement.devices(base["id"])) is not None:
                base["devices"] = devices  # [{index, uuid, name, vram_bytes}]
            out.append(base)
            out.extend({**base, "id": v.name, "aliases": list(v.aliases), "variant_of": h.name,
                        "defaults": v.request_defaults.view()} for v in by_base.get(h.name, []))
        return out


def _if_visible(handle: ModelHandle | None) -> ModelHandle | None:
    """`handle`, unless the request's API key may not use it (router.keys)."""
    if handle is None or can_see((handle.name, *handle.preset.aliases)):
        return handle
    return None
