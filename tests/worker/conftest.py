"""Worker fixtures: real `omni-worker` subprocesses on the tiny models, shared per session.

`worker` is parametrized over the backends: llama_cpp serves the F32 GGUF with an F32 KV cache
(so greedy results are exact), torch serves the HF directory and is skipped when the torch
backend module is not there. Tests that change a worker's state (sleep, SIGTERM, a tiny
context) start their own process instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.util import HTTP, ROOT, free_port, run_worker, stop_process
from tests.util import wait_healthy as wait_until_healthy
from tests.worker.wire_models import ChatCompletion, ChatCompletionChunk, Completion, ModelList
from worker.protocol.wire import OpenAIBaseModel
from worker.testing.tiny_models import ModelPaths

N_SLOTS = 4
CTX = 2048
# F32 weights and KV cache, no flash attention: logits within ~1e-6 of transformers' on the HF
# twin, for the tests that compare the two backends. (Greedy output is reproducible with the
# defaults too: tests/worker/test_determinism.py.) One thread on both backends: on a small shared
# box llama.cpp's spinning pool only loses time, and torch's two OpenMP threads crawl whenever
# another process holds a core (test_structured's torch half took 77 s instead of 10).
EXACT_GGUF_ARGS = ["--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off", "--threads", "1"]


# The worker builds its JSON by hand (no pydantic per token); the wire models are the contract
# that JSON must meet, so every response a test reads is validated against them.
_WIRE: dict[tuple[str, bool], type[OpenAIBaseModel]] = {
    ("/v1/chat/completions", False): ChatCompletion,
    ("/v1/chat/completions", True): ChatCompletionChunk,
    ("/v1/completions", False): Completion,
    ("/v1/completions", True): Completion,
    ("/v1/models", False): ModelList,
}


def check_wire(path: str, obj: object, stream: bool = False) -> None:
    model = _WIRE.get((path, stream))
    if model is not None:
        model.model_validate(obj)


def _check_response(path: str, r: httpx.Response) -> None:
    if r.status_code == 200 and (path, False) in _WIRE:
        check_wire(path, r.json())


@dataclass(frozen=True)
class Worker:
    url: str
    backend: str

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def post(self, path: str, body: object, timeout: float = 30.0) -> httpx.Response:
        r = HTTP.post(self.url + path, json=body, timeout=timeout)
        if not (isinstance(body, dict) and body.get("stream")):
            _check_response(path, r)
        return r

    def get(self, path: str) -> httpx.Response:
        r = HTTP.get(self.url + path, timeout=10)
        _check_response(path, r)
        return r


def worker_args(backend: str, models: ModelPaths) -> tuple[Path, list[str]]:
    if backend == "llama_cpp":
        return models.gguf_f32, EXACT_GGUF_ARGS
    return models.hf_dir, ["--backend", "torch", "--dtype", "float32", "--threads", "1"]


def require_backend(backend: str) -> None:
    if backend == "torch" and importlib.util.find_spec("worker.backends.torch_backend") is None:
        pytest.skip("the torch backend is not available")


@pytest.fixture(scope="session", params=["llama_cpp", "torch"])
def worker(request: pytest.FixtureRequest, tiny_models: ModelPaths) -> Iterator[Worker]:
    """A shared worker with 4 slots and a 2048-token context."""
    backend: str = request.param
    require_backend(backend)
    model, extra = worker_args(backend, tiny_models)
    args = ["--parallel", str(N_SLOTS), "--ctx-size", str(CTX), *extra]
    with run_worker(model, *args, timeout=120) as url:
        yield Worker(url, backend)


@contextlib.contextmanager
def worker_process(
    model: Path, *args: str, wait_healthy: bool = True
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A private worker process (for lifecycle tests that signal or break it)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "worker.server.cli",
        "--model",
        str(model),
        "--port",
        str(port),
        "--threads",
        "1",
        "--metrics",
        *args,
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait_healthy:
            wait_until_healthy(proc, url)
        yield proc, url
    finally:
        stop_process(proc)
        log.close()
