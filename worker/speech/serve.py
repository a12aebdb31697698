"""`omni-worker -m VOICE.onnx`: a speech worker (worker/server/cli.py hands over here when the
model is a Piper voice). The server is up at once while the voice loads on the synthesizer's
thread; SIGTERM, SIGINT and the death of `--parent-pid` stop it (exit 0); a failed load answers
/health 500 for a moment, then exits 1. Of the text worker's flags, it takes the model, alias,
address, threads (ONNX Runtime's intra-op threads), API keys, CORS and --metrics."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn

from worker.speech.app import SpeechState, build_app
from worker.speech.metrics import SpeechMetrics
from worker.speech.synth import Synthesizer

log = logging.getLogger("worker")
_LOAD_FAILURE_GRACE_S = 1.0


@dataclass(frozen=True)
class SpeechOptions:
    model: str
    model_id: str
    aliases: tuple[str, ...]
    host: str
    port: int
    uds: str | None
    threads: int | None
    parent_pid: int | None
    api_keys: tuple[str, ...]
    cors_origins: str
    is_metrics_on: bool


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("signal %s: shutting down", signal.Signals(sig).name)
        self.should_exit = True


def _watch_parent(pid: int, server: _Server) -> None:
    import psutil

    while not server.should_exit:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            log.info("parent process %d is gone: shutting down", pid)
            server.should_exit = True
            return
        time.sleep(0.25)


def serve_speech(o: SpeechOptions) -> None:
    exit_code = 0
    server: _Server | None = None

    def on_load_failed() -> None:  # synthesizer thread
        nonlocal exit_code
        exit_code = 1

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        threading.Timer(_LOAD_FAILURE_GRACE_S, stop).start()

    synth = Synthesizer(o.model, o.threads, SpeechMetrics(), on_load_failed)
    synth.start()
    state = SpeechState(synth, o.model_id, o.model, o.aliases, o.is_metrics_on, int(time.time()))
    config = uvicorn.Config(build_app(state, api_keys=o.api_keys, cors_origins=o.cors_origins),
                            host=o.host, port=o.port, uds=o.uds, log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=1)
    server = _Server(config)
    if o.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(o.parent_pid, server), name="parent-watch",
                         daemon=True).start()
    where = o.uds or f"{o.host}:{o.port}"
    log.info("omni-worker: voice %s (piper, onnxruntime), listening on %s", o.model, where)
    server.run()
    synth.stop()
    log.info("exit %d", exit_code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
