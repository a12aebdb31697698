"""llama-swap (github.com/mostlygeek/llama-swap) as a benchmark target beside our router.

The swap benchmark runs the same trace through both; this module is the llama-swap half. It
writes a llama-swap config whose models run *our* worker, starts the real llama-swap binary on
it (built by scripts/build_llama_swap.sh), and reads back the sequence of model loads.

- Worker commands (`worker_commands`): the exact argv the router would spawn for each model of a
  preset (router/lifecycle/process.py `worker_argv`), with llama-swap's `${PORT}` macro for the
  port. A preset's `load-delay` is applied by the router, not the worker (it sleeps after the
  spawn, router/lifecycle/model.py `_start`), so under llama-swap the worker is started through
  bench/slow_load_worker.py, which holds `/health` at 503 until that long after the start: the
  same floor on the load. `--parent-pid` names this process, so no worker outlives the benchmark.
- Config (`config_text`): one entry per model with `cmd` and `checkEndpoint: /health` (our worker
  answers 200 once loaded, also llama-swap's default), everything else llama-swap's defaults.
  No groups: llama-swap then puts every model in one "(default)" group with `swap: true,
  exclusive: true` (internal/config/config.go `AddDefaultGroupToConfig`, applied in
  internal/config/load.go when no `matrix` is set), so one model runs at a time, like our
  `--models-max 1`. Its default scheduler is FIFO (internal/router/scheduler/fifo.go): requests
  for the running model are served at once, the others queue in arrival order, one swap at a
  time; at most 10 requests in flight per model (more get 429; `concurrencyLimit`).
- Loads (`LlamaSwap.loads`): llama-swap logs `<MODEL> Health check passed on URL` at info level
  once per load, when the new process first answers its check endpoint
  (internal/process/process_command.go `doStart`); the log file's lines of that kind, in order,
  are the loads. A load that never became healthy is not one (its requests fail instead). Its
  health check waits 250 ms, then polls once a second, so a load takes 0.25 s + whole seconds.
- `LlamaSwap` is a `bench.common.Server` (llama-swap answers `GET /health` with 200 "OK"), run
  from the repository root so that `-m worker.server.cli` resolves, its output in a log file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Server, free_port  # noqa: E402  # after the sys.path insert above

BINARY = Path(os.environ.get("LLAMA_SWAP_BIN", "/tmp/llama-swap/llama-swap"))
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


class LlamaSwap:
    """The llama-swap binary on a free port with `config_text(models)`; its config and log in a temp dir."""

    def __init__(self, models: Mapping[str, list[str]], binary: Path = BINARY) -> None:
        if not binary.is_file():
            raise FileNotFoundError(f"{binary}: build it with scripts/build_llama_swap.sh")
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


def _smoke() -> None:
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
    swap = LlamaSwap(commands)
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
    _smoke()
