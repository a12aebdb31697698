"""llama-server's slot files (POST /slots/{id_slot}?action=save|restore|erase, with
--slot-save-path): a slot's KV cache to a file in that directory and back, into any slot
(the file format is worker/engine/slot_file.py's). Each action runs once the engine is idle,
as llama-server defers it while the slot is busy; file I/O runs off the event loop."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import anyio.to_thread

from worker.engine import slot_file
from worker.protocol.errors import APIError, parse_model
from worker.protocol.strict import StrictModel
from worker.server.state import WorkerState


class SlotFileRequest(StrictModel):
    """The body of save and restore (erase takes none)."""

    filename: Any = None  # checked by `file_path`


def slot_id(state: WorkerState, raw: str) -> int:
    try:
        id_slot = int(raw)
    except ValueError:
        raise APIError("Invalid slot ID", param="id_slot") from None
    if not 0 <= id_slot < state.engine.n_slots:
        raise APIError("Invalid slot ID", param="id_slot")
    return id_slot


async def erase(state: WorkerState, id_slot: int) -> dict[str, Any]:
    engine = state.engine
    n = await asyncio.wrap_future(engine.call_when_idle(lambda: engine.erase_slot(id_slot)))
    return {"id_slot": id_slot, "n_erased": n}


def file_path(state: WorkerState, raw_body: bytes) -> tuple[str, Path]:
    """The request's `filename` (checked against path traversal) and its path in --slot-save-path."""
    assert state.slot_save_path is not None
    if not raw_body.strip():
        raise APIError("a JSON body with a filename is required", param="filename")
    filename = parse_model(SlotFileRequest, raw_body).filename
    if filename is None:
        raise APIError("a JSON body with a filename is required", param="filename")
    if not isinstance(filename, str) or not slot_file.is_valid_filename(filename):
        raise APIError("Invalid filename", param="filename")
    return filename, Path(state.slot_save_path) / filename


def _model_key(state: WorkerState) -> str:
    return f"{state.backend_kind}:{os.path.realpath(state.model_path)}"


async def save(state: WorkerState, id_slot: int, filename: str, path: Path) -> dict[str, Any]:
    engine = state.engine
    t0 = time.perf_counter()
    try:
        tokens, rows, kv = await asyncio.wrap_future(
            engine.call_when_idle(lambda: engine.slot_snapshot(id_slot)))
    except ValueError as e:
        raise APIError(str(e), param="id_slot") from None
    saved = slot_file.SlotFile(tokens, rows[0], rows[1], _model_key(state), bytes(kv or b""))
    n_written = await anyio.to_thread.run_sync(slot_file.write, path, saved)
    return {"id_slot": id_slot, "filename": filename, "n_saved": len(tokens), "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


async def restore(state: WorkerState, id_slot: int, filename: str, path: Path) -> dict[str, Any]:
    engine = state.engine
    t0 = time.perf_counter()
    try:
        loaded, n_read = await anyio.to_thread.run_sync(slot_file.read, path, _model_key(state))
    except slot_file.SlotFileError as e:
        raise APIError(str(e), param="filename") from None
    rows = (loaded.n_prompt_rows, loaded.prompt_class)
    if not await asyncio.wrap_future(
        engine.call_when_idle(lambda: engine.restore_slot(id_slot, loaded.tokens, rows, loaded.state))
    ):
        raise APIError("Unable to restore slot, no available space in KV cache or invalid slot save file")
    return {"id_slot": id_slot, "filename": filename, "n_restored": len(loaded.tokens), "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}
