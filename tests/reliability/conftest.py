"""Fixtures for the reliability tests: the router fixtures of tests/router, plus a router shared
by a whole module (`shared_router`) for tests that only send requests and never change its state."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.conftest import PY, RouterProc, router_factory
from tests.util import ROOT, free_port, preset_defaults, stop_process, wait_healthy

__all__ = ["GGUF", "TINY_PRESET", "router_factory", "serve_router"]

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
TINY_PRESET = f"""
{preset_defaults(256)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"
"""

needs_tiny = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")


@contextlib.contextmanager
def serve_router(tmp: Path, preset: str, *args: str) -> Iterator[RouterProc]:
    """An `omni-router` subprocess on `preset` (TOML), stopped (with its workers) on exit."""
    path = tmp / "preset.toml"
    path.write_text(preset)
    port = free_port()
    log_path = tmp / "router.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        PY,
        "-m",
        "router.cli",
        "--preset",
        str(path),
        "--port",
        str(port),
        "--data-dir",
        str(tmp / "data"),
        *args,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    rp = RouterProc(
        proc, f"http://127.0.0.1:{port}", log_path, {"Authorization": f"Bearer {key}"} if key else {}
    )
    try:
        wait_healthy(proc, rp.base, 30, lambda: rp.log()[-3000:])
        yield rp
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def tiny_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """One router on the tiny GGUF model (ctx 256, 2 slots), body limit 1 MB, for a module."""
    if not GGUF.exists():
        pytest.skip("tiny models not generated (make models)")
    with serve_router(tmp_path_factory.mktemp("tiny"), TINY_PRESET, "--max-body-size", "1000000") as r:
        yield r
