"""Fused CPU kernels (float32, bfloat16) for the layers, compiled at run time, called via ctypes.

Why: on the CPU a decode step over a few rows is matmuls (weight-bandwidth bound, oneDNN) plus
~45 small torch ops per layer, each costing 3-15 us of dispatch for almost no arithmetic, and
an attention (index_select gathers + SDPA) that costs ~350 us per layer for 8 rows of ~100
cells: SDPA's CPU kernel is built for long queries. `cpu_kernels.c` replaces them with four
kernels: RMSNorm, RoPE + KV store, SiLU*up, and attention.

Attention (`omni_attn`) computes every row of a step, prompt rows and decode rows alike, each
reading its own sequence's cells straight from the pool through the sequence's position ->
cell table (no gather copies), in position order and with an order of reduction that depends
on the row's position only. So a row's result is bitwise the same whatever else is in the
batch, however its prompt was cut into pieces, and whether its prefix cells are shared with
another sequence: the fused path is batch invariant (with oneDNN's row-invariant matmuls, see
model.py). Consecutive rows of one sequence (a prompt piece) share each pass over its K/V, so
a 1000-token prefill runs about as fast as SDPA.

Build: `cc -O3 -march=native -fopenmp -shared` on first use, cached under
`$OMNI_KERNEL_CACHE` (default `~/.cache/omni-router/kernels`, else a per-user temp dir) by a hash
of the source, the flags, the compiler's version and the CPU's feature flags; written to a temp file
and renamed, so workers starting together do not race. Loaded after torch, the library's OpenMP calls bind to
the libgomp torch ships (same soname): one thread pool.

Fallback: no compiler, a failed build, `OMNI_CPU_KERNELS=0`, float16 or odd head shapes, and
the model runs its plain torch ops instead (same results to float rounding; the
tests check both ways).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC"]
MAX_HEAD_DIM = 512  # per-head scratch in omni_rope_store
HEAD_DIM_MULTIPLE = 16  # the widest vector the kernels work in (AVX-512: 16 floats)

_p, _i64, _int, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "omni_rms_norm": [_p, _i64, _p, _i64, _p, _i64, _i64, _f, _int, _int],
    "omni_rope_store": [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p, _p, _p, _f, _int, _int],
    "omni_silu_mul": [_p, _p, _i64, _i64, _int, _int],
    "omni_attn": [
        _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i64, _f, _int, _int,
    ],
}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    if env := os.environ.get("OMNI_KERNEL_CACHE"):
        return Path(env)
    home = Path.home() / ".cache" / "omni-router" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:  # a read-only or missing home
        return Path(tempfile.gettempdir()) / f"omni-router-kernels-{os.getuid()}"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()]))
    cache_dir = _cache_dir()
    lib = cache_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=True
        )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _bf(t: Tensor) -> int:
    """The kernels' storage-type flag: 1 for bfloat16, 0 for float32."""
    return 1 if t.dtype == torch.bfloat16 else 0


class Kernels:
    """The compiled library. `short` calls keep the GIL (a few us of work: releasing and
    re-taking it would cost more); attention releases it.

    The kernels read raw pointers: tensors must be CPU, float32 or bfloat16 (all of one call the
    same), rows contiguous (stride 1 in the last dimension), index tensors int64 and contiguous.
    Model.forward_fused is the one caller, and passes exactly that."""

    def __init__(self, path: Path) -> None:
        short, long = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))
        for lib in (short, long):
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = args
                fn.restype = None
        self.path = path
        self._rms_norm = short.omni_rms_norm
        self._rope_store = short.omni_rope_store
        self._silu_mul = short.omni_silu_mul
        self._attn = long.omni_attn

    def rms_norm(self, x: Tensor, w: Tensor, eps: float, nt: int) -> Tensor:
        t, n = x.shape
        out = torch.empty((t, n), dtype=x.dtype)
        self._rms_norm(out.data_ptr(), n, x.data_ptr(), x.stride(0), w.data_ptr(), t, n, eps, nt, _bf(x))
        return out

    def rope_store(
        self, qkv: Tensor, n_heads: int, n_kv_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
        positions: Tensor, cells: Tensor, k_cache: Tensor, v_cache: Tensor, q_norm: Tensor | None,
        k_norm: Tensor | None, eps: float, nt: int,
    ) -> None:
        """RoPE on q (in place in qkv) and k (into k_cache[cells]); v copied into v_cache[cells].
        q_norm/k_norm: per-head RMSNorm weights applied first (Qwen3), or None."""
        self._rope_store(
            qkv.data_ptr(),
            qkv.shape[0],
            qkv.stride(0),
            n_heads,
            n_kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            cells.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
            nt,
            _bf(qkv),
        )

    def silu_mul(self, gate_up: Tensor, nt: int) -> Tensor:
        t, n2 = gate_up.shape
        out = torch.empty((t, n2 // 2), dtype=gate_up.dtype)
        self._silu_mul(out.data_ptr(), gate_up.data_ptr(), t, n2 // 2, nt, _bf(gate_up))
        return out

    def attn(
        self, out: Tensor, q: Tensor, n_heads: int, n_kv_heads: int, head_dim: int, k_cache: Tensor,
        v_cache: Tensor, tables: Tensor, row_seq: Tensor, row_pos: Tensor, window: int | None, nt: int,
    ) -> None:
        """Attention of every row of q (q heads first in each row, any row stride) into out: row t
        over the cells tables[row_seq[t], 0..row_pos[t]] (see omni_attn in cpu_kernels.c)."""
        self._attn(
            out.data_ptr(),
            out.stride(0),
            q.data_ptr(),
            q.stride(0),
            q.shape[0],
            n_heads,
            n_kv_heads,
            head_dim,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            row_seq.data_ptr(),
            row_pos.data_ptr(),
            window or 0,
            head_dim**-0.5,
            nt,
            _bf(q),
        )


@cache
def load() -> Kernels | None:
    """The kernels, built if needed; None (logged once per process) when they cannot be used."""
    if os.environ.get("OMNI_CPU_KERNELS", "1") == "0":
        return None
    return build()


def build() -> Kernels | None:
    """`load` without the process-wide cache (tests build with other compilers)."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: the torch backend runs without its fused CPU kernels")
        return None
    try:
        return Kernels(_build(cc))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("fused CPU kernels failed to build (%s); running plain torch ops", detail.strip()[:500])
        return None


def usable(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether a model of this shape can run on the kernels (the library itself may still fail)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and n_heads % n_kv_heads == 0
        and head_dim % HEAD_DIM_MULTIPLE == 0
        and head_dim <= MAX_HEAD_DIM
    )
