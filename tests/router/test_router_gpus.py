"""End to end: the GPU placement through a real router with real workers on this CPU, and a
stand-in `nvidia-smi` (tests/router/fake_nvidia_smi.py, first on PATH) reporting two GPUs.

The workers run on the CPU (llama.cpp's CPU build ignores CUDA_VISIBLE_DEVICES and the split
flags); what is checked is where the router says and starts them: each worker's own environment
(/proc/PID/environ) and command line, /v1/models' `devices`, /metrics and the banner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.router.conftest import RouterProc, chat
from tests.router.fake_nvidia_smi import install
from tests.util import ROOT, wait_until

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
MIB = 1 << 20

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")

GPUS = {"gpus": [
    {"index": 0, "uuid": "GPU-0000aaaa", "name": "Fake GPU A", "memory.total": 24576, "memory.used": 2048},
    {"index": 1, "uuid": "GPU-1111bbbb", "name": "Fake GPU B", "memory.total": 24576, "memory.used": 10240},
], "apps": []}
SETTINGS = "threads = 1\nparallel = 1\nctx-size = 256\nstop-timeout = 5\n"


def model(name: str, extra: str = "") -> str:
    return f'[models.{name}]\nmodel = "{GGUF}"\nbackend = "llama_cpp"\n{SETTINGS}{extra}\n'


def worker_of(r: RouterProc, name: str) -> psutil.Process:
    found = [w for w in r.workers()
             if "--alias" in (cmd := w.cmdline()) and cmd[cmd.index("--alias") + 1] == name]
    assert len(found) == 1, [w.cmdline() for w in r.workers()]
    return found[0]


def test_each_worker_runs_on_the_devices_chosen_and_the_router_says_so(router_factory: Factory,
                                                                         tmp_path: Path) -> None:
    preset = (model("small") + model("on-one", "devices = [1]") + model("split", 'vram = "30GiB"')
              + model("huge", 'vram = "100GiB"'))
    r = router_factory(preset, env=install(tmp_path, GPUS))
    log = r.log()
    assert "GPU 0: Fake GPU A (GPU-0000aaaa), 24.0 GiB, 22.0 GiB free" in log
    assert "GPU 1: Fake GPU B (GPU-1111bbbb), 24.0 GiB, 14.0 GiB free" in log

    with r.client(timeout=120) as c:
        refused = c.post("/v1/chat/completions", json=chat("huge", max_tokens=2))
        for name in ("small", "on-one", "split"):
            resp = c.post("/v1/chat/completions", json=chat(name, max_tokens=2))
            assert resp.status_code == 200, resp.text
    assert refused.status_code == 503
    message = refused.json()["error"]["message"]
    for text in ("needs ~100.0 GiB of GPU memory", "more than all the GPUs together",
                 "GPU 0 (Fake GPU A): 22.0 GiB free of 24.0 GiB, 1.0 GiB reserved", "GPU 1 (Fake GPU B)"):
        assert text in message, message

    # small: the most free memory (spread); on-one: as its preset says; split: over both, the
    # tensor split in proportion to their room
    expected = {"small": "0", "on-one": "1", "split": "0,1"}
    cards = r.models()
    for name, visible in expected.items():
        worker = worker_of(r, name)
        env = worker.environ()
        assert env.get("CUDA_VISIBLE_DEVICES") == visible and env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        devices = cards[name]["devices"]
        assert ",".join(str(d["index"]) for d in devices) == visible
        assert all(d["uuid"] == GPUS["gpus"][d["index"]]["uuid"] and d["vram_bytes"] > 0 for d in devices)
        argv = worker.cmdline()
        if "," in visible:
            parts = [float(x) for x in argv[argv.index("--tensor-split") + 1].split(",")]
            assert len(parts) == 2 and parts[0] > parts[1]  # GPU 0 has more room than GPU 1
        else:
            assert argv[argv.index("--split-mode") + 1] == "none"
    assert cards["huge"]["devices"] == [] and cards["huge"]["status"]["value"] == "unloaded"
    workers = [w for w in r.workers() if "--alias" in w.cmdline()]  # (not the stand-in nvidia-smi)
    assert len(workers) == 3  # none was spawned for `huge`

    # once it runs, what the driver reports for its process on each device replaces the estimate
    small = worker_of(r, "small").pid
    state = {**GPUS, "apps": [{"pid": small, "gpu_uuid": "GPU-0000aaaa", "used_memory": 700}]}
    (tmp_path / "gpus.json").write_text(json.dumps(state))
    wait_until(lambda: r.models()["small"]["devices"][0]["vram_bytes"] == 700 * MIB, 30,
               what="the measured use on the card")
    metrics = httpx.get(f"{r.base}/metrics", timeout=10).text
    charged = 'omni_router:gpu_model_memory_bytes{gpu="0",model="small"} '
    seen = [float(line[len(charged):]) for line in metrics.splitlines() if line.startswith(charged)]
    assert seen == [700 * MIB]
    total = ('omni_router:gpu_memory_total_bytes{gpu="0",name="Fake GPU A",uuid="GPU-0000aaaa"} '
             "2.5769803776e+10")
    assert total in metrics
    assert 'omni_router:gpu_model_memory_bytes{gpu="1",model="on-one"}' in metrics
    assert 'omni_router:gpu_model_memory_bytes{gpu="0",model="split"}' in metrics


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--gpu-reserve", "lots", "expected a size like 1GiB or 512M, or a percentage like 5%"),
    ("--gpu-reserve", "100%", "a percentage below 100"),
    ("--placement", "pack", "expected one of spread, binpack"),
])
def test_a_bad_gpu_flag_is_refused_by_name_before_serving(tmp_path: Path, flag: str, value: str,
                                                          says: str) -> None:
    preset = tmp_path / "p.toml"
    preset.write_text(model("m"))
    out = subprocess.run([sys.executable, "-m", "router.cli", "--preset", str(preset), flag, value],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **install(tmp_path, GPUS)})
    assert out.returncode == 2 and flag in out.stderr and says in out.stderr, out.stderr
