"""`ModelConfig`: the parts of an HF `config.json` the Llama-family forward pass needs.

Accepts transformers 4 (`rope_theta` + `rope_scaling`) and transformers 5 (`rope_parameters`)
spellings. RoPE scaling types: default, linear, llama3. Anything else is rejected at load
time with the key path in the message, rather than silently producing wrong logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_parameters.rope_type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=theta,
        type=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("model_type") == "idefics3":  # SmolVLM: its text model (the vision side: vision.py)
        raw = {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **raw["text_config"]}
    model_type = str(raw.get("model_type", "llama"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (supported: silu)")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    window = raw.get("sliding_window")
    # Qwen2 ships a sliding_window value but only uses it when use_sliding_window is true.
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=_rope_from(raw),
        sliding_window=int(window) if window else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=_ids(raw.get("bos_token_id"))[0] if _ids(raw.get("bos_token_id")) else None,
        eos_token_ids=_ids(raw.get("eos_token_id")),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    return parse_config(json.loads(path.read_text(encoding="utf-8")))
