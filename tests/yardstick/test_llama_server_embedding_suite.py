"""llama.cpp's own server tests for embeddings and rerank (tools/server/tests/unit/test_embedding.py,
test_rerank.py), against omni-worker on models/tiny-llama-f32.gguf through scripts/llama_server_shim.py.

Every id in EXPECTED_PASS must pass: the 28 the reference llama-server passes on the same tiny
model through the same shim (third_party/llama-server-build-0.3.36; 2026-11-22). The other 21 fail
on both servers for reasons of the model, not the server: the suite's models are BERT embedders
and a Jina reranker, while a llama GGUF pools with none unless told (the OpenAI route then answers
400), counts its own tokens (usage tests) and ranks at random (the order tests). omni-worker fails
exactly those 21 too.

By hand: .venv/bin/python scripts/llama_server_suite.py unit/test_embedding.py unit/test_rerank.py
[--server llama-server].
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import ROOT
from worker.testing.tiny_models import ModelPaths

pytestmark = pytest.mark.soak  # ~2.5 min: `make soak` runs it, not `make test`

HARNESS = ROOT / "scripts" / "llama_server_suite.py"
EXIT_UNAVAILABLE = 3  # llama_server_suite.EXIT_UNAVAILABLE
E, R = "unit/test_embedding.py", "unit/test_rerank.py"
EXPECTED_PASS = [
    *(
        f"{E}::{t}"
        for t in (
            "test_embedding_single",
            "test_embedding_multiple",
            "test_embedding_multiple_with_fa",
            "test_embedding_content_text_same_as_string",
            *(f"test_embedding_invalid_input[input{i}]" for i in range(6)),
            "test_embedding_pooling_mean",
            "test_embedding_pooling_mean_multiple",
            "test_embedding_pooling_none_oai",
            "test_embedding_openai_library_single",
            "test_embedding_openai_library_multiple",
            "test_same_prompt_give_same_result",
        )
    ),
    *(f"{R}::test_invalid_rerank_req[{p}]" for p in ("documents0", "None", "123", "documents3")),
    *(
        f"{R}::test_rerank_{kind}top_n[{case}]"
        for kind in ("", "tei_")
        for case in ("None-4", "2-2", "4-4", "99-4")
    ),
]
TEST_TIMEOUT_S = 60
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def suite_results(
    tiny_models: ModelPaths, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, str]]:
    out = tmp_path_factory.mktemp("suite") / "results.json"
    cmd = [sys.executable, str(HARNESS), "--server", "ours", "--model", str(tiny_models.gguf_f32),
           "--json", str(out), "--test-timeout", str(TEST_TIMEOUT_S), "--timeout", str(RUN_TIMEOUT_S), E, R]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT_S + 120, check=False)
    if proc.returncode == EXIT_UNAVAILABLE:
        pytest.skip(f"llama.cpp's server test-suite cannot be fetched: {proc.stdout[-500:]}")
    if not Path(out).exists():
        pytest.fail(f"the harness wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return {r["nodeid"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("nodeid", EXPECTED_PASS, ids=lambda n: n.split("::", 1)[1])
def test_passes_what_llama_server_passes(suite_results: dict[str, dict[str, str]], nodeid: str) -> None:
    result = suite_results.get(nodeid)
    assert result is not None, f"{nodeid} did not run; ran: {sorted(suite_results)}"
    assert result["outcome"] == "passed", f"{result['outcome']}: {result['message']}"
