"""Where llama.cpp keeps a model's weights on the CPU: the `--repack` decision, and what it gave.

llama.cpp's CPU backend offers "extra" buffer types for weights besides plain memory, each with
kernels of its own for the quant types it re-lays at load:
- `CPU_REPACK`: interleaved blocks for the AVX2 / AVX-512 / NEON / RVV kernels (on x86: Q4_0,
  Q4_K, IQ4_NL, MXFP4 with AVX2, Q2_K with AVX-512; nothing for Q4_1 or Q8_0);
- `AMX`: tiles for Intel's AMX units (Q4_0, Q4_1, Q8_0 and K-quants), present only in a build
  made on, or for, a CPU with AMX and only where the kernel grants the tile state;
- others on other CPUs (KleidiAI on Arm).
llama.cpp chooses per weight: the first extra type in the backend's list whose kernels take that
weight's op, else plain memory. llama-server's `--repack` (its default) lets it choose among
all; `--no-repack` (`use_extra_bufts = false`) among none.

The AMX buffer type crashes the pinned llama.cpp at the first decode (a segfault in
ggml_backend_amx_mul_mat, llama.cpp issue 20824, never fixed): llama-server, llama-cpp-python's
`Llama` and this worker alike, on the demo model (Q4_1, which only AMX would repack on x86).
So omni-worker's default, `auto`, is llama-server's `--repack` less AMX: every other extra
type stays, so a Q4_0 or Q4_K model keeps its repacked kernels on an AMX CPU, and a CPU without
AMX loads exactly as before. `--repack` asks for all of them, AMX included (the user's choice);
`--no-repack` for none. The choice and its reason are logged once at load and shown in /props
with the buffers that the weights then took (llama.cpp's own "model buffer size" report).

How AMX is left out while the others stay. llama.cpp asks the CPU backend for its extra types
through `ggml_backend_dev_get_extra_bufts`, which returns a null-terminated array that the
backend keeps for that caller: a copy of its own list. `restrict` rewrites that array, before
the first full load, to the allowed types; llama.cpp then chooses among them tensor by tensor
by its own rules (the op each weight feeds, its type and shape). The backend's internal list,
which its kernels consult, is untouched; with no weight in an AMX buffer, no AMX kernel runs.
A pattern override (`tensor_buft_overrides`) could place weights in CPU_REPACK too, but it
bypasses llama.cpp's check that the buffer's kernels take the weight: a weight they do not take
is dereferenced through a null trait at load. Rewriting the list keeps that check.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger("worker.llama_cpp")

RepackMode = Literal["auto", "on", "off"]
REPACK_MODES: tuple[RepackMode, ...] = ("auto", "on", "off")
AMX = "AMX"
_GGML_BACKEND_DEVICE_TYPE_CPU = 0

# llama.cpp, at the end of a load: "load_tensors:   CPU_REPACK model buffer size =    50.00 MiB"
_BUFFER_LINE = re.compile(r"^\w+:\s+(\S+) model buffer size =\s*([0-9.]+) MiB")


@dataclass(frozen=True, slots=True)
class RepackPlan:
    """What llama.cpp may choose from, and why. `allowed`: the extra buffer types left in the CPU
    backend's list for llama.cpp (in its order); `left_out`: those taken out."""

    mode: RepackMode
    use_extra_bufts: bool
    allowed: tuple[str, ...]
    left_out: tuple[str, ...]
    reason: str


def plan(mode: RepackMode, available: Sequence[str]) -> RepackPlan:
    """The decision, from the mode asked for and the extra buffer types this build and CPU offer
    (pure: the unit tests give it any list, an AMX one included, on any CPU)."""
    names = tuple(available)
    if mode == "off":
        return RepackPlan(mode, False, (), names, "--no-repack: every weight in plain CPU memory")
    if mode == "on" or AMX not in names:
        why = ("--repack: llama.cpp chooses among all of them" if mode == "on"
               else "llama.cpp chooses among all of them (as llama-server's default --repack)")
        return RepackPlan(mode, bool(names), names, (), why)
    allowed = tuple(n for n in names if n != AMX)
    return RepackPlan(
        mode, bool(allowed), allowed, (AMX,),
        "the AMX buffer type is left out: it crashes llama.cpp's first decode (llama.cpp issue "
        "20824); --repack uses it anyway, --no-repack uses no extra buffer type",
    )


class _ExtraBufts:
    """The CPU backend's array of extra buffer types, as llama.cpp reads it (see the module doc)."""

    def __init__(self, lib: Any) -> None:
        def fn(name: str, restype: Any, *argtypes: Any) -> Any:
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, list(argtypes)
            return f

        vp = ctypes.c_void_p
        by_type = fn("ggml_backend_dev_by_type", vp, ctypes.c_int)
        backend_reg = fn("ggml_backend_dev_backend_reg", vp, vp)
        proc = fn("ggml_backend_reg_get_proc_address", vp, vp, ctypes.c_char_p)
        self._name = fn("ggml_backend_buft_name", ctypes.c_char_p, vp)
        dev = by_type(_GGML_BACKEND_DEVICE_TYPE_CPU)
        address = proc(backend_reg(dev), b"ggml_backend_dev_get_extra_bufts") if dev else None
        self._array: Any = None
        self.original: tuple[int, ...] = ()
        if address:
            array_ptr = ctypes.CFUNCTYPE(vp, vp)(address)(dev)
            if array_ptr:
                n = 0
                while ctypes.c_void_p.from_address(array_ptr + n * ctypes.sizeof(vp)).value:
                    n += 1
                self._array = (vp * (n + 1)).from_address(array_ptr)
                self.original = tuple(self._array[i] for i in range(n))

    def name(self, buft: int) -> str:
        raw = self._name(buft)
        return raw.decode(errors="replace") if raw else "?"

    def names(self) -> list[str]:
        return [self.name(b) for b in self.original]

    def keep(self, allowed: Sequence[str]) -> None:
        """Rewrite the array to the original entries named in `allowed` (order kept), then nulls."""
        if self._array is None:
            return
        kept = [b for b in self.original if self.name(b) in allowed]
        for i in range(len(self.original) + 1):
            self._array[i] = kept[i] if i < len(kept) else None


_lock = threading.Lock()
_bufts: _ExtraBufts | None = None


def _extra(lib: Any) -> _ExtraBufts:
    global _bufts
    if _bufts is None:
        _bufts = _ExtraBufts(lib)
    return _bufts


def available(lib: Any) -> list[str]:
    """The extra buffer types this build of llama.cpp offers on this CPU, in its order (the list as
    first read, whatever `restrict` did since)."""
    with _lock:
        return _extra(lib).names()


def restrict(lib: Any, allowed: Sequence[str]) -> None:
    """Leave llama.cpp only the `allowed` extra buffer types for the loads that follow, in this
    process (a draft model and a projector included)."""
    with _lock:
        _extra(lib).keep(allowed)


class BufferReport:
    """llama.cpp's "model buffer size" lines of one load: buffer name -> MiB. Fed by the log
    callback while a load runs (on the loading thread)."""

    def __init__(self) -> None:
        self.sizes: dict[str, float] = {}
        self.active = False

    def feed(self, text: str) -> None:
        if self.active:
            m = _BUFFER_LINE.match(text.strip())
            if m:
                self.sizes[m.group(1)] = self.sizes.get(m.group(1), 0.0) + float(m.group(2))
