"""The fused CPU kernels (worker/torch_model/cpu_kernels.c) against the torch ops they replace.

The model-level parity tests (test_model.py) run both paths against transformers; these pin
each kernel on shapes the tiny models do not reach: GQA group sizes 1-12, head sizes 16-128,
long and scattered key lists, sliding windows, mixed batches of prompt and decode rows, and
multi-threaded (large) inputs; and that an attention row is bitwise the same however it is
batched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.torch_model import cpu_kernels
from worker.torch_model.cpu_kernels import Kernels
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
def test_rope_store(
    kern: Kernels, qk_norm: bool, h: int, kvh: int, d: int, t: int, dtype: torch.dtype
) -> None:
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
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Row by row: the row's table entries 0..p gathered, SDPA under the window (float32)."""
    t, n_heads, d = q.shape
    kvh = k_cache.shape[1]
    out = []
    for i in range(t):
        p = int(row_pos[i])
        cells = tables[row_seq[i], : p + 1]
        k, v = k_cache[cells].float().transpose(0, 1), v_cache[cells].float().transpose(0, 1)
        mask = torch.ones(p + 1, dtype=torch.bool)
        if window is not None:
            mask[: max(p - window + 1, 0)] = False
        qi = q[i].float().view(kvh, n_heads // kvh, d)
        out.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask).reshape(n_heads * d))
    return torch.stack(out).to(q.dtype)


def attention_case(
    h: int, kvh: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of 4 sequences with scattered cells: a 40-row prompt piece of seq 0 (positions
    30..69), decode rows of seqs 1-3 (one of them at position 0), a 3-row piece of seq 1 that
    follows its own decode row, and a row of seq 2 at the position of an already-decoded one.
    Returns qkv, k_cache, v_cache, tables, row_seq, row_pos."""
    g = rng(seed)
    n_cells, width = 600, 80
    k_cache = torch.randn(n_cells + 1, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(n_cells + 1, kvh, d, generator=g).to(dtype)
    tables = torch.full((4, width), n_cells, dtype=torch.long)
    perm = torch.randperm(n_cells, generator=g)
    for s, n in enumerate([70, 24, 18, 1]):
        tables[s, :n] = perm[s * 80 : s * 80 + n]
    row_seq = torch.tensor([0] * 40 + [1, 2, 3, 1, 1, 1, 2])
    row_pos = torch.tensor([*range(30, 70), 20, 17, 0, 21, 22, 23, 9])
    qkv = torch.randn(len(row_seq), (h + 2 * kvh) * d, generator=g).to(dtype)
    return qkv, k_cache, v_cache, tables, row_seq, row_pos


@DTYPES
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("h", "kvh", "d"),
    [
        (4, 4, 64),
        (4, 2, 16),
        (12, 4, 64),
        (8, 2, 128),
        (10, 2, 32),
        (14, 2, 64),
        (32, 4, 64),
        (24, 2, 32),
        (6, 2, 80),
    ],
    ids=lambda v: str(v),
)  # groups 1, 2, 3, 4, 5, 7, 8 and 12; head size 80: a partial output chunk
def test_attention(kern: Kernels, h: int, kvh: int, d: int, window: int | None, dtype: torch.dtype) -> None:
    qkv, k_cache, v_cache, tables, row_seq, row_pos = attention_case(h, kvh, d, dtype, h * 100 + kvh * 10 + d)
    out = torch.full((len(row_seq), h * d), 7.0, dtype=dtype)
    kern.attn(out, qkv, h, kvh, d, k_cache, v_cache, tables, row_seq, row_pos, window, 2)
    q = qkv[:, : h * d].reshape(-1, h, d)
    close(out, reference_attention(q, k_cache, v_cache, tables, row_seq, row_pos, window))


@DTYPES
@pytest.mark.parametrize("window", [None, 5])
def test_attention_rows_are_batch_invariant(kern: Kernels, window: int | None, dtype: torch.dtype) -> None:
    """Each row computed alone, in another order, from a table whose cells are copies elsewhere,
    or at another row stride: bitwise what it is in the mixed batch."""
    h, kvh, d = 12, 4, 64
    qkv, k_cache, v_cache, tables, row_seq, row_pos = attention_case(h, kvh, d, dtype, 3)
    out = torch.empty(len(row_seq), h * d, dtype=dtype)
    kern.attn(out, qkv, h, kvh, d, k_cache, v_cache, tables, row_seq, row_pos, window, 2)
    for t in range(len(row_seq)):
        one = torch.empty(1, h * d, dtype=dtype)
        kern.attn(
            one,
            qkv[t : t + 1],
            h,
            kvh,
            d,
            k_cache,
            v_cache,
            tables,
            row_seq[t : t + 1],
            row_pos[t : t + 1],
            window,
            1,
        )
        assert torch.equal(one[0], out[t]), t
    order = torch.randperm(len(row_seq), generator=rng(4))
    shuffled = torch.empty_like(out)
    kern.attn(
        shuffled, qkv[order], h, kvh, d, k_cache, v_cache, tables, row_seq[order], row_pos[order], window, 2
    )
    assert torch.equal(shuffled, out[order])
    # Seq 0's cells copied to new cells (what a restored state reads).
    n = k_cache.shape[0]
    moved = tables.clone()
    moved[0, :70] = torch.arange(n, n + 70)
    k_cache, v_cache = (
        torch.cat([k_cache, k_cache[tables[0, :70]]]),
        torch.cat([v_cache, v_cache[tables[0, :70]]]),
    )
    again = torch.empty_like(out)
    kern.attn(again, qkv.clone(), h, kvh, d, k_cache, v_cache, moved, row_seq, row_pos, window, 2)
    assert torch.equal(again, out)


def test_attention_long_keys_one_thread(kern: Kernels) -> None:
    g = rng(5)
    k_cache, v_cache = torch.randn(5001, 2, 64, generator=g), torch.randn(5001, 2, 64, generator=g)
    tables = torch.full((1, 4000), 5000, dtype=torch.long)
    tables[0] = torch.randperm(5000, generator=g)[:4000]
    row_seq, row_pos = torch.tensor([0, 0]), torch.tensor([3999, 2500])
    qkv = torch.randn(2, 8 * 64, generator=g) * 4  # peaky scores: the softmax max matters
    out = torch.empty(2, 4 * 64)
    kern.attn(out, qkv, 4, 2, 64, k_cache, v_cache, tables, row_seq, row_pos, None, 1)
    want = reference_attention(
        qkv[:, : 4 * 64].view(2, 4, 64), k_cache, v_cache, tables, row_seq, row_pos, None
    )
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
