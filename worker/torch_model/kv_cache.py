"""The KV cache: a unified pool of `n_cells` cells shared by all sequences (llama.cpp's design).

Why cells and not one region per slot: the Backend contract promises a unified KV of `n_ctx`
cells where any slot may use up to the whole context. A per-slot region would cost
n_seq_max x n_ctx memory; fixed-size pages would need a gather per layer. Here each cell
records the (seq_id, position) it holds; a token attends to every cell of its own sequence at
a position <= its own, expressed as one boolean mask over cells [0, n_kv), where n_kv is one
past the highest used cell. Cells are handed out lowest-first, so n_kv stays close to the
number of cells in use and attention cost follows the live context, not the pool size.

K and V are [layers, kv_heads, n_cells + 1, head_dim]: cells slice as a strided view that
scaled_dot_product_attention reads in place. The extra last cell is scratch space for padded
rows of fixed-shape (CUDA graph) batches; it is never handed out and never attended by real
tokens. Bookkeeping (cell_seq, cell_pos) is numpy on the host: allocation and seq_rm are a
few vectorised array ops per step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

FREE = -1
SCRATCH = -2


class KVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, n_cells: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_layers, num_kv_heads, n_cells + 1, head_dim)
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

    def attention_mask(
        self, seq_ids: Tensor, positions: Tensor, n_kv: int, group: int, window: int | None
    ) -> Tensor:
        """Bool [group*T, n_kv]: token t may attend cell c (rows repeated per query-head group)."""
        cs = torch.from_numpy(self.cell_seq[:n_kv]).to(self.device, non_blocking=True)
        cp = torch.from_numpy(self.cell_pos[:n_kv]).to(self.device, non_blocking=True)
        mask = (cs[None, :] == seq_ids[:, None]) & (cp[None, :] <= positions[:, None])
        if window is not None:
            mask &= cp[None, :] > positions[:, None] - window
        return mask.repeat(group, 1) if group > 1 else mask
