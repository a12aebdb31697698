"""Pure parts of the worker: incremental detokenization, text output, slot choice, the HTTP
side's per-backend caches."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from worker.backends.base import Vocab
from worker.engine.policy import common_prefix_len, kv_victims, pick_slot, youngest
from worker.engine.slot import Slot
from worker.engine.task import Task, TextOutput
from worker.protocol.sampling import SamplingParams
from worker.server.context import BackendLRU, tokenize_text
from worker.testing.tiny_models import ModelPaths
from worker.text.detok import IncrementalDetokenizer


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        ([b"abc"], ["abc"]),
        (["é".encode()[:1], "é".encode()[1:]], ["", "é"]),
        ([b"\xf0\x9f", b"\x9a", b"\x80!"], ["", "", "🚀!"]),
        ([b"a\xe4\xbd", b"\xa0b"], ["a", "你b"]),
        ([b"\xff", b"x"], ["\ufffd", "x"]),
    ],
)
def test_detokenizer_never_splits_a_character(pieces: list[bytes], expected: list[str]) -> None:
    d = IncrementalDetokenizer()
    assert [d.feed(p) for p in pieces] == expected
    assert d.flush() == ""


def test_detokenizer_flushes_an_incomplete_tail() -> None:
    d = IncrementalDetokenizer()
    assert d.feed(b"ok\xe4") == "ok"
    assert d.flush() == "\ufffd"


def test_text_output_holds_back_a_split_stop_string() -> None:
    out = TextOutput(("STOP",))
    assert out.push(b"abc ST") == ("abc ", None)
    assert out.push(b"O") == ("", None)
    assert out.push(b"P tail") == ("", "STOP")


def test_text_output_releases_a_false_alarm_at_the_end() -> None:
    out = TextOutput(("STOP",))
    assert out.push(b"x ST") == ("x ", None)
    assert out.finish() == "ST"


def _slot(i: int, cache: list[int], used: float, busy: bool = False) -> Slot:
    s = Slot(i, cache=list(cache), t_last_used=used)
    if busy:
        s.task = Task([1], SamplingParams(), 0, lambda e: None)
    return s


@pytest.mark.parametrize(
    ("caches", "busy", "prompt", "id_slot", "cache_prompt", "expected"),
    [
        ([[1, 2, 3], [1, 9], []], [], [1, 2, 3, 4], -1, True, 0),  # longest common prefix
        ([[5], [1, 9], [1, 2]], [2], [1, 2, 3], -1, True, 1),  # best idle match
        ([[5], [1, 2], [1, 2]], [], [1, 2, 3], -1, True, 1),  # a tie: the lowest id
        ([[5], [6], [7]], [1], [1, 2], -1, True, 0),  # no match: the lowest idle id (packing)
        ([[6], [1, 2], [7]], [], [1, 2], -1, False, 0),  # cache_prompt off: the lowest idle id
        ([[1, 2], [6], [7]], [], [1, 2], 2, True, 2),  # id_slot wins
        ([[1, 2], [6], [7]], [2], [1, 2], 2, True, None),  # id_slot busy: wait
        ([[1], [2], [3]], [0, 1, 2], [1], -1, True, None),  # all busy
    ],
)
def test_pick_slot(
    caches: list[list[int]],
    busy: list[int],
    prompt: list[int],
    id_slot: int,
    cache_prompt: bool,
    expected: int | None,
) -> None:
    idle = [_slot(i, c, used=float(i)) for i, c in enumerate(caches) if i not in busy]
    reuse = [common_prefix_len(s.cache, prompt) if cache_prompt else 0 for s in idle]
    chosen = pick_slot(idle, reuse, id_slot=id_slot, n_slots=len(caches))
    assert (chosen.id if chosen else None) == expected


@pytest.mark.parametrize(
    ("busy", "best", "expected"),
    [
        ([], 5, 5),  # nothing busy: the best prefix, no copy
        ([0], 5, 1),  # next to slot 0; the prefix will be copied from slot 5
        ([0, 1], 2, 2),  # the best prefix is next to them anyway
        ([3], 4, 4),  # 2 and 4 both keep one run: the better prefix of the two
        ([3], 7, 2),  # ... or the lowest of them
        ([0, 2], 6, 1),  # the gap: one run instead of two
    ],
)
def test_pick_slot_keeps_busy_slots_packed(busy: list[int], best: int, expected: int) -> None:
    idle = [_slot(i, [i], used=0.0) for i in range(8) if i not in busy]
    reuse = [10 if s.id == best else 0 for s in idle]
    chosen = pick_slot(idle, reuse, id_slot=-1, n_slots=8, busy=busy, packed=True)
    assert chosen is not None and chosen.id == expected
    assert pick_slot(idle, reuse, id_slot=-1, n_slots=8, busy=busy, packed=False).id == best  # type: ignore[union-attr]


def test_kv_victims_and_youngest() -> None:
    slots = [_slot(0, [1], 3.0), _slot(1, [], 1.0), _slot(2, [2], 2.0), _slot(3, [3], 0.0, busy=True)]
    assert [s.id for s in kv_victims(slots)] == [2, 0]
    slots[1].task = Task([1], SamplingParams(), 0, lambda e: None)  # arrived after slot 3's task
    assert youngest(slots) is slots[1]
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2


def test_gguf_path_never_imports_torch() -> None:
    """Fast start: the llama.cpp worker must not pay torch's import (seconds)."""
    import subprocess
    import sys

    code = (
        "import sys, worker.server.cli, worker.server.app, worker.backends.llama_cpp, "
        "worker.text.chat_template; "
        "from worker.backends import resolve_kind; assert resolve_kind('auto', 'x.gguf') == 'llama_cpp'; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tokenize_after_close_raises_instead_of_segfaulting(tiny_models: ModelPaths) -> None:
    """Regression: the vocab pointer dangled after close(), so a late /tokenize crashed the process."""
    from worker.backends.llama_cpp import LlamaCppBackend

    backend = LlamaCppBackend(str(tiny_models.gguf_f32), n_ctx=256, n_slots=1, n_batch=64)
    assert backend.tokenize("hi there", False, True)
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.tokenize("hi", False, True)
    with pytest.raises(RuntimeError, match="closed"):
        backend.token_to_piece(900)


@pytest.mark.parametrize("kind", ["llama_cpp", "torch"])
def test_backend_options_are_each_backends_constructor_keywords(kind: str) -> None:
    # load_backend passes BackendOptions.kwargs_for(kind) as keywords: every option must be one the
    # backend takes (else a TypeError at load), and an option the backend takes is never dropped.
    import inspect

    from worker.backends import BackendOptions

    if kind == "llama_cpp":
        from worker.backends.llama_cpp import LlamaCppBackend as cls
    else:
        from worker.backends.torch_backend import TorchBackend as cls
    taken = set(inspect.signature(cls.__init__).parameters) - {
        "self",
        "model_path",
        "progress",
        "prepack",
        "cpu_kernels",
    }  # test-only switches
    assert set(BackendOptions().kwargs_for(kind)) == taken  # type: ignore[arg-type]  # kind is one of the Literal values


class _CountingVocab:
    """Stands in for a backend's tokenizer: one token per character, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self.calls += 1
        return [ord(c) for c in text] + ([1] if add_special else [])


def test_backend_lru_bounds_entries_and_weight_and_forgets_another_backend() -> None:
    a, b = cast(Vocab, _CountingVocab()), cast(Vocab, _CountingVocab())
    lru: BackendLRU[str, int] = BackendLRU(3, max_weight=10, weight=len)
    for k in ("aa", "bb", "cc"):
        lru.put(a, k, len(k))
    assert lru.get(a, "aa") == 2
    lru.put(a, "dd", 2)  # 4 entries: the least recently used (bb) goes
    assert [lru.get(a, k) for k in ("aa", "bb", "cc", "dd")] == [2, None, 2, 2]
    lru.put(a, "eeeeee", 6)  # weight 12 > 10: the oldest go
    assert lru.get(a, "eeeeee") == 6 and lru.get(a, "aa") is None
    lru.put(a, "x" * 11, 0)  # heavier than the whole cache: not kept
    assert lru.get(a, "x" * 11) is None
    assert lru.get(b, "eeeeee") is None  # another backend: emptied
    assert lru.get(a, "eeeeee") is None


def test_tokenize_text_reuses_the_ids_of_a_repeated_text() -> None:
    counting = _CountingVocab()
    v = cast(Vocab, counting)
    first = asyncio.run(tokenize_text(v, "hello", True, True))
    first.append(99)  # the caller may change its list: the cache keeps its own
    again = asyncio.run(tokenize_text(v, "hello", True, True))
    other = asyncio.run(tokenize_text(v, "hello", False, True))
    assert again == [ord(c) for c in "hello"] + [1] and other == [ord(c) for c in "hello"]
    assert counting.calls == 2


def test_greedy_argmax_picks_what_llama_cpps_greedy_chain_picks(tiny_models: ModelPaths) -> None:
    """`sample`'s argmax path for a greedy sampler (a logit bias, then greedy) against the same
    chain run by llama.cpp on the same rows: random rows, ties, a -inf bias on the best token,
    every token biased away, and a NaN (left to llama.cpp)."""
    import numpy as np

    from worker.backends.llama_cpp import LlamaCppBackend, _address, _greedy

    backend = LlamaCppBackend(str(tiny_models.gguf_f32), n_ctx=256, n_slots=1, n_batch=64)
    try:
        n = backend.n_vocab
        rng = np.random.default_rng(0)
        rows = [rng.standard_normal(n).astype(np.float32) for _ in range(20)]
        tie = np.zeros(n, dtype=np.float32)
        tie[[7, 3, 11]] = 5.0  # the first of equal maxima, in id order
        rows.append(tie)
        biases = [{}, {int(np.argmax(rows[0])): float("-inf")}, {1: 3.5, 2: -1.25},
                  dict.fromkeys(range(n), float("-inf"))]
        for bias in biases:
            params = SamplingParams(temperature=0.0, logit_bias=bias)
            sampler = backend.new_sampler(params, 0)
            ids, values = backend._argmax[_address(sampler)]
            for row in rows:
                assert _greedy(row, ids, values) == backend._sample_row(sampler, row.copy(), None)
            backend.free_sampler(sampler)
        nan = rows[1].copy()
        nan[5] = np.nan
        assert _greedy(nan, np.zeros(0, np.int64), np.zeros(0, np.float32)) == -1
        penalized = backend.new_sampler(SamplingParams(temperature=0.0, repeat_penalty=1.3), 0)
        assert _address(penalized) not in backend._argmax  # penalties keep llama.cpp's chain
        backend.free_sampler(penalized)
    finally:
        backend.close()


def test_a_cross_stream_copy_is_done_before_the_source_is_restored_over(tiny_models: ModelPaths) -> None:
    """Regression: llama_memory_seq_cp across KV streams copies the data only at the next decode,
    so a prompt-cache restore into the source in the same step (the scheduler places one task
    after another before decoding) reached the copy's destination instead of the source's rows."""
    import numpy as np

    from worker.backends.base import BatchEntry
    from worker.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(str(tiny_models.gguf_f32), n_ctx=512, n_slots=3, n_batch=64, threads=1)
    try:
        a, other = list(range(10, 40)), list(range(500, 530))

        def next_row(seq: int, prefix: list[int]) -> np.ndarray:
            b.decode([BatchEntry(seq, [7], len(prefix), True)])
            return b.logits_row(0).copy()

        b.decode([BatchEntry(0, a, 0, False)])
        b.decode([BatchEntry(2, other, 0, False)])
        saved_other = b.seq_state_get(2)
        b.seq_cp(0, 1, len(a))  # seq 1 takes a's rows ...
        b.seq_rm(0, 0)
        assert saved_other is not None and b.seq_state_set(0, saved_other)  # ... then seq 0 is restored over
        copied = next_row(1, a)
        b.seq_rm(2, 0)
        b.decode([BatchEntry(2, a, 0, False)])
        np.testing.assert_array_equal(copied, next_row(2, a))  # a's own rows, not the restored ones
    finally:
        b.close()


def test_logits_rows_are_llama_cpps_rows_of_each_output(tiny_models: ModelPaths) -> None:
    """The backend reads a decode's logits as one view of llama.cpp's output buffer. Each output
    must be the row llama_get_logits_ith gives for its batch index: in a step of prompt pieces
    (several outputs each) and one-row entries out of sequence order, which llama.cpp splits
    into several ubatches per KV stream and then puts back in batch order."""
    import llama_cpp as ll
    import numpy as np

    from worker.backends.base import BatchEntry
    from worker.backends.llama_cpp import LlamaCppBackend

    b = LlamaCppBackend(str(tiny_models.gguf_f32), n_ctx=512, n_slots=4, n_batch=64, threads=1)
    try:
        for s in (0, 1):
            b.decode([BatchEntry(s, list(range(20 + s, 30 + s)), 0, False)])
        entries = [
            BatchEntry(3, list(range(40, 52)), 0, True, n_outputs=3),
            BatchEntry(1, [9], 10, True),
            BatchEntry(2, list(range(60, 65)), 0, True),
            BatchEntry(0, [8], 10, True),
        ]
        b.decode(entries)
        # the last llama_decode's outputs (rows of earlier calls of the step were copied out)
        last = [(i, row) for i, (copied, row) in enumerate(b._outputs) if copied is None]
        assert len(last) >= 2
        for i, batch_idx in last:
            ptr = ll.llama_get_logits_ith(b._ctx, batch_idx)
            np.testing.assert_array_equal(b.logits_row(i), np.ctypeslib.as_array(ptr, shape=(b.n_vocab,)))
    finally:
        b.close()
