"""The KV cache: a pool of cells, per-sequence position -> cell tables, and a reference count per cell.

Why tables: a sequence's positions are always 0..n-1, and `tables[s, j]` is the cell holding
position j of sequence s. Attention reads a sequence's cells through its table, in position
order, so a row's arithmetic never depends on where its cells lie in the pool or on what other
sequences hold (worker/torch_model/cpu_kernels.c: the fused kernel is batch invariant).

Why reference counts: `seq_cp(src, dst, n)` points dst's table at src's first n cells (each
gets one more reference) instead of copying K/V. Tokens are only ever appended (at position ==
the sequence's length) into fresh cells, so two sequences that share a prefix and then diverge
write their own cells: copy-on-write without a copy. `seq_rm` drops references; a cell with
none is free. A shared cell holds the same position in every sequence that holds it.

Sizes: `n_cells` in all; a sequence holds at most `n_ctx_seq`. The backend sizes the pool so
that, with a KV stream per sequence (kv_unified off), every sequence can fill its share at
once; with a unified pool they compete, and `allocate` returning None is the engine's
NO_KV_SPACE. Bookkeeping is numpy on the host, a few vectorised array ops per step: free cells
are a stack (allocation costs the tokens allocated, not the pool size), and a decode step (one
token per sequence) takes a shortcut through the table updates.

K and V are [layers, n_cells + 1, kv_heads, head_dim], cell-major: a token's K/V is one
contiguous row, so writing a step's tokens and gathering cells are plain row copies. The extra
last cell is scratch: it pads tables (entries past a sequence's length point at it), padded
gathers read it (masked by position), and padded rows of CUDA-graph batches write and read it.
It is never handed out.

`cell_pos` and `cell_seqs` (a bitmask of the sequences holding each cell) describe the pool
cell by cell, for the CUDA-graph path (worker/torch_model/cuda_graphs.py), which attends over
the whole pool with a mask instead of gathering.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MAX_MASK_SEQS = 62  # sequences that fit the int64 `cell_seqs` bitmask, plus one bit for the scratch cell


def round16(n: int) -> int:
    return (n + 15) & ~15


@dataclass(slots=True)
class AttnGroup:
    """For the SDPA path: query rows `rows` (B x Tq of them, sequence-major) attend keys `cells`
    [B, L] under `mask` (bool [B, 1, group * Tq, L], query rows head-group-major, see
    model.attention). cells None means the pool prefix [0, L) itself (no gather, B = 1)."""

    rows: Tensor | slice
    cells: Tensor | None
    mask: Tensor


@dataclass(slots=True)
class AttnPlan:
    """How the rows of one step attend, shared by all layers.

    The fused CPU kernel reads `tables` (the KV cache's own array, not a copy), `row_seq` and
    `row_pos` (each row's sequence and position); the torch path runs `groups` through SDPA."""

    tables: Tensor
    row_seq: Tensor
    row_pos: Tensor
    groups: list[AttnGroup]


def position_mask(key_pos: Tensor, q_pos: Tensor, group: int, window: int | None) -> Tensor:
    """key_pos [B, L], q_pos [B, Tq] -> bool [B, 1, group*Tq, L]: key position <= query position."""
    mask = key_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
    return (mask.repeat(1, group, 1) if group > 1 else mask).unsqueeze(1)


def pool_mask(
    cell_seqs: Tensor, cell_pos: Tensor, row_seq: Tensor, row_pos: Tensor, group: int, window: int | None
) -> Tensor:
    """Whole-pool form: bool [1, 1, group*T, n]: row t attends cell c iff c belongs to row t's
    sequence (bit row_seq[t] of cell_seqs[c]) and the position rule holds."""
    mask = ((cell_seqs[None, :] >> row_seq[:, None]) & 1).bool() & (cell_pos[None, :] <= row_pos[:, None])
    if window is not None:
        mask &= cell_pos[None, :] > row_pos[:, None] - window
    return (mask.repeat(group, 1) if group > 1 else mask)[None, None]


class KVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, n_cells: int, n_seq: int, n_ctx_seq: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, n_cells + 1, num_kv_heads, head_dim)
        self.n_cells = n_cells
        self.n_seq = n_seq
        self.n_ctx_seq = n_ctx_seq
        self.device = device
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Width: a multiple of 16 covering n_ctx_seq (the kernel reads entries up to a row's
        # position rounded up; the padding is the scratch cell).
        self.tables = np.full((n_seq, round16(n_ctx_seq)), self.scratch_cell, dtype=np.int64)
        self.lens = np.zeros(n_seq, dtype=np.int64)
        self.refs = np.zeros(n_cells, dtype=np.int32)
        # Free cells as a stack (top: the end of _free[:num_free]); cell 0 is handed out first.
        self._free = np.arange(n_cells - 1, -1, -1, dtype=np.int64)
        self.num_free = n_cells
        self.cell_pos = np.zeros(n_cells + 1, dtype=np.int64)
        self.cell_seqs = np.zeros(n_cells + 1, dtype=np.int64)  # bit s: sequence s holds the cell
        if n_seq <= MAX_MASK_SEQS:
            self.cell_seqs[self.scratch_cell] = 1 << n_seq  # padded CUDA-graph rows use "sequence" n_seq

    @property
    def scratch_cell(self) -> int:
        return self.n_cells

    @property
    def has_seq_masks(self) -> bool:
        return self.n_seq <= MAX_MASK_SEQS

    def cells_of(self, seq: int) -> np.ndarray:
        """The cells of `seq`, in position order (a view)."""
        return self.tables[seq, : self.lens[seq]]

    # -- bookkeeping --------------------------------------------------------------------------

    def allocate(self, seqs: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
        """Append counts[i] tokens at positions starts[i].. to sequence seqs[i] (entries in batch
        order; a sequence may have several) and return each token's new cell, in batch order.
        None, changing nothing, if the pool has too few free cells. ValueError if an entry does
        not start at its sequence's length or would take it past n_ctx_seq."""
        if len(seqs) == 0:
            return np.empty(0, dtype=np.int64)
        if seqs.min() < 0 or seqs.max() >= self.n_seq:
            raise ValueError(f"sequence id out of range [0, {self.n_seq})")
        unique = np.bincount(seqs, minlength=self.n_seq).max() == 1
        expected = self.lens[seqs] if unique else self._expected_starts(seqs, counts)
        if not np.array_equal(starts, expected):
            bad = int(np.flatnonzero(starts != expected)[0])
            raise ValueError(
                f"sequence {int(seqs[bad])}: tokens must be appended at position {int(expected[bad])}, "
                f"not {int(starts[bad])}"
            )
        ends = starts + counts
        if ends.max() > self.n_ctx_seq:
            raise ValueError(f"sequence {int(seqs[np.argmax(ends)])} would exceed {self.n_ctx_seq} positions")
        n = int(ends[-1] - starts[-1]) if len(seqs) == 1 else int(counts.sum())
        if n > self.num_free:
            return None
        cells = self._free[self.num_free - n : self.num_free][::-1].copy()  # the stack's top, lowest first
        self.num_free -= n
        if (counts == 1).all():  # a decode step
            token_seq, positions = seqs, starts
        else:
            token_seq = np.repeat(seqs, counts)
            positions = np.arange(n, dtype=np.int64) + np.repeat(
                starts - (np.cumsum(counts) - counts), counts
            )
        self.refs[cells] = 1
        self.tables[token_seq, positions] = cells
        if unique:
            self.lens[seqs] = ends
        else:
            np.maximum.at(self.lens, seqs, ends)
        self.cell_pos[cells] = positions
        if self.has_seq_masks:
            self.cell_seqs[cells] = np.left_shift(1, token_seq)  # a free cell has no bits
        return cells

    def _expected_starts(self, seqs: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Where each entry must start when a sequence has several: its length plus the tokens of
        its earlier entries (batch order)."""
        order = np.argsort(seqs, kind="stable")
        s, c = seqs[order], counts[order]
        before = np.cumsum(c) - c
        first = np.ones(len(s), dtype=bool)
        first[1:] = s[1:] != s[:-1]
        before -= np.maximum.accumulate(np.where(first, before, 0))
        expected = np.empty_like(seqs)
        expected[order] = self.lens[s] + before
        return expected

    def seq_rm(self, seq: int, p0: int) -> None:
        """Drop positions >= p0 of `seq` (seq < 0: of every sequence)."""
        p0 = max(p0, 0)
        for s in range(self.n_seq) if seq < 0 else (seq,):
            n = int(self.lens[s])
            if p0 >= n:
                continue
            self._release(self.tables[s, p0:n], s)
            self.tables[s, p0:n] = self.scratch_cell
            self.lens[s] = p0

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        """Make `dst` hold exactly `src`'s positions [0, n): the same cells, one more reference each."""
        if not 0 <= n <= self.lens[src]:
            raise ValueError(f"seq_cp: sequence {src} holds {int(self.lens[src])} positions, not {n}")
        if src == dst:
            self.seq_rm(dst, n)
            return
        cells = self.tables[src, :n].copy()
        self.refs[cells] += 1  # before dst lets go of its own: they may be the same cells
        self.seq_rm(dst, 0)
        self.tables[dst, :n] = cells
        self.lens[dst] = n
        self._set_bits(cells, np.full(n, dst))

    def clear(self) -> None:
        self.seq_rm(-1, 0)

    def claim(self, seq: int, n: int) -> np.ndarray | None:
        """n fresh cells as positions [0, n) of the empty `seq` (their contents are the caller's)."""
        return self.allocate(np.array([seq]), np.zeros(1, dtype=np.int64), np.array([n]))

    def _release(self, cells: np.ndarray, seq: int) -> None:
        """Drop one reference of each of `cells` (distinct: one sequence's) held by `seq`."""
        self.refs[cells] -= 1
        freed = cells[self.refs[cells] == 0]
        self._free[self.num_free : self.num_free + len(freed)] = freed[::-1]  # popped in position order
        self.num_free += len(freed)
        if self.has_seq_masks:
            self.cell_seqs[cells] &= ~(1 << seq)

    def _set_bits(self, cells: np.ndarray, seqs: np.ndarray) -> None:
        if self.has_seq_masks:
            self.cell_seqs[cells] |= np.left_shift(1, seqs)

    # -- attention plan -------------------------------------------------------------------------

    def plan(
        self, seqs: np.ndarray, starts: np.ndarray, counts: np.ndarray, group: int, window: int | None,
        sdpa: bool,
    ) -> AttnPlan:
        """The attention plan of one batch (entries: sequence, first position, token count) whose
        cells `allocate` has just claimed. With `sdpa`, also the groups of the torch path:
          - all single-token entries (decoding rows) form one group: B rows, keys gathered from
            their tables up to the furthest position among them;
          - each multi-token entry (a prompt piece) is its own group (B = 1, Tq = its length).
        Keys are gathered through the tables (padding: the scratch cell) and masked by position,
        so attention work follows each sequence's own length."""
        dev = self.device
        offsets = np.cumsum(counts) - counts
        if (counts == 1).all():  # a decode step
            row_seq, row_pos = seqs, starts
        else:
            row_seq = np.repeat(seqs, counts)
            row_pos = np.arange(len(row_seq), dtype=np.int64) + np.repeat(starts - offsets, counts)
        groups: list[AttnGroup] = []
        if sdpa:
            single = np.flatnonzero(counts == 1)
            if len(single):
                q_pos = starts[single]
                width = int(q_pos.max()) + 1
                key_pos = torch.arange(width, device=dev).expand(len(single), width)
                mask = position_mask(key_pos, torch.from_numpy(q_pos).to(dev)[:, None], group, window)
                cells = torch.from_numpy(self.tables[seqs[single], :width]).to(dev)
                groups.append(AttnGroup(torch.from_numpy(offsets[single]).to(dev), cells, mask))
            for i in np.flatnonzero(counts > 1):
                end = int(starts[i] + counts[i])
                piece_pos = torch.arange(int(starts[i]), end, device=dev)[None]
                mask = position_mask(torch.arange(end, device=dev)[None], piece_pos, group, window)
                cells = torch.from_numpy(self.tables[seqs[i], :end][None]).to(dev)
                span = slice(int(offsets[i]), int(offsets[i] + counts[i]))
                groups.append(AttnGroup(span, cells, mask))
        tables = torch.from_numpy(self.tables) if dev.type == "cpu" else torch.empty(0, dtype=torch.long)
        return AttnPlan(tables, torch.from_numpy(row_seq).to(dev), torch.from_numpy(row_pos).to(dev), groups)

    # -- sequence state (host RAM) ---------------------------------------------------------------

    # magic, version, positions, layers, kv heads, head dim, bytes per element (32 bytes: the
    # rows after it stay aligned for any element type)
    _HEADER = struct.Struct("<4sIQIIII")
    _MAGIC = b"OKVS"

    def state_get(self, seq: int) -> bytearray | None:
        """`seq`'s K and V rows (all layers, position order) and length as bytes; None if empty."""
        n = int(self.lens[seq])
        if n == 0:
            return None
        layers, _, kvh, d = self.k.shape
        header = self._HEADER.pack(self._MAGIC, 1, n, layers, kvh, d, self.k.element_size())
        row_bytes = layers * n * kvh * d * self.k.element_size()
        out = bytearray(len(header) + 2 * row_bytes)
        out[: len(header)] = header
        idx = torch.from_numpy(self.cells_of(seq)).to(self.device)
        body = torch.frombuffer(out, dtype=torch.uint8, offset=len(header))
        for i, pool in enumerate((self.k, self.v)):
            rows = pool.index_select(1, idx).contiguous().view(torch.uint8).view(-1)
            body[i * row_bytes : (i + 1) * row_bytes].copy_(rows)
        return out

    def state_set(self, seq: int, state: bytearray) -> bool:
        """Load a `state_get` state into `seq` (emptied first) with fresh cells; False if the pool
        has too few free cells. ValueError if the state is not of this cache's shape."""
        magic, version, n, layers, kvh, d, esz = self._HEADER.unpack_from(state)
        shape = (layers, n, kvh, d)
        row_bytes = layers * n * kvh * d * esz
        mine = (self.k.shape[0], self.k.shape[2], self.k.shape[3], self.k.element_size())
        if (magic, version) != (self._MAGIC, 1) or (layers, kvh, d, esz) != mine:
            raise ValueError("KV state of another model, dtype or format")
        if len(state) != self._HEADER.size + 2 * row_bytes:
            raise ValueError("KV state truncated")
        if n > self.n_ctx_seq:
            return False
        self.seq_rm(seq, 0)
        cells = self.claim(seq, n)
        if cells is None:
            return False
        idx = torch.from_numpy(cells).to(self.device)
        body = torch.frombuffer(state, dtype=torch.uint8, offset=self._HEADER.size)
        for i, pool in enumerate((self.k, self.v)):
            rows = body[i * row_bytes : (i + 1) * row_bytes].view(pool.dtype).view(shape)
            pool.index_copy_(1, idx, rows.to(self.device))
        return True
