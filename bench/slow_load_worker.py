"""`omni-worker` whose model load ends no sooner than SECONDS after this process started.

    python -m bench.slow_load_worker SECONDS <omni-worker flags>

A preset's `load-delay` is the router's doing, not the worker's: the router spawns the worker,
sleeps that long, then polls its `/health` (router/lifecycle/model.py, `_start`), so a load takes
max(load-delay, the worker's own load). A worker spawned by another proxy (llama-swap, in the swap
benchmark) would load at tiny-model speed. This launcher gives it the same floor inside the
worker: the model loads at once and the engine holds it back until SECONDS have passed since
start, so `/health` answers 503 (loading) until then, as under the router. Nothing else differs:
the flags go to the worker's own entry point unchanged.
"""

from __future__ import annotations

import sys
import time
from typing import Any

_STARTED = time.monotonic()  # before the worker's imports: they are part of its load


def main(argv: list[str]) -> None:
    delay = float(argv[0])
    from worker import backends

    load = backends.load_backend

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        backend = load(*args, **kwargs)
        time.sleep(max(0.0, _STARTED + delay - time.monotonic()))
        return backend

    # Before the worker's entry point imports it by name (worker/server/cli.py): its loader calls this.
    backends.load_backend = slow_load
    from worker.server import cli

    cli.main(argv[1:])

if __name__ == "__main__":
    main(sys.argv[1:])
