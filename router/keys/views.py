"""What a key sees of the models: only its own, and without internals unless it is an admin key
(or the router runs without keys).

Internals are where things are on this box and how its processes run: the model file's path,
the disk prompt cache's folder, the LoRA files, a remote upstream's URL, the Ray node and the GPUs
it runs on, the worker's command line (`status.args`: its ports and the router's PID) and the
tail of its log.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from router.keys.context import can_see, sees_internals
from router.lifecycle import views as lifecycle_views

__all__ = ["card", "cards", "is_visible", "sees_internals", "shown_card", "shown_status", "visible"]

if TYPE_CHECKING:
    from router.lifecycle.model import ModelHandle
    from router.lifecycle.pool import Pool

_CARD_INTERNALS = ("path", "prompt_cache_disk", "upstream", "node", "devices")
_STATUS_INTERNALS = ("args", "log_tail")
PROPS_INTERNALS = ("model_path",)  # a worker's /props


def is_visible(handle: ModelHandle) -> bool:
    return can_see((handle.name, *handle.preset.aliases))


def visible(handles: Iterable[ModelHandle]) -> list[ModelHandle]:
    return [h for h in handles if is_visible(h)]


def card(handle: ModelHandle) -> dict[str, Any]:
    """The model's card (router.lifecycle.views) as the current key may see it."""
    return shown_card(lifecycle_views.card(handle))


def shown_card(c: dict[str, Any]) -> dict[str, Any]:
    if sees_internals():
        return c
    out = {k: v for k, v in c.items() if k not in _CARD_INTERNALS}
    if isinstance(c.get("status"), dict):
        out["status"] = shown_status(c["status"])
    if isinstance(c.get("lora"), dict):
        out["lora"] = {k: v for k, v in c["lora"].items() if k != "files"}
    return out


def shown_status(status: dict[str, Any]) -> dict[str, Any]:
    if sees_internals():
        return status
    return {k: v for k, v in status.items() if k not in _STATUS_INTERNALS}


def cards(pool: Pool) -> list[dict[str, Any]]:
    """`pool.models()` (the cards, with what the pool adds: GPU devices) as the key may see them."""
    return [
        shown_card(c)
        for c in pool.models()
        if (c["id"] not in pool.handles and c["id"] not in pool.variants) or pool.get(c["id"]) is not None
    ]
