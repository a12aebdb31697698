"""`omni-router profile-report DIR`: profiling events -> per-request timelines and a per-stage table.

Reads every `events_*.jsonl` under DIR (router and workers; worker/server/profiling.py has the
format), joins them by `request_id` and splits each request's time into stages:

    queue    waiting for a slot: in the router while the model was loaded but full (or
             draining), plus in the worker from `queued` to `slot_assigned`
    load     waiting in the router for the model to load or wake
    prefill  worker `slot_assigned` -> `prefill_done`
    decode   worker `first_token` -> `finished`
    ttft     router `received` -> router `first_token` (what the client saw)
    total    router `received` -> router `finished`

Requests seen only by a worker (a worker profiled on its own) get the worker stages.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

STAGES = ("queue", "load", "prefill", "decode", "ttft", "total")
_READY_STATES = frozenset({"loaded"})  # waiting in these states is queueing, not loading


@dataclass
class RequestTimeline:
    request_id: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def first(self, event: str, component: str | None = None) -> dict[str, Any] | None:
        for e in self.events:
            if e["event"] == event and (component is None or _is_router(e) == (component == "router")):
                return e
        return None

    def ts(self, event: str, component: str) -> float | None:
        e = self.first(event, component)
        return None if e is None else float(e["ts"])

    @property
    def model(self) -> str:
        e = self.first("received", "router")
        return str(e.get("model", "")) if e else ""

    def stages(self) -> dict[str, float]:
        """Stage -> seconds, for the stages this request has."""
        out: dict[str, float] = {}
        received, queued = self.ts("received", "router"), self.first("queued", "router")
        ready = self.ts("model_ready", "router")
        if queued is not None and ready is not None:
            wait = max(0.0, ready - float(queued["ts"]))
            out["queue" if queued.get("state") in _READY_STATES else "load"] = wait
        w_queued, slot = self.ts("queued", "worker"), self.ts("slot_assigned", "worker")
        if w_queued is not None and slot is not None:
            out["queue"] = out.get("queue", 0.0) + max(0.0, slot - w_queued)
        prefill_done = self.ts("prefill_done", "worker")
        if slot is not None and prefill_done is not None:
            out["prefill"] = max(0.0, prefill_done - slot)
        w_first, w_end = self.ts("first_token", "worker"), self.ts("finished", "worker")
        if w_first is not None and w_end is not None:
            out["decode"] = max(0.0, w_end - w_first)
        first, end = self.ts("first_token", "router"), self.ts("finished", "router")
        if received is not None and first is not None:
            out["ttft"] = max(0.0, first - received)
        if received is not None and end is not None:
            out["total"] = max(0.0, end - received)
        return out


def _is_router(e: dict[str, Any]) -> bool:
    return str(e.get("component", "")) == "router"


def load_events(directory: Path, run_id: str | None = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("events_*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if (
                    isinstance(e, dict)
                    and "ts" in e
                    and "event" in e
                    and (run_id is None or e.get("run_id") == run_id)
                ):
                    events.append(e)
    return events


def timelines(events: Iterable[dict[str, Any]]) -> list[RequestTimeline]:
    by_id: dict[str, RequestTimeline] = {}
    for e in sorted(events, key=lambda e: float(e["ts"])):
        rid = str(e.get("request_id", ""))
        by_id.setdefault(rid, RequestTimeline(rid)).events.append(e)
    return sorted(by_id.values(), key=lambda t: float(t.events[0]["ts"]))


def summary(tls: list[RequestTimeline]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {s: [] for s in STAGES}
    for t in tls:
        for stage, secs in t.stages().items():
            out[stage].append(secs)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def write_report(tls: list[RequestTimeline], out: TextIO, *, with_timelines: bool = True) -> None:
    if with_timelines:
        for t in tls:
            t0 = float(t.events[0]["ts"])
            model = f" model={t.model}" if t.model else ""
            out.write(f"request {t.request_id}{model}\n")
            for e in t.events:
                extra = {
                    k: v
                    for k, v in e.items()
                    if k not in ("ts", "event", "request_id", "component", "pid", "run_id") and v is not None
                }
                detail = " ".join(f"{k}={v}" for k, v in extra.items())
                line = (
                    f"  {(float(e['ts']) - t0) * 1e3:10.3f} ms  "
                    f"{e['component']:<24} {e['event']:<14} {detail}"
                )
                out.write(line.rstrip() + "\n")
            out.write("\n")
    rows = summary(tls)
    out.write(f"{len(tls)} requests\n")
    out.write(f"{'stage':<8} {'count':>6} {'mean ms':>10} {'p50 ms':>10} {'p90 ms':>10} {'max ms':>10}\n")
    for stage in STAGES:
        v = rows[stage]
        if not v:
            out.write(f"{stage:<8} {0:>6} {'-':>10} {'-':>10} {'-':>10} {'-':>10}\n")
            continue
        out.write(f"{stage:<8} {len(v):>6} {statistics.fmean(v) * 1e3:>10.3f} {_pct(v, 0.5) * 1e3:>10.3f} "
                  f"{_pct(v, 0.9) * 1e3:>10.3f} {max(v) * 1e3:>10.3f}\n")
