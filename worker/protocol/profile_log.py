"""Profiling runs and their JSONL event files: the part the worker and the router share
(worker/server/profiling.py has the endpoints' contract and the events).

A `Profiler` is one process's set of active runs; `record()` appends one JSON object a line to
`<event_dir>/events_<component>_<pid>.jsonl` of every active run (runs sharing a directory
share the file). Any thread may record; when no run is active, `record()` is one attribute read.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pydantic import Field

from worker.protocol.errors import parse_model
from worker.protocol.strict import StrictModel

DEFAULT_TRACE_TEMPLATE = "{event_dir}/trace_{component}_{pid}.json"
DEFAULT_PROFILES_DIR = Path("profiles")  # a worker's own, under its working directory
SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


class StartProfile(StrictModel):
    """sglang-omni's body: every field may be left out (its documented example sends only
    `run_id` and `enable_torch`); `event_dir` defaults to `<profiles dir>/<run_id>/events` and
    `enable_torch` to on, as there."""

    run_id: str | None = None
    event_dir: str | None = None
    trace_path_template: str | None = None
    enable_torch: bool = True
    token_interval: int = Field(16, ge=1)


class StopProfile(StrictModel):
    run_id: str | None = None


@dataclass(frozen=True, slots=True)
class ProfileRun:
    run_id: str
    event_dir: Path
    trace_path_template: str
    enable_torch: bool
    token_interval: int

    @classmethod
    def from_request(cls, req: StartProfile, *, events_only: bool = False,
                     profiles_dir: Path = DEFAULT_PROFILES_DIR) -> ProfileRun:
        """`profiles_dir`: where a run without `event_dir` writes (`<it>/<run_id>/events`)."""
        run_id = req.run_id or time.strftime("%Y%m%d-%H%M%S")
        event_dir = (Path(req.event_dir) if req.event_dir
                     else profiles_dir / (SAFE_NAME.sub("_", run_id) or "_") / "events")
        return cls(run_id, event_dir.absolute(), req.trace_path_template or DEFAULT_TRACE_TEMPLATE,
                   req.enable_torch and not events_only, req.token_interval)

    def trace_path(self, component: str) -> Path:
        return Path(self.trace_path_template.format(event_dir=self.event_dir, run_id=self.run_id,
                                                    component=component, pid=os.getpid()))


@dataclass(slots=True)
class _Writer:
    path: Path
    file: IO[str]
    run_ids: list[str] = field(default_factory=list)


class Profiler:
    """The runs of one process and their JSONL files (any thread may `record`)."""

    def __init__(self, component: str) -> None:
        self.component = SAFE_NAME.sub("_", component)
        self.runs: dict[str, ProfileRun] = {}
        self.is_active = False  # read on hot paths without the lock
        self._writers: dict[Path, _Writer] = {}
        self._lock = threading.Lock()

    def events_path(self, run: ProfileRun) -> Path:
        return run.event_dir / f"events_{self.component}_{os.getpid()}.jsonl"

    def start(self, run: ProfileRun) -> Path:
        """Start `run` (again: a no-op); returns its events file."""
        path = self.events_path(run)
        with self._lock:
            if run.run_id in self.runs:
                return path
            writer = self._writers.get(path)
            if writer is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                # line-buffered: a run cut short by a crash or a SIGKILL keeps its events
                writer = self._writers[path] = _Writer(path, path.open("a", encoding="utf-8", buffering=1))
            writer.run_ids.append(run.run_id)
            self.runs[run.run_id] = run
            self.is_active = True
        return path

    def stop(self, run_id: str | None) -> list[ProfileRun]:
        """Stop one run (or all); a file is closed when its last run stops."""
        with self._lock:
            ids = list(self.runs) if run_id is None else [run_id] if run_id in self.runs else []
            stopped = [self.runs.pop(i) for i in ids]
            for run in stopped:
                path = self.events_path(run)
                writer = self._writers[path]
                writer.run_ids.remove(run.run_id)
                if not writer.run_ids:
                    writer.file.close()
                    del self._writers[path]
            self.is_active = bool(self.runs)
        return stopped

    def record(self, event: str, request_id: str, ts: float | None = None, **fields: Any) -> None:
        if not self.is_active:
            return
        head = {"ts": time.time() if ts is None else ts, "event": event, "request_id": request_id,
                "component": self.component, "pid": os.getpid()}
        with self._lock:
            for w in self._writers.values():
                w.file.write(json.dumps({**head, "run_id": w.run_ids[0], **fields}) + "\n")

    @property
    def token_interval(self) -> int:
        runs = list(self.runs.values())
        return min((r.token_interval for r in runs), default=16)


def wall(monotonic_ts: float) -> float:
    """A `time.monotonic()` stamp as wall-clock time."""
    return time.time() - (time.monotonic() - monotonic_ts)


def parse_start(raw: bytes) -> StartProfile:
    return parse_model(StartProfile, raw or b"{}")


def parse_stop(raw: bytes) -> StopProfile:
    return parse_model(StopProfile, raw) if raw.strip() else StopProfile()
