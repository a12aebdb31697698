"""Tiny LoRA adapters for the tiny Llama (worker/testing/tiny_models.py), in both formats:

    models/tiny-llama-lora-a.gguf          GGUF adapter (llama.cpp's layout, worker/backends/lora.py)
    models/tiny-llama-lora-a/              the same weights as a PEFT folder (adapter_config.json,
                                           adapter_model.safetensors) for the HF twin models/tiny-llama
    models/tiny-llama-lora-b.gguf, -b/     a second adapter (other weights)
    models/tiny-llama-lora-a-merged/       the base with adapter a merged at scale 1 (HF folder) ...
    models/tiny-llama-lora-a-merged-f32.gguf   ... and its GGUF: what "scale 1" must equal
    models/tiny-llama-lora-bad.gguf, -bad/ an adapter made for a model of another width (refused)
    models/tiny-lora-suite-f32.gguf        a stand-in for llama.cpp's test_lora.py (below) ...
    models/tiny-lora-suite-lora.gguf       ... and its adapter

Every attention and MLP projection of every layer is adapted, rank 4, lora_alpha 8 (a scaling
of 2, so alpha is exercised), with B A about as large as the weights themselves: the adapted
model's greedy text differs from the base's from the first tokens. Deterministic (seeded).

The stand-in for llama.cpp's tools/server/tests/unit/test_lora.py. That test runs stories15M_MOE
with a Shakespeare adapter from the hub and checks words of the text at scales 0, 0.3, 0.7 and 1
(scale 0: "little|girl|three|years|old" and "bright|day|many|happy", 0.3: "special|thing|gifted",
0.7: "far|from|home|away", 1: "eye|love|glass|sun"). Neither is here, so
scripts/llama_server_suite.py runs it on a model made to answer those words: the tiny model's
vocabulary plus four whole-word tokens (" old day", " special", " far", " eye"), every token
embedded alike and every layer's weights zero, so that the next token depends on the LM head
alone; the head's logits of the four are lines in the adapter's scale s (a LoRA of rank 1 on
`output.weight` adds s times a slope to each) whose upper envelope is " old day" below s = 0.15,
" special" to 0.5, " far" to 0.85 and " eye" above. The reference llama-server and omni-worker
run the same two files.

Usage:  python -m worker.testing.tiny_lora --out models
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.testing.tiny_models import (
    FORMAT_VERSION,
    SPECS,
    ModelSpec,
    _permute_qk,
    build_once,
    make_weights,
    train_tokenizer,
    write_gguf,
    write_hf,
)

RANK = 4
ALPHA = 8.0
MODULES = {  # HF module -> GGUF tensor (per layer)
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SEEDS = {"a": 77, "b": 78, "bad": 79}


@dataclass(frozen=True)
class LoraPaths:
    gguf: Path
    peft: Path


def lora_paths(out: Path, name: str, base: str = "tiny-llama") -> LoraPaths:
    return LoraPaths(out / f"{base}-lora-{name}.gguf", out / f"{base}-lora-{name}")


def merged_paths(out: Path, base: str = "tiny-llama") -> tuple[Path, Path]:
    """(HF folder, F32 GGUF) of the base with adapter a merged at scale 1."""
    return out / f"{base}-lora-a-merged", out / f"{base}-lora-a-merged-f32.gguf"


def make_lora(spec: ModelSpec, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module path (model.layers.i.<module>) -> (A [r x n_in], B [n_out x r]), float32."""
    rng = np.random.default_rng(seed)
    h, kv, inter = spec.hidden, spec.kv_heads * spec.head_dim, spec.intermediate
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(spec.layers):
        for module, (n_out, n_in) in dims.items():
            a = (rng.standard_normal((RANK, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float32)
            b = rng.standard_normal((n_out, RANK), dtype=np.float32) * np.float32(0.5 / np.sqrt(RANK))
            out[f"model.layers.{i}.{module}"] = (a, b)
    return out


def write_gguf_lora(path: Path, spec: ModelSpec, lora: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    import gguf

    tmp = path.with_suffix(".gguf.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", ALPHA)
    w.add_name(path.stem)
    for key, (a, b) in lora.items():
        i, module = key.split(".")[2], ".".join(key.split(".")[3:])
        tensor = MODULES[module]
        if tensor == "attn_q":  # the base's q/k rows are permuted into llama.cpp's RoPE layout
            b = _permute_qk(b, spec.heads)
        elif tensor == "attn_k":
            b = _permute_qk(b, spec.kv_heads)
        w.add_tensor(f"blk.{i}.{tensor}.weight.lora_a", np.ascontiguousarray(a))
        w.add_tensor(f"blk.{i}.{tensor}.weight.lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def write_peft(folder: Path, spec: ModelSpec, lora: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    from safetensors.numpy import save_file

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tensors: dict[str, np.ndarray] = {}
    for key, (a, b) in lora.items():
        tensors[f"base_model.model.{key}.lora_A.weight"] = a
        tensors[f"base_model.model.{key}.lora_B.weight"] = b
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "target_modules": sorted({m.split(".")[-1] for m in MODULES}), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "base_model_name_or_path": spec.name,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def merged_weights(base: dict[str, np.ndarray], lora: dict[str, tuple[np.ndarray, np.ndarray]],
                   scale: float = 1.0) -> dict[str, np.ndarray]:
    out = dict(base)
    for key, (a, b) in lora.items():
        w = key + ".weight"
        delta = scale * ALPHA / RANK * (b.astype(np.float64) @ a.astype(np.float64))
        out[w] = (base[w].astype(np.float64) + delta).astype(np.float32)
    return out


SUITE_WORDS = ("ĠoldĠday", "Ġspecial", "Ġfar", "Ġeye")  # byte-level BPE spelling: " old day", ...
SUITE_LINES = ((0.0, 0.0), (-3.0, 20.0), (-13.0, 40.0), (-30.0, 60.0))  # (logit at s = 0, slope)
SUITE_OTHERS = -40.0  # every other token's logit


def suite_paths(out: Path) -> tuple[Path, Path]:
    """(model, adapter) of the stand-in for llama.cpp's test_lora.py (see the module doc)."""
    return out / "tiny-lora-suite-f32.gguf", out / "tiny-lora-suite-lora.gguf"


def write_suite_stand_in(out: Path) -> None:
    spec = SPECS["tiny"]
    tok = train_tokenizer(spec)
    n_base = tok.get_vocab_size()
    weights = {k: np.zeros_like(v) for k, v in make_weights(spec, n_base).items()}
    for k, v in weights.items():
        if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
            v[:] = 1.0
    n_vocab = n_base + len(SUITE_WORDS)
    embed = np.zeros((n_vocab, spec.hidden), dtype=np.float32)
    embed[:, 0] = 1.0  # every token alike: after the final norm h = sqrt(hidden) * e0
    h0 = np.float32(np.sqrt(spec.hidden))
    head = np.full((n_vocab, spec.hidden), 0.0, dtype=np.float32)
    head[:, 0] = SUITE_OTHERS / h0
    slopes = np.zeros((n_vocab, 1), dtype=np.float32)
    for i, (at_0, slope) in enumerate(SUITE_LINES):
        head[n_base + i, 0] = at_0 / h0
        slopes[n_base + i, 0] = slope / h0
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    model, adapter = suite_paths(out)
    write_gguf(model, spec, tok, weights, f16=False, extra_tokens=SUITE_WORDS)
    import gguf

    tmp = adapter.with_suffix(".gguf.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 1.0)  # rank 1: a scaling of 1
    w.add_name(adapter.stem)
    a = np.zeros((1, spec.hidden), dtype=np.float32)
    a[0, 0] = 1.0
    w.add_tensor("output.weight.lora_a", a)
    w.add_tensor("output.weight.lora_b", slopes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, adapter)


def ensure_loras(out: Path, size: str = "tiny", force: bool = False) -> None:
    spec = SPECS[size]

    def build() -> None:
        for name, seed in SEEDS.items():
            paths = lora_paths(out, name, spec.name)
            # "bad": made for a model half as wide (another base model)
            target = spec if name != "bad" else ModelSpec(
                "other", spec.vocab_size, spec.hidden // 2, spec.layers, spec.heads, spec.kv_heads,
                spec.intermediate // 2, spec.max_positions, spec.tie_embeddings, spec.seed)
            lora = make_lora(target, seed)
            write_gguf_lora(paths.gguf, target, lora)
            write_peft(paths.peft, target, lora)
        tok = train_tokenizer(spec)
        merged = merged_weights(make_weights(spec, tok.get_vocab_size()), make_lora(spec, SEEDS["a"]))
        hf, gg = merged_paths(out, spec.name)
        if hf.exists():
            shutil.rmtree(hf)
        write_hf(hf, spec, tok, merged)
        write_gguf(gg, spec, tok, merged, f16=False)
        write_suite_stand_in(out)

    key = f"{FORMAT_VERSION}:{spec}:lora{RANK}/{ALPHA}/{sorted(SEEDS.items())}:suite{SUITE_LINES}"
    build_once(out / f".{size}-lora.done", key, build, force)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Generate the tiny model's LoRA adapters.")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--force", action="store_true", help="regenerate even if present")
    args = ap.parse_args(argv)
    ensure_loras(args.out, force=args.force)
    print(f"tiny LoRA adapters under {args.out}")


if __name__ == "__main__":
    main()
