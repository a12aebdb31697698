"""Random tiny HF checkpoints of each supported family, built with transformers in tmp dirs.

Each uses the session tiny model's tokenizer files (vocab 1024), so the backend can load it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.testing.tiny_models import ModelPaths

VOCAB = 1024
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,  # peaky logits, so greedy argmax is far from ties
    "bos_token_id": 0,
    "eos_token_id": 2,
}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-attn-bias": ("LlamaForCausalLM", {"attention_bias": True}),
    "llama3-rope": (
        "LlamaForCausalLM",
        {
            "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            },
        },
    ),
    "linear-rope": (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
}

HFModel = Any  # a transformers PreTrainedModel


def build_family(kind: str, out: Path, tokenizer_dir: Path) -> HFModel:
    import transformers

    arch, extra = FAMILIES[kind]
    model_cls = getattr(transformers, arch)
    cfg = model_cls.config_class(**{**COMMON, **extra})
    torch.manual_seed(1234)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return model


@pytest.fixture
def hf_family(tmp_path: Path, tiny_models: ModelPaths) -> Callable[[str], tuple[Path, HFModel]]:
    """kind -> (checkpoint dir, the transformers model it was saved from)."""

    def make(kind: str) -> tuple[Path, HFModel]:
        out = tmp_path / kind
        return out, build_family(kind, out, tiny_models.hf_dir)

    return make
