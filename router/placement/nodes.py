"""The Ray cluster's nodes as the router sees them, and which of them may take a model. Pure.

A model placed on Ray asks for `ray-resources` (e.g. `{"GPU": 1, "vram_gib": 24}`) and
`ray-node-labels`; a node may take it when its *total* resources cover the ask and it carries
every label. Whether there is room *now* is admission's question (per-node budgets, eviction),
not this one's. A node's budgets: its `vram_gib` resource, where declared, is its VRAM budget
(else `--vram-budget`); RAM is `--ram-budget` capped by the node's Ray `memory` resource.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from router.lifecycle.admission import Occupant
from router.lifecycle.eviction import Limits, Need, Occupancy, format_size
from router.presets import ModelPreset

GIB = 1 << 30
VRAM_RESOURCE = "vram_gib"  # a custom resource a GPU node declares: its VRAM in GiB


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    resources: Mapping[str, float] = field(default_factory=dict)  # totals
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def short(self) -> str:
        """The node's name in /metrics and logs: its address and the start of its id."""
        return f"{self.address}/{self.node_id[:8]}"

    def view(self) -> dict[str, Any]:
        return {"placement": "ray", "id": self.node_id, "address": self.address, "name": self.short}


def from_ray(entries: Sequence[Mapping[str, Any]]) -> list[Node]:
    """`ray.nodes()` -> the alive nodes, in a stable order (by id)."""
    nodes = [Node(str(e["NodeID"]), str(e.get("NodeManagerAddress", "")),
                  {str(k): float(v) for k, v in dict(e.get("Resources") or {}).items()},
                  {str(k): str(v) for k, v in dict(e.get("Labels") or {}).items()})
             for e in entries if e.get("Alive")]
    return sorted(nodes, key=lambda n: n.node_id)


def can_take(node: Node, preset: ModelPreset) -> bool:
    enough = all(node.resources.get(name, 0.0) >= amount for name, amount in preset.ray_resources)
    return enough and all(node.labels.get(k) == v for k, v in preset.ray_node_labels)


def none_can_take(nodes: Sequence[Node], preset: ModelPreset) -> str:
    """Why no node may ever take `preset`, with the figures (the immediate 503)."""
    ask = ", ".join(f"{k}={v:g}" for k, v in preset.ray_resources) or "no resources"
    labels = ", ".join(f"{k}={v}" for k, v in preset.ray_node_labels)
    seen = "; ".join(f"{n.short}: {_declared(n)}" for n in nodes) or "no alive node"
    return (f"no node of the Ray cluster has {ask}" + (f" with labels {labels}" if labels else "")
            + f" (ray-resources / ray-node-labels; the nodes: {seen})")


def _declared(node: Node) -> str:
    """Its resources without Ray's own bookkeeping ones (memory, object store, node:IP)."""
    return ", ".join(f"{k}={v:g}" for k, v in sorted(node.resources.items())
                     if k not in ("memory", "object_store_memory") and not k.startswith("node:")) or "none"


def _reserved_vram(preset: ModelPreset) -> int:
    return int(dict(preset.ray_resources).get(VRAM_RESOURCE, 0.0) * GIB)


def need_on(preset: ModelPreset, need: Need) -> Need:
    """The estimate, with VRAM at least what the preset reserves as `vram_gib`."""
    return Need(need.ram_bytes, max(need.vram_bytes, _reserved_vram(preset)))


def reserved(occupant: Occupant) -> Occupancy:
    """A model on a node as the policy sees it: charged at least the VRAM it reserves."""
    o = occupant.occupancy()
    return replace(o, vram_bytes=max(o.vram_bytes, _reserved_vram(occupant.preset)))


def limits_of(node: Node, base: Limits) -> Limits:
    """A node's budgets: see the module docstring."""
    ram = int(node.resources.get("memory", 0.0))
    ram_budget = min(b for b in (base.ram_budget, ram) if b > 0) if (base.ram_budget or ram) else 0
    vram = node.resources.get(VRAM_RESOURCE)
    return Limits(base.models_max, ram_budget, int(vram * GIB) if vram is not None else base.vram_budget)


def describe(limits: Limits) -> str:
    return (f"models-max {limits.models_max or 'unlimited'}, RAM budget "
            f"{format_size(limits.ram_budget) if limits.ram_budget else 'unlimited'}, VRAM budget "
            f"{format_size(limits.vram_budget) if limits.vram_budget else 'unlimited'}")
