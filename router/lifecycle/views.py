"""A model as `GET /v1/models` and the admin API show it: its card and its memory."""

from __future__ import annotations

from typing import Any

from router.lifecycle.modalities import modalities
from router.lifecycle.model import ModelHandle
from router.lifecycle.state import ModelState
from router.prompt_cache_dir import folder_bytes


def memory_view(h: ModelHandle) -> dict[str, Any]:
    """The estimate (RAM + VRAM) for this run, or the next; measured: the tree's USS, RSS and VRAM."""
    m = h.memory
    est = (
        h.need
        if h.process is not None and h.need is not None
        else h.deps.book.peek(h.run_preset)
    )
    return {"estimated_bytes": est.total_bytes if est and est.source != "unknown" else None,
            "ram_bytes": m.uss_bytes if m else None, "rss_bytes": m.rss_bytes if m else None,
            "vram_bytes": m.vram_bytes if m else None}


def card(h: ModelHandle) -> dict[str, Any]:
    """The model's entry in `GET /v1/models` (and `GET /models/{name}`)."""
    p = h.run_preset
    out: dict[str, Any] = {
        "id": p.name, "object": "model", "created": h.deps.created, "owned_by": "omni-router",
        "aliases": list(p.aliases), "backend": p.backend, "resolved_backend": p.resolved_backend,
        "status": h.status(),
        "in_flight": h.num_in_flight, "waiting": h.num_waiting, "pinned": p.pin, "memory": memory_view(h),
        "modalities": modalities(p),  # from the preset and its mmproj's header: no load needed
    }
    if p.model is not None:
        out["path"] = str(p.model)
    if p.upstream:
        out["upstream"] = p.upstream
    if p.speech_model is not None:
        out["speech_model"] = p.speech_model  # the voice that speaks its chat answers
    if p.group is not None:  # its preset group (docs/swaps.md)
        out["group"] = {"name": p.group.name, "swap": p.group.swap, "exclusive": p.group.exclusive,
                        "persistent": p.group.persistent}
    if h.node is not None:
        out["node"] = h.node
    if h.info is not None and h.state is not ModelState.UNLOADED:
        out["meta"] = h.info.get("meta", h.info)
    if p.cache_dir is not None:
        out["prompt_cache_disk"] = {"dir": p.cache_dir, "bytes": folder_bytes(p.cache_dir)}
    if p.lora or p.lora_aliases:  # LoRA adapters: `model` reaches one as "<id>:<adapter>" or an alias
        out["lora"] = {"files": [str(f) for f in p.lora],
                        "aliases": {name: f"{p.name}:{adapter}" for name, adapter in p.lora_aliases}}
    if p.hf_repo is not None:  # from a hub: the reference, and what its pull brought
        out["hf_repo"] = p.hf_repo if p.hf_file is None else f"{p.hf_repo} ({p.hf_file})"
        if h.pulled is not None:
            out["hf"] = {"commit": h.pulled.commit, "files": list(h.pulled.files),
                         "bytes": h.pulled.total_bytes, "sampling": dict(h.pulled.sampling)}
    return out
