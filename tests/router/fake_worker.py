"""A fake worker for router lifecycle edge cases: a real subprocess speaking the worker's HTTP
contract (/health 503-with-progress while loading, /sleep, /wake, chat completions streaming or
not, /v1/models, --parent-pid, SIGTERM), with flags that make the hard cases reproducible:
slow start, failing load, crash mid-stream or on a request (`--crash-on TEXT`), ignoring
SIGTERM, slow wake, and (`--no-sleep`) a server without the sleep contract, like llama-server:
no `is_sleeping` in /health, and a /sleep and /wake that answer 404 (after `--sleep-time`).

Run as `python tests/router/fake_worker.py --port P [flags]` (presets use `backend = cmd`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ECHO_PATHS = (
    "/completion",
    "/completions",
    "/infill",
    "/embedding",
    "/embeddings",
    "/v1/embeddings",
    "/rerank",
    "/v1/rerank",
    "/reranking",
    "/v1/reranking",
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/images/generations",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="fake")
    p.add_argument("--alias", default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--load-time", type=float, default=0.0, help="seconds of 503 'Loading model'")
    p.add_argument("--wake-time", type=float, default=0.0)
    p.add_argument("--no-sleep", action="store_true", help="no sleep contract (404 on /sleep and /wake)")
    p.add_argument("--sleep-time", type=float, default=0.0, help="seconds before /sleep answers")
    p.add_argument("--fail-load", action="store_true", help="exit 1 after the load time")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--tokens", type=int, default=5, help="chunks per streamed answer")
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--crash-after", type=int, default=-1, help="SIGKILL itself after N streamed chunks")
    p.add_argument("--crash-on", default=None,
                   help="SIGKILL itself on a chat request whose body contains this text, before answering")
    p.add_argument("--spawn-log", default=None, help="append our pid to this file at start")
    p.add_argument("--event-log", default=None, help="append 'cancelled' here when a stream is cut short")
    args, _unknown = p.parse_known_args(argv)
    return args


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name = args.alias or args.model
        self.started = time.monotonic()
        self.is_sleeping = False
        self.num_requests = 0

    def progress(self) -> float:
        if self.args.fail_load:
            return 0.5  # never ready: it exits at --load-time
        if self.args.load_time <= 0:
            return 1.0
        return min(1.0, (time.monotonic() - self.started) / float(self.args.load_time))

    async def health(self, request: Request) -> Response:
        if self.progress() < 1.0:
            body = {
                "error": {
                    "message": "Loading model",
                    "type": "unavailable_error",
                    "param": None,
                    "code": 503,
                    "progress": {"phase": "weights", "fraction": round(self.progress(), 3)},
                }
            }
            return JSONResponse(body, status_code=503)
        if self.args.no_sleep:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "is_sleeping": self.is_sleeping})

    async def sleep(self, request: Request) -> Response:
        await asyncio.sleep(self.args.sleep_time)
        if self.args.no_sleep:
            return _not_found()
        self.is_sleeping = True
        return JSONResponse({"status": "sleeping"})

    async def wake(self, request: Request) -> Response:
        if self.args.no_sleep:
            return _not_found()
        if self.is_sleeping:
            await asyncio.sleep(self.args.wake_time)
        self.is_sleeping = False
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "fake",
                        "meta": {"fake": True, "pid": os.getpid()},
                    }
                ],
            }
        )

    async def props(self, request: Request) -> Response:
        return JSONResponse({"role": "worker", "model_alias": self.name, "pid": os.getpid()})

    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        if self.args.crash_on and self.args.crash_on.encode() in raw:
            os.kill(os.getpid(), signal.SIGKILL)  # a request that crashes its worker (a kernel bug, say)
        body = json.loads(raw)
        self.num_requests += 1
        if self.is_sleeping:
            await self.wake(request)
        n = int(body.get("max_tokens") or self.args.tokens)
        if not body.get("stream"):
            text = " ".join(f"t{i}" for i in range(n))
            return JSONResponse(
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": self.name,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
                    "pid": os.getpid(),
                }
            )
        return StreamingResponse(self._stream(n), media_type="text/event-stream")

    async def _stream(self, n: int) -> AsyncIterator[bytes]:
        finished = False
        try:
            for i in range(n):
                if i == self.args.crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                chunk = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": self.name,
                    "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
                }
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                if self.args.token_delay:
                    await asyncio.sleep(self.args.token_delay)
            finished = True
        finally:
            if not finished and self.args.event_log:
                with Path(self.args.event_log).open("a") as f:
                    f.write("cancelled\n")
        last = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": self.name,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        yield b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"

    async def echo(self, request: Request) -> Response:
        """The other OpenAI / llama-server routes a `cmd` upstream may serve: report what arrived
        (path, body digest, content type) so a test can check the router forwarded it untouched."""
        body = await request.body()
        seen = {"path": request.url.path, "model": self.name, "sha256": hashlib.sha256(body).hexdigest(),
                "content_type": request.headers.get("content-type", ""), "pid": os.getpid()}
        if request.url.path == "/v1/audio/speech":  # chunked audio, no content-length
            return StreamingResponse(
                self._audio(), media_type="audio/mpeg", headers={"x-seen": json.dumps(seen)}
            )
        if body.startswith(b"{") and json.loads(body).get(
            "stream"
        ):  # llama-server's native stream: no [DONE]
            return StreamingResponse(self._native_stream(), media_type="text/event-stream")
        return JSONResponse(seen)

    async def _audio(self) -> AsyncIterator[bytes]:
        for i in range(3):
            yield bytes([i]) * 1000
            await asyncio.sleep(0)

    async def _native_stream(self) -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"data: " + json.dumps({"content": f"t{i}", "stop": False}).encode() + b"\n\n"
        yield b"data: " + json.dumps({"content": "", "stop": True, "model": self.name}).encode() + b"\n\n"

    async def watch_parent(self) -> None:
        parent = self.args.parent_pid
        while parent:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(0)
            await asyncio.sleep(0.2)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.args.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        watcher = asyncio.create_task(self.watch_parent())
        if self.args.fail_load:
            asyncio.get_running_loop().call_later(self.args.load_time, os._exit, 1)
        yield
        watcher.cancel()


def _not_found() -> Response:
    return JSONResponse(
        {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": 404}},
        status_code=404,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.spawn_log:
        with Path(args.spawn_log).open("a") as f:
            f.write(f"{os.getpid()}\n")
    fake = Fake(args)
    app = Starlette(routes=[
        Route("/health", fake.health),
        Route("/sleep", fake.sleep, methods=["POST"]),
        Route("/wake", fake.wake, methods=["POST"]),
        Route("/v1/models", fake.models),
        Route("/props", fake.props),
        Route("/v1/chat/completions", fake.chat, methods=["POST"]),
        *(Route(path, fake.echo, methods=["POST"]) for path in ECHO_PATHS),
    ], lifespan=fake.lifespan)
    print(f"fake worker {fake.name} pid {os.getpid()} on port {args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
