"""The GPU check's placement part (scripts/gpu_check.sh run, once the CUDA build of llama.cpp is
there): what the GPU-less tests cannot show (docs/gpu-placement.md).

1. The inventory (router.lifecycle.gpus: NVML when `pynvml` imports, else nvidia-smi) against
   nvidia-smi's own rows: index, UUID, name and total equal, used within USED_TOLERANCE.
2. Per-process figures: a torch process that holds HOLD_BYTES on GPU 0; what the inventory says
   it uses there against nvidia-smi's --query-compute-apps.
3. The demo model served through the placement on CUDA: the router on a preset for MODEL, one
   chat; its card's `devices`, the worker's CUDA_VISIBLE_DEVICES (/proc/PID/environ), its log's
   offload line, and the per-device gauges on /metrics.

    python3 scripts/gpu_placement_check.py MODEL      (prints PASS/FAIL lines; exit 1 on a FAIL)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from router.lifecycle import gpus  # noqa: E402  (after the path)

MIB = 1 << 20
USED_TOLERANCE = 256 * MIB  # "used" moves while we read it twice
HOLD_BYTES = 1 << 30
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def inventory_against_smi() -> None:
    inv = gpus.read_inventory()
    raw = gpus.nvidia_smi("--query-gpu=index,uuid,name,memory.total,memory.used") or ""
    smi = gpus.parse_gpus(raw)
    check(inv is not None and bool(smi),
          f"inventory read ({inv.source if inv else 'none'}), nvidia-smi rows: {raw!r}")
    if inv is None:
        return
    for mine, theirs in zip(inv.gpus, smi, strict=False):
        same = (mine.index, mine.uuid, mine.name) == (theirs.index, theirs.uuid, theirs.name)
        # NVML reports bytes, nvidia-smi MiB: equal to the MiB
        check(same and abs(mine.total_bytes - theirs.total_bytes) < MIB
              and abs(mine.used_bytes - theirs.used_bytes) <= USED_TOLERANCE,
              f"GPU {mine.index}: {mine} vs nvidia-smi {theirs}")


def per_process_against_smi() -> None:
    code = (f"import torch, time; x = torch.empty({HOLD_BYTES}, dtype=torch.uint8, device='cuda:0'); "
            "print('ready', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        assert holder.stdout is not None
        check(holder.stdout.readline().strip() == "ready", "a torch process holds 1 GiB on GPU 0")
        inv = gpus.read_inventory()
        use = inv.use_of({holder.pid}) if inv is not None else {}
        rows = gpus.parse_processes(gpus.nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory") or "")
        theirs = sum(p.used_bytes for p in rows if p.pid == holder.pid)
        check(use.get(0, 0) >= HOLD_BYTES and abs(use.get(0, 0) - theirs) < MIB,
              f"its use on GPU 0: inventory {use} vs nvidia-smi {theirs} bytes")
    finally:
        holder.kill()
        holder.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return bytes(r.read())


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def serve_demo(model: str) -> None:
    import psutil

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "p.toml"
        preset.write_text(f'[models.demo]\nmodel = "{model}"\nbackend = "llama_cpp"\nctx-size = 4096\n')
        log = open(Path(tmp) / "router.log", "wb")  # noqa: SIM115
        argv = [sys.executable, "-m", "router.cli", "--preset", str(preset), "--port", str(port)]
        router = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            for _ in range(120):
                try:
                    get(f"{base}/health")
                    break
                except OSError:
                    time.sleep(0.5)
            banner = (Path(tmp) / "router.log").read_text(errors="replace")
            check("GPU 0:" in banner, "the banner lists the GPUs: "
                  + " | ".join(line for line in banner.splitlines() if "GPU" in line))
            answer = post(f"{base}/v1/chat/completions",
                          {"model": "demo", "messages": [{"role": "user", "content": "Say hi"}],
                           "max_tokens": 8})
            check(bool(answer.get("choices")), f"a chat through the placement: {json.dumps(answer)[:200]}")
            card = next(m for m in json.loads(get(f"{base}/v1/models"))["data"] if m["id"] == "demo")
            devices = card.get("devices") or []
            check(len(devices) == 1 and devices[0]["vram_bytes"] > 0, f"its card's devices: {devices}")
            workers = [p for p in psutil.Process(router.pid).children() if "--alias" in p.cmdline()]
            env = workers[0].environ() if workers else {}
            visible = env.get("CUDA_VISIBLE_DEVICES")
            argv_seen = workers[0].cmdline() if workers else None
            check(visible == ",".join(str(d["index"]) for d in devices),
                  f"the worker's CUDA_VISIBLE_DEVICES={visible} and argv {argv_seen}")
            tail = get(f"{base}/logs?model=demo").decode(errors="replace")
            offload = [line for line in tail.splitlines() if "offloaded" in line or "CUDA0" in line]
            check(any("offloaded" in line for line in offload), f"the worker's offload lines: {offload[-3:]}")
            metrics = get(f"{base}/metrics").decode()
            gauges = [line for line in metrics.splitlines() if line.startswith("omni_router:gpu_")]
            check(any('model="demo"' in line for line in gauges), "/metrics: " + " | ".join(gauges))
        finally:
            router.terminate()
            router.wait(30)
            log.close()


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "models" / "tiny-llama-f32.gguf")
    inventory_against_smi()
    per_process_against_smi()
    serve_demo(model)
    print(f"== gpu placement check: {len(failures)} failed ==")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
