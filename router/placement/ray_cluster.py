"""The router as a Ray driver: per-node admission and the effects that run a worker in an actor.

`RayPlacement.wire` wraps the pool's local effects and `Slots`:

- Admission (`NodeSlots`): a model placed locally uses the local `Slots`, as without Ray. A
  model placed on Ray first gets a node: among the alive nodes that may take it
  (router.placement.nodes), the first where the pure policy admits it now, else one where it
  would evict, drain or wait; if no node may ever take it, the load is refused at once with the
  figures (a 503, as a local budget does). Each node has its own `Slots` with its own budgets,
  so eviction on one node never touches another.
- Effects (`RayEffects`): `spawn` creates the actor on the node admission chose (hard node
  affinity, with the preset's `ray-resources` reserved in Ray too) and starts the worker there;
  readiness, sleep, wake and the card are the same HTTP calls as locally, straight to the
  worker's `host:port`; memory samples come from the actor.
- Actors are not detached and never restarted: when the router (the driver) exits, however it
  exits, Ray kills them, and each worker dies with its actor (router.placement.ray_actor).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from router.lifecycle.admission import Admission, Occupant, Slots, SlotsFull
from router.lifecycle.effects import Effects, LayeredEffects, Process, WorkerEffects
from router.lifecycle.eviction import Admit, Decision, Drain, Evict, Full, Need, choose_victim
from router.lifecycle.memory import TreeMemory
from router.lifecycle.process import SpawnError
from router.placement import nodes as cluster_nodes
from router.placement.nodes import Node
from router.placement.ray_actor import WorkerActor
from router.placement.ray_process import RayProcess, first_line
from router.presets import ModelPreset

log = logging.getLogger("omni.router.ray")
NAMESPACE = "omni-router"
REACH_TIMEOUT_S = 5.0
SUSPECT_S = 60.0  # a node where an actor was lost takes no new model for this long


def is_on_ray(preset: ModelPreset) -> bool:
    """With `--ray`, every model but a `placement = "local"` one (and `remote`, which has no process)."""
    return preset.placement != "local" and not preset.is_remote


def connect(address: str) -> None:
    """Join the cluster as a driver (blocking): `auto`, `ray://host:10001` or `host:6379`."""
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and "://" not in address:
        # ray.init retries an unreachable GCS for minutes: say so at once instead.
        try:
            socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
        except OSError as e:
            raise ConnectionError(f"nothing answers at {address} ({e})") from None
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    log.info("joined the Ray cluster at %s: %d alive nodes", address, len(alive_nodes()))


def alive_nodes() -> list[Node]:
    return cluster_nodes.from_ray(ray.nodes())  # type: ignore[no-untyped-call]  # ray ships no hints here


def _rank(decision: Decision) -> int:
    return 0 if isinstance(decision, Admit) else 1 if isinstance(decision, Evict | Drain) else 2


class NodeSlots:
    """Admission with one `Slots` per Ray node beside the local one (see the module docstring)."""

    def __init__(self, local: Slots, nodes: Callable[[], list[Node]] = alive_nodes) -> None:
        self.local = local
        self._nodes = nodes
        self.by_node: dict[str, Slots] = {}
        self.placed: dict[str, Node] = {}  # model -> the node its current load was admitted on
        self._suspects: dict[str, float] = {}  # node id -> when it was found lost (monotonic)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def queued(self) -> list[str]:
        return [*self.local.queued, *(n for s in self.by_node.values() for n in s.queued)]

    def poke(self) -> None:
        self.local.poke()
        for s in self.by_node.values():
            s.poke()

    def admits_before(self, name: str) -> float | None:
        """The bound of the Slots the model was admitted by (its node's, or the local one)."""
        node = self.placed.get(name)
        slots = self.by_node.get(node.node_id) if node is not None else None
        return (slots or self.local).admits_before(name)

    def release(self, occupant: Occupant) -> None:
        self.local.release(occupant)
        for s in self.by_node.values():
            s.release(occupant)

    async def run(self) -> None:
        try:
            await self.local.run()
        finally:
            for t in self._tasks:
                t.cancel()

    def suspect(self, node: Node) -> None:
        """The node was lost (or could not start an actor): place nothing there for a while.
        Ray may take some seconds to declare a node dead (its health checks), and lists it as
        alive until then."""
        self._suspects[node.node_id] = time.monotonic()

    def _is_suspect(self, node: Node) -> bool:
        since = self._suspects.get(node.node_id)
        return since is not None and time.monotonic() - since < SUSPECT_S

    def _slots(self, node: Node) -> Slots:
        slots = self.by_node.get(node.node_id)
        if slots is None:
            slots = self.by_node[node.node_id] = Slots(cluster_nodes.limits_of(node, self.local.limits),
                                                       cluster_nodes.reserved, self.local.rule)
            log.info("node %s: %s", node.short, cluster_nodes.describe(slots.limits))
            self._tasks.append(asyncio.create_task(slots.run(), name=f"slots:{node.short}"))
        return slots

    async def acquire(self, occupant: Occupant, need: Need) -> None:
        preset = occupant.preset
        if not is_on_ray(preset):
            await self.local.acquire(occupant, need)
            return
        nodes = [n for n in await asyncio.to_thread(self._nodes) if not self._is_suspect(n)]
        fit = [n for n in nodes if cluster_nodes.can_take(n, preset)]
        if not fit:
            raise SlotsFull(cluster_nodes.none_can_take(nodes, preset))
        on_node = cluster_nodes.need_on(preset, need)
        choices = self._choices(fit, on_node)
        usable = [(n, d) for n, d in choices if not isinstance(d, Full)]
        if not usable:
            reasons = (f"node {n.short}: {d.reason}" for n, d in choices if isinstance(d, Full))
            raise SlotsFull("; ".join(reasons))
        node = min(usable, key=lambda c: _rank(c[1]))[0]
        self.placed[preset.name] = node
        await self._slots(node).acquire(occupant, on_node)

    def _choices(self, fit: Sequence[Node], need: Need) -> list[tuple[Node, Decision]]:
        out: list[tuple[Node, Decision]] = []
        for n in fit:
            slots = self._slots(n)
            out.append((n, choose_victim([slots.snapshot(h) for h in slots.holders], need, slots.limits)))
        return out


class RayEffects(LayeredEffects):
    """Local effects for local models; a worker actor on the admitted node for the others."""

    def __init__(self, local: WorkerEffects, admission: NodeSlots) -> None:
        super().__init__(local)
        self.admission = admission
        self.actor_class: Any = ray.remote(WorkerActor)

    async def spawn(self, preset: ModelPreset) -> tuple[Process, str, list[str]]:
        if not is_on_ray(preset):
            return await self.local.spawn(preset)
        node = self.admission.placed.get(preset.name)
        if node is None:  # (admission places every Ray model before its spawn)
            raise SpawnError(f"model {preset.name!r} was not admitted on any Ray node")
        resources = dict(preset.ray_resources)
        actor = self.actor_class.options(
            num_cpus=resources.pop("CPU", 0.0), num_gpus=resources.pop("GPU", 0.0), resources=resources,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            max_restarts=0, max_task_retries=0, lifetime=None,
        ).remote(preset.name)
        try:
            started = await asyncio.wait_for(actor.start.remote(preset), preset.load_timeout)
        except (RayError, TimeoutError) as e:
            ray.kill(actor, no_restart=True)
            self.admission.suspect(node)
            raise SpawnError(f"could not start its actor on node {node.short}: {first_line(e)}") from None
        proc = RayProcess(actor, preset.name, started, node, on_lost=self.admission.suspect)
        log.info("model %s: worker pid %d on node %s", preset.name, proc.pid, node.short)
        return proc, f"http://{started['host']}:{started['port']}", list(started["argv"])

    async def samples(self, proc: Process, interval: Callable[[], float]) -> AsyncIterator[TreeMemory]:
        """As locally, measured by the actor on its node, until the worker or the actor is gone."""
        if not isinstance(proc, RayProcess):
            async for m in self.local.samples(proc, interval):
                yield m
            return
        while True:
            try:
                memory = await proc.actor.memory.remote()
            except RayError:
                return
            if memory is None:
                return
            yield memory
            await asyncio.sleep(interval())


class RayPlacement:
    """The pool's `Placement` for `--ray` (router.lifecycle.pool)."""

    def wire(self, local: WorkerEffects, slots: Slots) -> tuple[Effects, Admission]:
        admission = NodeSlots(slots)
        return RayEffects(local, admission), admission

    def devices(self, name: str) -> list[dict[str, Any]] | None:
        return None  # a node's GPUs are Ray's to assign

    async def close(self) -> None:
        """Every worker has stopped: leave the cluster (Ray kills any actor still there)."""
        try:
            await asyncio.to_thread(ray.shutdown)
        except Exception as e:  # leaving must not fail the router's shutdown
            log.warning("leaving the Ray cluster: %s", first_line(e))
