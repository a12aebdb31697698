"""The worker's table of LoRA adapters (worker/backends/lora.py) and what a request's `lora` means.

The engine thread loads and unloads adapters (the backend's `load_lora` / `unload_lora`); any
thread reads the table, a tuple replaced whole on each change (no lock). Ids are given in
loading order and never reused. Each adapter has a global scale (llama-server's
`POST /lora-adapters`, `--lora-scaled`, 0 for all with `--lora-init-without-apply`, else 1).

A request's adapter set (`resolve`), as llama-server's:
- no `lora` field: every adapter at its global scale;
- a `lora` list: the adapters it names at the scales it gives, every other one at scale 0.
An id that is not loaded is refused (ValueError naming it: a 400 with param `lora`; llama-server
answers 200 and ignores it); a non-finite scale never gets here (the wire model refuses it).
The result is a `LoraKey`: ids ascending, zero scales left out, so "scale 0" is the base model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from worker.backends.base import Backend
from worker.backends.lora import LoraAdapter, LoraError, check_scale
from worker.protocol.model_names import adapter_name
from worker.protocol.sampling import LoraKey, lora_key

log = logging.getLogger("worker.engine.adapters")


class Adapters:
    def __init__(self) -> None:
        self.table: tuple[LoraAdapter, ...] = ()  # loaded adapters, by ascending id
        self._next_id = 0
        self._lock = threading.Lock()  # writers only (engine thread, HTTP's scale updates)

    def get(self, lora_id: int) -> LoraAdapter | None:
        return next((a for a in self.table if a.id == lora_id), None)

    def by_name(self, name: str) -> LoraAdapter | None:
        return next((a for a in self.table if a.name == name), None)

    # -- engine thread -------------------------------------------------------------------------
    def load(self, backend: Backend, path: str, scale: float = 1.0, name: str | None = None) -> LoraAdapter:
        """Load an adapter (LoraError with the reason if it does not fit the model)."""
        check_scale(scale, path)
        name = name or adapter_name(path)
        if self.by_name(name) is not None:
            raise LoraError(f"an adapter named {name!r} is already loaded")
        task_name, prefix = backend.load_lora(path)
        with self._lock:
            adapter = LoraAdapter(self._next_id, path, name, scale, task_name, prefix)
            self._next_id += 1
            self.table = (*self.table, adapter)
        log.info("LoRA adapter %d loaded: %s (scale %g)", adapter.id, path, scale)
        return adapter

    def unload(self, backend: Backend, lora_id: int) -> LoraAdapter:
        adapter = self.get(lora_id)
        if adapter is None:
            raise LoraError(f"no adapter with id {lora_id}")
        backend.unload_lora(lora_id)
        with self._lock:
            self.table = tuple(a for a in self.table if a.id != lora_id)
        log.info("LoRA adapter %d unloaded: %s", lora_id, adapter.path)
        return adapter

    def is_loaded(self, key: LoraKey) -> bool:
        ids = {a.id for a in self.table}
        return all(i in ids for i, _ in key)

    # -- any thread ----------------------------------------------------------------------------
    def set_scales(self, scales: Iterable[tuple[int, float]]) -> None:
        """POST /lora-adapters: the global scales; an adapter not listed gets 0 (llama-server)."""
        given = self._checked(scales)
        with self._lock:
            self.table = tuple(
                LoraAdapter(a.id, a.path, a.name, given.get(a.id, 0.0), a.task_name, a.prompt_prefix)
                for a in self.table
            )

    def resolve(self, request: Iterable[tuple[int, float]] | None) -> LoraKey:
        """A request's adapter set (see the module doc); ValueError names an unknown id."""
        if request is None:
            return lora_key({a.id: a.scale for a in self.table})
        return lora_key(self._checked(request))

    def _checked(self, pairs: Iterable[tuple[int, float]]) -> dict[int, float]:
        ids = {a.id for a in self.table}
        out: dict[int, float] = {}
        for i, scale in pairs:
            if i not in ids:
                known = ", ".join(str(x) for x in sorted(ids)) or "none are loaded"
                raise ValueError(f"lora: no adapter with id {i} (loaded: {known}; GET /lora-adapters)")
            check_scale(scale, f"lora id {i}")
            out[i] = scale
        return out
