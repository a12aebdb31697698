"""The llama.cpp backend: llama-cpp-python's low-level ctypes API, nothing from `llama_cpp.Llama`.

One `llama_context` with `n_slots + 1` sequences (the last is the engine's staging sequence).
By default each sequence has a KV *stream* of its own (`kv_unified` off, llama-server's
default): n_ctx / n_slots cells, its cells in position order, attention never over another
sequence's cells. With `kv_unified` all sequences share one pool of n_ctx cells and `seq_cp`
shares cells instead of copying a stream. The engine thread is the only caller of `decode`,
`sample`, `seq_*`, `sleep` and `wake`.

Why one file of over 500 lines: it is the only module that touches llama.cpp's ctypes API, the
one place where its pointer lifetimes, batch buffers and sampler chains are owned; the pieces
with no ctypes in them (FIM tokens, the pooling names) live elsewhere.

Reproducible rows (`RowRecipe`). llama.cpp's CPU kernels depend on how many rows of one
sequence a ubatch holds: flash attention runs a per-row kernel below 64 rows and a tiled one
from 64 (different float32/float16 accumulation), attention without it and the matmuls run
other kernels for one row than for several, and llama.cpp splits a batch of sequences with
unequal row counts into ubatches of equal counts. So the recipe tells the engine to cut
prompts in pieces of >= 64 rows (< 64 tokens: >= 2 rows) with flash attention, >= 2 rows
without, and `decode` runs all one-row entries (decode rows) in one llama_decode and the
prompt pieces in others, grouping pieces only where llama.cpp's split of the group keeps
every row in its class (`_keeps_classes` replays that split). What stays: a
decode step of a single sequence runs llama.cpp's one-row matmul kernel (and, past 256 cells
with flash attention, its split-KV kernel), so one lone request and the same request beside
others can differ at float rounding level (see worker/engine/engine.py, Determinism).

Since pieces run in separate llama_decode calls, a logits row of an earlier call is copied out
before the next call overwrites it; sampling such a row (or a row saved earlier, `logits_row`)
applies the sampler chain to a token array built from it, as llama_sampler_sample does from
the context's own buffer.

Two models are loaded from the same file: a vocab-only one (a few MB, loaded first and kept
through sleep) that serves tokenization from any thread, and the full one that `sleep` frees.
The batch is one `llama_batch` whose arrays are numpy buffers allocated once (`_BatchBuffers`),
so filling it is a handful of slice assignments per entry, not a Python loop per token.

Embedding models (`embedding=True`, llama-server's `--embedding`): the context computes
embeddings with the pooling asked for (or the model's own), every row is an output (llama.cpp
requires it), and after each llama_decode the pooled vector of every entry that asked for
logits is copied out (`llama_get_embeddings_seq`; per row with pooling none). llama.cpp pools
per ubatch, so a sequence's rows must all be in one ubatch: pieces share a llama_decode only
when they are of equal length (its `split_equal` then keeps each whole) and fit one ubatch, and
never with mean pooling (`_keeps_whole`); a one-token input has a call of its own. So every
embedding is bitwise the same alone or batched (measured: 1e-7 apart otherwise), at the price
of more, smaller llama_decode calls in a step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from worker.backends import weight_buffers
from worker.backends.base import (
    BatchEntry,
    DecodeStatus,
    ModelMeta,
    Pooling,
    RowRecipe,
    Sample,
    SampleItem,
)
from worker.backends.llama_lib import RUNTIME, ll, llc
from worker.backends.lora import LoraError, check_gguf
from worker.backends.media import Vision
from worker.backends.mtmd import EncodeShare, MtmdVision
from worker.protocol.sampler_order import DEFAULT_ORDER
from worker.protocol.sampling import LoraKey, SamplingParams
from worker.text.fim import FimTokens

log = logging.getLogger("worker.llama_cpp")

Progress = Callable[[str, float], None]

# Flash attention on the CPU switches to its tiled kernel at this many rows of one sequence.
FA_TILE_ROWS = 64
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_MAX_POST_PROBS = 64  # post-sampling candidates kept (a request asks for 20 at most)

KV_TYPES: dict[str, int] = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30,
}
FLASH_ATTN: dict[str, int] = {"auto": -1, "off": 0, "on": 1}
_SPLIT_MODES: dict[str, int] = {"none": 0, "layer": 1, "row": 2}  # llama_split_mode
POOLING_TYPES: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

_GGML_LOG_WARN = 3
_GGML_LOG_CONT = 5
_backend_ready = False


_buffers = weight_buffers.BufferReport()  # the weight buffers of the load in progress


def _on_llama_log(level: int, text: bytes, _user: Any) -> None:
    # Only warnings and errors: llama.cpp's info chatter would flood the router's 50-line tail.
    if level >= _GGML_LOG_WARN and level != _GGML_LOG_CONT and text:
        msg = text.decode(errors="replace").rstrip()
        if msg:
            log.warning("llama.cpp: %s", msg)
    elif _buffers.active and text:
        _buffers.feed(text.decode(errors="replace"))


_LOG_CALLBACK = ll.llama_log_callback(_on_llama_log)  # module-level: must outlive every call

# The same library through ctypes.PyDLL: calls that keep the GIL. ctypes' CDLL releases and
# re-acquires the GIL around every call; for calls of a few microseconds that is pure cost, and
# each re-acquisition waits for the event-loop thread (up to the 5 ms switch interval, longer when
# the OS has descheduled it). Only llama_decode, the one long call per step, releases the GIL.
_PYLIB = ctypes.PyDLL(llc._lib._name)


def _holding_gil(cfunc: Any) -> Any:
    f = getattr(_PYLIB, cfunc.__name__)
    f.argtypes = cfunc.argtypes
    f.restype = cfunc.restype
    return f


_sampler_sample = _holding_gil(ll.llama_sampler_sample)
_get_logits = _holding_gil(ll.llama_get_logits)
_memory_seq_rm = _holding_gil(ll.llama_memory_seq_rm)
_sampler_apply = _holding_gil(ll.llama_sampler_apply)
_sampler_accept = _holding_gil(ll.llama_sampler_accept)
_vocab_is_eog = _holding_gil(ll.llama_vocab_is_eog)
_token_to_piece = _holding_gil(ll.llama_token_to_piece)


def _address(sampler: Any) -> int:
    return ctypes.cast(sampler, ctypes.c_void_p).value or 0


def _greedy(logits: np.ndarray, ids: np.ndarray, bias: np.ndarray) -> int:
    """llama.cpp's logit-bias then greedy sampler on one row: the first token of the highest
    biased logit; -1 when that is NaN (the sampler's own `>` never picks a NaN: let it decide)."""
    if not len(ids):
        token = int(np.argmax(logits))
        return -1 if np.isnan(logits[token]) else token
    # The bias on the row in place and the row put back as it was (exactly: the saved values), in
    # place of a copy of the whole row (49,152 floats for SmolLM2: ~90 us a row, 6 ms a step at 64
    # slots, for the two EOG tokens `ignore_eos` biases).
    if not logits.flags.writeable:  # a saved row we may not touch
        logits = logits.copy()
    saved = logits[ids]
    logits[ids] += bias
    token = int(np.argmax(logits))
    is_nan = bool(np.isnan(logits[token]))
    logits[ids] = saved
    return -1 if is_nan else token


def _init_llama_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


class _Rows:
    """A `llama_batch` over numpy arrays of capacity `n` rows, one sequence id per row: token ids
    (`_BatchBuffers`) or embedding rows (`_EmbdBuffers`, an image chunk's)."""

    def __init__(self, n: int, token: Any = None, embd: Any = None) -> None:
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.logits = np.zeros(n, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * n)(*(ctypes.cast(base + 4 * i, i32p) for i in range(n)))
        self.batch = ll.llama_batch(
            n_tokens=0,
            token=token,
            embd=embd,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )


class _BatchBuffers(_Rows):
    """Token rows."""

    def __init__(self, n: int) -> None:
        self.token = np.zeros(n, dtype=np.int32)
        super().__init__(n, token=self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))

    def fill(self, entries: Sequence[BatchEntry], arange: np.ndarray, all_outputs: bool = False) -> list[int]:
        """Write `entries`; return the batch index of every output row (an entry's last n_outputs).
        `all_outputs`: every row is an output (an embedding context requires it)."""
        out_rows: list[int] = []
        i = 0
        for e in entries:
            n = len(e.tokens)
            j = i + n
            if n == 1:
                self.token[i] = e.tokens[0]
                self.pos[i] = e.pos
            else:
                self.token[i:j] = e.tokens
                self.pos[i:j] = arange[e.pos : e.pos + n]
            self.seq[i:j] = e.seq_id
            self.logits[i:j] = 1 if all_outputs else 0
            if e.logits:
                k = min(e.n_outputs, n)
                self.logits[j - k : j] = 1
                out_rows.extend(range(j - k, j))
            i = j
        self.batch.n_tokens = i
        return out_rows


class _EmbdBuffers(_Rows):
    """Embedding rows (an image chunk's), capacity `n` rows of `n_embd`."""

    def __init__(self, n: int, n_embd: int) -> None:
        self.embd = np.zeros((n, n_embd), dtype=np.float32)
        super().__init__(n, embd=self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))

    def fill(self, entries: Sequence[BatchEntry], arange: np.ndarray, all_outputs: bool = False) -> list[int]:
        out_rows: list[int] = []
        i = 0
        for e in entries:
            assert e.embd is not None
            n = len(e.tokens)
            j = i + n
            self.embd[i:j] = e.embd
            self.pos[i:j] = arange[e.pos : e.pos + n]
            self.seq[i:j] = e.seq_id
            self.logits[i:j] = 1 if all_outputs else 0
            if e.logits:
                self.logits[j - 1] = 1
                out_rows.append(j - 1)
            i = j
        self.batch.n_tokens = i
        return out_rows


class LlamaCppBackend:
    """The `Backend` Protocol over a GGUF file (see worker/backends/base.py)."""

    supports_seq_state = True
    # A verify entry (several rows of one sequence) runs in a llama_decode of its own beside the
    # one-row entries (`_calls`): drafting beside other generating slots costs that call too.
    verify_apart = True

    def __init__(
        self,
        model_path: str,
        *,
        n_ctx: int = 4096,
        n_slots: int = 4,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_gpu_layers: int | None = None,
        split_mode: str = "layer",
        tensor_split: Sequence[float] = (),
        main_gpu: int = 0,
        threads: int | None = None,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        flash_attn: str = "auto",
        kv_unified: bool = False,
        progress: Progress | None = None,
        embedding: bool = False,
        pooling: Pooling | None = None,
        mmproj: str | None = None,
        image_max_pixels: int = 0,
        audio_max_seconds: float = 0.0,
        repack: weight_buffers.RepackMode = "auto",
    ) -> None:
        _init_llama_backend()
        if repack not in weight_buffers.REPACK_MODES:
            raise ValueError(f"repack: {repack!r} is not one of {', '.join(weight_buffers.REPACK_MODES)}")
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"model file not found: {model_path}")
        for name, value in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
            if value not in KV_TYPES:
                raise ValueError(f"{name}: {value!r} is not one of {sorted(KV_TYPES)}")
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn: {flash_attn!r} is not one of {sorted(FLASH_ATTN)}")
        if n_slots < 1:
            raise ValueError("n_slots must be at least 1")
        if pooling is not None and pooling not in POOLING_TYPES:
            raise ValueError(f"pooling: {pooling!r} is not one of {', '.join(POOLING_TYPES)}")
        self._embedding = embedding
        self._req_pooling = pooling
        self.pooling: Pooling | None = None  # set once the context tells which pooling it runs
        self.pools_in_pieces = False
        self._embeddings: list[np.ndarray] = []  # per logits entry of the last decode (embedding models)
        self._path = model_path
        self._req_n_ctx = n_ctx
        self._n_slots = n_slots
        self.n_seq_max = n_slots + 1  # the last sequence is the engine's staging one
        self.n_batch = n_batch
        self.n_ubatch = min(n_ubatch, n_batch)
        if embedding and self.n_ubatch % self.n_seq_max:
            # llama.cpp reserves its pooling graph for n_ubatch rows rounded up to a multiple of
            # n_seq_max but n_ubatch outputs, and aborts (ggml_can_mul_mat) unless they agree.
            self.n_ubatch = max(self.n_ubatch - self.n_ubatch % self.n_seq_max, self.n_seq_max)
            self.n_batch = max(self.n_batch, self.n_ubatch) if self.n_batch > n_ubatch else self.n_ubatch
            log.info(
                "embeddings: ubatch size %d (a multiple of the %d sequences)", self.n_ubatch, self.n_seq_max
            )
        self._n_gpu_layers = -1 if n_gpu_layers is None else n_gpu_layers
        if split_mode not in _SPLIT_MODES:
            raise ValueError(f"split_mode: {split_mode!r} is not one of {', '.join(_SPLIT_MODES)}")
        self._split_mode, self._tensor_split, self._main_gpu = split_mode, tuple(tensor_split), main_gpu
        self._threads = threads or _default_threads()
        self._type_k = KV_TYPES[cache_type_k]
        self._type_v = KV_TYPES[cache_type_v]
        self.flash_attn = flash_attn
        self.kv_unified = kv_unified
        self.runs_by_seq_id = not kv_unified  # llama.cpp's split_equal: a ubatch per run of consecutive ids
        # "auto" is flash attention on the CPU (llama.cpp's choice); its recipe holds either way.
        # Without it prompt pieces may be of any size >= 2 rows, which bounds the others'
        # inter-token latency better while a long prompt comes in on a small CPU.
        self.recipe = RowRecipe() if flash_attn == "off" else RowRecipe(short_prompt=FA_TILE_ROWS)
        self._progress = progress or (lambda phase, fraction: None)
        self._abort = threading.Event()
        self._model: Any = None
        self._ctx: Any = None
        self._outputs: list[
            tuple[np.ndarray | None, int]
        ] = []  # per logits entry: (copied row | None, batch row)
        # The last decode's llama_decode calls of output rows only (one-row entries, verify
        # entries): (rows, seconds) each, what the engine's step-cost fit learns from. A step's
        # verify entries run in calls of their own (`_calls`), so the whole decode's time would
        # charge the fit with the extra calls' fixed cost as if it were rows.
        self.timed_calls: list[tuple[int, float]] = []
        # The last llama_decode's logits: one view of llama.cpp's output buffer per (address, rows)
        # (the buffer moves only when it grows), and each output's batch row -> its row there.
        self._views: dict[int, np.ndarray] = {}  # the logits buffer's address -> a view of it
        self._view: np.ndarray | None = None
        self._row_of: dict[int, int] = {}
        self._pieces: dict[int, bytes] = {}
        self._eog_ids: list[int] | None = None
        # LoRA adapters by id (worker/backends/lora.py): their files (None: unloaded), the loaded
        # llama.cpp objects (freed with the model, reloaded at wake), and the set the context runs.
        self._lora_paths: list[str | None] = []
        self._lora_ptrs: list[Any] = []
        self._lora_set: LoraKey = ()

        # Which extra buffer types the weights may take (worker/backends/weight_buffers.py),
        # decided before the full load; the buffers they took are read from llama.cpp's report.
        self.repack = weight_buffers.plan(repack, weight_buffers.available(llc._lib))
        self.weight_buffers: dict[str, float] = {}
        self.cxx_runtime = RUNTIME
        log.info("weights: extra buffer types %s (%s)%s", ", ".join(self.repack.allowed) or "none",
                 self.repack.reason,
                 f"; left out: {', '.join(self.repack.left_out)}" if self.repack.left_out else "")
        self._vocab_model = self._load_model(vocab_only=True)
        self._vocab = ll.llama_model_get_vocab(self._vocab_model)
        self._grammar_lock = threading.Lock()
        self._grammar_tok: Any = None  # llguidance's view of the vocabulary, made at first use
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        if mmproj and not os.path.isfile(mmproj):
            raise FileNotFoundError(f"mmproj file not found: {mmproj}")
        self._load()
        self._meta = self._read_meta()
        self._buf = _BatchBuffers(self.n_batch)
        n_embd = int(ll.llama_model_n_embd(self._model))  # (a vocab-only model says 0)
        self._ebuf = _EmbdBuffers(self.n_batch, n_embd) if mmproj else None  # image and audio rows
        # libmtmd tokenizes with the vocab-only model, which outlives sleep.
        self._share = EncodeShare(self._threads) if mmproj else None  # the cores, beside an encode
        self._cur_threads = self._threads
        self.vision: Vision | None = MtmdVision(
            mmproj, self._vocab_model, n_embd, max_pixels=image_max_pixels,
            max_audio_seconds=audio_max_seconds, use_gpu=self._n_gpu_layers != 0, share=self._share,
        ) if mmproj else None
        self._arange = np.arange(self.n_ctx + self.n_batch, dtype=np.int32)
        self._token_data = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        self._vocab_ids = np.arange(self.n_vocab, dtype=np.int32)
        # Samplers that are a logit bias (or none) and greedy: sampler address -> the bias's
        # (token ids, values). `sample` picks their token with one numpy argmax over the row in
        # place of llama_sampler_sample, which first copies the whole vocabulary into candidates.
        self._argmax: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # -- loading ------------------------------------------------------------------------
    def abort_loading(self) -> None:
        """Make an in-progress load stop at the next progress callback (any thread)."""
        self._abort.set()

    def _load_model(self, *, vocab_only: bool) -> Any:
        params = ll.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = self._n_gpu_layers
        self._place_on_gpus(params)
        if not vocab_only:

            def on_progress(fraction: float, _user: Any) -> bool:
                self._progress("loading weights", float(fraction))
                return not self._abort.is_set()

            self._progress_cb = ll.llama_progress_callback(on_progress)  # kept alive on self
            params.progress_callback = self._progress_cb
            params.use_extra_bufts = self.repack.use_extra_bufts
            weight_buffers.restrict(llc._lib, self.repack.allowed)
            _buffers.sizes, _buffers.active = {}, True
        try:
            model = ll.llama_model_load_from_file(self._path.encode(), params)
        finally:
            if not vocab_only:
                _buffers.active = False
                self.weight_buffers = {k: round(v, 2) for k, v in _buffers.sizes.items()}
        if not model:
            if self._abort.is_set():
                raise RuntimeError("model loading aborted")
            raise RuntimeError(f"llama.cpp failed to load {self._path!r} (not a valid GGUF model?)")
        return model

    def _place_on_gpus(self, params: Any) -> None:
        """--split-mode, --main-gpu, --tensor-split (the array kept alive on self, as llama.cpp
        reads it during the load). A CPU build has no GPU to split over: they change nothing."""
        params.split_mode = _SPLIT_MODES[self._split_mode]
        params.main_gpu = self._main_gpu
        if self._tensor_split:
            n = int(ll.llama_max_devices())
            if len(self._tensor_split) > n:
                log.warning("--tensor-split: %d parts, this build takes %d devices: the first ones only",
                            len(self._tensor_split), n)
            self._c_tensor_split = (ctypes.c_float * n)(*self._tensor_split[:n])
            params.tensor_split = self._c_tensor_split

    def _load(self) -> None:
        self._model = self._load_model(vocab_only=False)
        self._progress("creating context", 0.0)
        cp = ll.llama_context_default_params()
        n_ctx = self._req_n_ctx or int(ll.llama_model_n_ctx_train(self._model))
        if self.kv_unified:
            cp.n_ctx = n_ctx
        else:  # a stream of n_ctx / n_slots cells per slot, and one more for staging
            if n_ctx < self._n_slots:
                raise ValueError(
                    f"--ctx-size {n_ctx} gives less than one cell to each of {self._n_slots} slots"
                )
            cp.n_ctx = n_ctx // self._n_slots * self.n_seq_max
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_ubatch
        cp.n_seq_max = self.n_seq_max
        cp.n_threads = self._threads
        cp.n_threads_batch = self._threads
        cp.flash_attn_type = FLASH_ATTN[self.flash_attn]
        cp.type_k = self._type_k
        cp.type_v = self._type_v
        cp.kv_unified = self.kv_unified
        cp.no_perf = True
        if self._embedding:
            cp.embeddings = True
            cp.pooling_type = POOLING_TYPES[self._req_pooling] if self._req_pooling is not None else -1
        ctx = ll.llama_init_from_model(self._model, cp)
        if not ctx:
            ll.llama_model_free(self._model)
            self._model = None
            raise RuntimeError("llama.cpp failed to create a context (out of memory? bad --ctx-size?)")
        self._ctx = ctx
        self._mem = ll.llama_get_memory(ctx)
        self.n_ctx = int(ll.llama_n_ctx(ctx))
        self.n_ctx_seq = int(ll.llama_n_ctx_seq(ctx))
        if self._embedding:
            names = {v: k for k, v in POOLING_TYPES.items()}
            self.pooling = names[int(ll.llama_pooling_type(ctx))]  # type: ignore[assignment]  # POOLING_TYPES keys are the Pooling literals
            rank = self.pooling == "rank"
            causal = bool(ll.llama_get_causal_attn(ctx))
            self.pools_in_pieces = self.pooling == "last" or (rank and causal)
            self._n_embd_out = int(
                ll.llama_model_n_cls_out(self._model) if rank else ll.llama_model_n_embd_out(self._model)
            )
        log.info(
            "context: %d cells, %d per sequence, flash attention %s",
            self.n_ctx,
            self.n_ctx_seq,
            self.flash_attn,
        )
        self._progress("warming up", 1.0)
        self._warmup()

    def _warmup(self) -> None:
        """One throwaway decode pages the weights in, so the first request is not slow."""
        bos = ll.llama_vocab_bos(self._vocab)
        tok = bos if bos >= 0 else 0
        buf = _BatchBuffers(1)
        buf.fill(
            [BatchEntry(seq_id=0, tokens=[tok], pos=0, logits=True)],
            np.arange(1, dtype=np.int32),
            self._embedding,
        )
        ll.llama_decode(self._ctx, buf.batch)
        ll.llama_memory_clear(self._mem, True)

    def _read_meta(self) -> ModelMeta:
        tmpl = ll.llama_model_chat_template(self._model, None)
        bos = int(ll.llama_vocab_bos(self._vocab))
        eos = int(ll.llama_vocab_eos(self._vocab))
        rerank = ll.llama_model_chat_template(self._model, b"rerank")
        return ModelMeta(
            path=self._path,
            n_vocab=self.n_vocab,
            n_ctx_train=int(ll.llama_model_n_ctx_train(self._model)),
            n_params=int(ll.llama_model_n_params(self._model)),
            size_bytes=int(ll.llama_model_size(self._model)),
            bos_token=self._piece(bos, special=True).decode(errors="replace") if bos >= 0 else "",
            eos_token=self._piece(eos, special=True).decode(errors="replace") if eos >= 0 else "",
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos=bool(ll.llama_vocab_get_add_bos(self._vocab)),
            chat_template=tmpl.decode(errors="replace") if tmpl else None,
            fim=FimTokens(*(int(f(self._vocab)) for f in (ll.llama_vocab_fim_pre, ll.llama_vocab_fim_suf,
                                                           ll.llama_vocab_fim_mid, ll.llama_vocab_fim_rep,
                                                           ll.llama_vocab_fim_sep))),
            add_eos=bool(ll.llama_vocab_get_add_eos(self._vocab)),
            add_sep=bool(ll.llama_vocab_get_add_sep(self._vocab)),
            sep_token_id=int(ll.llama_vocab_sep(self._vocab)),
            rerank_template=rerank.decode(errors="replace") if rerank else None,
        )

    @property
    def meta(self) -> ModelMeta:
        return self._meta

    @property
    def is_sleeping(self) -> bool:
        return self._ctx is None

    # -- tokenizer (any thread) -----------------------------------------------------------
    def _check_open(self) -> None:
        # The vocab pointer dangles once the model is freed: a late HTTP call must not segfault.
        if self._vocab_model is None:
            raise RuntimeError("the model is closed")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self._check_open()
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            arr = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, parse_special)
            if n >= 0:
                return list(arr[:n])
            cap = -n

    def _piece(self, token: int, *, special: bool) -> bytes:
        self._check_open()
        buf = ctypes.create_string_buffer(64)
        n = _token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        if special:  # not cached: /detokenize only
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"token id {token} out of range [0, {self.n_vocab})")
            return self._piece(token, special=True)
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"token id {token} out of range [0, {self.n_vocab})")
            piece = self._pieces[token] = self._piece(token, special=False)
        return piece

    def is_eog(self, token: int) -> bool:
        return bool(_vocab_is_eog(self._vocab, token))

    def grammar_tokenizer(self) -> Any:
        with self._grammar_lock:
            if self._grammar_tok is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                self._grammar_tok = lltokenizer_from_vocab(
                    self._vocab, n_vocab=self.n_vocab, eos_token=self._eog_tokens()
                )
            return self._grammar_tok

    def _eog_tokens(self) -> list[int]:
        if self._eog_ids is None:
            self._eog_ids = [t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, t)]
        return self._eog_ids

    # -- engine thread ----------------------------------------------------------------------
    def decode(self, entries: Sequence[BatchEntry]) -> DecodeStatus:
        """Prompt pieces first (each its own ubatch), then every one-row entry in one call."""
        if self._share is None:
            return self._decode(entries)
        with self._share.step() as n:  # fewer threads while media are encoded beside (mtmd.py)
            if n != self._cur_threads:
                ll.llama_set_n_threads(self._ctx, n, n)
                self._cur_threads = n
            return self._decode(entries)

    def _decode(self, entries: Sequence[BatchEntry]) -> DecodeStatus:
        n = sum(len(e.tokens) for e in entries)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"batch of {n} tokens (capacity {self.n_batch})")
        calls = self._calls(entries)
        self.timed_calls = []
        done: list[BatchEntry] = []
        where: dict[int, list[tuple[np.ndarray | None, int]]] = {}  # id(entry) -> its rows' logits
        pooled: dict[int, np.ndarray] = {}  # id(entry) -> its embedding (embedding models)
        for k, call in enumerate(calls):
            buf: _BatchBuffers | _EmbdBuffers = self._buf
            if call[0].embd is not None:  # an image chunk's rows: a call of their own
                assert self._ebuf is not None, "media rows for a model loaded without --mmproj"
                buf = self._ebuf
            rows = buf.fill(call, self._arange, self._embedding)
            t0 = time.perf_counter()
            ret = ll.llama_decode(self._ctx, buf.batch)
            if ret != 0:
                for e in done:  # nothing of this batch stays in the KV cache
                    self.seq_rm(e.seq_id, e.pos)
                if ret == 1:
                    self._outputs = []
                    return DecodeStatus.NO_KV_SPACE
                raise RuntimeError(f"llama_decode failed with status {ret}")
            done.extend(call)
            if self._embedding:
                pooled.update(self._read_embeddings(call))
                continue
            if rows:
                self._take_logits(rows)  # (llama_get_logits: the device's sync, on a GPU)
            if all(e.is_output_rows for e in call):
                self.timed_calls.append((sum(len(e.tokens) for e in call), time.perf_counter() - t0))
            is_last = k == len(calls) - 1
            it = iter(rows)
            for e in call:
                if e.logits:
                    mine = [next(it) for _ in range(min(e.n_outputs, len(e.tokens)))]
                    where[id(e)] = [(None, r) if is_last else (self._logits_row(r).copy(), r) for r in mine]
        if self._embedding:
            self._embeddings = [pooled[id(e)] for e in entries if e.logits]
            return DecodeStatus.OK
        self._outputs = [o for e in entries if e.logits for o in where[id(e)]]
        return DecodeStatus.OK

    def _read_embeddings(self, call: list[BatchEntry]) -> dict[int, np.ndarray]:
        """The outputs of the llama_decode just run (the next one overwrites them): each
        entry's pooled vector, or with pooling none its rows' vectors."""
        out: dict[int, np.ndarray] = {}
        n = self._n_embd_out
        i = 0
        for e in call:
            if e.logits:
                if self.pooling == "none":
                    rows = [np.ctypeslib.as_array(ll.llama_get_embeddings_ith(self._ctx, i + r), shape=(n,))
                            for r in range(len(e.tokens))]
                    out[id(e)] = np.array(rows, dtype=np.float32)
                else:
                    ptr = ll.llama_get_embeddings_seq(self._ctx, e.seq_id)
                    if not ptr:
                        raise RuntimeError(f"llama.cpp returned no embedding for sequence {e.seq_id}")
                    out[id(e)] = np.ctypeslib.as_array(ptr, shape=(1, n)).copy()
            i += len(e.tokens)
        return out

    def embedding(self, index: int) -> np.ndarray:
        return self._embeddings[index]

    def _calls(self, entries: Sequence[BatchEntry]) -> list[list[BatchEntry]]:
        """llama_decode calls whose ubatches give every row the kernels the recipe promises:
        prompt pieces grouped (consecutive sequences, as llama.cpp's ubatch split requires)
        wherever the split that llama.cpp will make of the group keeps every piece's rows in
        their class, then all one-row entries in one last call."""
        rows = [e for e in entries if len(e.tokens) == 1 and e.embd is None]
        calls: list[list[BatchEntry]] = []
        for e in sorted((e for e in entries if len(e.tokens) > 1 and e.embd is None), key=lambda e: e.seq_id):
            last = calls[-1] if calls else None
            if last is not None and last[-1].seq_id + 1 == e.seq_id and self._keeps_classes([*last, e]) and (
                not self._embedding or self._keeps_whole([*last, e])
            ):
                last.append(e)
            else:
                calls.append([e])
        calls.extend([e] for e in entries if e.embd is not None)  # media rows: each chunk's run alone
        if rows and self._embedding:  # one-token inputs: the one-row kernel always, alone or not
            calls.extend([r] for r in rows)
        elif rows:
            calls.append(rows)
        return calls

    def _keeps_whole(self, pieces: list[BatchEntry]) -> bool:
        """Embedding models: llama.cpp's split keeps every piece in one ubatch (it pools per ubatch).
        Mean pooling never groups: llama.cpp pools by a matmul over all the ubatch's rows, whose
        sums round differently with the row count (1e-7, measured), and an embedding must not
        depend on what else was batched."""
        if self.pooling == "mean":
            return False
        n = len(pieces[0].tokens)
        return all(len(e.tokens) == n for e in pieces) and n * len(pieces) <= self.n_ubatch

    def _keeps_classes(self, pieces: list[BatchEntry]) -> bool:
        """Whether llama.cpp's split of these pieces (consecutive sequences, in order) into
        ubatches (`split_equal`: t rows of each sequence of a run of consecutive ones, t the
        fewest left, at most n_ubatch in all) leaves every row in its class: no one-row ubatch
        (another matmul kernel), t >= 2 rows of a sequence without flash attention, and with it
        a piece of 64+ rows never cut below 64 (flash attention's tiled kernel)."""
        fa = self.recipe.short_prompt > 0

        def min_rows(n: int) -> int:
            if not fa:
                return 2
            return self.recipe.short_prompt if n >= self.recipe.short_prompt else 1

        left = [len(e.tokens) for e in pieces]
        need = [min_rows(n) for n in left]
        while any(left):
            first = next(i for i, n in enumerate(left) if n)
            run = [first]
            while run[-1] + 1 < len(left) and left[run[-1] + 1]:
                run.append(run[-1] + 1)
            t = max(1, min(min(left[i] for i in run), self.n_ubatch // len(run)))
            if t * len(run) < 2 or any(t < need[i] for i in run):
                return False
            for i in run:
                left[i] -= t
        return True

    def seq_rm(self, seq_id: int, p0: int) -> None:
        if self._ctx is not None and self._mem and not _memory_seq_rm(self._mem, seq_id, p0, -1):
            # A partial removal can fail only for recurrent models; drop the whole sequence.
            _memory_seq_rm(self._mem, seq_id, 0, -1)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        if self._ctx is None or src == dst:
            return
        if self.kv_unified:  # the cells are shared, nothing is copied
            _memory_seq_rm(self._mem, dst, 0, -1)
            ll.llama_memory_seq_cp(self._mem, src, dst, 0, n)
        else:
            # Across streams llama_memory_seq_cp copies the cells' metadata at once but the data
            # only at the next decode: a state saved or restored meanwhile (the prompt cache, on
            # either stream) would be read stale or overwritten. The sequence's state instead is
            # copied now, and only its own cells, not the whole stream.
            state = self.seq_state_get(src)  # None: src holds nothing, and neither will dst
            _memory_seq_rm(self._mem, dst, 0, -1)
            if state is not None and not self.seq_state_set(dst, state):
                raise RuntimeError(f"could not copy sequence {src}'s KV into sequence {dst}")
            _memory_seq_rm(self._mem, dst, n, -1)

    def seq_state_get(self, seq_id: int) -> bytearray | None:
        if self._ctx is None:
            return None
        n = int(ll.llama_state_seq_get_size(self._ctx, seq_id))
        if n <= 0:
            return None
        state = bytearray(n)
        got = int(ll.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * n).from_buffer(state), n, seq_id))
        return state if got == n else None

    def seq_state_set(self, seq_id: int, state: bytearray) -> bool:
        if self._ctx is None:
            return False
        n = len(state)
        return (
            int(ll.llama_state_seq_set_data(self._ctx, (ctypes.c_uint8 * n).from_buffer(state), n, seq_id))
            == n
        )

    def new_sampler(self, params: SamplingParams, seed: int) -> Any:
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_params(no_perf=True))
        self._argmax.pop(_address(chain), None)  # a sampler freed unseen may have left its address
        add = ll.llama_sampler_chain_add
        bias = dict(params.logit_bias)
        if params.ignore_eos:
            bias.update({t: float("-inf") for t in self._eog_tokens()})
        bias = {t: b for t, b in bias.items() if 0 <= t < self.n_vocab}
        if bias:
            arr = (ll.llama_logit_bias * len(bias))(*(ll.llama_logit_bias(t, b) for t, b in bias.items()))
            add(chain, ll.llama_sampler_init_logit_bias(self.n_vocab, len(bias), arr))
        default_order = params.order == DEFAULT_ORDER
        if params.is_greedy and default_order:
            if params.has_penalties:
                add(chain, self._penalties(params))
            add(chain, ll.llama_sampler_init_greedy())
            if not params.has_penalties:
                ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
                values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
                self._argmax[_address(chain)] = (ids, values)
            return chain
        # The request's chain, in its order (llama-server's `samplers`; a stage that is off adds
        # nothing). Greedy: the truncations keep the top token, so they matter only before the
        # penalties, and temperature 0 is the greedy pick itself.
        for stage in params.order:
            if stage == "penalties" and params.has_penalties:
                add(chain, self._penalties(params))
            elif stage == "top_k" and params.top_k > 0:
                add(chain, ll.llama_sampler_init_top_k(params.top_k))
            elif stage == "top_p" and params.top_p < 1.0:
                add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
            elif stage == "min_p" and params.min_p > 0.0:
                add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
            elif stage == "temperature" and not params.is_greedy:
                add(chain, ll.llama_sampler_init_temp(params.temperature))
        if params.is_greedy:
            add(chain, ll.llama_sampler_init_greedy())
        else:
            add(chain, ll.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def _penalties(self, params: SamplingParams) -> Any:
        # llama.cpp allocates the whole window up front: a client's 2**31 would be 8 GB per
        # sampler (an OOM kill); more than the context is never looked at anyway.
        last_n = self.n_ctx if params.repeat_last_n < 0 else min(params.repeat_last_n, self.n_ctx)
        return ll.llama_sampler_init_penalties(
            self.n_vocab, last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty
        )

    def is_row_independent(self, sampler: Any) -> bool:
        return _address(sampler) in self._argmax  # logit bias and greedy only: no state, no RNG

    def free_sampler(self, sampler: Any) -> None:
        self._argmax.pop(_address(sampler), None)
        ll.llama_sampler_free(sampler)

    def _take_logits(self, rows: list[int]) -> None:
        """After a llama_decode: its output rows (batch indices, in batch order, which is the
        order of llama.cpp's output buffer) as rows of one numpy view. One call per decode
        instead of a llama_get_logits_ith and an array wrapper per output: right after a decode
        has streamed the weights through the caches, each of those cost 30-60 us."""
        address = ctypes.cast(_get_logits(self._ctx), ctypes.c_void_p).value or 0
        if address == 0:
            raise RuntimeError("llama.cpp returned no logits for the last decode")
        # One view per buffer over the most rows it has held, sliced per decode: a view per row
        # count cost a ctypes array type each (~1 ms), and speculation's counts vary step to step.
        # llama.cpp's output buffer only grows (output_reserve), so rows it once held stay inside.
        view = self._views.get(address)
        if view is None or len(view) < len(rows):
            buf = (ctypes.c_float * (len(rows) * self.n_vocab)).from_address(address)
            view = np.ctypeslib.as_array(buf).reshape(len(rows), self.n_vocab)
            self._views = {address: view}  # the buffer moved: views of the old one would dangle
        self._view = view[: len(rows)]
        self._row_of = {r: j for j, r in enumerate(rows)}

    def _logits_row(self, batch_idx: int) -> np.ndarray:
        """The logits of the last llama_decode's output at batch index `batch_idx` (a view)."""
        assert self._view is not None
        row: np.ndarray = self._view[self._row_of[batch_idx]]
        return row

    def logits_row(self, logits_index: int) -> np.ndarray:
        copied, row = self._outputs[logits_index]
        return (copied if copied is not None else self._logits_row(row)).copy()

    def sample(self, items: Sequence[SampleItem], params: Sequence[SamplingParams]) -> list[Sample]:
        out: list[Sample] = []
        for item, p in zip(items, params, strict=True):
            row: np.ndarray | None = item.logits
            idx = -1
            if row is None:
                row, idx = self._outputs[item.logits_index]
            logprobs: np.ndarray | None = None
            if p.logprobs:
                logprobs = _log_softmax(row if row is not None else self._logits_row(idx))
            post: list[tuple[int, float]] | None = [] if p.logprobs and p.post_sampling_probs else None
            argmax = self._argmax.get(_address(item.sampler)) if item.mask is None else None
            if argmax is not None and post is None:  # greedy: llama.cpp's pick, without the candidates' copy
                # (a row of the last decode, a row copied out of an earlier decode call of the step
                # (a verify entry's), or a saved row)
                token = _greedy(row if row is not None else self._logits_row(idx), *argmax)
                if token >= 0:
                    _sampler_accept(item.sampler, token)
                elif row is None:
                    token = int(_sampler_sample(item.sampler, self._ctx, idx))
                else:  # a NaN on top: the sampler decides, as for any row held outside the context
                    token = self._sample_row(item.sampler, row.copy(), None)
            elif row is None and post is None:  # a row of the last llama_decode: the sampler reads it
                if item.mask is not None:
                    self._logits_row(idx)[~item.mask] = -np.inf
                token = int(_sampler_sample(item.sampler, self._ctx, idx))
            else:
                source = row if row is not None else self._logits_row(idx).copy()
                token = self._sample_row(item.sampler, source, item.mask, post)
            if logprobs is None:
                out.append(Sample(token))
            elif post is None:
                out.append(Sample(token, float(logprobs[token]), _top(logprobs, p.top_logprobs)))
            else:
                chosen = next((q for t, q in post if t == token), 1.0 if p.is_greedy else 0.0)
                out.append(Sample(token, float(logprobs[token]), _top(logprobs, p.top_logprobs), chosen,
                                  post[: p.top_logprobs] if not p.is_greedy else [(token, 1.0)]))
        return out

    def _sample_row(self, sampler: Any, row: np.ndarray, mask: np.ndarray | None,
                    post: list[tuple[int, float]] | None = None) -> int:
        """What llama_sampler_sample does, for a logits row held outside the context. `post`: filled
        with the candidates the chain left and their probabilities, most likely first (p > 0)."""
        data = self._token_data
        data["id"] = self._vocab_ids
        data["logit"] = row
        data["p"] = 0.0
        if mask is not None:
            data["logit"][~mask] = -np.inf
        arr = ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=self.n_vocab, selected=-1, sorted=False
        )
        _sampler_apply(sampler, ctypes.byref(arr))
        token = int(arr.data[arr.selected].id)
        if post is not None:
            left = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                         shape=(arr.size * _TOKEN_DATA.itemsize,)).view(_TOKEN_DATA)
            order = np.argsort(-left["p"], kind="stable")[:_MAX_POST_PROBS]
            post.extend((int(left["id"][i]), float(left["p"][i])) for i in order if left["p"][i] > 0)
        _sampler_accept(sampler, token)
        return token

    # -- LoRA adapters (engine thread) ----------------------------------------------------------
    def load_lora(self, path: str) -> tuple[str, str]:
        """Load a GGUF adapter as the next id; its (task_name, prompt_prefix). LoraError (the
        reason) when it does not fit the model."""
        meta = check_gguf(path, self._path)
        ptr = ll.llama_adapter_lora_init(self._model, path.encode())
        if not ptr:
            raise LoraError(f"{path}: llama.cpp failed to load the adapter (see the worker's log)")
        self._lora_paths.append(path)
        self._lora_ptrs.append(ptr)
        return meta

    def unload_lora(self, lora_id: int) -> None:
        """Free adapter `lora_id` (it must not be in the current set); its id is not reused."""
        if self._lora_set and any(i == lora_id for i, _ in self._lora_set):
            self.set_lora(())
        if self._lora_ptrs[lora_id] is not None:
            ll.llama_adapter_lora_free(self._lora_ptrs[lora_id])
        self._lora_ptrs[lora_id] = None
        self._lora_paths[lora_id] = None

    def set_lora(self, key: LoraKey) -> None:
        """Run the next decodes with the adapters and scales of `key` (() the base model)."""
        if key == self._lora_set:
            return
        n = len(key)
        ptrs = (llc.llama_adapter_lora_p_ctypes * max(n, 1))(*(self._lora_ptrs[i] for i, _ in key))
        scales = (ctypes.c_float * max(n, 1))(*(s for _, s in key))
        if ll.llama_set_adapters_lora(self._ctx, ptrs if n else None, n, scales if n else None) != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed for {key}")
        self._lora_set = key

    def sleep(self) -> None:
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            ll.llama_model_free(self._model)  # frees its adapters too
            self._model = None
            self._lora_ptrs = [None] * len(self._lora_ptrs)
            self._lora_set = ()

    def wake(self) -> None:
        """Reload the weights, the context and every adapter; all or nothing. A failed wake (an
        adapter's file changed or went away while asleep) frees what it had loaded and raises: the
        backend is asleep again, whole. Half-awake (a context, a NULL adapter pointer) it would
        count as awake and hand the NULL to llama_set_adapters_lora at the next decode: a segfault."""
        if self._ctx is not None:
            return
        self._abort.clear()
        try:
            self._load()
            self._cur_threads = self._threads
            for i, path in enumerate(self._lora_paths):
                if path is not None:
                    ptr = ll.llama_adapter_lora_init(self._model, path.encode())
                    if not ptr:
                        raise RuntimeError(
                            f"LoRA adapter {i} ({path}) could not be loaded again at wake: its file "
                            "changed or went away while the model slept. The model stays asleep: put "
                            "the file back (or, with --lora-runtime, unload the adapter: POST "
                            "/v1/unload_lora_adapter)")
                    self._lora_ptrs[i] = ptr
        except BaseException:
            self.sleep()  # frees the context, the weights and the adapters loaded so far
            raise

    def close(self) -> None:
        self.sleep()
        if isinstance(self.vision, MtmdVision):
            self.vision.close()
        if self._vocab_model is not None:
            ll.llama_model_free(self._vocab_model)
            self._vocab_model = None


def _default_threads() -> int:
    """Physical cores we may run on (llama-server's default): hyperthreads only add contention."""
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return max(1, min(physical, len(os.sched_getaffinity(0))))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    out: np.ndarray = x - np.log(np.exp(x).sum())
    return out


def _top(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    k = min(k, logprobs.shape[0])
    ids = np.argpartition(-logprobs, k - 1)[:k]
    ids = ids[np.argsort(-logprobs[ids], kind="stable")]
    return [(int(t), float(logprobs[t])) for t in ids]
