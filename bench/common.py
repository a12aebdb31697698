"""Small helpers shared by the benchmarks: percentiles, medians, and a server subprocess handle.

A `Server` is started in its own process group with its output going to a log file (never an
undrained pipe), is ready when `GET /health` answers 200, and is stopped with SIGTERM to the
group, a bounded wait, then SIGKILL. Start failures raise `ServerStartError` with the log tail.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.util import ROOT, free_port, stop_process

__all__ = ["ROOT", "free_port"]  # re-exported for the benchmarks


class ServerStartError(RuntimeError):
    pass


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100], NaNs ignored; NaN if empty."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def system_busy_seconds() -> float:
    """CPU-seconds all CPUs of the machine have spent busy since boot (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10])  # already counted in user/nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def listening_pid(base_url: str) -> int | None:
    """The local process listening on `base_url`'s port, if it can be seen (else None)."""
    import psutil

    port = httpx.URL(base_url).port
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return int(c.pid)
    except psutil.Error:
        pass
    return None


def log_tail(path: Path, num_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return "<no log>"


@dataclass
class Server:
    """A benchmark target. `cmd` None means an external server already running at `base_url`."""

    name: str
    base_url: str
    cmd: list[str] | None = None
    log_path: Path | None = None
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    pid: int | None = None  # the process to account CPU to (found by port for an external server)

    def start(self, timeout: float) -> None:
        if self.cmd is not None:
            assert self.log_path is not None
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("wb") as log:
                self.proc = subprocess.Popen(
                    self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, env=self.env,
                )
            self.pid = self.proc.pid
        self._wait_healthy(timeout)
        if self.pid is None:
            self.pid = listening_pid(self.base_url)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode} before becoming healthy.\n"
                    f"command: {' '.join(self.cmd or [])}\nlog ({self.log_path}) tail:\n"
                    f"{log_tail(self.log_path) if self.log_path else ''}"
                )
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(
            f"{self.name} not healthy at {self.base_url}/health after {timeout:.0f}s (last: {last}).\n"
            f"log ({self.log_path}) tail:\n{log_tail(self.log_path) if self.log_path else ''}"
        )

    def cpu_seconds(self) -> float:
        """User+system CPU time of the server process tree so far (0 when its pid is unknown)."""
        if self.pid is None:
            return 0.0
        import psutil

        try:
            p = psutil.Process(self.pid)
            procs = [p, *p.children(recursive=True)]
            total = 0.0
            for q in procs:
                with contextlib.suppress(psutil.Error):
                    t = q.cpu_times()
                    total += t.user + t.system
            return total
        except psutil.Error:
            return 0.0

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)


def router_server(preset: Path, log_path: Path, *args: str) -> Server:
    """`omni-router --preset PRESET ARGS` on a free port, as a benchmark target (not started)."""
    port = free_port()
    cmd = [sys.executable, "-m", "router.cli", "--preset", str(preset), "--port", str(port), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return Server("router", f"http://127.0.0.1:{port}", cmd, log_path, env)
