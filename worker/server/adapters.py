"""LoRA adapters over HTTP: llama-server's GET / POST /lora-adapters (the global scales) and vLLM's
POST /v1/load_lora_adapter / /v1/unload_lora_adapter (adapters loaded at run time; on with
`--lora-runtime`, 501 without, as vLLM refuses them unless VLLM_ALLOW_RUNTIME_LORA_UPDATING).

The table and a request's adapter set are worker/engine/adapters.py's. Loading runs on the
engine thread between two steps (the running requests go on); unloading waits until the engine
is idle, so no request runs with an adapter that goes away. A request that names an adapter by
`model` ("<model>:<name>") gets it at scale 1 (worker/server/prepare.py).

Where a run-time adapter may come from: under `--lora-allowed-path` only (which `--lora-runtime`
needs), after symlinks and `..` are resolved (a relative `lora_path` is taken from that folder),
and only the kind of thing the backend loads (a file for llama.cpp, a PEFT folder for torch).
Every refusal of a path is the same 400, word for word, whether the path is outside the folder,
missing or of the wrong kind: the route is open to clients, and two different answers would tell
a client which files exist anywhere on the box. Once a path passes, the adapter's own checks
(worker/backends/lora.py) say what is wrong with it: that speaks only of the allowed folder.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from worker.backends.lora import LoraAdapter, LoraError
from worker.protocol.errors import APIError, parse_json, parse_model
from worker.protocol.wire import LoadLoraRequest, LoraScale, UnloadLoraRequest
from worker.server.context import ready_backend, worker_state

_SCALES = TypeAdapter(list[LoraScale])
PATH_REFUSED = "lora_path does not name an adapter under this server's --lora-allowed-path"


def allowed_adapter_path(path: str, root: str, is_folder: bool) -> str | None:
    """The real path of the adapter at `path` (relative: in `root`) when it lies under `root`,
    symlinks and `..` resolved, and is a folder (`is_folder`) or else a regular file; None for
    every other case alike (see the module doc)."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(os.path.join(real_root, path)))  # an absolute `path` replaces the root
    if not real.is_relative_to(real_root) or real == real_root:
        return None
    if not (real.is_dir() if is_folder else real.is_file()):
        return None
    return str(real)


def describe(a: LoraAdapter) -> dict[str, Any]:
    """One adapter as llama-server lists it (and its name, for `model`)."""
    return {"id": a.id, "path": a.path, "scale": a.scale, "task_name": a.task_name,
            "prompt_prefix": a.prompt_prefix, "name": a.name}


async def list_adapters(request: Request) -> Response:
    state = worker_state(request)
    ready_backend(state)
    return JSONResponse([describe(a) for a in state.engine.adapters.table])


async def set_scales(request: Request) -> Response:
    """The global scales: adapters not listed get 0 (llama-server's construct_lora_list)."""
    state = worker_state(request)
    ready_backend(state)
    body = parse_json(await request.body())
    if not isinstance(body, list):
        raise APIError("Request body must be an array of {id, scale}", param="lora")
    try:
        items = _SCALES.validate_python(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise APIError(f"lora[{where}]: {first['msg']}", param="lora") from None
    try:
        state.engine.adapters.set_scales((x.id, x.scale) for x in items)
    except ValueError as e:
        raise APIError(str(e), param="lora") from None
    return JSONResponse({"success": True})


def _require_runtime(request: Request) -> None:
    if not worker_state(request).is_lora_runtime_on:
        raise APIError("This server does not load LoRA adapters at run time. Start it with `--lora-runtime`",
                       status_code=501, type="not_supported_error", code=501)


async def load_adapter(request: Request) -> Response:
    _require_runtime(request)
    state = worker_state(request)
    ready_backend(state)
    req = parse_model(LoadLoraRequest, await request.body())
    assert state.lora_allowed_path is not None, "the CLI refuses --lora-runtime without it"
    path = await asyncio.to_thread(allowed_adapter_path, req.lora_path, state.lora_allowed_path,
                                   state.backend_kind != "llama_cpp")  # a file system walk: off the loop
    if path is None:
        raise APIError(PATH_REFUSED, param="lora_path")
    engine = state.engine
    try:
        adapter = await asyncio.wrap_future(engine.call(lambda: engine.load_lora(path, req.scale,
                                                                                 req.lora_name)))
    except LoraError as e:
        raise APIError(str(e), param="lora_path") from None
    except RuntimeError as e:  # a sleeping model wakes first, and that failed (another adapter's file)
        raise APIError(f"the model could not wake: {e}", status_code=500, type="server_error") from None
    return JSONResponse(describe(adapter))


async def unload_adapter(request: Request) -> Response:
    _require_runtime(request)
    state = worker_state(request)
    ready_backend(state)
    req = parse_model(UnloadLoraRequest, await request.body())
    adapters = state.engine.adapters
    if req.lora_int_id is not None:
        adapter = adapters.get(req.lora_int_id)
        param = "lora_int_id"
    elif req.lora_name is not None:
        adapter, param = adapters.by_name(req.lora_name), "lora_name"
    else:
        raise APIError("name the adapter: lora_name or lora_int_id", param="lora_name")
    if adapter is None or (req.lora_name is not None and adapter.name != req.lora_name):
        raise APIError("no such LoRA adapter is loaded (GET /lora-adapters)", param=param, status_code=404,
                       type="not_found_error")
    engine = state.engine
    lora_id = adapter.id
    try:
        await asyncio.wrap_future(engine.call_when_idle(lambda: engine.unload_lora(lora_id)))
    except LoraError as e:  # unloaded by another request meanwhile
        raise APIError(str(e), param=param, status_code=404, type="not_found_error") from None
    return JSONResponse(describe(adapter))


def routes() -> list[Route]:
    return [
        Route("/lora-adapters", list_adapters, methods=["GET"]),
        Route("/lora-adapters", set_scales, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
    ]
