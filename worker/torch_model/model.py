"""The Llama-family forward pass over one flat, mixed batch (gpt-fast / nano-vllm style).

Covers Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm): RMSNorm,
rotary embeddings (HF "rotate half" layout), grouped-query attention, SwiGLU, tied or untied
embeddings. q/k/v and gate/up projections are packed into one matrix each at load time
(`load_weights` maps HF names onto row slices), so a layer is four matmuls.

A forward pass takes every token of the batch as one row: decoding slots (one token each) and
prompt pieces alike; all matmuls run over the flat [T, hidden] batch. Each token writes its
K/V into the cache cell the KV cache gave it, then attends over its sequence's cells through
the step's attention plan (`KVCache.plan`: per-sequence position -> cell tables). Only the
rows in `logit_rows` go through the final norm and the LM head.

Numerics mirror transformers (RMSNorm in float32, RoPE tables computed in float32 and cast to
the model dtype) so float32 logits match `LlamaForCausalLM` to ~1e-5.

CPU weight prepacking (`Model.prepack_cpu`): plain `F.linear` on CPU hands the weight to an
sgemm that re-packs it into its blocked layout on every call, which for the few rows of a
decode step costs as much as the multiply itself. After loading, the four layer matrices and
the LM head are reordered once into oneDNN's blocked layout and run through
`torch.ops.mkldnn._linear_pointwise` (the kernel inductor's freezing pass uses): 2-4x faster
matmuls at 1-16 rows on float32 and bfloat16 alike, same arithmetic up to summation order.
The plain weights are dropped afterwards (the embedding table stays for lookups).

Fused CPU kernels (`Model.use_cpu_kernels`, worker/torch_model/cpu_kernels.py): on float32 and
bfloat16 CPU models each layer runs as RMSNorm -> qkv matmul -> RoPE+KV store -> attention ->
o matmul (+ residual, one oneDNN call in float32) -> RMSNorm -> gate_up matmul -> SiLU*up ->
down matmul (+ residual): nine calls instead of ~45 torch ops. One attention kernel computes
every row, prompt and decode rows alike, reading each sequence's cells straight from the pool
through its table.

Batch invariance (why the kernel path can be exact): every step of a layer computes each row on
its own, by arithmetic that does not depend on the other rows: the kernels are row-wise, and
the attention kernel's order of reduction depends on the row's position only (cpu_kernels.c).
The matmuls are oneDNN's, whose kernel choice depends on the row count: on some CPUs float32
on prepacked weights gives every row bitwise the same result whatever the row count (an AVX2
EPYC, checked for 1..2100 rows), on others not (an AVX-512 Xeon), so `matmuls_row_invariant`
probes the model's own weights at load. Where it holds, a row's logits are a function of its
sequence's tokens alone: not of the batch around it, of how its prompt was cut into pieces, or
of whether its prefix KV was shared from another sequence. bfloat16 runs `F.linear` (oneDNN
has no bf16 prepacking without avx512bw), and the torch path's SDPA and gathers are not batch
invariant either: those results hold to rounding only.

LoRA adapters (worker/torch_model/lora.py): `set_lora` gives each layer the active set's
low-rank pairs; a packed matmul's output then gets its update added (not merged into W).

Without the kernels (float16, a GPU, or no C compiler) `Layer.forward` runs the same layer as
torch ops, attention through SDPA over keys gathered by the tables.

Why one file of over 500 lines: the forward pass and the loading that lays out its weights are
one unit whose layouts must agree (q/k/v and gate/up packed as row slices, oneDNN-prepacked
matrices, the fused kernels' inputs); the kernels and the attention plan live elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.torch_model import cpu_kernels
from worker.torch_model.config import ModelConfig, RopeConfig
from worker.torch_model.cpu_kernels import Kernels
from worker.torch_model.kv_cache import AttnGroup, AttnPlan
from worker.torch_model.lora import Pair, update


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:
    """Per-pair inverse frequencies in float32, computed exactly as transformers does."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv / rope.factor
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv


def rope_tables(rope: RopeConfig, head_dim: int, n_pos: int) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [n_pos, head_dim] (float32)."""
    freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), rope_inv_freq(rope, head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttnPlan) -> Tensor:
    """q [T, n_heads, d]; k/v_cache [n_cells + 1, n_kv_heads, d] -> [T, n_heads * d].

    GQA without repeating K/V: the query heads sharing one KV head are folded into the query
    length (rows head-group-major), so each KV head is read once.
    """
    t, n_heads, d = q.shape
    n_kv_heads = k_cache.shape[1]
    group = n_heads // n_kv_heads
    groups = plan.groups
    if len(groups) == 1 and isinstance(groups[0].rows, slice) and groups[0].rows == slice(0, t):
        return _attend(q, k_cache, v_cache, groups[0], group)
    out = q.new_empty((t, n_heads * d))
    for g in groups:
        out[g.rows] = _attend(q[g.rows], k_cache, v_cache, g, group)
    return out


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, g: AttnGroup, group: int) -> Tensor:
    rows, n_heads, d = q.shape
    b = g.mask.shape[0]
    tq = rows // b
    n_kv_heads = k_cache.shape[1]
    qg = q.view(b, tq, n_kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, n_kv_heads, group * tq, d)
    if g.cells is None:
        n = g.mask.shape[-1]
        k, v = k_cache[:n].transpose(0, 1)[None], v_cache[:n].transpose(0, 1)[None]
    else:
        flat = g.cells.view(-1)  # index_select is ~8x faster than advanced indexing here
        k = k_cache.index_select(0, flat).view(*g.cells.shape, n_kv_heads, d).transpose(1, 2)
        v = v_cache.index_select(0, flat).view(*g.cells.shape, n_kv_heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask)
    return out.view(b, n_kv_heads, group, tq, d).permute(0, 3, 1, 2, 4).reshape(rows, n_heads * d)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """`F.linear`, or the oneDNN kernel when `w` was prepacked by `prepack_weight`."""
    if w.is_mkldnn:
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return out
    return F.linear(x, w, b)


def linear_add(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor) -> Tensor:
    """`residual + linear(x, w, b)`, the add fused into the oneDNN call when `w` is prepacked and
    float32 (where that is the same arithmetic; in 16-bit the fused add skips a rounding step)."""
    if w.is_mkldnn and x.dtype == torch.float32:
        out: Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, b, "add")
        return out
    return residual + linear(x, w, b)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN on this CPU runs matmuls in `dtype` (float16 needs AVX512-FP16 or AVX-NE-CONVERT)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def prepack_weight(w: Tensor, rows_hint: int = 8) -> Tensor:
    """A [out, in] weight reordered into oneDNN's blocked layout (valid for any row count)."""
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows_hint)
    return packed


# Row counts at which `Model.matmuls_row_invariant` compares rows with the same rows alone: small
# batches, block multiples and one past them (tail blocks).
PROBE_ROWS = (1, 2, 3, 8, 9, 16, 17, 33, 64, 65, 129, 257, 513)


def _rows_agree(
    w: Tensor, bias: Tensor | None, add: bool, counts: list[int], dtype: torch.dtype, gen: torch.Generator
) -> bool:
    """Whether `linear` (or `linear_add`) of random rows gives the first rows and the last row of
    every row count in `counts` bitwise as it gives them alone."""
    n_out, n_in = w.shape
    x = torch.randn(counts[-1], n_in, generator=gen).to(dtype)
    res = torch.randn(counts[-1], n_out, generator=gen).to(dtype)

    def run(a: int, b: int) -> Tensor:
        return linear_add(x[a:b], w, bias, res[a:b]) if add else linear(x[a:b], w, bias)

    checked = sorted({0, 1, 2, *(m - 1 for m in counts)} & set(range(counts[-1])))
    alone = {r: run(r, r + 1)[0] for r in checked}
    for m in counts:
        out = run(0, m)
        if not all(torch.equal(out[r], alone[r]) for r in checked if r < m):
            return False
    return True


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Layer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.cfg = cfg
        self.split = [q, kv, kv]
        self.input_norm = _param((h,), dtype, device)
        self.post_norm = _param((h,), dtype, device)
        self.qkv = _param((q + 2 * kv, h), dtype, device)
        self.qkv_bias = _param((q + 2 * kv,), dtype, device) if qkv_bias else None
        self.o = _param((h, q), dtype, device)
        self.o_bias = _param((h,), dtype, device) if o_bias else None
        self.q_norm = _param((cfg.head_dim,), dtype, device) if qk_norm else None
        self.k_norm = _param((cfg.head_dim,), dtype, device) if qk_norm else None
        self.gate_up = _param((2 * i, h), dtype, device)
        self.down = _param((h, i), dtype, device)
        # What forward multiplies by: the parameters themselves, or their prepacked copies
        # (a plain dict: nn.Module would register the aliases as parameters).
        self.w: dict[str, Tensor] = {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}
        self.lora: dict[str, Pair] = {}  # the active LoRA set's pairs by packed target (Model.set_lora)

    def _mm(self, name: str, x: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        """x @ w[name]^T (+ bias, + residual), plus the active LoRA update of that target."""
        w = self.w[name]
        out = linear(x, w, bias) if residual is None else linear_add(x, w, bias, residual)
        pair = self.lora.get(name)
        return out if pair is None else out + update(x, pair)

    def prepack_cpu(self) -> None:
        for name in ("qkv", "o", "gate_up", "down"):
            param = getattr(self, name)
            self.w[name] = prepack_weight(param.data)
            param.data = param.data.new_empty(0)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cells: Tensor,
        plan: AttnPlan,
    ) -> Tensor:
        cfg, t = self.cfg, x.shape[0]
        eps = cfg.rms_norm_eps
        qkv = self._mm("qkv", rms_norm(x, self.input_norm, eps), self.qkv_bias)
        h, d = cfg.num_heads, cfg.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = torch.split(qkv, self.split, dim=-1)
            q = apply_rope(rms_norm(q.view(t, h, d), self.q_norm, eps), cos, sin)
            k = apply_rope(rms_norm(k.view(t, cfg.num_kv_heads, d), self.k_norm, eps), cos, sin)
        else:  # q and k heads rotate as one [T, heads + kv_heads, d] view
            qk = apply_rope(qkv[:, : self.split[0] + self.split[1]].view(t, -1, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, self.split[0] + self.split[1] :]
        k_cache.index_copy_(0, cells, k)
        v_cache.index_copy_(0, cells, v.view(t, cfg.num_kv_heads, d))
        o = attention(q, k_cache, v_cache, plan)
        x = self._mm("o", o, self.o_bias, x)
        gate, up = self._mm("gate_up", rms_norm(x, self.post_norm, eps)).chunk(2, dim=-1)
        return self._mm("down", F.silu(gate) * up, None, x)

    def forward_fused(
        self, x: Tensor, positions: Tensor, cells: Tensor, plan: AttnPlan, k_cache: Tensor, v_cache: Tensor,
        cos: Tensor, sin: Tensor, kern: Kernels, nt: int,
    ) -> Tensor:
        """`forward` on the fused CPU kernels; cos/sin are the whole tables, not per-token rows."""
        cfg = self.cfg
        eps, h, kvh, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._mm("qkv", kern.rms_norm(x, self.input_norm, eps, nt), self.qkv_bias)
        kern.rope_store(
            qkv, h, kvh, d, cos, sin, positions, cells, k_cache, v_cache, self.q_norm, self.k_norm, eps, nt
        )
        o = qkv.new_empty((x.shape[0], h * d))
        kern.attn(
            o,
            qkv,
            h,
            kvh,
            d,
            k_cache,
            v_cache,
            plan.tables,
            plan.row_seq,
            plan.row_pos,
            cfg.sliding_window,
            nt,
        )
        x = self._mm("o", o, self.o_bias, x)
        gate_up = self._mm("gate_up", kern.rms_norm(x, self.post_norm, eps, nt))
        return self._mm("down", kern.silu_mul(gate_up, nt), None, x)


class Model(nn.Module):
    """Weights plus RoPE tables; `forward` is one step over a flat batch (see module doc)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        n_pos: int = 4096,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.embed = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            Layer(cfg, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, dtype=dtype, device=device)
            for _ in range(cfg.num_layers)
        )
        self.norm = _param((cfg.hidden_size,), dtype, device)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        )
        self.w: dict[str, Tensor] = {"lm_head": self.lm_head}  # see Layer.w
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)
        self.ensure_positions(n_pos)
        self.kernels: Kernels | None = None

    @property
    def prepacked(self) -> bool:
        return self.w["lm_head"].is_mkldnn

    def prepack_cpu(self) -> None:
        """Reorder every matmul weight into oneDNN's layout (see module doc); call after loading."""
        if self.prepacked or not can_prepack(self.device, self.dtype):
            return
        for layer in self.layers:
            assert isinstance(layer, Layer)
            layer.prepack_cpu()
        self.w["lm_head"] = prepack_weight(self.lm_head.data)
        if self.lm_head is not self.embed:
            self.lm_head.data = self.lm_head.data.new_empty(0)

    @torch.inference_mode()
    def matmuls_row_invariant(self, max_rows: int) -> bool:
        """Whether every prepacked matmul gives each row bitwise the same result whatever the row
        count. oneDNN picks its kernel by shape, row count and thread count: on some CPUs all row
        counts agree (the AVX2 machine this was written on, checked up to 2100 rows), on others
        they do not (an AVX-512 Xeon: a 1-row product differs from the same row among others, and
        from 16 rows on some shapes differ again). So this probes the model's own weights, as
        forward calls them, at PROBE_ROWS row counts up to `max_rows`: evidence, not proof."""
        if not self.prepacked:
            return False
        layer = cast(Layer, self.layers[0])
        counts = [m for m in PROBE_ROWS if m <= max_rows]
        gen = torch.Generator().manual_seed(0)
        cases = [
            (layer.w["qkv"], layer.qkv_bias, False),
            (layer.w["o"], layer.o_bias, True),
            (layer.w["gate_up"], None, False),
            (layer.w["down"], None, True),
            (self.w["lm_head"], None, False),
        ]
        return all(_rows_agree(w, bias, add, counts, self.dtype, gen) for w, bias, add in cases)

    def use_cpu_kernels(self) -> bool:
        """Run on the fused CPU kernels from now on if this model can (see module doc)."""
        cfg = self.cfg
        if cpu_kernels.usable(self.device, self.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            self.kernels = cpu_kernels.load()
        return self.kernels is not None

    def set_lora(self, pairs: list[dict[str, Pair]] | None) -> None:
        """The LoRA set the next forwards add (lora.build_set's, one dict per layer); None: none."""
        for i, layer in enumerate(self.layers):
            cast(Layer, layer).lora = pairs[i] if pairs is not None else {}

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def ensure_positions(self, n_pos: int) -> None:
        """Grow the RoPE tables to cover positions [0, n_pos)."""
        if self.cos.shape[0] >= n_pos and self.cos.device == self.device:
            return
        cos, sin = rope_tables(self.cfg.rope, self.cfg.head_dim, max(n_pos, self.cos.shape[0]))
        self.cos = cos.to(device=self.device, dtype=self.dtype)
        self.sin = sin.to(device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cells: Tensor,
        plan: AttnPlan,
        logit_rows: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        embd: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """tokens, positions, cells: [T]; plan: see kv_cache; returns float32 logits of logit_rows [R, V].
        `embd`: (rows, vectors) that replace those rows' token embeddings (an image's, in a VLM)."""
        x = self._final_norm(self._trunk(tokens, positions, cells, plan, k_cache, v_cache, embd)[logit_rows])
        return linear(x, self.w["lm_head"]).float()

    @torch.inference_mode()
    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor,
        cells: Tensor,
        plan: AttnPlan,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        """Every row's final-normed hidden state [T, H] (what llama.cpp's embeddings pool)."""
        return self._final_norm(self._trunk(tokens, positions, cells, plan, k_cache, v_cache))

    def _trunk(
        self,
        tokens: Tensor,
        positions: Tensor,
        cells: Tensor,
        plan: AttnPlan,
        k_cache: Tensor,
        v_cache: Tensor,
        embd: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        x = F.embedding(tokens, self.embed)
        if embd is not None:
            x = x.index_copy(0, embd[0], embd[1].to(x.dtype))
        kern = self.kernels
        if kern is not None:
            nt = torch.get_num_threads()
            for i, layer in enumerate(self.layers):
                x = cast(Layer, layer).forward_fused(
                    x, positions, cells, plan, k_cache[i], v_cache[i], self.cos, self.sin, kern, nt
                )
            return x
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_cache[i], v_cache[i], cells, plan)
        return x

    def _final_norm(self, x: Tensor) -> Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, torch.get_num_threads())
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    # -- loading -------------------------------------------------------------------------

    def _target(self, name: str) -> tuple[Tensor, int, int] | None:
        """HF tensor name -> (destination parameter, row offset, rows); None for ignored names."""
        cfg = self.cfg
        name = name.replace("model.text_model.", "model.", 1)  # a VLM's text model (Idefics3)
        parts = name.removeprefix("model.").split(".")
        if parts == ["embed_tokens", "weight"]:
            return self.embed, 0, cfg.vocab_size
        if parts == ["norm", "weight"]:
            return self.norm, 0, cfg.hidden_size
        if parts == ["lm_head", "weight"]:
            return (None if cfg.tie_word_embeddings else (self.lm_head, 0, cfg.vocab_size))
        if parts[0] != "layers" or "rotary_emb" in parts:
            return None
        layer = self.layers[int(parts[1])]
        assert isinstance(layer, Layer)
        q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        module, kind = ".".join(parts[2:-1]), parts[-1]
        packed = {
            "self_attn.q_proj": ("qkv", 0, q),
            "self_attn.k_proj": ("qkv", q, kv),
            "self_attn.v_proj": ("qkv", q + kv, kv),
            "self_attn.o_proj": ("o", 0, cfg.hidden_size),
            "mlp.gate_proj": ("gate_up", 0, i),
            "mlp.up_proj": ("gate_up", i, i),
            "mlp.down_proj": ("down", 0, cfg.hidden_size),
            "input_layernorm": ("input_norm", 0, cfg.hidden_size),
            "post_attention_layernorm": ("post_norm", 0, cfg.hidden_size),
            "self_attn.q_norm": ("q_norm", 0, cfg.head_dim),
            "self_attn.k_norm": ("k_norm", 0, cfg.head_dim),
        }
        if module not in packed:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        attr, offset, rows = packed[module]
        if kind == "bias":
            attr = {"qkv": "qkv_bias", "o": "o_bias"}.get(attr, attr + "_bias")
        param = getattr(layer, attr, None)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        return param, offset, rows

    def load_weights(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors into the packed parameters; every parameter must be covered."""
        filled: dict[int, int] = {}
        for name, tensor in tensors:
            target = self._target(name)
            if target is None:
                continue
            param, offset, rows = target
            if tensor.shape[0] != rows or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit the config")
            param.data[offset : offset + rows].copy_(tensor)
            filled[id(param)] = filled.get(id(param), 0) + rows
        for pname, param in self.named_parameters():
            if filled.get(id(param), 0) != param.shape[0]:
                raise ValueError(f"checkpoint does not fill parameter {pname} (model code layout)")
