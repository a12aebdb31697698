"""What Ollama's API costs over the OpenAI route it translates onto: the same greedy chat, sent
alternately to `/api/chat` and `/v1/chat/completions` on one router with one tiny-model worker,
whole and streamed; medians of the wall time per request and of the router's CPU per request.

    .venv/bin/python -m bench.bench_ollama [--rounds 20] [--tokens 32]

What it shows: the translation (pydantic parse, the chunk fold into NDJSON, the bridge's parsed
SSE instead of the proxy's byte pipe) on top of the same generation. Both answers are checked to
be equal, so the two routes do the same work in the worker.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, median, router_server

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
PRESET = f"""
[defaults]
ctx-size = 2048
parallel = 1
threads = 1

[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"
load-on-startup = true
"""
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _ollama(c: httpx.Client, stream: bool, tokens: int) -> str:
    body = {"model": "tiny", "messages": MESSAGES, "stream": stream,
            "options": {"temperature": 0, "num_predict": tokens}}
    if not stream:
        return str(c.post("/api/chat", json=body).json()["message"]["content"])
    with c.stream("POST", "/api/chat", json=body) as r:
        return "".join(json.loads(line)["message"]["content"] for line in r.iter_lines() if line)


def _openai(c: httpx.Client, stream: bool, tokens: int) -> str:
    body = {"model": "tiny", "messages": MESSAGES, "stream": stream, "temperature": 0, "max_tokens": tokens}
    if not stream:
        return str(c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])
    out = []
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "preset.toml"
        preset.write_text(PRESET)
        server = router_server(preset, Path(tmp) / "router.log")
        server.start(60)
        try:
            with httpx.Client(base_url=server.base_url, timeout=120) as c:
                while c.get("/v1/models").json()["data"][0]["status"]["value"] != "loaded":
                    time.sleep(0.2)
                router_pid = server.pid
                assert router_pid is not None
                import psutil

                router = psutil.Process(router_pid)
                for stream in (False, True):
                    walls: dict[str, list[float]] = {"api/chat": [], "v1/chat": []}
                    cpus: dict[str, list[float]] = {"api/chat": [], "v1/chat": []}
                    answers: dict[str, str] = {}
                    for _ in range(args.rounds):
                        for name, call in (("api/chat", _ollama), ("v1/chat", _openai)):
                            cpu0 = sum(router.cpu_times()[:2])
                            t = time.perf_counter()
                            answers[name] = call(c, stream, args.tokens)
                            walls[name].append(time.perf_counter() - t)
                            cpus[name].append(sum(router.cpu_times()[:2]) - cpu0)
                    assert answers["api/chat"] == answers["v1/chat"], answers
                    for name in walls:
                        kind = "stream" if stream else "whole "
                        cpu_ms = sum(cpus[name]) / len(cpus[name]) * 1e3  # a mean: the clock ticks are 10 ms
                        print(f"{kind} {name:9s} wall p50 {median(walls[name]) * 1e3:7.1f} ms, "
                              f"router CPU {cpu_ms:6.1f} ms/request")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
