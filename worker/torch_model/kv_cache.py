"""The KV cache: a unified pool of `n_cells` cells shared by all sequences (llama.cpp's design).

Why cells and not one region per slot: the Backend contract promises a unified KV of `n_ctx`
cells where any slot may use up to the whole context. A per-slot region would cost
n_seq_max x n_ctx memory. Here each cell records the (seq_id, position) it holds, cells are
handed out lowest-first, and `n_kv` is one past the highest used cell.

Attention plan (`plan`), built once per step and shared by all layers: a list of
`AttnGroup`s, each a small batch of sequences whose query rows attend over *their own* cells,
gathered by index from the pool:
  - all single-token entries (decoding slots) form one group: B rows, keys padded to the
    longest of their sequences;
  - each multi-token entry (a prompt chunk) is its own group (B = 1, Tq = chunk length).
The mask inside a group is by position (a cell at a position <= the query's, within the
sliding window if any). So attention work follows each sequence's own length; one masked
pass over the whole pool would cost (all rows) x (all live cells) instead.

`unified_group` is the other form: every row against cells [0, n) of the pool, with a
(seq, position) mask and no gather; the fixed-shape CUDA-graph path uses it.

K and V are [layers, n_cells + 1, kv_heads, head_dim], cell-major: a token's K/V is one
contiguous row, so writing a step's tokens and gathering a group's cells are plain row copies
(about 1.4x faster than gathering a strided head-major layout). The extra last cell is scratch: padding
of gathered groups points at it (masked out), and padded rows of CUDA-graph batches write and
read it. It is never handed out. Bookkeeping (cell_seq, cell_pos) is numpy on the host:
allocation, seq_rm and planning are a few vectorised array ops per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

FREE = -1
SCRATCH = -2
_FAR = np.iinfo(np.int64).max // 2  # the position given to padding: after every query


@dataclass(slots=True)
class AttnGroup:
    """Query rows `rows` (B x Tq of them, sequence-major) attend keys `cells` [B, L] under `mask`.

    cells None means the pool prefix [0, mask.shape[-1]) itself (no gather, B = 1).
    mask: bool [B, 1, group * Tq, L], query rows head-group-major (see model.attention).
    cell_pos [B, L] and q_pos [B]: set on the single-token group only (Tq = 1), for the fused
    CPU kernel, which applies the position rule itself (its mask is then None).
    """

    rows: Tensor | slice
    cells: Tensor | None
    mask: Tensor | None
    cell_pos: Tensor | None = None
    q_pos: Tensor | None = None


def position_mask(cell_pos: Tensor, q_pos: Tensor, group: int, window: int | None) -> Tensor:
    """cell_pos [B, L], q_pos [B, Tq] -> bool [B, 1, group*Tq, L]: cell position <= query position."""
    mask = cell_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= cell_pos[:, None, :] > q_pos[:, :, None] - window
    return (mask.repeat(1, group, 1) if group > 1 else mask).unsqueeze(1)


def build_mask(
    cell_seq: Tensor, cell_pos: Tensor, seq_ids: Tensor, positions: Tensor, group: int, window: int | None
) -> Tensor:
    """Unified form: bool [1, 1, group*T, n]: token t attends cell c iff same sequence and position rule."""
    mask = (cell_seq[None, :] == seq_ids[:, None]) & (cell_pos[None, :] <= positions[:, None])
    if window is not None:
        mask &= cell_pos[None, :] > positions[:, None] - window
    return (mask.repeat(group, 1) if group > 1 else mask)[None, None]


class KVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, n_cells: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_layers, n_cells + 1, num_kv_heads, head_dim)
        self.n_cells = n_cells
        self.device = device
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.cell_seq = np.full(n_cells, FREE, dtype=np.int64)
        self.cell_pos = np.zeros(n_cells, dtype=np.int64)
        self.n_kv = 0  # one past the highest used cell

    @property
    def scratch_cell(self) -> int:
        return self.n_cells

    @property
    def num_free(self) -> int:
        return int(np.count_nonzero(self.cell_seq == FREE))

    def allocate(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
        """Claim one cell per token (lowest free first); None, changing nothing, if they do not fit."""
        free = np.flatnonzero(self.cell_seq == FREE)
        n = len(seq_ids)
        if len(free) < n:
            return None
        cells = free[:n]
        self.cell_seq[cells] = seq_ids
        self.cell_pos[cells] = positions
        if n:
            self.n_kv = max(self.n_kv, int(cells[-1]) + 1)
        return cells

    def seq_rm(self, seq_id: int, p0: int) -> None:
        """Free positions >= p0 of seq_id (seq_id < 0: of every sequence)."""
        sel = self.cell_pos >= p0
        sel &= (self.cell_seq >= 0) if seq_id < 0 else (self.cell_seq == seq_id)
        self.cell_seq[sel] = FREE
        used = np.flatnonzero(self.cell_seq != FREE)
        self.n_kv = int(used[-1]) + 1 if len(used) else 0

    def clear(self) -> None:
        self.seq_rm(-1, 0)

    def plan(
        self, seq_ids: np.ndarray, starts: np.ndarray, lens: np.ndarray, group: int, window: int | None,
        single_masks: bool = True,
    ) -> list[AttnGroup]:
        """The attention groups of one batch (per entry: sequence, first position, token count).

        single_masks=False: the single-token group gets no mask (the fused CPU kernel applies
        the position rule from cell_pos/q_pos itself)."""
        live = self.cell_seq[: self.n_kv]
        offsets = np.cumsum(lens) - lens
        dev = self.device
        groups: list[AttnGroup] = []
        single = np.flatnonzero(lens == 1)
        if len(single):
            cells, pos = self._own_cells(live, seq_ids[single])
            rows = torch.from_numpy(offsets[single]).to(dev)
            q_pos = torch.from_numpy(starts[single]).to(dev)
            cell_pos = torch.from_numpy(pos).to(dev)
            mask = position_mask(cell_pos, q_pos[:, None], group, window) if single_masks else None
            groups.append(AttnGroup(rows, torch.from_numpy(cells).to(dev), mask, cell_pos, q_pos))
        for i in np.flatnonzero(lens > 1):
            c = np.flatnonzero(live == seq_ids[i])
            q_pos = torch.arange(int(starts[i]), int(starts[i] + lens[i]), device=dev)[None]
            mask = position_mask(torch.from_numpy(self.cell_pos[c][None]).to(dev), q_pos, group, window)
            span = slice(int(offsets[i]), int(offsets[i] + lens[i]))
            groups.append(AttnGroup(span, torch.from_numpy(c[None]).to(dev), mask))
        return groups

    def _own_cells(self, live: np.ndarray, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's cells (ascending) and their positions as rows of [len(seqs), longest],
        padded with the scratch cell at a position after every query; one pass over the pool."""
        top = int(seqs.max())
        row_of = np.full(top + 2, -1, dtype=np.int64)  # the last entry, -1, is for every other cell
        row_of[seqs] = np.arange(len(seqs))
        r = row_of[np.where((live >= 0) & (live <= top), live, top + 1)]
        sel = np.flatnonzero(r >= 0)
        r = r[sel]
        order = np.argsort(r, kind="stable")
        sel, r = sel[order], r[order]
        counts = np.bincount(r, minlength=len(seqs))
        col = np.arange(len(r)) - np.repeat(np.cumsum(counts) - counts, counts)
        cells = np.full((len(seqs), int(counts.max())), self.scratch_cell, dtype=np.int64)
        pos = np.full(cells.shape, _FAR, dtype=np.int64)
        cells[r, col] = sel
        pos[r, col] = self.cell_pos[sel]
        return cells, pos
