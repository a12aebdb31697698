"""A Llama-architecture GGUF -> an HF folder (the "twin" our torch backend and transformers load).

transformers can read a GGUF but refuses to `save_pretrained` a model loaded that way, and the
demo must not need transformers at all, so the twin is written here with `gguf`, `numpy`,
`safetensors` and `tokenizers` only:

- weights: every tensor dequantized to float32 (`gguf.quants.dequantize`: Q4_0/Q4_1/Q8_0/K-quants
  alike), renamed to HF's names, and Q/K rows put back in HF's rotate-half order (llama.cpp's
  converter permuted them into interleaved pairs; `unpermute_qk` is its exact inverse). A GGUF
  without `output.weight` has tied embeddings.
- tokenizer.json: a byte-level BPE built with `tokenizers` from the GGUF's token list and merges;
  the GGUF's CONTROL tokens are the special added tokens. The pre-tokenizer is chosen from
  `tokenizer.ggml.pre` (llama.cpp's name for the split regex); a name we have no mapping for is
  an error, not a guess.
- tokenizer_config.json / generation_config.json / config.json: BOS/EOS/PAD/UNK and add-BOS as
  the GGUF says, the GGUF's own chat template, the architecture hyperparameters.

The result is float32: the torch twin holds exactly the values llama.cpp dequantizes to, so
differences between the two backends come from kernels and float order, not from the weights.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's `tokenizer.ggml.pre` -> the HF pre-tokenizer that splits text the same way.
# "smollm" (StarCoder's tokenizer) is llama.cpp's regex
#   \p{N} , 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
# i.e. single digits, then GPT-2's byte-level regex: HF's Digits(individual) + ByteLevel.
_PRE_TOKENIZERS: dict[str, list[dict[str, Any]]] = {
    "gpt-2": [],
    "smollm": [{"type": "Digits", "individual_digits": True}],
    "starcoder": [{"type": "Digits", "individual_digits": True}],
}
_CONTROL = 3  # gguf.TokenType.CONTROL


class ConversionError(ValueError):
    """The GGUF is not something this converter can turn into an HF twin (the message says why)."""


@dataclass(frozen=True)
class GGUFModel:
    """What the converter reads out of a GGUF: metadata values and float32 tensors (GGUF names)."""

    meta: dict[str, Any]
    tensors: dict[str, np.ndarray]

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.meta:
            raise ConversionError(f"GGUF metadata has no {key!r}")
        return self.meta[key]


def read_gguf(path: Path) -> GGUFModel:
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key == "tokenizer.ggml.token_type":
            meta[key] = [int(fld.parts[i][0]) for i in fld.data]
        else:
            meta[key] = fld.contents()
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions innermost first; numpy wants (rows, cols)
        shape = tuple(int(d) for d in reversed(t.shape))
        tensors[t.name] = np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
    return GGUFModel(meta, tensors)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaved-pair row order -> HF rotate-half row order (inverse of its `permute`)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_weights(model: GGUFModel) -> dict[str, np.ndarray]:
    """GGUF tensor names -> HF Llama names, Q/K rows un-permuted."""
    arch = model.need("general.architecture")
    if arch != "llama":
        raise ConversionError(f"general.architecture {arch!r} is not supported (supported: llama)")
    n_head = int(model.need("llama.attention.head_count"))
    n_kv = int(model.get("llama.attention.head_count_kv", n_head))
    t = model.tensors
    out = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"]}
    if "output.weight" in t:
        out["lm_head.weight"] = t["output.weight"]
    for i in range(int(model.need("llama.block_count"))):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = t[b + "attn_norm.weight"]
        out[p + "self_attn.q_proj.weight"] = unpermute_qk(t[b + "attn_q.weight"], n_head)
        out[p + "self_attn.k_proj.weight"] = unpermute_qk(t[b + "attn_k.weight"], n_kv)
        out[p + "self_attn.v_proj.weight"] = t[b + "attn_v.weight"]
        out[p + "self_attn.o_proj.weight"] = t[b + "attn_output.weight"]
        out[p + "post_attention_layernorm.weight"] = t[b + "ffn_norm.weight"]
        out[p + "mlp.gate_proj.weight"] = t[b + "ffn_gate.weight"]
        out[p + "mlp.up_proj.weight"] = t[b + "ffn_up.weight"]
        out[p + "mlp.down_proj.weight"] = t[b + "ffn_down.weight"]
    return out


def hf_config(model: GGUFModel) -> dict[str, Any]:
    n_embd = int(model.need("llama.embedding_length"))
    n_head = int(model.need("llama.attention.head_count"))
    head_dim = int(model.get("llama.rope.dimension_count", n_embd // n_head))
    theta = float(model.get("llama.rope.freq_base", 10000.0))
    if model.get("llama.rope.scaling.type") not in (None, "none"):
        raise ConversionError(
            f"llama.rope.scaling.type {model.get('llama.rope.scaling.type')!r} is not supported"
        )
    eps = float(np.float32(model.need("llama.attention.layer_norm_rms_epsilon")))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(model.need("tokenizer.ggml.tokens")),
        "hidden_size": n_embd,
        "intermediate_size": int(model.need("llama.feed_forward_length")),
        "num_hidden_layers": int(model.need("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(model.get("llama.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(model.get("llama.context_length", 2048)),
        "rms_norm_eps": round(eps, 12),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "bos_token_id": model.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": model.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": model.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hf_tokenizer_json(model: GGUFModel) -> str:
    """tokenizer.json for a GGUF `gpt2` (byte-level BPE) vocabulary, built with `tokenizers`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = model.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConversionError(
            f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, byte-level BPE)"
        )
    pre = str(model.get("tokenizer.ggml.pre", "gpt-2"))
    if pre not in _PRE_TOKENIZERS:
        raise ConversionError(
            f"tokenizer.ggml.pre {pre!r} has no known HF pre-tokenizer (known: {', '.join(_PRE_TOKENIZERS)})"
        )
    tokens: list[str] = list(model.need("tokenizer.ggml.tokens"))
    types: list[int] = list(model.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in model.need("tokenizer.ggml.merges")]
    vocab = {text: i for i, text in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [getattr(pre_tokenizers, s["type"])(**{k: v for k, v in s.items() if k != "type"})
              for s in _PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level]) if splits else byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, ty in enumerate(types) if ty == _CONTROL]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ConversionError("the GGUF vocabulary has duplicate tokens")
    text: str = tok.to_str(pretty=True)
    return text


def hf_tokenizer_config(model: GGUFModel) -> dict[str, Any]:
    tokens: list[str] = list(model.need("tokenizer.ggml.tokens"))
    types: list[int] = list(model.get("tokenizer.ggml.token_type", [1] * len(tokens)))

    def text(key: str) -> str | None:
        idx = model.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "pad_token": text("padding"),
        "unk_token": text("unknown"),
        "add_bos_token": bool(model.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(model.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model.get("llama.context_length", 2048)),
        "chat_template": model.get("tokenizer.chat_template"),
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, ty in enumerate(types) if ty == _CONTROL
        },
    }


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF twin of `gguf_path` into `out_dir`
    (replaced atomically: a crash leaves no half folder)."""
    from safetensors.numpy import save_file

    model = read_gguf(gguf_path)
    config = hf_config(model)
    tokenizer_json = hf_tokenizer_json(model)
    weights = hf_weights(model)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(hf_tokenizer_config(model), indent=2, ensure_ascii=False) + "\n")
    (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
