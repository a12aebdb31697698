"""One C++ runtime per worker process (worker/backends/cxx_runtime.py), without a GPU.

The CUDA build that crashed carried the C++ runtime inside its libraries. Here a library built
the same way (g++ -static-libstdc++, the runtime's symbols exported) stands in for it: the ELF
reader must see it carries a runtime, the decision must preload the system's, and a worker
process pointed at it must load libstdc++ before anything else. The installed llama.cpp (which
links the runtime dynamically) must be left as it is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import ROOT
from worker.backends.cxx_runtime import LibInfo, decide, inspect, llama_lib_dir

_SOURCE = """
#include <locale>
#include <regex>
#include <string>
extern "C" int count_words(const char * text) {
    std::regex word("\\\\w+");
    std::string s(text);
    return (int) std::distance(std::sregex_iterator(s.begin(), s.end(), word), std::sregex_iterator());
}
"""


@pytest.mark.parametrize(
    ("libs", "preload"),
    [
        ([], False),
        ([LibInfo("libllama.so", ("libstdc++.so.6",), ())], False),
        ([LibInfo("libllama.so", ("libstdc++.so.6",), ()),
          LibInfo("libggml-cuda.so", (), ("__cxa_throw",))], True),
        ([LibInfo("libllama.so", (), ("_ZNSt6locale7classicEv",))], True),
    ],
)
def test_decide(libs: list[LibInfo], preload: bool) -> None:
    d = decide(libs)
    assert d.preload is preload
    if preload:
        assert any(Path(lib.path).name in d.reason for lib in libs if lib.carries_runtime)


def test_the_installed_llama_cpp_shares_the_system_runtime() -> None:
    where = llama_lib_dir()
    assert where is not None
    libllama = inspect(where / "libllama.so")
    assert libllama is not None
    assert "libstdc++.so.6" in libllama.needed and not libllama.carries_runtime


@pytest.fixture(scope="module")
def carrier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared library with the C++ runtime linked in and exported, as the CUDA build's."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on this machine to build a library that carries its own C++ runtime")
    d = tmp_path_factory.mktemp("carrier")
    (d / "carrier.cpp").write_text(_SOURCE)
    out = d / "lib" / "libcarrier.so"
    out.parent.mkdir()
    cmd = [gxx, "-shared", "-fPIC", "-O1", "-static-libstdc++", "-o", str(out), str(d / "carrier.cpp")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


def test_a_library_with_its_own_runtime_is_seen(carrier: Path) -> None:
    info = inspect(carrier)
    assert info is not None
    assert "libstdc++.so.6" not in info.needed
    assert info.carries_runtime
    assert decide([info]).preload


def test_not_an_elf_file_is_no_library(tmp_path: Path) -> None:
    (tmp_path / "libx.so").write_bytes(b"not an ELF file at all")
    (tmp_path / "libempty.so").write_bytes(b"")
    assert inspect(tmp_path / "libx.so") is None
    assert inspect(tmp_path / "libempty.so") is None


_SETTLE = """
import ctypes, json, sys
from worker.backends import cxx_runtime

class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

def global_definer(symbol):
    # the library that the global scope (RTLD_DEFAULT) binds `symbol` to, as a later dlopen would
    libc = ctypes.CDLL(None)
    libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    address = libc.dlsym(None, symbol)
    if not address:
        return None
    info = DlInfo()
    libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info))
    return info.fname.decode()

before = global_definer(b"__cxa_throw")
d = cxx_runtime.settle()
after = global_definer(b"__cxa_throw")
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
words = lib.count_words(b"one runtime for all")
print(json.dumps({"before": before, "preload": d.preload, "after": after, "words": words}))
"""


def test_settle_preloads_the_system_runtime_before_such_a_library(carrier: Path) -> None:
    """After settle(), the global scope defines the runtime's symbols by the system's libstdc++,
    so a library loaded next binds its runtime references there (as under LD_PRELOAD)."""
    env = {"LLAMA_CPP_LIB_PATH": str(carrier.parent), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", _SETTLE, str(carrier)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60, check=True)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["preload"] is True and got["words"] == 4
    assert got["before"] is None or "libstdc++" not in got["before"]
    assert "libstdc++.so.6" in got["after"]
