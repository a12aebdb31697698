"""`TorchBackend`: the Backend Protocol over our own PyTorch Llama-family model code.

One `decode(entries)` is one forward pass over every token of the batch (decoding slots and
prompt pieces together, see worker/torch_model/model.py); `sample` runs the vectorised sampler
chain of worker/torch_model/sampler.py over the rows that asked for logits (or saved rows).

KV (worker/torch_model/kv_cache.py): one pool of cells with a position -> cell table per
sequence and a reference count per cell. `n_seq_max` = n_slots + 1 sequences (the last is the
engine's staging sequence), each of at most `n_ctx_seq` cells: n_ctx / n_slots, or all of n_ctx
with `kv_unified`. The pool has `n_ctx` cells: n_ctx_seq per sequence (every sequence can fill
its share at once), or the n_ctx of a unified pool that the sequences compete for. `seq_cp`
shares cells instead of copying them, and `seq_state_get/set` move a sequence's K/V to host
RAM and back (the engine's prompt cache).

Determinism (`recipe`): on the CPU in float32, with the fused kernels and prepacked weights,
every row is batch invariant where this CPU's oneDNN matmuls are (probed at load, see
model.py): `RowRecipe.exact()`, a sequence's greedy output is bitwise the same alone or
batched, in any prompt pieces, with or without a shared prefix. Any other configuration
(bfloat16, plain F.linear, torch ops, CUDA, a CPU whose matmuls fail the probe) is best effort,
`RowRecipe()`: reproducible to rounding only, not bitwise.

Devices: CUDA when available (bfloat16 by default), else CPU (float32). `dtype` accepts
float32/fp32/f32, bfloat16/bf16, float16/fp16/f16 or auto (config.json's torch_dtype).
With `compile=True` on CUDA, decode-only batches run as captured CUDA graphs
(worker/torch_model/cuda_graphs.py). `threads` sets torch's intra-op threads (on a shared,
oversubscribed CPU fewer threads are much faster: OpenMP barriers stall). On CPU the matmul
weights are prepacked for oneDNN after loading (`Model.prepack_cpu`; `prepack=False` keeps
plain `F.linear`, which the benchmark uses to show the difference), and float32 and bfloat16
layers run on fused C kernels (`cpu_kernels=False` or OMNI_CPU_KERNELS=0 keeps torch ops).
Sleep: on CUDA the weights move to pinned host memory and the KV cache is freed; on CPU both
are dropped and `wake` reloads from disk (either way the KV contents are gone). Construction
(and wake) ends with one tiny warm-up step.

Images (an Idefics3/SmolVLM folder, worker/protocol/modalities.py; not as an embedding model):
the vision tower and connector load beside the text model, and `vision` is a TorchVision
(worker/backends/torch_vision.py) that makes, off the engine thread, the prompt libmtmd makes
for the GGUF twin. Image rows enter `decode` as `BatchEntry.embd`: they replace those rows'
token embeddings (`Model.forward`'s `embd`), in the same step as any other rows; a step without
them costs one check. The CUDA graphs capture token rows only: a step with image rows runs
eagerly.

LoRA adapters (worker/backends/lora.py): PEFT folders, loaded by `load_lora` into packed
low-rank pairs (worker/torch_model/lora.py); `set_lora` gives the model the pairs of a step's
adapter set (built once per set and scales, a few kept), added to each matmul's output, never
merged into the weights. A step with adapters runs eagerly (the CUDA graphs hold none).

Embedding models (`embedding=True`): `decode` runs the same layers, takes every row's
final-normed hidden state (`Model.hidden_states`) instead of logits, and pools each entry that
asks for logits as llama.cpp does (worker/backends/base.py). The default pooling is the
sentence-transformers folder's (1_Pooling/config.json), else none, as llama.cpp's default for a
llama-family GGUF. Pooling reads rows of one forward pass only, so on the exact CPU path an
embedding does not depend on what else was batched. Rank pooling on a Qwen3-Reranker
(worker/text/rerank.py) is its classifier as llama.cpp runs the converted GGUF: the LM head's
"yes" and "no" logits of the last row, softmaxed; on any other model it is llama.cpp's rank
without a head (the last row's first element).

Why one file of over 500 lines: it is the one module through which the engine drives the torch
model (the Backend Protocol's methods, loading on CPU or CUDA, sleep and wake, the KV pool's
calls); the model, its kernels, the KV cache and the sampler are modules of their own.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.backends.base import (
    POOLINGS,
    BatchEntry,
    DecodeStatus,
    ModelMeta,
    Pooling,
    RowRecipe,
    Sample,
    SampleItem,
)
from worker.backends.lora import LoraError
from worker.backends.media import Vision
from worker.protocol.modalities import folder_takes_images
from worker.protocol.sampling import LoraKey, SamplingParams
from worker.text.rerank import QWEN3_RERANK_TEMPLATE, RERANK_LABELS, is_qwen3_reranker
from worker.torch_model.config import ModelConfig, load_config
from worker.torch_model.kv_cache import MAX_MASK_SEQS, KVCache
from worker.torch_model.lora import LoraWeights, Pair, build_set, load_peft
from worker.torch_model.model import Model, linear
from worker.torch_model.sampler import SamplerState, new_state, sample_rows
from worker.torch_model.tokenizer import HFTokenizer
from worker.torch_model.vision import Idefics3Vision, load_vision_config
from worker.torch_model.weights import checkpoint_files, iter_tensors, tensor_names

log = logging.getLogger(__name__)
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")  # a VLM's (worker/torch_model/vision.py)
_LORA_SETS_KEPT = 8  # built adapter sets kept (each a few small matrices per layer)
_ASLEEP = torch.device("cpu")  # where a sleeping backend keeps its LoRA adapters

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}


def resolve_dtype(name: str | None, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    key = name.lower()
    if key == "auto":
        key = (cfg.torch_dtype or "float32").lower()
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (valid: auto, {', '.join(sorted(_DTYPES))})")
    return _DTYPES[key]


class TorchBackend:
    supports_seq_state = True

    def __init__(
        self,
        model_path: str,
        *,
        n_ctx: int,
        n_slots: int,
        kv_unified: bool = False,
        n_batch: int,
        n_ubatch: int = 512,
        device: str | None = None,
        dtype: str | None = None,
        progress: Callable[[str, float], None] | None = None,
        compile: bool = False,
        threads: int | None = None,
        prepack: bool = True,
        cpu_kernels: bool = True,
        embedding: bool = False,
        pooling: Pooling | None = None,
        image_max_pixels: int = 0,
    ) -> None:
        if threads is not None and threads > 0:
            torch.set_num_threads(threads)  # one backend per worker process: global is fine
        self._path = Path(model_path)
        self._progress = progress or (lambda phase, fraction: None)
        self.cfg = load_config(self._path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device, self.cfg)
        self.tokenizer = HFTokenizer(self._path)
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling: {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.pooling: Pooling | None = (pooling or default_pooling(self._path)) if embedding else None
        self._embeddings: list[np.ndarray] = []  # per logits entry of the last decode (embedding models)
        self.pools_in_pieces = self.pooling in ("last", "rank")  # a causal model: the last row is final
        self.vision: Vision | None = None  # an Idefics3 folder's (`_load_vision`), when generating
        self._labels: list[int] | None = None  # a Qwen3-Reranker's "yes" and "no" token ids
        if self.pooling == "rank" and is_qwen3_reranker(self._path):
            self._labels = [self.tokenizer.token_id(t) for t in RERANK_LABELS]
        self._grammar_lock = threading.Lock()
        self._grammar_tok: Any = None  # llguidance's view of the vocabulary, made at first use
        if n_slots < 1:
            raise ValueError(f"n_slots must be at least 1, not {n_slots}")
        n_ctx = n_ctx if n_ctx > 0 else self.cfg.max_position_embeddings
        self.kv_unified = kv_unified
        self.runs_by_seq_id = False  # one forward for a step's rows, whatever their sequences
        self.n_seq_max = n_slots + 1  # the last one is the engine's staging sequence
        self.n_ctx_seq = n_ctx if kv_unified else max(n_ctx // n_slots, 1)
        self.n_ctx = n_ctx if kv_unified else self.n_ctx_seq * self.n_seq_max
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch
        self._files = checkpoint_files(self._path)
        names = {n for n in tensor_names(self._files) if not n.startswith(_VISION_PREFIXES)}
        if self.pooling == "rank" and any(n.startswith(("score.", "classifier.")) for n in names):
            raise ValueError(
                "rank pooling through a sequence-classification head (score/classifier weights) is "
                "not implemented; llama.cpp's rank for a llama-family model without a head is what runs"
            )
        self._layout = {
            "qkv_bias": any(n.endswith("self_attn.q_proj.bias") for n in names),
            "o_bias": any(n.endswith("self_attn.o_proj.bias") for n in names),
            "qk_norm": any(n.endswith("self_attn.q_norm.weight") for n in names),
        }
        self._group = self.cfg.num_heads // self.cfg.num_kv_heads
        self._model: Model | None = None
        self._kv: KVCache | None = None
        self._graphs: Any = None
        self._compile = compile and self.device.type == "cuda"
        if compile and not self._compile:
            log.warning("--compile captures CUDA graphs and needs a CUDA device; ignored on %s", self.device)
        self._prepack = prepack
        self._cpu_kernels = cpu_kernels
        self._n_params = 0
        self._logits = torch.empty(0)
        self._sleeping = False
        self._loras: list[LoraWeights | None] = []  # by adapter id (None: unloaded)
        self._lora_set: LoraKey = ()
        self._lora_sets: dict[LoraKey, list[dict[str, Pair]]] = {}  # built sets, a few
        self._load_weights()
        if not embedding and folder_takes_images(self._path):
            self.vision = self._load_vision(image_max_pixels)
        self.recipe = self._recipe()
        self._alloc_kv()
        self._warm_up()
        n_params = self._n_params
        self._meta = ModelMeta(
            path=str(self._path),
            n_vocab=self.cfg.vocab_size,
            n_ctx_train=self.cfg.max_position_embeddings,
            n_params=n_params,
            size_bytes=n_params * torch.finfo(self.dtype).bits // 8,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            add_bos=self.tokenizer.add_bos,
            chat_template=self.tokenizer.chat_template,
            fim=self.tokenizer.fim_tokens(),
            rerank_template=QWEN3_RERANK_TEMPLATE if self._labels is not None else None,
        )
        log.info(
            "torch backend: %s on %s/%s, %d params, n_ctx=%d (%d per sequence, unified=%s), n_seq_max=%d, "
            "graphs=%s, cpu kernels=%s, exact rows=%s",
            self._path.name, self.device, str(self.dtype).removeprefix("torch."), n_params, self.n_ctx,
            self.n_ctx_seq, kv_unified, self.n_seq_max, self._graphs is not None,
            self._require_model().kernels is not None, self.recipe.exact_rows,
        )

    # -- loading ---------------------------------------------------------------------------

    def _load_weights(self) -> None:
        self._progress("loading weights", 0.0)
        model = Model(self.cfg, dtype=self.dtype, device=self.device, n_pos=self.n_ctx_seq, **self._layout)
        model.load_weights(
            iter_tensors(
                self._files, dtype=self.dtype, device=self.device,
                progress=lambda f: self._progress("loading weights", f),
                keep=lambda name: not name.startswith(_VISION_PREFIXES),  # `_load_vision` reads those
            )
        )
        self._n_params = sum(p.numel() for p in model.parameters())
        if self._prepack:
            model.prepack_cpu()  # a no-op off the CPU
        if self._cpu_kernels:
            model.use_cpu_kernels()  # float32/bfloat16 on the CPU only
        self._model = model

    def _load_vision(self, max_pixels: int) -> Vision:
        """The vision tower and connector (worker/torch_model/vision.py) on the text model's device
        and dtype, behind worker/backends/torch_vision.py's prompt layout. Kept through sleep."""
        from worker.backends.torch_vision import TorchVision  # libmtmd's image decoder: a VLM only

        tower = Idefics3Vision(load_vision_config(self._path), dtype=self.dtype, device=self.device)
        tower.load_weights(iter_tensors(self._files, dtype=self.dtype, device=self.device,
                                        keep=lambda name: name.startswith(_VISION_PREFIXES)))
        return TorchVision(self._path, tower, self.tokenizer, max_pixels=max_pixels)

    def _recipe(self) -> RowRecipe:
        """Exact only where every row is batch invariant (see model.py): the fused kernels on
        float32 weights prepacked for oneDNN, where this CPU's oneDNN kernels pass the probe."""
        model = self._require_model()
        if model.kernels is None or not model.prepacked or self.dtype != torch.float32:
            return RowRecipe()
        if not model.matmuls_row_invariant(self.n_batch):
            log.warning(
                "oneDNN's float32 matmuls are not batch invariant on this CPU: rows reproduce to rounding"
            )
            return RowRecipe()
        return RowRecipe.exact()

    def _alloc_kv(self) -> None:
        cfg = self.cfg
        self._kv = KVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.n_ctx, self.n_seq_max, self.n_ctx_seq,
            self.dtype, self.device,
        )
        self._alloc_graphs()

    def _alloc_graphs(self) -> None:
        if self._compile and not self._require_kv().has_seq_masks:
            log.warning("CUDA graphs need at most %d sequences; decoding eagerly", MAX_MASK_SEQS)
        elif self._compile:
            from worker.torch_model.cuda_graphs import DecodeGraphs

            self._progress("capturing CUDA graphs", 0.0)
            self._graphs = DecodeGraphs(
                self._require_model(),
                self._require_kv(),
                self.n_seq_max,
                self._group,
                self.cfg.sliding_window,
            )

    def _warm_up(self) -> None:
        """One tiny step so the first request does not pay for lazy kernel/allocator setup."""
        self.decode([BatchEntry(0, [0], 0, True)])
        self.seq_rm(0, 0)
        self._progress("ready", 1.0)

    def _require_model(self) -> Model:
        if self._model is None:
            raise RuntimeError("model is not loaded (sleeping?)")
        return self._model

    def _require_kv(self) -> KVCache:
        if self._kv is None:
            raise RuntimeError("KV cache is not allocated (sleeping?)")
        return self._kv

    # -- metadata and tokenizer --------------------------------------------------------------

    @property
    def meta(self) -> ModelMeta:
        return self._meta

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.tokenizer.tokenize(text, add_special, parse_special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        return self.tokenizer.token_to_piece(token, special)

    def is_eog(self, token: int) -> bool:
        return self.tokenizer.is_eog(token)

    def grammar_tokenizer(self) -> Any:
        with self._grammar_lock:
            if self._grammar_tok is None:
                import llguidance

                source = (self._path / "tokenizer.json").read_text(encoding="utf-8")
                eog = sorted(self.tokenizer.eog_ids)
                self._grammar_tok = llguidance.LLTokenizer(source, n_vocab=self.cfg.vocab_size, eos_token=eog)
            return self._grammar_tok

    # -- engine thread ------------------------------------------------------------------------

    def decode(self, entries: Sequence[BatchEntry]) -> DecodeStatus:
        model, kv = self._require_model(), self._require_kv()
        counts = np.fromiter((len(e.tokens) for e in entries), dtype=np.int64, count=len(entries))
        n_tok = int(counts.sum())
        if n_tok == 0:
            self._logits = torch.empty((0, self.cfg.vocab_size), device=self.device)
            return DecodeStatus.OK
        if n_tok > self.n_batch:
            raise ValueError(f"batch of {n_tok} tokens exceeds n_batch={self.n_batch}")
        if counts.min() == 0:
            raise ValueError("a batch entry without tokens")
        tokens = np.fromiter(chain.from_iterable(e.tokens for e in entries), dtype=np.int64, count=n_tok)
        embd = self._embd_rows(entries, counts, tokens)  # image rows: their media ids become token 0
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id out of range [0, {self.cfg.vocab_size})")
        starts = np.fromiter((e.pos for e in entries), dtype=np.int64, count=len(entries))
        seqs = np.fromiter((e.seq_id for e in entries), dtype=np.int64, count=len(entries))
        cells = kv.allocate(seqs, starts, counts)
        if cells is None:
            return DecodeStatus.NO_KV_SPACE
        want = np.fromiter((e.logits for e in entries), dtype=bool, count=len(entries))
        rows = np.cumsum(counts)[want] - 1
        if any(e.n_outputs > 1 for e in entries):  # speculative verify entries: their last n_outputs rows
            ends = np.cumsum(counts)
            rows = np.array([r for e, end in zip(entries, ends.tolist(), strict=True) if e.logits
                             for r in range(end - min(e.n_outputs, len(e.tokens)), end)], dtype=np.int64)
        max_pos = int((starts + counts).max()) - 1
        if max_pos >= model.cos.shape[0]:
            model.ensure_positions(max_pos + 1)
            if self._graphs is not None:  # captured graphs point at the old RoPE tables
                self._graphs = None
                self._alloc_graphs()
        if (
            self._graphs is not None
            and not self._lora_set
            and self.pooling is None
            and embd is None
            and self._graphs.can_run(n_tok, len(entries), len(rows))
        ):
            self._logits = self._graphs.run(tokens, starts, cells, seqs)
            return DecodeStatus.OK
        dev = self.device
        plan = kv.plan(seqs, starts, counts, self._group, self.cfg.sliding_window, sdpa=model.kernels is None)
        if self.pooling is not None:
            hidden = model.hidden_states(
                torch.from_numpy(tokens).to(dev),
                plan.row_pos,
                torch.from_numpy(cells).to(dev),
                plan,
                kv.k,
                kv.v,
            )
            ends = np.cumsum(counts)
            self._embeddings = [
                self._pool(hidden[end - len(e.tokens) : end])
                for e, end in zip(entries, ends.tolist(), strict=True)
                if e.logits
            ]
            return DecodeStatus.OK
        self._logits = model(
            torch.from_numpy(tokens).to(dev), plan.row_pos, torch.from_numpy(cells).to(dev), plan,
            torch.from_numpy(rows).to(dev), kv.k, kv.v, embd=embd,
        )
        return DecodeStatus.OK

    def _embd_rows(
        self, entries: Sequence[BatchEntry], counts: np.ndarray, tokens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(batch rows, embeddings) of the entries that are image rows (worker/backends/media.py);
        their token ids are set to 0 in `tokens` (the embeddings replace them)."""
        if all(e.embd is None for e in entries):
            return None
        ends = np.cumsum(counts)
        idx = [np.arange(end - len(e.tokens), end) for e, end in zip(entries, ends.tolist(), strict=True)
               if e.embd is not None]
        at = np.concatenate(idx)
        tokens[at] = 0
        rows = np.concatenate([e.embd for e in entries if e.embd is not None])
        return torch.from_numpy(at).to(self.device), torch.from_numpy(rows).to(self.device)

    def _pool(self, rows: torch.Tensor) -> np.ndarray:
        """One entry's rows (its whole prompt, or the last piece for last/rank) pooled as llama.cpp does."""
        if self.pooling == "mean":
            out = rows.mean(dim=0, keepdim=True)
        elif self.pooling == "cls":
            out = rows[:1]
        elif self.pooling == "last":
            out = rows[-1:]
        elif self.pooling == "rank" and self._labels is not None:  # a Qwen3-Reranker: P(yes), P(no)
            logits = linear(rows[-1:], self._require_model().w["lm_head"]).float()
            out = torch.softmax(logits[:, self._labels], dim=-1)
        elif self.pooling == "rank":  # causal, no classifier head: llama.cpp's score is the first element
            out = rows[-1:, :1]
        else:
            out = rows
        pooled: np.ndarray = out.float().cpu().numpy().copy()
        return pooled

    def embedding(self, index: int) -> np.ndarray:
        return self._embeddings[index]

    def seq_rm(self, seq_id: int, p0: int) -> None:
        if self._kv is not None:
            self._kv.seq_rm(seq_id, p0)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        """Shares src's cells (one more reference each): no K/V is copied, in either KV mode."""
        self._require_kv().seq_cp(src, dst, n)

    def seq_state_get(self, seq_id: int) -> bytearray | None:
        return self._require_kv().state_get(seq_id)

    def seq_state_set(self, seq_id: int, state: bytearray) -> bool:
        return self._require_kv().state_set(seq_id, state)

    def logits_row(self, logits_index: int) -> np.ndarray:
        row: np.ndarray = self._logits[logits_index].float().cpu().numpy().copy()
        return row

    def new_sampler(self, params: SamplingParams, seed: int) -> SamplerState:
        return new_state(params, seed, self.n_ctx_seq, self.tokenizer.eog_ids)

    def accept(self, sampler: SamplerState, tokens: Sequence[int]) -> None:
        """Feed tokens (e.g. the prompt, as llama-server does) into the penalty window."""
        sampler.accept(tokens)

    def is_row_independent(self, sampler: Any) -> bool:
        return bool(sampler.params.is_greedy and not sampler.params.has_penalties)

    def free_sampler(self, sampler: Any) -> None:
        return None

    def sample(self, items: Sequence[SampleItem], params: Sequence[SamplingParams]) -> list[Sample]:
        """Rows of the last decode (`logits_index`) and saved rows (`logits`) alike; each row is
        sampled on its own (the sampler's per-row ops and per-request RNG)."""
        if not items:
            return []
        dev = self._logits.device
        if all(it.logits is None for it in items):
            x = self._logits.index_select(0, torch.tensor([it.logits_index for it in items], device=dev))
        else:
            x = torch.stack([
                torch.from_numpy(np.asarray(it.logits, dtype=np.float32)).to(dev) if it.logits is not None
                else self._logits[it.logits_index].float()
                for it in items
            ])
        drawn = sample_rows(x, [it.sampler for it in items], params, [it.mask for it in items])
        return [Sample(d.token, d.logprob, d.top_logprobs, d.prob, d.top_probs) for d in drawn]

    # -- lifecycle ------------------------------------------------------------------------------

    # -- LoRA adapters (engine thread) ----------------------------------------------------------
    def load_lora(self, path: str) -> tuple[str, str]:
        try:
            weights = load_peft(path, self.cfg, self.dtype, self.device)
        except (ValueError, OSError, KeyError) as e:
            raise LoraError(str(e)) from None
        self._loras.append(weights)
        return "", ""

    def unload_lora(self, lora_id: int) -> None:
        if any(i == lora_id for i, _ in self._lora_set):
            self.set_lora(())
        self._lora_sets = {k: v for k, v in self._lora_sets.items() if all(i != lora_id for i, _ in k)}
        self._loras[lora_id] = None

    def set_lora(self, key: LoraKey) -> None:
        if key == self._lora_set:
            return
        pairs = None
        if key:
            pairs = self._lora_sets.get(key)
            if pairs is None:
                adapters = [(self._loras[i], s) for i, s in key]
                pairs = build_set([(w, s) for w, s in adapters if w is not None], self.cfg.num_layers)
                if len(self._lora_sets) >= _LORA_SETS_KEPT:
                    self._lora_sets.pop(next(iter(self._lora_sets)))
                self._lora_sets[key] = pairs
        self._require_model().set_lora(pairs)
        self._lora_set = key

    def _park_loras(self, device: torch.device) -> None:
        """Every adapter's tensors to `device` (a sleep: the host; a wake: the model's device). The
        sets built from them and the model's active set are dropped (the next `set_lora` builds
        its set again): left on the GPU, they would hold memory the router counts as freed."""
        if self._model is not None:
            self._model.set_lora(None)
        self._lora_set, self._lora_sets = (), {}
        pin = device.type == "cpu" and self.device.type == "cuda"
        self._loras = [w.to(device, pin=pin) if w is not None else None for w in self._loras]

    def sleep(self) -> None:
        if self._sleeping:
            return
        self._park_loras(_ASLEEP)
        self._graphs = None
        self._kv = None
        self._logits = torch.empty(0)
        if self.device.type == "cuda" and self._model is not None:
            for p in self._model.parameters():
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
                host.copy_(p.data)
                p.data = host
            self._model.cos = self._model.cos.cpu()
            self._model.sin = self._model.sin.cpu()
        else:
            self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._sleeping = True

    def wake(self) -> None:
        if not self._sleeping:
            return
        self._park_loras(self.device)
        if self._model is None:
            self._load_weights()
            self._lora_set = ()  # a new model: no set on it yet
        else:
            for p in self._model.parameters():
                p.data = p.data.to(self.device, non_blocking=True)
            self._model.ensure_positions(self.n_ctx_seq)
            torch.cuda.synchronize(self.device)
        self._alloc_kv()
        self._sleeping = False
        self._warm_up()

    def close(self) -> None:
        self._graphs = None
        self._kv = None
        self._model = None
        self._logits = torch.empty(0)
        gc.collect()


def default_pooling(path: Path) -> Pooling:
    """A sentence-transformers folder's pooling (1_Pooling/config.json, as llama.cpp's converter
    reads it), else none (llama.cpp's default for a llama-family model)."""
    try:
        cfg = json.loads((path / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "none"
    for key, pooling in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                         ("pooling_mode_lasttoken", "last")):
        if cfg.get(key):
            return pooling  # type: ignore[return-value]  # one of the literal names in the tuple above
    return "none"
