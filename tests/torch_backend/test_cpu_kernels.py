"""The fused CPU kernels (worker/torch_model/cpu_kernels.c) against the torch ops they replace.

The model-level parity tests (test_model.py) run both paths against transformers; these pin
each kernel on shapes the tiny models do not reach: every specialised GQA group size and a
generic one, head sizes 16-128, long and padded key lists, sliding windows, a subset of rows
of a mixed batch, and multi-threaded (large) inputs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.torch_model import cpu_kernels
from worker.torch_model.cpu_kernels import Kernels
from worker.torch_model.kv_cache import _FAR, position_mask
from worker.torch_model.model import apply_rope, rms_norm

TOL = 2e-5
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: to 2e-5. bfloat16: the kernels round where torch rounds, so they agree but for
    the odd last-bit difference from a float sum taken in another order."""
    assert got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=TOL, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


@pytest.fixture(scope="module")
def kern() -> Kernels:
    k = cpu_kernels.load()
    assert k is not None, "the fused CPU kernels did not build (is a C compiler installed?)"
    return k


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 768 crosses the multi-thread threshold
def test_rms_norm(kern: Kernels, rows: int, dtype: torch.dtype) -> None:
    g = rng(rows)
    x, w = (torch.randn(rows, 770, generator=g) * 3).to(dtype), torch.randn(770, generator=g).to(dtype)
    close(kern.rms_norm(x, w, 1e-5, 2), rms_norm(x, w, 1e-5))  # 770: a vector tail


@DTYPES
@pytest.mark.parametrize(("rows", "width"), [(1, 40), (5, 1536), (64, 1100)])  # 1100: a vector tail
def test_silu_mul(kern: Kernels, rows: int, width: int, dtype: torch.dtype) -> None:
    gu = (torch.randn(rows, 2 * width, generator=rng(width)) * 6).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    close(kern.silu_mul(gu, 2), F.silu(gate) * up)


@DTYPES
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("h", "kvh", "d", "t"), [(12, 4, 64, 5), (8, 8, 32, 1), (4, 2, 128, 200)])
def test_rope_store(kern: Kernels, qk_norm: bool, h: int, kvh: int, d: int, t: int, dtype: torch.dtype) -> None:
    g = rng(h * d + t)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    qkv = randn(t, (h + 2 * kvh) * d)
    cos_t, sin_t = randn(300, d), randn(300, d)
    positions = torch.randint(0, 300, (t,), generator=g)
    cells = torch.randperm(400, generator=g)[:t]
    qn = randn(d) if qk_norm else None
    kn = randn(d) if qk_norm else None
    k_cache, v_cache = torch.zeros(401, kvh, d, dtype=dtype), torch.zeros(401, kvh, d, dtype=dtype)

    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.reshape(t, h, d), k.reshape(t, kvh, d)
    if qn is not None and kn is not None:
        q, k = rms_norm(q, qn, 1e-6), rms_norm(k, kn, 1e-6)
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    want_q, want_k, want_v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(t, kvh, d).clone()

    kern.rope_store(qkv, h, kvh, d, cos_t, sin_t, positions, cells, k_cache, v_cache, qn, kn, 1e-6, 2)
    close(qkv[:, : h * d].view(t, h, d), want_q)
    close(k_cache[cells], want_k)
    assert torch.equal(v_cache[cells], want_v)
    untouched = torch.ones(401, dtype=torch.bool)
    untouched[cells] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cells: torch.Tensor, cell_pos: torch.Tensor,
    q_pos: torch.Tensor, window: int | None,
) -> torch.Tensor:
    """What model._attend computes for a single-token group: gather + SDPA under position_mask."""
    b, n_heads, d = q.shape
    kvh = k_cache.shape[1]
    group = n_heads // kvh
    k = k_cache[cells].transpose(1, 2)
    v = v_cache[cells].transpose(1, 2)
    mask = position_mask(cell_pos, q_pos[:, None], group, window)
    out = F.scaled_dot_product_attention(q.view(b, kvh, group, d), k, v, attn_mask=mask)
    return out.reshape(b, n_heads * d)


@DTYPES
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("h", "kvh", "d"),
    [(4, 4, 64), (4, 2, 16), (12, 4, 64), (8, 2, 128), (10, 2, 32), (14, 2, 64), (32, 4, 64), (24, 2, 32)],
    ids=lambda v: str(v),
)  # groups 1, 2, 3, 4, 5, 7, 8 (specialised) and 12 (generic)
def test_decode_attention(kern: Kernels, h: int, kvh: int, d: int, window: int | None, dtype: torch.dtype) -> None:
    g = rng(h * 100 + kvh * 10 + d)
    n_cells, b, width = 600, 6, 70
    k_cache = torch.randn(n_cells + 1, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(n_cells + 1, kvh, d, generator=g).to(dtype)
    lens = [1, 3, 17, 33, 64, 70]  # padded to width with the scratch cell at a far position
    cells = torch.full((b, width), n_cells, dtype=torch.long)
    cell_pos = torch.full((b, width), _FAR, dtype=torch.long)
    q_pos = torch.empty(b, dtype=torch.long)
    for i, n in enumerate(lens):
        cells[i, :n] = torch.randperm(n_cells, generator=g)[:n]
        cell_pos[i, :n] = torch.randperm(n, generator=g)  # cell order need not follow position
        q_pos[i] = n - 1
    cell_pos[4, 10] = 90  # a cell past its row's position (a stale tail) must not count
    # Rows 1, 3, 4, 6, 8, 9 of a 10-row step (the others would be prompt-chunk tokens).
    rows = torch.tensor([1, 3, 4, 6, 8, 9])
    qkv = torch.randn(10, (h + 2 * kvh) * d, generator=g).to(dtype)
    out = torch.full((10, h * d), 7.0, dtype=dtype)
    kern.decode_attn(out, qkv, qkv.stride(0), rows, h, kvh, d, k_cache, v_cache, cells, cell_pos, q_pos, window, 2)
    q = qkv[rows, : h * d].reshape(b, h, d)
    close(out[rows], reference_attention(q, k_cache, v_cache, cells, cell_pos, q_pos, window))
    others = torch.tensor([0, 2, 5, 7])
    assert torch.equal(out[others], torch.full((4, h * d), 7.0, dtype=dtype))


def test_decode_attention_long_keys_one_thread(kern: Kernels) -> None:
    g = rng(5)
    k_cache, v_cache = torch.randn(5001, 2, 64, generator=g), torch.randn(5001, 2, 64, generator=g)
    cells = torch.randperm(5000, generator=g)[:4000].view(1, 4000)
    cell_pos = torch.arange(4000).view(1, 4000)
    q_pos = torch.tensor([3999])
    qkv = torch.randn(1, 8 * 64, generator=g) * 4  # peaky scores: the softmax max matters
    out = torch.empty(1, 4 * 64)
    kern.decode_attn(out, qkv, qkv.stride(0), torch.tensor([0]), 4, 2, 64, k_cache, v_cache, cells, cell_pos, q_pos, None, 1)
    want = reference_attention(qkv[:, : 4 * 64].view(1, 4, 64), k_cache, v_cache, cells, cell_pos, q_pos, None)
    torch.testing.assert_close(out, want, atol=TOL, rtol=1e-5)


def test_usable_shapes() -> None:
    cpu = torch.device("cpu")
    assert cpu_kernels.usable(cpu, torch.float32, 12, 4, 64)
    assert cpu_kernels.usable(cpu, torch.bfloat16, 12, 4, 64)
    assert not cpu_kernels.usable(cpu, torch.float16, 12, 4, 64)
    assert not cpu_kernels.usable(cpu, torch.float32, 12, 4, 72)  # not a multiple of the vector width
    assert not cpu_kernels.usable(torch.device("meta"), torch.float32, 12, 4, 64)


def test_a_failed_build_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.build() is None
    assert "failed to build" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_the_build_is_cached_by_content(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build()
    assert first is not None
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    second = cpu_kernels.build()
    assert second is not None and second.path == first.path
    assert built[0].stat().st_mtime_ns == mtime
