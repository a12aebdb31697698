"""The storm (issue 39, `make soak`): 20,000 streams over three models through one router while a
worker is SIGKILLed every 10 s (bench/storm.py, run as a user runs it, its figures read from its
`--json`). A crash fails only what it must: no stream hangs, the error events stay within what
the killed workers could have been running (their slots and forwarding margin), and no model is
left failed once the storm is over; the router's peak RSS is reported (docs/reliability.md says
where the bytes go)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import ROOT

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"


@pytest.mark.soak
@pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
def test_twenty_thousand_streams_with_a_worker_killed_every_ten_seconds(tmp_path: Path) -> None:
    out = tmp_path / "storm.json"
    run = subprocess.run([sys.executable, "-m", "bench.storm", "--streams", "20000", "--kill-every", "10",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    outcomes = r["outcomes"]
    assert outcomes.get("hung", 0) == 0, outcomes
    assert outcomes.get("error event", 0) <= r["bound_with_margin"], outcomes
    assert "failed" not in r["states"].values(), r["states"]
    # every stream ended as one of the clean outcomes: served, an error event, a 503 with Retry-After
    assert set(outcomes) <= {"completed", "error event", "503"}, outcomes
    print(f"router peak RSS {r['peak_rss_mib']:.0f} MiB")
