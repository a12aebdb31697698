"""LoRA adapters on the torch model: PEFT folders, applied as low-rank updates in the forward pass.

A PEFT folder (adapter_config.json + adapter_model.safetensors, worker/backends/lora.py) adapts
some of a layer's projections: W x becomes W x + s * c * B (A x), with c = lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)) and s the scale the request gives. The base weights are never
touched: the model keeps one copy of them, prepacked, and a step adds the update of the active
set to the output of the matmul it belongs to.

The model packs q/k/v into one `qkv` matrix and gate/up into `gate_up` (model.py), so an
adapter's pieces are packed the same way: per layer and packed target, A_cat [R x n_in] stacks
the A of every adapted projection of that target, and B_cat [n_out x R] puts each B at its
projection's rows and its own rank columns (zeros elsewhere). One update is then two small
matmuls per packed target, `(x @ A_cat.T) @ B_cat.T`, whatever projections are adapted. An
adapter set (several adapters at their scales: `LoraSet.build`) concatenates its adapters'
A_cat and s * c * B_cat along the rank.

Checks (`load_peft`), each a ValueError that says why: not a LoRA PEFT folder, options we do
not run (DoRA, fan_in_fan_out, bias, modules_to_save, per-module rank or alpha patterns), a
module the model does not have, and an A or B whose shape does not fit the model's projection
(an adapter made for another base model).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from worker.torch_model.config import ModelConfig

# PEFT module name -> (packed target, which piece of it)
_PIECES = {
    "self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
    "self_attn.o_proj": ("o", 0), "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
    "mlp.down_proj": ("down", 0),
}
TARGETS = ("qkv", "o", "gate_up", "down")

Pair = tuple[Tensor, Tensor]  # (A_cat [R x n_in], B_cat [n_out x R])


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[list[int], int]]:
    """packed target -> (its pieces' row counts, n_in)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": ([q, kv, kv], h), "o": ([h], q), "gate_up": ([i, i], h), "down": ([h], i)}


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One adapter, packed: per layer, per adapted target, (A_cat, c * B_cat)."""

    path: str
    layers: list[dict[str, Pair]]

    def to(self, device: torch.device, *, pin: bool = False) -> LoraWeights:
        """The same adapter with every tensor on `device` (with `pin`: in pinned host memory, so
        that the copy back to the GPU at wake is asynchronous)."""

        def move(t: Tensor) -> Tensor:
            if pin:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t)
                return host
            return t.to(device, non_blocking=True)

        return LoraWeights(self.path, [{k: (move(a), move(b)) for k, (a, b) in layer.items()}
                                       for layer in self.layers])

    def tensors(self) -> list[Tensor]:
        return [t for layer in self.layers for pair in layer.values() for t in pair]


def load_peft(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LoraWeights:
    folder = Path(path)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: not a PEFT adapter folder (adapter_config.json: {e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: peft_type {config.get('peft_type')!r}, not LORA")
    for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):  # each is falsy when off
            raise ValueError(f"{folder}: {key} = {config.get(key)!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder}: bias = {config.get('bias')!r} is not supported (only none)")
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    c = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{folder}: no adapter_model.safetensors")
    pieces: dict[tuple[int, str], dict[str, Tensor]] = {}
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            bare = name.removeprefix("base_model.model.").removeprefix("model.")
            module, _, kind = bare.rpartition(".lora_")
            parts = module.split(".")
            if kind not in ("A.weight", "B.weight") or parts[0] != "layers" or len(parts) < 3:
                raise ValueError(f"{folder}: tensor {name!r} is not a layer's lora_A / lora_B weight")
            pieces.setdefault((int(parts[1]), ".".join(parts[2:])), {})[kind[0]] = f.get_tensor(name)
    shapes = target_shapes(cfg)
    layers: list[dict[str, Pair]] = [{} for _ in range(cfg.num_layers)]
    grouped: dict[tuple[int, str], list[tuple[int, Tensor, Tensor]]] = {}
    for (layer, module), ab in pieces.items():
        if module not in _PIECES:
            raise ValueError(f"{folder}: adapts {module!r}, which this model's layers do not have")
        if layer >= cfg.num_layers:
            raise ValueError(f"{folder}: adapts layer {layer}, the model has {cfg.num_layers}: "
                             "made for another base model")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{folder}: layer {layer} {module} has lora_A or lora_B but not both")
        target, piece = _PIECES[module]
        rows, n_in = shapes[target]
        a, b = ab["A"], ab["B"]
        fits = a.dim() == b.dim() == 2 and a.shape[1] == n_in and b.shape[0] == rows[piece]
        if not fits or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{folder}: layer {layer} {module} is {rows[piece]} x {n_in} in the model, the adapter's "
                f"B A is {tuple(b.shape)} times {tuple(a.shape)}: made for another base model"
            )
        grouped.setdefault((layer, target), []).append((piece, a, b))
    for (layer, target), items in grouped.items():
        rows, n_in = shapes[target]
        offsets = [sum(rows[:k]) for k in range(len(rows))]
        a_cat = torch.cat([a for _, a, _ in items]).to(device=device, dtype=dtype)
        b_cat = torch.zeros((sum(rows), a_cat.shape[0]), dtype=torch.float32)
        col = 0
        for piece, a, b in items:
            b_cat[offsets[piece] : offsets[piece] + rows[piece], col : col + a.shape[0]] = b.float() * c
            col += a.shape[0]
        layers[layer][target] = (a_cat, b_cat.to(device=device, dtype=dtype))
    return LoraWeights(str(folder), layers)


def build_set(adapters: list[tuple[LoraWeights, float]], n_layers: int) -> list[dict[str, Pair]]:
    """The active set's per-layer (A, B) pairs: adapters concatenated along the rank, each B scaled."""
    out: list[dict[str, Pair]] = [{} for _ in range(n_layers)]
    for layer in range(n_layers):
        for target in TARGETS:
            pairs = [(w.layers[layer][target], s) for w, s in adapters if target in w.layers[layer]]
            if pairs:
                a = torch.cat([ab[0] for ab, _ in pairs])
                b = torch.cat([ab[1] * s for ab, s in pairs], dim=1)
                out[layer][target] = (a, b)
    return out


def update(x: Tensor, pair: Pair) -> Tensor:
    """The low-rank update of one packed target for rows x: (x A^T) B^T."""
    a, b = pair
    return (x @ a.t()) @ b.t()
