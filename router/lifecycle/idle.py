"""Idle tiers: when an idle model falls asleep, then unloads. Pure: the owner asks, it acts."""

from __future__ import annotations

from dataclasses import dataclass

from router.lifecycle.state import Phase
from router.presets import ModelPreset


@dataclass(frozen=True)
class IdleDefaults:
    sleep_idle_seconds: float = 0.0  # per-model `ttl` overrides; 0 = never
    unload_idle_seconds: float = 0.0  # per-model `unload-after` overrides; 0 = never


def sleep_after(p: ModelPreset, defaults: IdleDefaults) -> float:
    """Idle seconds before the model sleeps (0: never; a remote upstream never does)."""
    ttl = p.ttl if p.ttl is not None else defaults.sleep_idle_seconds
    return 0.0 if p.is_remote else ttl


def unload_after(p: ModelPreset, defaults: IdleDefaults) -> float:
    """Idle seconds before the model unloads (0: never; a pinned or remote one never does)."""
    after = p.unload_after if p.unload_after is not None else defaults.unload_idle_seconds
    return 0.0 if p.is_remote or p.pin else after


def next_step(phase: Phase, last_used: float, ttl: float, after: float) -> tuple[float, str] | None:
    """When an idle model's next step is due (the clock of `last_used`) and what it is: "sleep"
    or "unload"; None: none is due (the phase has no idle step, or both tiers are off)."""
    steps = []
    if phase is Phase.READY and ttl > 0:
        steps.append((last_used + ttl, "sleep"))
    if phase in (Phase.READY, Phase.SLEEPING) and after > 0:
        steps.append((last_used + after, "unload"))
    return min(steps) if steps else None
