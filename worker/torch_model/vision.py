"""Idefics3 / SmolVLM's vision side in our own code: a SigLIP encoder and the pixel-shuffle
connector, from the HF checkpoint's `model.vision_model.*` and `model.connector.*` tensors.

    tiles [N, 3, S, S] (normalized pixels)
      -> patch convolution (stride = patch size) + learned position embeddings
      -> L pre-norm blocks: x += attn(LN1(x)); x += fc2(gelu_tanh(fc1(LN2(x))))   (biases everywhere)
      -> post LayerNorm
      -> pixel shuffle by `scale_factor` (each s x s block of patches becomes one row, s^2 wider)
      -> one matrix into the text model's width: [N, (S/patch/s)^2, n_embd]

What transformers' Idefics3VisionTransformer and Idefics3Connector compute for full tiles
(every tile a preprocessor makes is full: its patch attention mask is all ones, so the
position ids are 0..n_patches-1), and what libmtmd's clip graph for the idefics3 projector
computes from the mmproj GGUF. The text side is worker/torch_model/model.py's Llama, fed these
rows in place of the image tokens' embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    scale_factor: int
    text_hidden_size: int
    image_token_id: int

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        return self.n_patches // self.scale_factor**2


def vision_config(raw: dict[str, Any]) -> VisionConfig:
    """From an Idefics3 config.json (its vision_config and text_config)."""
    v = raw["vision_config"]
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: vision_config.hidden_act {act!r} is not supported")
    return VisionConfig(
        hidden_size=int(v.get("hidden_size", 1152)), intermediate_size=int(v.get("intermediate_size", 3072)),
        num_layers=int(v.get("num_hidden_layers", 12)), num_heads=int(v.get("num_attention_heads", 16)),
        image_size=int(v.get("image_size", 224)), patch_size=int(v.get("patch_size", 32)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)), scale_factor=int(raw.get("scale_factor", 2)),
        text_hidden_size=int(raw["text_config"]["hidden_size"]), image_token_id=int(raw["image_token_id"]),
    )


def load_vision_config(model_dir: str | Path) -> VisionConfig:
    return vision_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))


class _Block(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = c.hidden_size
        eps, ff = c.layer_norm_eps, c.intermediate_size
        self.ln1, self.ln2 = nn.LayerNorm(h, eps, dtype=dtype), nn.LayerNorm(h, eps, dtype=dtype)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, dtype=dtype) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, ff, dtype=dtype), nn.Linear(ff, h, dtype=dtype)
        self.n_heads = c.num_heads

    def forward(self, x: Tensor) -> Tensor:
        n, t, h = x.shape
        y = self.ln1(x)

        def heads(z: Tensor) -> Tensor:
            return z.view(n, t, self.n_heads, h // self.n_heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(y)), heads(self.k(y)), heads(self.v(y)))
        x = x + self.o(a.transpose(1, 2).reshape(n, t, h))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return out


_NAMES = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
          "self_attn.v_proj": "v", "self_attn.out_proj": "o", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}


class Idefics3Vision(nn.Module):
    """Tiles in, text-width rows out (module doc)."""

    def __init__(
        self, c: VisionConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        self.cfg = c
        h = c.hidden_size
        with torch.device(device):
            self.patch = nn.Conv2d(3, h, c.patch_size, stride=c.patch_size, dtype=dtype)
            self.pos = nn.Embedding(c.n_patches, h, dtype=dtype)
            self.blocks = nn.ModuleList(_Block(c, dtype) for _ in range(c.num_layers))
            self.post_ln = nn.LayerNorm(h, c.layer_norm_eps, dtype=dtype)
            self.proj = nn.Linear(h * c.scale_factor**2, c.text_hidden_size, bias=False, dtype=dtype)

    @torch.inference_mode()
    def forward(self, tiles: Tensor) -> Tensor:
        """[N, 3, S, S] -> [N, tokens_per_tile, text width]."""
        x = self.patch(tiles.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2) + self.pos.weight
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.proj(pixel_shuffle(self.post_ln(x), self.cfg.scale_factor))
        return out

    def load_weights(self, tensors: Iterable[tuple[str, Tensor]]) -> None:
        """HF-named tensors (`model.vision_model.*`, `model.connector.*`; others are skipped);
        every parameter must be covered."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, t in tensors:
            ours = _our_name(name)
            if ours is None:
                continue
            if ours not in params or params[ours].shape != t.shape:
                raise ValueError(f"{name}: unexpected tensor or shape {tuple(t.shape)} for the vision config")
            params[ours].data.copy_(t)
            filled.add(ours)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"checkpoint does not fill vision parameters {missing[:4]}")


def _our_name(name: str) -> str | None:
    if name == "model.connector.modality_projection.proj.weight":
        return "proj.weight"
    prefix = "model.vision_model."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    fixed = {"embeddings.patch_embedding.weight": "patch.weight",
             "embeddings.patch_embedding.bias": "patch.bias",
             "embeddings.position_embedding.weight": "pos.weight",
             "post_layernorm.weight": "post_ln.weight", "post_layernorm.bias": "post_ln.bias"}
    if rest in fixed:
        return fixed[rest]
    parts = rest.split(".")  # encoder.layers.I.<module>.<weight|bias>
    if parts[:2] != ["encoder", "layers"]:
        return None
    module = _NAMES.get(".".join(parts[3:-1]))
    return None if module is None else f"blocks.{parts[2]}.{module}.{parts[-1]}"


def pixel_shuffle(x: Tensor, s: int) -> Tensor:
    """Idefics3's: [N, side*side, C] -> [N, (side/s)^2, C*s*s], each s x s block of patches in one row."""
    n, seq, c = x.shape
    side = int(seq**0.5)
    x = x.view(n, side, side // s, c * s).permute(0, 2, 1, 3)
    x = x.reshape(n, side // s, side // s, c * s * s).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (s * s), c * s * s)
