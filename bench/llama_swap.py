"""llama-swap (github.com/mostlygeek/llama-swap) as a benchmark target beside our router.

The swap benchmark runs the same trace through both; this module is the llama-swap half. It
writes a llama-swap config whose models run *our* worker, starts the real llama-swap binary on
it (built by scripts/build_llama_swap.sh), and reads back the sequence of model loads.

Two versions run here, the same way (same config, same log line, one code path):
- HEAD: the snapshot's newest commit (0bdb3720, v250+5; `scripts/build_llama_swap.sh SRC`,
  /tmp/llama-swap/llama-swap, `BINARY`), with the pluggable scheduler of #823 (2026-06-10);
- v224 (0cfe5a66; `scripts/build_llama_swap.sh SRC v224`, /tmp/llama-swap-v224/llama-swap,
  `BINARY_V224`), the last release before #823, which replaced its request handling.
Source references below are HEAD's, then v224's where they differ.

- Worker commands (`worker_commands`): the exact argv the router would spawn for each model of a
  preset (router/lifecycle/process.py `worker_argv`), with llama-swap's `${PORT}` macro for the
  port. A preset's `load-delay` is applied by the router, not the worker (it sleeps after the
  spawn, router/lifecycle/model.py `_start`), so under llama-swap the worker is started through
  bench/slow_load_worker.py, which holds `/health` at 503 until that long after the start: the
  same floor on the load. `--parent-pid` names this process, so no worker outlives the benchmark.
- Config (`config_text`): one entry per model with `cmd` and `checkEndpoint: /health` (our worker
  answers 200 once loaded, also llama-swap's default), everything else llama-swap's defaults.
  Both versions read it alike (`models.<id>.cmd` with the `${PORT}` macro, `checkEndpoint`,
  `healthCheckTimeout`; v224 internal/config/config.go:359-377 for `${PORT}`).
  No groups: llama-swap then puts every model in one "(default)" group with `swap: true,
  exclusive: true` (internal/config/config.go:258 `AddDefaultGroupToConfig`, applied at
  internal/config/load.go:227 when no `matrix` is set; v224: config.go:556, applied at
  config.go:470), so one model runs at a time, like our `--models-max 1`: the group planner
  evicts every other running member (internal/router/group.go `EvictionFor`; v224 :268-309).
- Scheduling, HEAD: the FIFO scheduler (internal/router/scheduler/fifo.go, `OnRequest`).
  v224: the same decision tree inlined in the router's run loop (the lines
  below are v224's internal/router/base.go: `handleRequest` :254-299, `drainQueue` :341-378).
  In both, one goroutine decides every request in
  arrival order, with no lock held across a swap: a request for the ready model with nothing
  to evict is served at once (:273), even past requests queued for other models; one for a
  model being loaded joins that load (:264); one that would evict a model being loaded, or be
  evicted by a load, waits in the queue (:280), as does one that would evict a model still
  serving requests (:288): a swap waits for the running model's in-flight requests to finish
  (:451-458), and is retried whenever that count drops to 0 (`handleServeDone` :329-335) or a
  load ends (`handleSwapDone` :306-323). With the one default group that makes one swap at a
  time. The queue is walked in order; each queued request gets the same tests, so those for
  the model just loaded are served at once and those for other models stay queued, in order;
  the first of them starts the next swap when the loaded model is idle. Nothing holds a
  loaded model while requests for it keep overlapping: a steady overlap of requests for the
  running model starves a queued one for another. Per model at most 10 requests (HEAD
  fifo.go:17, `admit` :308; v224 internal/server/concurrency.go:16, a semaphore around the
  whole router call, queued requests included, :47), more get 429 (`concurrencyLimit`).
  What #823 added to this tree: a per-model queue `priority` (all 0 by default, so arrival
  order; fifo.go `enqueue` :385) and dropping a request from the queue when its client goes
  (`OnCancel`); with our config the two versions decide alike.
- Loads (`LlamaSwap.loads`): llama-swap logs `<MODEL> Health check passed on URL` at info level
  once per load, when the new process first answers its check endpoint
  (internal/process/process_command.go:545 `doStart`; v224 the same line at :498); the log
  file's lines of that kind, in order, are the loads. A load that never became healthy is not
  one (its requests fail instead). Its health check waits 250 ms, then polls once a second
  (v224 :471-476, :509), so a load takes 0.25 s + whole seconds.
- `LlamaSwap` is a `bench.common.Server` (llama-swap answers `GET /health` with 200 "OK"), run
  from the repository root so that `-m worker.server.cli` resolves, its output in a log file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Server, free_port  # noqa: E402  # after the sys.path insert above

BINARY = Path(os.environ.get("LLAMA_SWAP_BIN", "/tmp/llama-swap/llama-swap"))
BINARY_V224 = Path(os.environ.get("LLAMA_SWAP_V224_BIN", "/tmp/llama-swap-v224/llama-swap"))
_PORT_MARK = 65_535  # stands for ${PORT} while the router builds the argv
_LOAD_LINE = re.compile(r"<(?P<model>[^>]+)> Health check passed on ")


def worker_commands(preset: Path, parent_pid: int | None = None) -> dict[str, list[str]]:
    """Each model of `preset`: the worker argv the router would run, port `${PORT}` (see module doc)."""
    from router.lifecycle.process import worker_argv
    from router.presets import load_presets

    out: dict[str, list[str]] = {}
    for p in load_presets(preset):
        argv = worker_argv(p, _PORT_MARK, os.getpid() if parent_pid is None else parent_pid)
        argv[argv.index("--port") + 1] = "${PORT}"
        if p.load_delay > 0:
            assert argv[1:3] == ["-m", "worker.server.cli"], argv[:3]
            argv[1:3] = ["-m", "bench.slow_load_worker", str(p.load_delay)]
        out[p.name] = argv
    return out


def config_text(models: Mapping[str, list[str]], health_check_timeout: int = 120) -> str:
    """A llama-swap YAML config: model name -> its `cmd`; one model at a time (llama-swap's default).

    `health_check_timeout` is llama-swap's `healthCheckTimeout` (its default, 120 s; 15 at least).
    Written as JSON, which YAML reads as is, so no name or argument needs YAML quoting.
    """
    entries = {
        name: {"cmd": shlex.join(argv), "checkEndpoint": "/health"} for name, argv in models.items()
    }
    return json.dumps({"healthCheckTimeout": health_check_timeout, "models": entries}, indent=2) + "\n"


def binary_version(binary: Path) -> str:
    """`llama-swap --version`'s line, e.g. "version: v224 (0cfe5a66), built at ..."."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10)
    return (out.stdout or out.stderr).strip()


class LlamaSwap:
    """The llama-swap binary on a free port with `config_text(models)`; its config and log in a temp dir.

    `binary`: either version (`BINARY`, `BINARY_V224`; see the module doc), run the same way.
    """

    def __init__(self, models: Mapping[str, list[str]], binary: Path = BINARY) -> None:
        if not binary.is_file():
            raise FileNotFoundError(f"{binary}: build it with scripts/build_llama_swap.sh SRC [REF]")
        self.binary = binary
        self.version = binary_version(binary)
        self._dir = tempfile.TemporaryDirectory(prefix="llama-swap-")
        config = Path(self._dir.name) / "config.yaml"
        config.write_text(config_text(models))
        self.log_path = Path(self._dir.name) / "llama-swap.log"
        port = free_port()
        cmd = [str(binary), "-config", str(config), "-listen", f"127.0.0.1:{port}"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.server = Server("llama-swap", f"http://127.0.0.1:{port}", cmd, self.log_path, env)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def start(self, timeout: float = 30.0) -> None:
        self.server.start(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop llama-swap (it stops its workers on SIGTERM), then drop the temp dir."""
        self.server.stop(timeout)
        self._dir.cleanup()

    def loads(self) -> list[str]:
        """The models llama-swap has loaded so far, in order (one entry per load)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [m["model"] for m in _LOAD_LINE.finditer(text)]


def _smoke(binary: Path = BINARY) -> None:
    """Models A and B (the tiny GGUF, bench_swap's settings); chat A, B, A; expect 3 loads."""
    gguf = ROOT / "models" / "tiny-llama-f32.gguf"
    if not gguf.exists():
        sys.exit(f"{gguf} is missing: make models")
    models = "".join(f'[models.{m}]\nmodel = "{gguf}"\nbackend = "llama_cpp"\n' for m in ("A", "B"))
    preset_toml = (
        "[defaults]\nctx-size = 256\nparallel = 2\nthreads = 1\nstop-timeout = 5\nload-delay = 1.5\n" + models
    )
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "swap.toml"
        preset.write_text(preset_toml)
        commands = worker_commands(preset)
    print("worker A:", shlex.join(commands["A"]))
    swap = LlamaSwap(commands, binary)
    print(f"llama-swap: {binary}: {swap.version}")
    swap.start(30)
    try:
        with httpx.Client(base_url=swap.base_url, timeout=120) as c:
            for model in ("A", "B", "A"):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "temperature": 0,
                }
                r = c.post("/v1/chat/completions", json=body)
                took = r.elapsed.total_seconds()
                print(f"{model}: HTTP {r.status_code} in {took:.2f} s, loads so far {swap.loads()}")
        loads = swap.loads()
        print(f"loads: {len(loads)} {loads} (expected 3: ['A', 'B', 'A'])")
    finally:
        swap.stop()
    if loads != ["A", "B", "A"]:
        sys.exit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Smoke: chat A, B, A through llama-swap; expect 3 loads.")
    ap.add_argument(
        "--binary",
        type=Path,
        default=BINARY,
        help=f"the llama-swap binary (default {BINARY}; v224: {BINARY_V224})",
    )
    _smoke(ap.parse_args().binary)
