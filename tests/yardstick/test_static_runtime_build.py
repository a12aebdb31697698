"""A llama.cpp build whose libraries carry their own C++ runtime, on the CPU (make soak).

The CUDA build of the lent GPU came out with the C++ runtime linked into each library and
exported, and the worker died in its vocab-only load until one runtime served all
(worker/backends/cxx_runtime.py). scripts/build_llama_static_runtime.sh builds the pinned
sources that way for the CPU (-static-libstdc++). Here the worker runs on those libraries: it
must see the runtime they carry, load the system's first (/props `weights.cxx_runtime`), and
answer with the same greedy text as on the installed build.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from tests.util import ROOT, run_worker
from worker.backends.cxx_runtime import decide, inspect, llama_lib_dir
from worker.testing.tiny_models import ModelPaths

pytestmark = pytest.mark.soak

SCRIPT = ROOT / "scripts" / "build_llama_static_runtime.sh"
ARGS = ["--parallel", "1", "--ctx-size", "512", "--threads", "1", "--cache-type-k", "f32",
        "--cache-type-v", "f32", "--flash-attn", "off"]
BODY = {"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def static_libs() -> Path:
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       check=False)
    if r.returncode == 3:
        pytest.skip(f"no llama.cpp sources to build: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(r.stdout.strip().splitlines()[-1])


def test_the_libraries_carry_a_runtime(static_libs: Path) -> None:
    infos = [i for p in sorted(static_libs.glob("lib*.so*")) if (i := inspect(p)) is not None]
    assert any(i.carries_runtime for i in infos), [(i.path, i.needed) for i in infos]
    assert decide(infos).preload


def test_the_worker_runs_on_them_with_one_runtime(tiny_models: ModelPaths, static_libs: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(static_libs))
    monkeypatch.setenv("MTMD_CPP_LIB", str(static_libs))  # a folder, as LLAMA_CPP_LIB_PATH
    with run_worker(tiny_models.gguf_f32, *ARGS, timeout=120) as url:
        weights = httpx.get(url + "/props", timeout=10).json()["weights"]
        text = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    assert weights["cxx_runtime"]["preloaded"] is True, weights
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    monkeypatch.delenv("MTMD_CPP_LIB")
    installed = llama_lib_dir()  # a CUDA build carries its own runtime too: ask the table (issue 47, 9)
    libs = sorted(installed.glob("lib*.so*")) if installed else []
    infos = [i for p in libs if (i := inspect(p)) is not None]
    with run_worker(tiny_models.gguf_f32, *ARGS, timeout=120) as url:  # the installed build
        got = httpx.get(url + "/props", timeout=10).json()["weights"]["cxx_runtime"]["preloaded"]
        assert got is decide(infos).preload
        reference = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    assert text == reference
