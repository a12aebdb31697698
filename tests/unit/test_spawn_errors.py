"""A spawn that fails because the box is short of descriptors is transient (retried with backoff),
not a broken model (issue 39): forced here with a soft RLIMIT_NOFILE below what a spawn needs."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.util import ROOT

_CODE = """
import asyncio, json, os, resource, sys
from router.lifecycle.process import SpawnError, WorkerProcess

async def main():
    out = {}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n_open = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (n_open + 1, hard))  # no room for the pipes
    try:
        await WorkerProcess.spawn([sys.executable, "-c", "pass"], "m")
        out["first"] = "spawned"
    except SpawnError as e:
        out["first"] = "SpawnError: " + str(e)
    except OSError as e:
        out["first"] = "OSError: " + str(e)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # descriptors free again
    proc = await WorkerProcess.spawn([sys.executable, "-c", "pass"], "m")
    out["second"] = await proc.proc.wait()
    try:
        await WorkerProcess.spawn(["/nonexistent/omni-worker"], "m")
    except SpawnError:
        out["missing"] = "SpawnError"
    except OSError:
        out["missing"] = "OSError"
    print(json.dumps(out))

asyncio.run(main())
"""


def test_emfile_at_spawn_is_transient_and_a_missing_program_is_not() -> None:
    r = subprocess.run([sys.executable, "-c", _CODE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    first = out["first"]
    assert first.startswith("SpawnError: ") and "EMFILE" in first and "transient" in first
    assert out["second"] == 0
    assert out["missing"] == "OSError"  # the model's own problem: permanent, as before
