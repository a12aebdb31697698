"""One C++ runtime per worker process, settled before llama.cpp's libraries load.

llama-cpp-python loads libllama.so and libggml*.so into the Python process with dlopen
(RTLD_GLOBAL). Most builds link the C++ runtime dynamically (they list libstdc++.so.6 as
NEEDED) and all of them share the one copy. Some builds carry the runtime inside each library
instead (linked statically and exported: a CUDA build on the lent GPU's toolchain showed no
libstdc++ in NEEDED and 3,465 exported `std::` symbols in libggml-cuda.so alone). Then every
library holds a copy, and the dynamic linker binds each exported runtime symbol to the first
definition in the process's global scope: some calls of libllama's copy land in libggml-cuda's,
and the two copies' locale facets get mixed. The worker died in its vocab-only load, in the
`std::regex` compile of the tokenizer, in a `codecvt` of libggml-cuda.so. llama-server from
the same build runs: its executable brings one runtime and binds everything to it first.

So before llama_cpp is imported, the worker looks at llama.cpp's libraries (`inspect`: their
ELF dynamic sections, no tool needed) and, when one of them defines the runtime itself
(`decide`), loads the system's libstdc++.so.6 with RTLD_GLOBAL. It is then the first definition
in the global scope, and every library's references to the runtime bind to it, as with
`LD_PRELOAD=libstdc++.so.6` (which made the CUDA build start and answer). A build that links the
runtime dynamically is left as it is. The decision is logged once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("worker.llama_cpp")

# Defined only by a C++ runtime (not by the template instances every C++ library exports).
RUNTIME_MARKERS = frozenset({"__cxa_throw", "__cxa_begin_catch", "_ZSt9terminatev", "_ZNSt6locale7classicEv"})
_SHT_DYNAMIC, _SHT_DYNSYM = 6, 11
_DT_NEEDED = 1
_SHN_UNDEF = 0


@dataclass(frozen=True, slots=True)
class LibInfo:
    path: str
    needed: tuple[str, ...]  # DT_NEEDED entries
    runtime_symbols: tuple[str, ...]  # RUNTIME_MARKERS it defines and exports

    @property
    def carries_runtime(self) -> bool:
        return bool(self.runtime_symbols)


@dataclass(frozen=True, slots=True)
class Decision:
    preload: bool
    reason: str


def inspect(path: str | Path) -> LibInfo | None:
    """A 64-bit little-endian ELF shared library's NEEDED list and the runtime markers it
    defines; None for anything else (another format, a truncated file)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(str(path), data)
    except (OSError, ValueError):  # unreadable, or empty (mmap refuses a zero-length file)
        return None


def _read(path: str, data: mmap.mmap) -> LibInfo | None:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    try:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

        def strtab(index: int) -> tuple[int, int]:
            s = sections[index]
            return s[4], s[5]  # offset, size

        def string(table: tuple[int, int], at: int) -> str:
            start = table[0] + at
            end = data.find(b"\0", start, table[0] + table[1])
            if end < 0:
                raise ValueError("unterminated string")
            return data[start:end].decode(errors="replace")

        needed: list[str] = []
        found: set[str] = set()
        for _name, kind, _flags, _addr, off, size, link, _info, _align, entsize in sections:
            if kind == _SHT_DYNAMIC:
                names = strtab(link)
                for at in range(off, off + size, entsize or 16):
                    tag, value = struct.unpack_from("<qQ", data, at)
                    if tag == _DT_NEEDED:
                        needed.append(string(names, value))
            elif kind == _SHT_DYNSYM:
                names = strtab(link)
                for at in range(off, off + size, entsize or 24):
                    st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, at)
                    if st_shndx != _SHN_UNDEF and st_info >> 4 in (1, 2):  # defined, global or weak
                        name = string(names, st_name)
                        if name in RUNTIME_MARKERS:
                            found.add(name)
    except (struct.error, ValueError, IndexError):
        return None
    return LibInfo(path, tuple(needed), tuple(sorted(found)))


def decide(libs: Sequence[LibInfo]) -> Decision:
    """Preload the system's runtime when any of llama.cpp's libraries carries one of its own."""
    carriers = [os.path.basename(lib.path) for lib in libs if lib.carries_runtime]
    if not carriers:
        return Decision(False, "llama.cpp's libraries share the system's C++ runtime")
    verb = "carries" if len(carriers) == 1 else "carry"
    return Decision(True, f"{', '.join(carriers)} {verb} a C++ runtime of their own: the system's "
                          "libstdc++ is loaded first, so that one runtime serves all")


def llama_lib_dir() -> Path | None:
    """Where llama-cpp-python will load its libraries from (its LLAMA_CPP_LIB_PATH, else its lib/)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


_settled: Decision | None = None


def settle() -> Decision:
    """Decide once, before llama_cpp is imported, and preload the system runtime if so decided."""
    global _settled
    if _settled is not None:
        return _settled
    where = llama_lib_dir()
    libs = [info for p in sorted(where.glob("lib*.so*")) if (info := inspect(p)) is not None] if where else []
    decision = decide(libs)
    if decision.preload:
        name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            decision = Decision(False, f"{decision.reason}; but {name} could not be loaded ({e})")
            log.warning("C++ runtime: %s", decision.reason)
        else:
            log.info("C++ runtime: %s (%s)", decision.reason, name)
    _settled = decision
    return decision
