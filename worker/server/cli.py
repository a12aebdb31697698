"""`omni-worker`: one model behind an OpenAI-compatible HTTP server (what the router spawns).

The HTTP server is up at once; the engine thread loads the model meanwhile (/health: 503 with
progress, then 200; 500 and a non-zero exit if loading fails). SIGTERM, SIGINT and the death of
`--parent-pid` all take the same way out: fail in-flight requests, stop the server (1 s grace),
free the model, exit 0 (hard exit: no waiting on library threads).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import typer
import uvicorn

from worker.backends import BackendOptions, load_backend, resolve_kind
from worker.backends.base import Backend
from worker.engine.engine import Engine, Progress
from worker.engine.metrics import WorkerMetrics
from worker.server.state import REASONING_FORMATS, WorkerState

log = logging.getLogger("worker")
cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

_LOAD_FAILURE_GRACE_S = 1.0  # let /health report the 500 before exiting


class _Server(uvicorn.Server):
    """uvicorn that runs `on_exit` first and does not re-raise the signal (SIGTERM exits 0)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("signal %s: shutting down", signal.Signals(sig).name)
        self.request_exit()

    def request_exit(self) -> None:
        """Any thread (or a signal handler): fail in-flight work, then stop serving."""
        self._on_exit()
        self.should_exit = True


def _default_model_id(model_path: str) -> str:
    name = os.path.basename(os.path.normpath(model_path))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def _setup_logging() -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _watch_parent(pid: int, server: _Server) -> None:
    import psutil

    while not server.should_exit:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            log.info("parent process %d is gone: shutting down", pid)
            server.request_exit()
            return
        time.sleep(0.25)


@cli.command()
def serve(
    model: str = typer.Option(..., "--model", "-m", help="GGUF file or HF model directory"),
    backend: str = typer.Option("auto", "--backend", help="auto | llama_cpp | torch"),
    alias: str | None = typer.Option(None, "--alias", "-a", help="model id reported by the API"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    uds: str | None = typer.Option(None, "--uds", help="listen on a unix socket instead of a port"),
    parallel: int = typer.Option(4, "--parallel", "-np", min=1, help="number of slots"),
    ctx_size: int = typer.Option(
        4096, "--ctx-size", "-c", min=0,
        help="KV cache cells in all (0: the model's); each slot gets ctx-size / parallel unless --kv-unified",
    ),
    kv_unified: bool = typer.Option(
        False, "--kv-unified", "-kvu",
        help="one KV cache that any slot may fill (llama.cpp: numerics then depend on what else runs)",
    ),
    batch_size: int = typer.Option(2048, "--batch-size", "-b", min=1, help="max tokens per decode step"),
    ubatch_size: int = typer.Option(512, "--ubatch-size", "-ub", min=1, help="physical batch size"),
    n_gpu_layers: int | None = typer.Option(None, "--n-gpu-layers", "-ngl", help="default: all"),
    threads: int | None = typer.Option(None, "--threads", "-t", min=1),
    chat_template: str | None = typer.Option(None, "--chat-template", help="template file or builtin name"),
    cache_type_k: str = typer.Option("f16", "--cache-type-k", "-ctk"),
    cache_type_v: str = typer.Option("f16", "--cache-type-v", "-ctv"),
    flash_attn: str = typer.Option("auto", "--flash-attn", "-fa", help="auto | on | off"),
    device: str | None = typer.Option(None, "--device", help="torch backend: cpu, cuda, ..."),
    dtype: str | None = typer.Option(None, "--dtype", help="torch backend: float32, bfloat16, ..."),
    compile: bool = typer.Option(False, "--compile", help="torch backend on CUDA: CUDA graphs for decode steps (ignored, with a warning, on CPU)"),
    cache_ram: int = typer.Option(
        8192, "--cache-ram", "-cram", min=-1,
        help="host-RAM prompt cache for idle slots' KV, in MiB (0: off, -1: no limit); llama.cpp backend",
    ),
    reasoning_format: str = typer.Option(
        "auto", "--reasoning-format",
        help="auto | deepseek | deepseek-legacy | none: where <think> text goes (a request's reasoning_format wins)",
    ),
    parent_pid: int | None = typer.Option(None, "--parent-pid", help="exit when this process is gone"),
) -> None:
    """Serve one model with continuous batching over N slots."""
    _setup_logging()

    if backend not in ("auto", "llama_cpp", "torch"):
        raise typer.BadParameter(f"{backend!r} is not one of auto, llama_cpp, torch", param_hint="--backend")
    if batch_size < parallel:
        raise typer.BadParameter(
            f"must be at least --parallel ({parallel}): every generating slot adds a token per step",
            param_hint="--batch-size",
        )
    if reasoning_format not in REASONING_FORMATS:
        raise typer.BadParameter(f"{reasoning_format!r} is not one of {', '.join(REASONING_FORMATS)}",
                                 param_hint="--reasoning-format")
    try:
        kind = resolve_kind(backend, model)  # type: ignore[arg-type]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    options = BackendOptions(
        n_ctx=ctx_size,
        n_slots=parallel,
        kv_unified=kv_unified,
        n_batch=batch_size,
        n_ubatch=ubatch_size,
        n_gpu_layers=n_gpu_layers,
        threads=threads,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        flash_attn=flash_attn,
        device=device,
        dtype=dtype,
        compile=compile,
    )
    metrics = WorkerMetrics()
    exit_code = 0
    server: _Server | None = None

    def on_load_failed() -> None:  # engine thread
        nonlocal exit_code
        exit_code = 1
        # Leave /health a moment to report the 500 before the process goes away.
        threading.Timer(_LOAD_FAILURE_GRACE_S, exit_now).start()

    def exit_now() -> None:
        if server is not None:
            server.request_exit()

    engine = Engine(
        _loader(kind, model, options, chat_template, lambda: state), parallel, metrics, on_load_failed,
        cache_ram_mib=cache_ram,
    )
    state = WorkerState(engine, metrics, alias or _default_model_id(model), model, kind, reasoning_format=reasoning_format)
    engine.start()  # the model loads while the HTTP stack is imported
    from worker.server.app import build_app

    config = uvicorn.Config(
        build_app(state),
        host=host,
        port=port,
        uds=uds,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server = _Server(config, on_exit=lambda: engine.stop(timeout=0))  # failing in-flight requests ends their streams
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid, server), name="parent-watch", daemon=True).start()
    log.info("omni-worker: model %s (backend %s), %d slots, listening on %s", model, kind, parallel, uds or f"{host}:{port}")
    server.run()
    engine.stop(timeout=1.0)
    log.info("exit %d", exit_code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _loader(
    kind: str, model: str, options: BackendOptions, chat_template: str | None, state: Callable[[], WorkerState]
) -> Callable[[Progress], Backend]:
    """The engine's backend factory: load the model, then its chat template (engine thread)."""

    def load(progress: Progress) -> Backend:
        from worker.text.chat_template import load_chat_template

        backend = load_backend(kind, model, options, progress)  # type: ignore[arg-type]
        meta = backend.meta
        state().template = load_chat_template(
            chat_template, meta.chat_template, bos_token=meta.bos_token, eos_token=meta.eos_token
        )
        return backend

    return load


def main() -> None:
    """Console-script entry point (`omni-worker`)."""
    cli()


if __name__ == "__main__":
    main()
