"""KV cache bookkeeping: position -> cell tables, reference counts, sharing, state round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.torch_model.kv_cache import AttnGroup, KVCache

N_CELLS, N_SEQ, N_CTX_SEQ = 16, 4, 10


def new_cache(n_cells: int = N_CELLS, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(2, 2, 4, n_cells, N_SEQ, N_CTX_SEQ, dtype, torch.device("cpu"))


def put(kv: KVCache, *entries: tuple[int, int, int]) -> np.ndarray | None:
    """allocate for (seq, start, count) entries in batch order."""
    seqs, starts, counts = (np.array(x, dtype=np.int64) for x in zip(*entries, strict=True))
    return kv.allocate(seqs, starts, counts)


def refs_of(kv: KVCache, seq: int) -> list[int]:
    return kv.refs[kv.cells_of(seq)].tolist()


def check_invariants(kv: KVCache) -> None:
    """Refcounts = table references; free count; padding is the scratch cell; bitmasks agree."""
    counts = np.zeros(kv.n_cells, dtype=np.int64)
    bits = np.zeros(kv.n_cells, dtype=np.int64)
    for s in range(kv.n_seq):
        cells = kv.cells_of(s)
        assert len(set(cells.tolist())) == len(cells)
        counts[cells] += 1
        bits[cells] |= 1 << s
        assert (kv.tables[s, kv.lens[s] :] == kv.scratch_cell).all()
        assert (kv.cell_pos[cells] == np.arange(len(cells))).all()
    assert (kv.refs == counts).all()
    assert sorted(kv._free[: kv.num_free].tolist()) == np.flatnonzero(counts == 0).tolist()  # the free stack
    assert (kv.cell_seqs[:-1] == bits).all()


def test_allocate_appends_to_tables() -> None:
    kv = new_cache()
    cells = put(kv, (0, 0, 3), (2, 0, 1), (1, 0, 2))
    assert cells is not None and len(set(cells.tolist())) == 6
    assert kv.cells_of(0).tolist() == cells[:3].tolist()
    assert kv.cells_of(2).tolist() == cells[3:4].tolist()
    assert kv.cells_of(1).tolist() == cells[4:].tolist()
    assert kv.lens.tolist() == [3, 2, 1, 0]
    assert kv.num_free == N_CELLS - 6
    # Two entries of one sequence in one batch: the second continues the first.
    cells = put(kv, (0, 3, 2), (1, 2, 1), (0, 5, 1))
    assert cells is not None
    assert kv.cells_of(0)[3:].tolist() == [cells[0], cells[1], cells[3]]
    assert kv.lens.tolist() == [6, 3, 1, 0]
    check_invariants(kv)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([(0, 1, 2)], "appended at position 0"),  # a gap
        ([(0, 0, 2), (0, 3, 1)], "appended at position 2"),  # a gap after an earlier entry
        ([(1, 0, 11)], "exceed 10 positions"),
        ([(4, 0, 1)], "out of range"),
        ([(-1, 0, 1)], "out of range"),
    ],
)
def test_allocate_rejects_bad_entries(entries: list[tuple[int, int, int]], message: str) -> None:
    kv = new_cache()
    with pytest.raises(ValueError, match=message):
        put(kv, *entries)
    assert kv.num_free == N_CELLS and not kv.lens.any()


def test_allocate_fails_whole_when_the_pool_is_full() -> None:
    kv = new_cache()
    assert put(kv, (0, 0, 10), (1, 0, 4)) is not None
    before = (kv.tables.copy(), kv.refs.copy(), kv.lens.copy())
    assert put(kv, (2, 0, 1), (3, 0, 2)) is None
    assert all((a == b).all() for a, b in zip(before, (kv.tables, kv.refs, kv.lens), strict=True))
    assert put(kv, (2, 0, 2)) is not None and kv.num_free == 0


def test_seq_rm_drops_tails_and_whole_sequences() -> None:
    kv = new_cache()
    put(kv, (0, 0, 5), (1, 0, 3), (2, 0, 2))
    kv.seq_rm(0, 3)
    assert kv.lens.tolist() == [3, 3, 2, 0] and kv.num_free == N_CELLS - 8
    kv.seq_rm(0, 7)  # past the end: nothing
    kv.seq_rm(1, 0)
    assert kv.lens.tolist() == [3, 0, 2, 0] and kv.num_free == N_CELLS - 5
    check_invariants(kv)
    # Appending resumes at the new length, into fresh cells.
    assert put(kv, (0, 3, 2)) is not None and kv.lens[0] == 5
    kv.seq_rm(-1, 1)
    assert kv.lens.tolist() == [1, 0, 1, 0]
    kv.clear()
    assert kv.num_free == N_CELLS and not kv.lens.any()
    check_invariants(kv)


def test_seq_cp_shares_cells_and_appends_diverge() -> None:
    kv = new_cache()
    put(kv, (0, 0, 6), (2, 0, 3))
    free = kv.num_free
    kv.seq_cp(0, 1, 4)
    kv.seq_cp(0, 2, 4)  # dst's own cells are released first
    assert kv.num_free == free + 3  # no cell used, seq 2's three released
    assert kv.cells_of(1).tolist() == kv.cells_of(2).tolist() == kv.cells_of(0)[:4].tolist()
    assert refs_of(kv, 0) == [3, 3, 3, 3, 1, 1]
    check_invariants(kv)
    # Copy-on-write: appends after the shared prefix take fresh cells.
    cells = put(kv, (1, 4, 1), (2, 4, 1))
    assert cells is not None and not set(cells.tolist()) & set(kv.cells_of(0).tolist())
    # A sequence's prefix outlives the sequence it was copied from.
    kv.seq_rm(0, 0)
    assert refs_of(kv, 1) == [2, 2, 2, 2, 1]
    kv.seq_rm(1, 2)
    assert refs_of(kv, 2) == [2, 2, 1, 1, 1]
    kv.seq_rm(2, 0)
    kv.seq_rm(1, 0)
    assert kv.num_free == N_CELLS
    check_invariants(kv)


def test_seq_cp_onto_itself_truncates_and_checks_the_length() -> None:
    kv = new_cache()
    put(kv, (0, 0, 5))
    kv.seq_cp(0, 0, 3)
    assert kv.lens[0] == 3 and kv.num_free == N_CELLS - 3
    with pytest.raises(ValueError, match="holds 3 positions"):
        kv.seq_cp(0, 1, 4)
    kv.seq_cp(2, 1, 0)  # an empty copy empties dst
    assert kv.lens[1] == 0
    check_invariants(kv)


def test_state_round_trip_into_fresh_cells() -> None:
    kv = new_cache()
    put(kv, (0, 0, 3), (1, 0, 5))
    kv.seq_cp(1, 2, 4)
    rows = torch.arange(kv.k[:, :-1].numel(), dtype=torch.float32).view_as(kv.k[:, :-1])
    kv.k[:, :-1], kv.v[:, :-1] = rows, -rows
    want_k, want_v = kv.k[:, kv.cells_of(2)].clone(), kv.v[:, kv.cells_of(2)].clone()
    state = kv.state_get(2)
    assert state is not None
    kv.seq_rm(2, 0)
    kv.seq_rm(1, 0)
    kv.k.zero_()
    kv.v.zero_()
    assert kv.state_set(3, state)
    assert kv.lens[3] == 4
    assert torch.equal(kv.k[:, kv.cells_of(3)], want_k) and torch.equal(kv.v[:, kv.cells_of(3)], want_v)
    check_invariants(kv)
    assert kv.state_get(1) is None  # empty


def test_state_set_fails_without_room_and_rejects_other_shapes() -> None:
    kv = new_cache()
    put(kv, (0, 0, 8))
    state = kv.state_get(0)
    assert state is not None
    put(kv, (1, 0, 7))
    assert not kv.state_set(2, state)  # 1 free cell, 8 needed
    assert kv.lens[2] == 0 and kv.num_free == 1
    with pytest.raises(ValueError, match="another model"):
        new_cache(dtype=torch.bfloat16).state_set(0, state)
    with pytest.raises(ValueError, match="truncated"):
        new_cache().state_set(0, state[:-4])


def test_plan_rows_and_sdpa_groups() -> None:
    kv = new_cache()
    put(kv, (0, 0, 4), (1, 0, 2))
    seqs, starts, counts = np.array([1, 0, 2]), np.array([2, 4, 0]), np.array([1, 3, 1])
    assert put(kv, *zip(seqs.tolist(), starts.tolist(), counts.tolist(), strict=True)) is not None
    plan = kv.plan(seqs, starts, counts, group=2, window=None, sdpa=True)
    assert plan.row_seq.tolist() == [1, 0, 0, 0, 2]
    assert plan.row_pos.tolist() == [2, 4, 5, 6, 0]
    assert plan.tables.data_ptr() == kv.tables.ctypes.data  # the kernel reads the live tables
    single, piece = plan.groups
    assert isinstance(single, AttnGroup) and single.cells is not None
    assert single.rows.tolist() == [0, 4]  # type: ignore[union-attr]
    assert single.cells.tolist() == [kv.tables[1, :3].tolist(), kv.tables[2, :3].tolist()]
    assert single.cells[1, 1:].tolist() == [kv.scratch_cell] * 2  # padding, masked by position
    assert single.mask.shape == (2, 1, 2, 3) and single.mask[1, 0, :, 1:].sum() == 0
    assert piece.rows == slice(1, 4) and piece.cells is not None
    assert piece.cells.tolist() == [kv.cells_of(0).tolist()]
    assert piece.mask.shape == (1, 1, 6, 7)
    assert not kv.plan(seqs, starts, counts, group=2, window=None, sdpa=False).groups
