"""A preset reload's change to one model: whether it needs its worker restarted. Pure."""

from __future__ import annotations

from dataclasses import replace

from router.presets import ModelPreset
from router.variants import RequestDefaults


def settings(p: ModelPreset) -> ModelPreset:
    """A preset without where it was written: two presets with equal settings compare equal."""
    return replace(p, source="")


def needs_restart(old: ModelPreset, new: ModelPreset) -> bool:
    """Whether the worker's command line (or what it serves) differs; the router-side keys
    (aliases, idle tiers, pin, memory, timeouts, load-on-startup) apply without a restart."""
    def worker_side(p: ModelPreset) -> ModelPreset:
        return replace(settings(p), aliases=(), load_on_startup=False, ttl=None, unload_after=None, pin=False,
                       memory=None, stop_timeout=0.0, load_timeout=0.0, group=None,
                       request_defaults=RequestDefaults(), priority=0, concurrency_limit=None, load_delay=0.0)

    return worker_side(old) != worker_side(new)
