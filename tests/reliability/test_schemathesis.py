"""schemathesis against the live router (tiny GGUF model behind it), driven by the router's own
`GET /openapi.json`: no 5xx, status codes and content types as documented, every error in the
envelope's schema. The default run is bounded (a few examples per operation, a time budget);
`-m soak` runs the coverage phase and more examples."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.conftest import GGUF, TINY_PRESET, serve_router

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
ST = Path(sys.executable).with_name("schemathesis")
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
# Left out: the profiling routes (they write files where the body says) and the endless event
# streams.
# /models/pull and /api/pull reach a hub outside the box (tests/hub runs them on a stand-in hub)
EXCLUDE = r"(_profile|/logs/stream|/models/sse|/models/pull|/api/pull)"
# 501 is llama-server's not_supported_error (embeddings on a chat model, /infill without FIM
# tokens): a documented answer of a server without the feature, not a crash. Every other 5xx fails.
CONFIG = '[checks.not_a_server_error]\nexpected-statuses = ["2xx", "3xx", "4xx", "501"]\n'


def run_schemathesis(tmp_path: Path, *args: str, budget_s: int) -> None:
    if not ST.exists() and shutil.which("schemathesis") is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    with serve_router(tmp_path, TINY_PRESET, "--max-body-size", "1000000") as r:
        cmd = [
            str(ST),
            "--config-file",
            str(config),
            "run",
            f"{r.base}/openapi.json",
            "--checks",
            CHECKS,
            "--exclude-path-regex",
            EXCLUDE,
            "--seed",
            "17",
            "--workers",
            "1",
            "--no-shrink",
            "--request-timeout",
            "60",
            "--max-response-time",
            "60",
            "--max-time",
            str(budget_s),
            *args,
        ]
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=budget_s + 120)
        assert r.proc.poll() is None, "the router died under fuzzing:\n" + r.log()[-3000:]
    summary = out.stdout[-6000:]
    print("\n[reliability] schemathesis:", " ".join(line.strip() for line in summary.splitlines()
                                                   if "generated" in line or "passed" in line))
    assert out.returncode == 0, summary + out.stderr[-2000:]


def test_schemathesis_finds_no_5xx_and_no_schema_violation(tmp_path: Path) -> None:
    run_schemathesis(tmp_path, "--phases", "examples,fuzzing", "--max-examples", "3", budget_s=25)


@pytest.mark.soak
def test_soak_schemathesis_with_the_coverage_phase(tmp_path: Path) -> None:
    run_schemathesis(tmp_path, "--phases", "examples,coverage,fuzzing", "--max-examples", "25", budget_s=480)
