"""The router's `GET /metrics`: its own counters (labelled by `model`) plus every running
worker's metrics, scraped on each scrape and re-exported with a `model` label.

Router-side series are named `omni_router:*` and fed by the EventBus (one subscriber task):

    request          omni_router:requests_total{model,route,status}, the latency histograms
    load_started     a load (spawn) began; the next status `loaded` / `failed` ends it
    wake_started     a wake began; the next status `loaded` ends it
    status_change    sleeps (entering `sleeping`), load outcomes
    evicted          omni_router:model_evictions_total{model,reason}

Gauges that are state, not events (in-flight and queued requests, the state of each model,
`omni_router:model_node{model,node}`: where its worker runs, `local` or a Ray node) are read
from the pool when scraped (`_LiveCollector`). Worker series keep the worker's own names
(`llamacpp:*`, `omni:*`; worker/engine/metrics.py) with `model` added, and `node` for a
worker on a Ray node; only READY
workers are scraped (concurrently, `SCRAPE_TIMEOUT_S` each): a sleeping or stopped worker has
nothing to add, and a scrape must never wake one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from router.events import Event, EventBus
from router.lifecycle.state import ModelState

if TYPE_CHECKING:
    from router.lifecycle.model import ModelHandle
    from router.observability.request_trace import RequestTrace

log = logging.getLogger("omni.router.metrics")
disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created series are noise here

SCRAPE_TIMEOUT_S = 1.0
EVENTS = frozenset({"request", "status_change", "load_started", "wake_started", "evicted"})
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
_LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def _download_bytes(handles: Mapping[str, ModelHandle]) -> GaugeMetricFamily:
    """An `hf-repo` model's pull under way (router/hub): bytes done and in all."""
    family = GaugeMetricFamily("omni_router:model_download_bytes",
                               "Bytes of a model's files downloaded (done) of all (total), while downloading",
                               labels=["model", "kind"])
    for name, h in handles.items():
        progress = h.progress if h.state is ModelState.DOWNLOADING else None
        if progress is not None and "bytes_total" in progress:
            family.add_metric([name, "done"], float(progress["bytes_done"]))
            family.add_metric([name, "total"], float(progress["bytes_total"]))
    return family


class ConnectionRefusals:
    """Client connections answered 503 at the connection budget (router/http/connection_budget.py
    counts them as uvicorn refuses them, before any app code runs)."""

    count: int = 0


CONNECTION_REFUSALS = ConnectionRefusals()


class RouterMetrics:
    """Owns the registry. `run()` consumes events; `render()` answers a scrape."""

    def __init__(self, events: EventBus, handles: Mapping[str, ModelHandle], client: httpx.AsyncClient,
                 active: Callable[[], Iterable[RequestTrace]]) -> None:
        self._events = events
        self._handles = handles
        self._client = client
        self._queue: asyncio.Queue[Event] | None = None
        self._loading: dict[str, tuple[str, float]] = {}  # model -> ("load" | "wake", monotonic start)
        self._last_state: dict[str, str] = {}
        self.registry = r = CollectorRegistry()
        self.requests = Counter("omni_router:requests", "Proxied requests by client route and final status",
                                ["model", "route", "status"], registry=r)
        self.queue_seconds = Histogram("omni_router:request_queue_seconds",
                                       "Time a request waited for its model (a slot, a load or a wake)",
                                       ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("omni_router:time_to_first_token_seconds",
                                      "Request received to first response body byte (status 200)",
                                      ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.e2e_seconds = Histogram("omni_router:e2e_request_latency_seconds",
                                     "Request received to response end", ["model"], buckets=_LATENCY_BUCKETS,
                                     registry=r)
        self.loads = Counter(
            "omni_router:model_loads", "Worker loads started (spawns)", ["model"], registry=r
        )
        self.load_failures = Counter(
            "omni_router:model_load_failures", "Loads that ended in `failed`", ["model"], registry=r
        )
        self.load_seconds = Histogram("omni_router:model_load_seconds", "Spawn to ready, successful loads",
                                      ["model"], buckets=_LOAD_BUCKETS, registry=r)
        self.evictions = Counter("omni_router:model_evictions", "Workers stopped to make room or when idle",
                                 ["model", "reason"], registry=r)
        self.sleeps = Counter("omni_router:model_sleeps", "Workers put to sleep", ["model"], registry=r)
        self.wakes = Counter("omni_router:model_wakes", "Workers woken", ["model"], registry=r)
        self.wake_seconds = Histogram("omni_router:model_wake_seconds", "Wake to ready", ["model"],
                                      buckets=_LOAD_BUCKETS, registry=r)
        self._live = _LiveCollector(handles, active)
        r.register(self._live)

    # ---- events

    async def run(self) -> None:
        async with self._events.subscribe(EVENTS) as queue:
            self._queue = queue
            try:
                while True:
                    self._handle(*await queue.get())
            finally:
                self._queue = None

    def _drain(self) -> None:
        """Take every event emitted so far (a scrape right after a request sees it counted)."""
        q = self._queue
        while q is not None and not q.empty():
            self._handle(*q.get_nowait())

    def _handle(self, event: str, data: dict[str, Any]) -> None:
        try:
            model = str(data["model"])
            if event == "request":
                self._on_request(model, data["trace"])
            elif event == "status_change":
                self._on_status(model, str(data["status"]["value"]))
            elif event in ("load_started", "wake_started"):
                self._loading[model] = ("load" if event == "load_started" else "wake", time.monotonic())
                if event == "load_started":
                    self.loads.labels(model).inc()
            elif event == "evicted":
                self.evictions.labels(model, str(data.get("reason", "unknown"))).inc()
        except Exception:  # a malformed event must not stop the metrics
            log.exception("metrics: cannot count event %s %r", event, data)

    def _on_request(self, model: str, trace: RequestTrace) -> None:
        self.requests.labels(model, trace.route, str(trace.status)).inc()
        if trace.t_ready:
            self.queue_seconds.labels(model).observe(trace.queued_s)
        ttft = trace.ttft_s
        if ttft is not None and trace.status == 200:
            self.ttft_seconds.labels(model).observe(ttft)
        if not trace.is_cancelled:
            self.e2e_seconds.labels(model).observe(trace.duration_s)

    def _on_status(self, model: str, value: str) -> None:
        last, self._last_state[model] = self._last_state.get(model), value
        if value == last:
            return  # a progress update
        if value == ModelState.SLEEPING.value:
            self.sleeps.labels(model).inc()
        pending = self._loading.get(model)
        if pending is None or value not in (ModelState.READY.value, ModelState.FAILED.value,
                                            ModelState.UNLOADED.value):
            return
        del self._loading[model]
        kind, t0 = pending
        if value == ModelState.READY.value:
            (self.load_seconds if kind == "load" else self.wake_seconds).labels(model).observe(
                time.monotonic() - t0
            )
            if kind == "wake":
                self.wakes.labels(model).inc()
        elif value == ModelState.FAILED.value and kind == "load":
            self.load_failures.labels(model).inc()

    # ---- a scrape

    async def render(self) -> bytes:
        targets = [h for h in self._handles.values()
                   if h.state is ModelState.READY and h.base_url and not h.preset.is_remote]
        scraped = await asyncio.gather(
            *(self._scrape(h.name, h.base_url or "", node_name(h)) for h in targets))
        self._drain()
        self._live.workers = [m for families in scraped for m in families]
        return generate_latest(self.registry)

    async def _scrape(self, model: str, base_url: str, node: str) -> list[Metric]:
        try:
            r = await self._client.get(f"{base_url}/metrics", timeout=SCRAPE_TIMEOUT_S)
            if r.status_code != 200:
                return []
            return [_with_model(f, model, node) for f in text_string_to_metric_families(r.text)]
        except (httpx.HTTPError, ValueError) as e:
            log.debug("metrics: scraping %s failed: %r", model, e)
            return []


def node_name(h: ModelHandle) -> str:
    """Where a model's worker runs: `local` (the router's box) or its Ray node's name."""
    return str(h.node["name"]) if h.node is not None else "local"


def _with_model(family: Metric, model: str, node: str) -> Metric:
    out = Metric(family.name, family.documentation, family.type, family.unit)
    where = {"node": node} if node != "local" else {}  # a local worker's series stay as they were
    out.samples = [Sample(s.name, {**s.labels, "model": model, **where}, s.value, s.timestamp, s.exemplar)
                   for s in family.samples]
    return out


class _LiveCollector:
    """Gauges read at scrape time, and the workers' families of the current scrape."""

    def __init__(
        self, handles: Mapping[str, ModelHandle], active: Callable[[], Iterable[RequestTrace]]
    ) -> None:
        self._handles = handles
        self._active = active
        self.workers: list[Metric] = []

    def describe(self) -> list[Metric]:
        return []  # unknown until scraped (and registering must not call collect())

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily("omni_router:requests_in_flight", "Requests being served by a worker",
                                      labels=["model"])
        queued = GaugeMetricFamily("omni_router:requests_queued", "Requests waiting for their model",
                                   labels=["model"])
        state = GaugeMetricFamily(
            "omni_router:model_state", "1 for the model's current state", labels=["model", "state"]
        )
        where = GaugeMetricFamily("omni_router:model_node", "1 for the node a model's worker runs (ran) on",
                                  labels=["model", "node"])
        waiting: dict[str, int] = {}
        for t in self._active():
            if t.t_queued and not t.t_ready:
                waiting[t.model] = waiting.get(t.model, 0) + 1
        for name, h in self._handles.items():
            in_flight.add_metric([name], h.num_in_flight)
            queued.add_metric([name], waiting.get(name, 0))
            for s in ModelState:
                state.add_metric([name, s.value], 1.0 if h.state is s else 0.0)
            if not h.preset.is_remote:
                where.add_metric([name, node_name(h)], 1.0)
        yield from (in_flight, queued, state, where, _download_bytes(self._handles))
        yield CounterMetricFamily(
            "omni_router:connections_refused",
            "Client connections answered 503 at the connection budget (--max-connections)",
            value=CONNECTION_REFUSALS.count)
        merged: dict[str, Metric] = {}  # one family per name, every model's samples in it
        for m in self.workers:
            into = merged.get(m.name)
            if into is None:
                into = merged[m.name] = Metric(m.name, m.documentation, m.type, m.unit)
            into.samples.extend(m.samples)
        yield from merged.values()
