"""CUDA graphs for decode-only steps (one token per sequence, every row wants logits).

Like nano-vllm: one graph per batch-size bucket (1, 2, 4, 8, ... up to n_seq_max), captured
once after the KV cache is allocated, all sharing one memory pool. Shapes must be static, so
a captured step attends over a prefix of the cell pool under a mask instead of gathering each
sequence's cells through its table: row t sees cell c iff bit seq(t) of `cell_seqs[c]` is set
(the sequences holding c: a cell shared by seq_cp has several bits) and c's position passes
the position rule. The mask is built inside the graph from device copies of the cache's
`cell_seqs` and `cell_pos`, refreshed from the host before each replay. Needs
n_seq <= MAX_MASK_SEQS (the bitmask is one int64 per cell).

KV spans: each batch bucket is captured once per span (256, 512, ... cells, up to the pool),
and a step replays the smallest span that holds every cell in use. The cache hands out low
cells first, so a short context reads a short prefix of the pool: attending over the whole
pool of a long `--ctx-size` made a batch-1 decode step of a 1.2B model ~6 ms on an H100, 2/3
of it in attention over empty cells. Padding rows repeat row 0 (its sequence, position and
token) but write their K/V to the scratch cell, which no mask shows: each padding row attends
exactly what row 0 does, never an empty row (rows are independent, their outputs dropped).

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


def spans(n_cells: int, smallest: int = 256) -> list[int]:
    """KV prefixes a graph is captured for: doubling from `smallest`, the last the whole pool."""
    out = [smallest]
    while out[-1] < n_cells:
        out.append(out[-1] * 2)
    return [x for x in out if x < n_cells] + [n_cells]


class DecodeGraphs:
    def __init__(self, model: Model, kv: KVCache, n_seq_max: int, group: int, window: int | None) -> None:
        assert kv.has_seq_masks, "CUDA graphs need n_seq <= MAX_MASK_SEQS"
        dev = kv.device
        self.model, self.kv, self.group, self.window = model, kv, group, window
        self.sizes = buckets(max(n_seq_max, 1))
        self.spans = spans(kv.n_cells)
        n_max, n_all = self.sizes[-1], kv.n_cells + 1
        self.n_pos = model.cos.shape[0]  # tables must not be reallocated under a graph
        self.tokens = torch.zeros(n_max, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n_max, dtype=torch.long, device=dev)
        self.cells = torch.full((n_max,), kv.scratch_cell, dtype=torch.long, device=dev)
        self.seq_ids = torch.full((n_max,), kv.n_seq, dtype=torch.long, device=dev)
        self.rows = torch.arange(n_max, device=dev)
        self.cell_seqs = torch.zeros(n_all, dtype=torch.long, device=dev)
        self.cell_pos = torch.zeros(n_all, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self._capture_all()

    def _forward(self, bs: int, span: int) -> Tensor:
        seq_ids, positions = self.seq_ids[:bs], self.positions[:bs]
        mask = pool_mask(
            self.cell_seqs[:span], self.cell_pos[:span], seq_ids, positions, self.group, self.window
        )
        plan = AttnPlan(self.cells[:0], seq_ids, positions, [AttnGroup(slice(0, bs), None, mask)])
        logits: Tensor = self.model(
            self.tokens[:bs], positions, self.cells[:bs], plan, self.rows[:bs], self.kv.k, self.kv.v
        )
        return logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        # largest first, so smaller graphs reuse its pool
        for key in sorted(((bs, span) for bs in self.sizes for span in self.spans), reverse=True):
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(*key)  # warm-up: kernels and workspaces exist before capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def can_run(self, n_tokens: int, n_entries: int, n_rows: int) -> bool:
        return n_tokens == n_entries == n_rows and n_tokens <= self.sizes[-1]

    def run(
        self, tokens: np.ndarray, positions: np.ndarray, cells: np.ndarray, seq_ids: np.ndarray
    ) -> Tensor:
        n = len(tokens)
        if int(positions.max()) >= self.n_pos:
            raise ValueError(f"position {int(positions.max())} beyond the captured RoPE table ({self.n_pos})")
        bs = next(b for b in self.sizes if b >= n)
        in_use = np.flatnonzero(self.kv.refs)
        top = max(int(in_use[-1]) if in_use.size else 0, int(cells.max())) + 1
        span = next(x for x in self.spans if x >= top)
        pad = bs - n  # padding rows repeat row 0 but write the scratch cell (module doc)
        self.tokens[:bs].copy_(torch.from_numpy(np.concatenate([tokens, np.repeat(tokens[:1], pad)])))
        self.positions[:bs].copy_(
            torch.from_numpy(np.concatenate([positions, np.repeat(positions[:1], pad)]))
        )
        self.cells[:bs].copy_(torch.from_numpy(np.concatenate([cells, np.full(pad, self.kv.scratch_cell)])))
        self.seq_ids[:bs].copy_(torch.from_numpy(np.concatenate([seq_ids, np.repeat(seq_ids[:1], pad)])))
        self.cell_seqs[:span].copy_(torch.from_numpy(self.kv.cell_seqs[:span]))
        self.cell_pos[:span].copy_(torch.from_numpy(self.kv.cell_pos[:span]))
        self.graphs[(bs, span)].replay()
        return self.outputs[(bs, span)][:n]
