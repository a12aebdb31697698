"""Router benchmark: what the router costs and how fast it moves models, side by side in one run.

    .venv/bin/python bench/bench_router.py [--requests 1000] [--sequential 2000] [--json out.json]
    .venv/bin/python bench/bench_router.py --ray [--requests 1000] [--repeats 3]

Starts `omni-router` on a temporary preset with two real tiny GGUF models, then measures:
  1. added latency: tiny non-streaming chat requests (max_tokens=1) through the router vs
     straight to the same worker, interleaved one by one so both see the same machine load;
     reported as p50/p99 of each and the differences (target: p50 added <= 1 ms);
  2. dropped connections over N sequential keep-alive requests through the router (target 0);
  3. cold start: unloaded model -> first streamed token (spawn + load + first token);
  4. wake from sleep: sleeping model -> first streamed token (target <= 25% of cold);
  5. swap with --models-max 1: a request for B while A is loaded -> answer
     (stop A + cold start B; target < 2 s + B's load time);
  6. for comparison, the added latency with httpx as the router's upstream client.

`--ray` measures instead what placing a worker on Ray adds (docs/ray.md): a local Ray cluster on
127.0.0.1 (a head and one node), one router with `--ray`, the same GGUF served by a local worker
(`placement = "local"`) and by a Ray-placed one; tiny requests to the four targets (each worker
directly, each through the router) interleaved one by one, and the cold start of each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.util import free_port, wait_until  # noqa: E402  # after the sys.path insert above

GGUF_A = ROOT / "models" / "tiny-llama-f32.gguf"
GGUF_B = ROOT / "models" / "tiny-llama-f16.gguf"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


def preset_text(threads: int) -> str:
    return f"""
[defaults]
ctx-size = 512
parallel = 1
threads = {threads}
stop-timeout = 5

[models.a]
model = "{GGUF_A}"
backend = "llama_cpp"

[models.b]
model = "{GGUF_B}"
backend = "llama_cpp"
"""


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


class Router:
    def __init__(self, preset: Path, *args: str, env_extra: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  # the child's output; lives as long as the benchmark process
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "router.cli", "--preset", str(preset), "--port",
                                      str(self.port), "--log-level", "warning", *args],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.http = httpx.Client(base_url=self.base, timeout=120)
        wait_until(lambda: self.http.get("/health").status_code == 200, 30, what="router up")

    def status(self, name: str) -> str:
        for m in self.http.get("/v1/models").json()["data"]:
            if m["id"] == name:
                return str(m["status"]["value"])
        raise KeyError(name)

    def worker_port(self, name: str) -> int:
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "--alias" in cmd and cmd[cmd.index("--alias") + 1] == name:
                return int(cmd[cmd.index("--port") + 1])
        raise LookupError(name)

    def close(self) -> None:
        self.http.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(20)


def ttft(client: httpx.Client, model: str) -> float:
    """Seconds from sending a streamed request to its first content chunk."""
    t0 = time.perf_counter()
    body = {**CHAT, "model": model, "stream": True, "max_tokens": 4}
    first: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def bench_latency(r: Router, n: int) -> dict[str, float]:
    direct = httpx.Client(base_url=f"http://127.0.0.1:{r.worker_port('a')}", timeout=30)
    routed = httpx.Client(base_url=r.base, timeout=30)
    body = {**CHAT, "model": "a"}
    d_ms: list[float] = []
    r_ms: list[float] = []
    for i in range(n + 50):
        for client, sink in ((direct, d_ms), (routed, r_ms)) if i % 2 else ((routed, r_ms), (direct, d_ms)):
            t0 = time.perf_counter()
            resp = client.post("/v1/chat/completions", json=body)
            dt = (time.perf_counter() - t0) * 1000
            resp.raise_for_status()
            if i >= 50:  # warm-up
                sink.append(dt)
    direct.close()
    routed.close()
    d50, r50, d99, r99 = pct(d_ms, 50), pct(r_ms, 50), pct(d_ms, 99), pct(r_ms, 99)
    return {"direct_p50_ms": d50, "router_p50_ms": r50, "added_p50_ms": r50 - d50,
            "direct_p99_ms": d99, "router_p99_ms": r99, "added_p99_ms": r99 - d99,
            "added_mean_ms": statistics.fmean(r_ms) - statistics.fmean(d_ms)}


def bench_drops(r: Router, n: int) -> dict[str, float]:
    client = httpx.Client(base_url=r.base, timeout=30)
    body = {**CHAT, "model": "a"}
    dropped = 0
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            if client.post("/v1/chat/completions", json=body).status_code != 200:
                dropped += 1
        except httpx.HTTPError:
            dropped += 1
    elapsed = time.perf_counter() - t0
    client.close()
    return {"sequential_requests": n, "dropped": dropped, "requests_per_s": n / elapsed}


def median_of(k: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(k))


def bench_lifecycle(r: Router, repeats: int) -> dict[str, float]:
    def cold() -> float:
        r.http.post("/models/unload", json={"model": "a"})
        wait_until(lambda: r.status("a") == "unloaded", 30)
        return ttft(r.http, "a")

    def wake() -> float:
        r.http.post("/models/sleep", json={"model": "a"}).raise_for_status()
        wait_until(lambda: r.status("a") == "sleeping", 30)
        return ttft(r.http, "a")

    cold_s = median_of(repeats, cold)
    wake_s = median_of(repeats, wake)
    return {"cold_ttft_s": cold_s, "wake_ttft_s": wake_s, "wake_over_cold": wake_s / cold_s}


def bench_swap(r: Router, repeats: int) -> dict[str, float]:
    """--models-max 1: time for a request to B while A is loaded, vs B's own cold start."""
    r.http.post("/v1/chat/completions", json={**CHAT, "model": "a"}).raise_for_status()

    def swap_to(target: str) -> float:
        t0 = time.perf_counter()
        r.http.post("/v1/chat/completions", json={**CHAT, "model": target}).raise_for_status()
        return time.perf_counter() - t0

    swaps = [swap_to("b" if i % 2 == 0 else "a") for i in range(2 * repeats)]

    def cold_b() -> float:
        for m in ("a", "b"):
            r.http.post("/models/unload", json={"model": m})
        wait_until(lambda: r.status("a") == "unloaded" and r.status("b") == "unloaded", 30)
        t0 = time.perf_counter()
        r.http.post("/v1/chat/completions", json={**CHAT, "model": "b"}).raise_for_status()
        return time.perf_counter() - t0

    cold = median_of(repeats, cold_b)
    swap = statistics.median(swaps)
    return {"swap_s": swap, "cold_request_s": cold, "swap_overhead_s": swap - cold}


RAY_PRESET = """
[defaults]
ctx-size = 512
parallel = 1
threads = {threads}
stop-timeout = 5

[models.local]
model = "{gguf}"
backend = "llama_cpp"
placement = "local"

[models.onray]
model = "{gguf}"
backend = "llama_cpp"
placement = "ray"
ray-resources = {{bench = 1}}
"""


def card_port(r: Router, name: str) -> int:
    for m in r.http.get("/v1/models").json()["data"]:
        if m["id"] == name:
            args = m["status"]["args"]
            return int(args[args.index("--port") + 1])
    raise KeyError(name)


def bench_ray(args: argparse.Namespace) -> dict[str, Any]:
    """Local vs Ray-placed worker behind one router: added latency and cold start."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    small = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**small, "include_dashboard": False})
    cluster.add_node(**small, resources={"bench": 1})
    cluster.wait_for_nodes()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            preset = Path(tmp) / "bench.toml"
            preset.write_text(RAY_PRESET.format(threads=args.threads, gguf=GGUF_A))
            r = Router(preset, "--ray", cluster.address, "--models-max", "0",
                       env_extra={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
            try:
                for m in ("local", "onray"):
                    r.http.post("/v1/chat/completions", json={**CHAT, "model": m}).raise_for_status()
                results["latency"] = interleaved(r, args.requests)
                results["cold_ttft_s"] = {m: median_of(args.repeats, lambda m=m: cold_ttft(r, m))
                                          for m in ("local", "onray")}
            finally:
                r.close()
    finally:
        cluster.shutdown()
    return results


def cold_ttft(r: Router, model: str) -> float:
    r.http.post("/models/unload", json={"model": model})
    wait_until(lambda: r.status(model) == "unloaded", 30)
    return ttft(r.http, model)


def interleaved(r: Router, n: int) -> dict[str, dict[str, float]]:
    """p50/p99 (ms) of each target, the four taking turns (rotating order) so all see one load."""
    def client(base: str) -> httpx.Client:
        return httpx.Client(base_url=base, timeout=30)

    targets = {
        "local_direct": (client(f"http://127.0.0.1:{card_port(r, 'local')}"), "local"),
        "local_router": (client(r.base), "local"),
        "ray_direct": (client(f"http://127.0.0.1:{card_port(r, 'onray')}"), "onray"),
        "ray_router": (client(r.base), "onray"),
    }
    samples: dict[str, list[float]] = {k: [] for k in targets}
    order = list(targets)
    for i in range(n + 50):
        for key in order[i % 4:] + order[:i % 4]:
            client, model = targets[key]
            t0 = time.perf_counter()
            client.post("/v1/chat/completions", json={**CHAT, "model": model}).raise_for_status()
            if i >= 50:  # warm-up
                samples[key].append((time.perf_counter() - t0) * 1000)
    for client, _ in targets.values():
        client.close()
    return {k: {"p50_ms": pct(v, 50), "p99_ms": pct(v, 99)} for k, v in samples.items()}


def print_ray(results: dict[str, Any], args: argparse.Namespace) -> None:
    lat, cold = results["latency"], results["cold_ttft_s"]
    print(f"ray placement bench (tiny GGUF, one router --ray, a local 2-node Ray cluster on 127.0.0.1,"
          f" {os.cpu_count()} CPUs)")
    print(f"  latency, max_tokens=1, {args.requests} interleaved requests per target:")
    for key in ("local_direct", "local_router", "ray_direct", "ray_router"):
        print(f"    {key:13s} p50 {lat[key]['p50_ms']:7.3f} ms   p99 {lat[key]['p99_ms']:7.3f} ms")
    added_local = lat["local_router"]["p50_ms"] - lat["local_direct"]["p50_ms"]
    added_ray = lat["ray_router"]["p50_ms"] - lat["ray_direct"]["p50_ms"]
    ray_vs_local = lat["ray_router"]["p50_ms"] - lat["local_router"]["p50_ms"]
    print(f"    router adds p50: local {added_local:.3f} ms, Ray-placed {added_ray:.3f} ms;"
          f" Ray-placed vs local through the router: {ray_vs_local:+.3f} ms")
    print(f"  cold start -> first token (median of {args.repeats}): local {cold['local'] * 1000:.0f} ms,"
          f" Ray-placed {cold['onray'] * 1000:.0f} ms ({cold['onray'] / cold['local']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="latency samples per side")
    ap.add_argument("--sequential", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ray", action="store_true", help="local vs Ray-placed worker instead (needs ray)")
    args = ap.parse_args()
    if args.ray:
        ray_results = bench_ray(args)
        print_ray(ray_results, args)
        if args.json:
            args.json.write_text(json.dumps(ray_results, indent=2))
        return
    for p in (GGUF_A, GGUF_B):
        if not p.exists():
            sys.exit(f"missing {p}: run `make models` first")

    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "bench.toml"
        preset.write_text(preset_text(args.threads))
        results: dict[str, Any] = {}
        r = Router(preset, "--models-max", "2")
        try:
            r.http.post("/v1/chat/completions", json={**CHAT, "model": "a"}).raise_for_status()
            results["latency"] = bench_latency(r, args.requests)
            results["keepalive"] = bench_drops(r, args.sequential)
            results["lifecycle"] = bench_lifecycle(r, args.repeats)
        finally:
            r.close()
        r = Router(preset, "--models-max", "1")
        try:
            results["swap"] = bench_swap(r, args.repeats)
        finally:
            r.close()
        # The same router with its upstream client swapped for httpx: what the lean client saves.
        r = Router(preset, env_extra={"OMNI_PROXY_CLIENT": "httpx"})
        try:
            r.http.post("/v1/chat/completions", json={**CHAT, "model": "a"}).raise_for_status()
            results["latency_httpx"] = bench_latency(r, max(100, args.requests // 3))
        finally:
            r.close()

    lat, ka, lc, sw = results["latency"], results["keepalive"], results["lifecycle"], results["swap"]
    print(f"router bench (tiny GGUF, real workers, {os.cpu_count()} CPUs)")
    print(f"  latency, max_tokens=1, {args.requests} interleaved requests each:")
    print(f"    direct  p50 {lat['direct_p50_ms']:7.3f} ms   p99 {lat['direct_p99_ms']:7.3f} ms")
    print(f"    router  p50 {lat['router_p50_ms']:7.3f} ms   p99 {lat['router_p99_ms']:7.3f} ms")
    print(f"    added   p50 {lat['added_p50_ms']:7.3f} ms   p99 {lat['added_p99_ms']:7.3f} ms"
          f"   (target p50 <= 1 ms)")
    hx = results["latency_httpx"]
    print(f"    (same router with httpx as its upstream client: added p50 {hx['added_p50_ms']:.3f} ms,"
          f" p99 {hx['added_p99_ms']:.3f} ms)")
    print(f"  keep-alive: {ka['dropped']} dropped of {ka['sequential_requests']} sequential requests"
          f" ({ka['requests_per_s']:.0f} req/s; target 0)")
    print(f"  cold start -> first token   {lc['cold_ttft_s'] * 1000:8.1f} ms (median of {args.repeats})")
    print(f"  wake from sleep -> first token {lc['wake_ttft_s'] * 1000:5.1f} ms"
          f" = {lc['wake_over_cold'] * 100:.1f}% of cold (target <= 25%)")
    print(
        f"  swap A->B (models-max 1)    {sw['swap_s'] * 1000:8.1f} ms; "
        f"B cold alone {sw['cold_request_s'] * 1000:.1f} ms;"
        f" swap overhead {sw['swap_overhead_s'] * 1000:.1f} ms (target < 2000 ms + load)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
