"""Bitwise batch invariance on the CPU in float32 with the fused kernels (`RowRecipe.exact()`).

A sequence's logits (its prompt's last row and every greedy decode step after it) must be
torch.equal however it runs: alone as one piece, in pieces of 1, 7 or 64 rows, beside other
sequences that prefill and decode in the same steps, in another sequence id, after taking
its prefix from another sequence with seq_cp (shared cells), or from a saved KV state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.torch_backend.conftest import HFModel
from tests.torch_backend.test_model import new_backend, random_tokens
from worker.backends.base import BatchEntry, DecodeStatus, RowRecipe, SampleItem
from worker.backends.torch_backend import TorchBackend
from worker.protocol.sampling import SamplingParams
from worker.testing.tiny_models import ModelPaths

N_NEW = 10  # the prompt's row, then 9 decode steps
PROMPT = random_tokens(70, seed=70)  # crosses 64 rows and several 16-entry key blocks


@dataclass
class Track:
    """One sequence driven through a run: its prompt fed in `piece`-row pieces from `pos`
    (a prefix already in the cache starts later), then greedy decode steps."""

    seq: int
    prompt: list[int]
    piece: int
    n_new: int = N_NEW
    pos: int = 0
    after: int = 0  # the step it joins at
    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def entry(self, step: int) -> BatchEntry | None:
        if step < self.after:
            return None
        if self.pos < len(self.prompt):
            toks = self.prompt[self.pos : self.pos + self.piece]
            return BatchEntry(self.seq, toks, self.pos, self.pos + len(toks) == len(self.prompt))
        if len(self.tokens) < self.n_new:
            return BatchEntry(self.seq, [self.tokens[-1]], self.pos, True)
        return None


def run(backend: TorchBackend, *tracks: Track) -> None:
    """Step all tracks together (one decode per step) until each has its tokens."""
    step = 0
    while entries := [(t, e) for t in tracks if (e := t.entry(step)) is not None]:
        step += 1
        assert backend.decode([e for _, e in entries]) is DecodeStatus.OK
        row = 0
        for t, e in entries:
            t.pos += len(e.tokens)
            if e.logits:
                t.logits.append(torch.from_numpy(backend.logits_row(row)))
                t.tokens.append(int(t.logits[-1].argmax()))
                row += 1


def assert_same(got: Track, want: Track) -> None:
    assert len(got.logits) == len(want.logits) == got.n_new == want.n_new
    for i, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert torch.equal(a, b), f"logits of step {i} differ by {(a - b).abs().max().item():.3g}"
    assert got.tokens == want.tokens


def exact_backend(path: Path) -> TorchBackend:
    backend = new_backend(path, n_ctx=640, n_slots=4)  # 128 positions per sequence, 5 sequences
    if not backend._require_model().matmuls_row_invariant(backend.n_batch):
        pytest.skip("oneDNN's float32 matmuls are not batch invariant on this CPU")  # e.g. AVX-512 Xeons
    assert backend.recipe == RowRecipe.exact()
    return backend


def solo(backend: TorchBackend, prompt: list[int] = PROMPT, n_new: int = N_NEW) -> Track:
    """The reference: the prompt as one piece in seq 0, alone in every step (cache emptied)."""
    ref = Track(0, prompt, piece=len(prompt), n_new=n_new)
    backend.seq_rm(-1, 0)
    run(backend, ref)
    backend.seq_rm(-1, 0)
    return ref


@pytest.fixture(params=["llama", "qwen3", "mistral-window"])
def family(request: pytest.FixtureRequest, hf_family: Callable[[str], tuple[Path, HFModel]]) -> Path:
    """The tiny families: plain GQA, per-head q/k norms, and a sliding window of 8."""
    path, _ = hf_family(request.param)
    return path


@pytest.mark.parametrize("piece", [1, 7, 64])
def test_prompt_pieces_do_not_change_a_row(family: Path, piece: int) -> None:
    backend = exact_backend(family)
    ref = solo(backend)
    track = Track(0, PROMPT, piece)
    run(backend, track)
    assert_same(track, ref)


def test_neighbours_and_seq_id_do_not_change_a_row(family: Path) -> None:
    """Ours runs in seq 2 in pieces of 7 while seq 0 decodes (short prompt), seq 1 prefills a
    long prompt in pieces of 64, and seq 4 (staging) joins mid-way; then all decode together."""
    backend = exact_backend(family)
    ref = solo(backend)
    others = [
        Track(0, random_tokens(5, seed=1), piece=5, n_new=20),
        Track(1, random_tokens(100, seed=2), piece=64, n_new=6),
        Track(4, random_tokens(30, seed=3), piece=30, n_new=4, after=5),
    ]
    ours = Track(2, PROMPT, piece=7)
    run(backend, ours, *others)
    assert_same(ours, ref)
    for other in others:  # and each neighbour is as it would be alone
        assert_same(other, solo(backend, other.prompt, other.n_new))


def test_shared_prefix_does_not_change_a_row(family: Path) -> None:
    """Seq 1 prefills 40 tokens of our prompt plus a tail of its own; seq 3 takes the 40 by
    seq_cp (no cells copied) and continues our prompt, while seq 1 decodes on in the same
    steps (both append after the shared cells: copy on write)."""
    backend = exact_backend(family)
    ref = solo(backend)
    theirs_prompt = PROMPT[:40] + random_tokens(9, seed=4)
    theirs_ref = solo(backend, theirs_prompt, n_new=2 * N_NEW)
    theirs = Track(1, theirs_prompt, piece=49, n_new=N_NEW)
    run(backend, theirs)
    kv = backend._require_kv()
    free = kv.num_free
    backend.seq_cp(1, 3, 40)
    assert kv.num_free == free and (kv.cells_of(3) == kv.cells_of(1)[:40]).all()
    ours = Track(3, PROMPT, piece=16, pos=40)
    theirs.n_new = 2 * N_NEW
    run(backend, ours, theirs)
    assert_same(ours, ref)
    assert_same(theirs, theirs_ref)


def test_saved_state_does_not_change_a_row(family: Path) -> None:
    backend = exact_backend(family)
    ref = solo(backend)
    run(backend, Track(0, PROMPT[:50], piece=50, n_new=1))
    state = backend.seq_state_get(0)
    assert state is not None
    backend.seq_rm(0, 0)
    backend.decode([BatchEntry(1, random_tokens(20, seed=5), 0, False)])  # other cells in the way
    assert backend.seq_state_set(4, state)
    ours = Track(4, PROMPT, piece=64, pos=50)
    run(backend, ours)
    assert_same(ours, ref)


@pytest.mark.parametrize(
    ("options", "exact"),
    [({}, True), ({"kernels": False}, False), ({"dtype": "bfloat16"}, False)],
    ids=["kernels-f32", "torch-ops", "bf16"],
)
def test_recipe_is_exact_only_where_rows_are_invariant(
    tiny_models: ModelPaths, options: dict[str, object], exact: bool
) -> None:
    """Exact: the fused kernels, float32, and oneDNN matmuls that pass the row probe."""
    backend = new_backend(tiny_models.hf_dir, **options)  # type: ignore[arg-type]
    exact = exact and backend._require_model().matmuls_row_invariant(backend.n_batch)
    assert backend.recipe == (RowRecipe.exact() if exact else RowRecipe())


def test_sample_takes_decode_rows_and_saved_rows_together(tiny_models: ModelPaths) -> None:
    backend = new_backend(tiny_models.hf_dir)
    greedy = SamplingParams(temperature=0.0)
    backend.decode(
        [BatchEntry(0, random_tokens(6, seed=6), 0, True), BatchEntry(1, random_tokens(9, seed=7), 0, True)]
    )
    saved = backend.logits_row(1)
    assert saved.dtype == np.float32 and saved.shape == (backend.meta.n_vocab,)
    saved_copy = saved.copy()
    backend.decode([BatchEntry(0, [5], 6, True)])
    items = [
        SampleItem(backend.new_sampler(greedy, 0), logits=saved),
        SampleItem(backend.new_sampler(greedy, 0), logits_index=0),
    ]
    got = [s.token for s in backend.sample(items, [greedy, greedy])]
    assert got == [int(saved.argmax()), int(backend.logits_row(0).argmax())]
    assert np.array_equal(saved, saved_copy)  # the saved row is not modified


def test_backend_sizes(tiny_models: ModelPaths) -> None:
    streams = TorchBackend(str(tiny_models.hf_dir), n_ctx=256, n_slots=4, n_batch=128, device="cpu")
    assert (streams.n_ctx, streams.n_ctx_seq, streams.n_seq_max, streams.kv_unified) == (320, 64, 5, False)
    assert streams.supports_seq_state and streams.n_ubatch == 512
    unified = TorchBackend(
        str(tiny_models.hf_dir), n_ctx=0, n_slots=2, kv_unified=True, n_batch=64, n_ubatch=32, device="cpu"
    )
    assert (unified.n_ctx, unified.n_ctx_seq, unified.n_seq_max, unified.n_ubatch) == (4096, 4096, 3, 32)
    with pytest.raises(ValueError, match="exceed 64 positions"):
        streams.decode([BatchEntry(0, random_tokens(65, seed=8), 0, True)])
    with pytest.raises(ValueError, match="appended at position 0"):
        streams.decode([BatchEntry(0, [5], 3, True)])
    with pytest.raises(ValueError, match="exceeds n_batch"):
        unified.decode([BatchEntry(0, random_tokens(65, seed=8), 0, True)])
