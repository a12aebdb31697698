"""llama.cpp's own tools/server/tests/unit/test_lora.py against omni-worker, as against llama-server.

scripts/llama_server_suite.py runs the test file from the pinned sdist through
scripts/llama_server_shim.py on models/tiny-lora-suite-f32.gguf, with the adapter it downloads
from the hub replaced by models/tiny-lora-suite-lora.gguf (both made by
worker/testing/tiny_lora.py to answer the words the test checks at scales 0, 0.3, 0.7 and 1):

    test_lora[0.0-...]     POST /lora-adapters scale 0, then /completion: the base model's words
    test_lora[1.0-...]     scale 1: the adapter's
    test_lora_per_request  6 requests at once on 4 slots, per-request `lora` at 0, 0.3, 0.7, 1
    test_with_big_model    skipped (SLOW_TESTS: an 8B model from the hub)

The reference llama-server (third_party/llama-server-build-0.3.36, same shim, same two files)
passes the same three (2026-11-27); so must we.
By hand: .venv/bin/python scripts/llama_server_suite.py --model models/tiny-lora-suite-f32.gguf
unit/test_lora.py [--server llama-server].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import ROOT
from worker.testing.tiny_lora import ensure_loras, suite_paths

pytestmark = pytest.mark.slow

HARNESS = ROOT / "scripts" / "llama_server_suite.py"
EXIT_UNAVAILABLE = 3  # llama_server_suite.EXIT_UNAVAILABLE
FILE = "unit/test_lora.py"
EXPECTED_PASS = [
    f"{FILE}::test_lora[0.0-(little|girl|three|years|old)+]",
    f"{FILE}::test_lora[1.0-(eye|love|glass|sun)+]",
    f"{FILE}::test_lora_per_request",
]
RUN_TIMEOUT_S = 300


def test_llama_cpp_test_lora_passes(tmp_path: Path) -> None:
    ensure_loras(ROOT / "models")
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(HARNESS), "--server", "ours", "--model", str(suite_paths(ROOT / "models")[0]),
           "--json", str(out), "--test-timeout", "60", "--timeout", str(RUN_TIMEOUT_S), FILE]
    env = {**os.environ, "OMNI_SHIM_WORKER_ARGS": "--threads 1"}
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT_S + 60, check=False, env=env)
    if proc.returncode == EXIT_UNAVAILABLE:
        pytest.skip(f"llama.cpp's server test-suite cannot be fetched: {proc.stdout[-500:]}")
    assert out.exists(), f"the harness wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
    results = {r["nodeid"]: r for r in json.loads(out.read_text())}
    for nodeid in EXPECTED_PASS:
        assert nodeid in results, f"{nodeid} did not run; ran: {sorted(results)}"
        assert results[nodeid]["outcome"] == "passed", f"{nodeid}: {results[nodeid]['message']}"
