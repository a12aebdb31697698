"""CUDA graphs for decode-only steps (one token per sequence, every row wants logits).

Like nano-vllm: one graph per batch-size bucket (1, 2, 4, 8, ... up to n_seq_max), captured
once after the KV cache is allocated, all sharing one memory pool. Shapes must be static, so
a captured step attends over the whole cell pool (n_cells + 1 cells) under a mask instead of
gathering each sequence's cells through its table: row t sees cell c iff bit seq(t) of
`cell_seqs[c]` is set (the sequences holding c: a cell shared by seq_cp has several bits) and
c's position passes the position rule. Padding rows are "sequence" n_seq at position 0: they
write and see the scratch cell only (its bit is n_seq). The mask is built inside the graph
from device copies of the cache's `cell_seqs` and `cell_pos`, refreshed from the host before
each replay. Needs n_seq <= MAX_MASK_SEQS (the bitmask is one int64 per cell).

Only used with `compile=True` on CUDA; the eager path handles everything else (prefill,
mixed batches, sizes above the largest bucket).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from worker.torch_model.kv_cache import AttnGroup, AttnPlan, KVCache, pool_mask
from worker.torch_model.model import Model


def buckets(n_max: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < n_max:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 32 else 16))
    return [b for b in sizes if b < n_max] + [n_max]


class DecodeGraphs:
    def __init__(self, model: Model, kv: KVCache, n_seq_max: int, group: int, window: int | None) -> None:
        assert kv.has_seq_masks, "CUDA graphs need n_seq <= MAX_MASK_SEQS"
        dev = kv.device
        self.model, self.kv, self.group, self.window = model, kv, group, window
        self.sizes = buckets(max(n_seq_max, 1))
        n_max, n_all = self.sizes[-1], kv.n_cells + 1
        self.n_pos = model.cos.shape[0]  # tables must not be reallocated under a graph
        self.tokens = torch.zeros(n_max, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n_max, dtype=torch.long, device=dev)
        self.cells = torch.full((n_max,), kv.scratch_cell, dtype=torch.long, device=dev)
        self.seq_ids = torch.full((n_max,), kv.n_seq, dtype=torch.long, device=dev)
        self.rows = torch.arange(n_max, device=dev)
        self.cell_seqs = torch.zeros(n_all, dtype=torch.long, device=dev)
        self.cell_pos = torch.zeros(n_all, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self._capture_all()

    def _forward(self, bs: int) -> Tensor:
        seq_ids, positions = self.seq_ids[:bs], self.positions[:bs]
        mask = pool_mask(self.cell_seqs, self.cell_pos, seq_ids, positions, self.group, self.window)
        plan = AttnPlan(self.cells[:0], seq_ids, positions, [AttnGroup(slice(0, bs), None, mask)])
        logits: Tensor = self.model(
            self.tokens[:bs], positions, self.cells[:bs], plan, self.rows[:bs], self.kv.k, self.kv.v
        )
        return logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bs)  # warm-up: kernels and workspaces exist before capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, n_tokens: int, n_entries: int, n_rows: int) -> bool:
        return n_tokens == n_entries == n_rows and n_tokens <= self.sizes[-1]

    def run(self, tokens: np.ndarray, positions: np.ndarray, cells: np.ndarray, seq_ids: np.ndarray) -> Tensor:
        n = len(tokens)
        if int(positions.max()) >= self.n_pos:
            raise ValueError(f"position {int(positions.max())} beyond the captured RoPE table ({self.n_pos})")
        bs = next(b for b in self.sizes if b >= n)
        self.tokens[:n].copy_(torch.from_numpy(tokens))
        self.positions[:n].copy_(torch.from_numpy(positions))
        self.cells[:n].copy_(torch.from_numpy(cells))
        self.seq_ids[:n].copy_(torch.from_numpy(seq_ids))
        self.tokens[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.cells[n:bs].fill_(self.kv.scratch_cell)
        self.seq_ids[n:bs].fill_(self.kv.n_seq)
        self.cell_seqs.copy_(torch.from_numpy(self.kv.cell_seqs))
        self.cell_pos.copy_(torch.from_numpy(self.kv.cell_pos))
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
