"""--repack / --no-repack and the default that leaves AMX out (worker/backends/weight_buffers.py).

The decision is a pure function, tested here with an AMX list on any CPU. The mechanism (the
CPU backend's extra-type list rewritten before a load) is tested on the buffer type this CPU
has: a Q4_0 model, whose weights llama.cpp repacks wherever CPU_REPACK has kernels for Q4_0
(AVX2, NEON), loads with or without it as the list says; /props reports what the weights took.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.util import ROOT, run_worker
from worker.backends.cxx_runtime import Decision, decide, inspect, llama_lib_dir
from worker.backends.weight_buffers import AMX, RepackPlan, plan
from worker.testing.tiny_models import ModelPaths


@pytest.mark.parametrize(
    ("mode", "available", "use_extra", "allowed", "left_out"),
    [
        # a CPU without AMX: exactly llama-server's default
        ("auto", ["CPU_REPACK"], True, ("CPU_REPACK",), ()),
        ("auto", [], False, (), ()),
        # an AMX CPU: AMX out, the other repacking kept
        ("auto", [AMX, "CPU_REPACK"], True, ("CPU_REPACK",), (AMX,)),
        ("auto", [AMX], False, (), (AMX,)),
        # asked for: all of them, AMX included
        ("on", [AMX, "CPU_REPACK"], True, (AMX, "CPU_REPACK"), ()),
        ("on", ["KleidiAI"], True, ("KleidiAI",), ()),
        # --no-repack: none
        ("off", [AMX, "CPU_REPACK"], False, (), (AMX, "CPU_REPACK")),
        ("off", [], False, (), ()),
    ],
)
def test_plan(mode: str, available: list[str], use_extra: bool, allowed: tuple[str, ...],
              left_out: tuple[str, ...]) -> None:
    p = plan(mode, available)  # type: ignore[arg-type]
    assert isinstance(p, RepackPlan)
    assert (p.use_extra_bufts, p.allowed, p.left_out) == (use_extra, allowed, left_out)
    assert p.reason
    if left_out == (AMX,):
        assert "20824" in p.reason  # the log line says why AMX is out


@pytest.fixture(scope="module")
def q4_0(tiny_models: ModelPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model quantized to Q4_0 by llama.cpp (every matrix has rows in multiples of 8)."""
    out = tmp_path_factory.mktemp("q4_0") / "tiny-q4_0.gguf"
    code = (
        "import ctypes, sys\n"
        "from worker.backends.llama_lib import ll\n"
        "ll.llama_backend_init()\n"
        "p = ll.llama_model_quantize_default_params(); p.ftype = 2; p.nthread = 1\n"  # 2: MOSTLY_Q4_0
        "sys.exit(ll.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tiny_models.gguf_f32), str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    return out


_LOAD = """
import ctypes, json, sys
from worker.backends import weight_buffers as wb
from worker.backends.llama_cpp import _buffers, _init_llama_backend
from worker.backends.llama_lib import ll, llc
_init_llama_backend()
names = wb.available(llc._lib)
out = {"available": names}
for label, allowed in (("none", []), ("all", names)):
    wb.restrict(llc._lib, allowed)
    p = ll.llama_model_default_params(); p.use_extra_bufts = True
    _buffers.sizes, _buffers.active = {}, True
    m = ll.llama_model_load_from_file(sys.argv[1].encode(), p)
    _buffers.active = False
    ll.llama_model_free(m)
    out[label] = sorted(_buffers.sizes)
print(json.dumps(out))
"""


def test_a_rewritten_list_keeps_a_buffer_type_out_of_the_load(q4_0: Path) -> None:
    """What the AMX default does, done to the buffer type this CPU has: with the list emptied,
    llama.cpp (asked for extra types) puts no weight in CPU_REPACK; restored, it does again."""
    r = subprocess.run([sys.executable, "-c", _LOAD, str(q4_0)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=True)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if "CPU_REPACK" not in got["available"]:
        pytest.skip(f"this CPU's llama.cpp offers no CPU_REPACK buffer type (it offers {got['available']})")
    assert "CPU_REPACK" not in got["none"]
    assert "CPU_REPACK" in got["all"]


def _props_weights(url: str) -> dict[str, object]:
    weights: dict[str, object] = httpx.get(url + "/props", timeout=10).json()["weights"]
    return weights


def _greedy(url: str) -> str:
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
    text: str = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    return text


def _this_box() -> tuple[list[str], Decision]:
    """What the decision tables are given here: the extra buffer types this build of llama.cpp
    offers on this CPU (AMX among them on an AMX CPU with a native build), and the C++ runtime
    decision for the libraries llama-cpp-python loads (a CUDA build carries its own runtime)."""
    code = ("import json\nfrom worker.backends import weight_buffers as wb\n"
            "from worker.backends.llama_lib import llc\nprint(json.dumps(wb.available(llc._lib)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=True)
    where = llama_lib_dir()
    libs = [i for p in sorted(where.glob("lib*.so*")) if (i := inspect(p)) is not None] if where else []
    return json.loads(r.stdout.strip().splitlines()[-1]), decide(libs)


def test_repack_flags_and_props(q4_0: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/props says what the decision tables say for this CPU and build. Regression (issue 47, 9):
    it asserted `left_out == []` and `preloaded is False`, false on an AMX CPU with a native
    build and on a build that carries its own C++ runtime (the CUDA build)."""
    available, runtime_decision = _this_box()
    with run_worker(q4_0, "--parallel", "1", "--ctx-size", "256", "--threads", "1") as url:
        auto = _props_weights(url)
        auto_text = _greedy(url)
    want = plan("auto", available)
    assert auto["repack"] == "auto"
    assert (auto["extra_buffer_types"], auto["left_out"]) == (list(want.allowed), list(want.left_out))
    assert isinstance(auto["buffers_mib"], dict) and auto["buffers_mib"]
    runtime = auto["cxx_runtime"]
    assert isinstance(runtime, dict)
    could_not_load = "could not be loaded" in str(runtime["reason"])  # settle()'s fallback, said so
    assert runtime["preloaded"] is (runtime_decision.preload and not could_not_load), runtime
    with run_worker(q4_0, "--parallel", "1", "--ctx-size", "256", "--threads", "1", "-nr") as url:
        off = _props_weights(url)
        assert _greedy(url)  # answers; the text may differ (other kernels)
    assert off["repack"] == "off" and off["extra_buffer_types"] == []
    assert isinstance(off["buffers_mib"], dict) and "CPU_REPACK" not in off["buffers_mib"]
    monkeypatch.setenv("LLAMA_ARG_REPACK", "0")  # llama-server's environment name
    with run_worker(q4_0, "--parallel", "1", "--ctx-size", "256", "--threads", "1") as url:
        assert _props_weights(url)["repack"] == "off"
    if "CPU_REPACK" not in auto["extra_buffer_types"]:
        pytest.skip("this CPU's llama.cpp has no CPU_REPACK: the default cannot differ from --no-repack")
    assert isinstance(auto["buffers_mib"], dict) and "CPU_REPACK" in auto["buffers_mib"]
    assert auto_text

