"""Deterministic random-weight Llama models for tests, the demo and benchmarks.

Model hubs are unreachable here, so the project makes its own models. One spec produces:

    models/<name>/                 HF format: config.json, model.safetensors (float32),
                                   tokenizer.json, tokenizer_config.json (ChatML template),
                                   generation_config.json
    models/<name>-f32.gguf         the same weights, F32
    models/<name>-f16.gguf         the same weights, F16 matrices (norms stay F32)

The tokenizer is a byte-level BPE trained offline with `tokenizers` on a generated corpus;
in GGUF it is tokenizer model `gpt2` with pre-tokenizer `gpt-2` (the same regex as HF's
ByteLevel). Special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are control tokens;
eos is `<|im_end|>` and no BOS is added (as Qwen/ChatML models do).

llama.cpp applies RoPE to interleaved pairs while HF Llama rotates halves, so Q and K rows are
permuted on the way into GGUF (`_permute_qk`). Everything is derived from `seed`, so running
the factory twice writes identical files.

`tiny-reranker` is a Qwen3-Reranker look-alike (Qwen3: per-head q/k RMSNorm, NEOX RoPE, so no
permutation): the HF folder is a plain Qwen3ForCausalLM named like one (what llama.cpp's
converter looks for), and its GGUF twins are what that converter writes for a Qwen3-Reranker:
pooling type rank, classifier labels yes/no, a `cls.output` head made of the LM head's "yes"
and "no" rows (and no `output.weight`), and the reranker's "rerank" chat template.

Usage:  python -m worker.testing.tiny_models --out models --size tiny|small|tiny-reranker|all
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.text.rerank import QWEN3_RERANK_TEMPLATE

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The tiny VLM's (worker/testing/tiny_vlm.py) extra special tokens: SmolVLM's image tokens, the
# ones libmtmd's idefics3 projector looks up, and the grid positions of up to 4x4 image tiles.
VLM_TOKENS = [
    "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)),
]
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
FORMAT_VERSION = 1  # bump to force regeneration when the layout changes


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    tie_embeddings: bool
    seed: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    # repr=False: the stamp of the llama specs (their repr) stays what it was, no regeneration
    arch: str = field(default="llama", repr=False)  # "llama" or "qwen3" (a Qwen3-Reranker look-alike)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def special_tokens(self) -> list[str]:
        return SPECIAL_TOKENS + VLM_TOKENS if self.arch == "idefics3" else SPECIAL_TOKENS


SPECS = {
    # ~1 MB: fast tests. Untied output so greedy text varies instead of echoing its input.
    "tiny": ModelSpec("tiny-llama", 1024, 64, 2, 4, 2, 192, 4096, tie_embeddings=False, seed=1234),
    # ~135 MB in F16: benchmarks. Tied embeddings exercise the "no output.weight" GGUF path.
    "small": ModelSpec("small-llama", 8192, 768, 12, 12, 4, 1536, 8192, tie_embeddings=True, seed=4321),
    # ~1 MB: rerank tests (a classifier head on both backends).
    "tiny-reranker": ModelSpec(
        "tiny-qwen3-reranker", 1024, 64, 2, 4, 2, 192, 4096, tie_embeddings=False, seed=2468, arch="qwen3"
    ),
}


@dataclass(frozen=True)
class ModelPaths:
    hf_dir: Path
    gguf_f32: Path
    gguf_f16: Path


def model_paths(out: Path, spec: ModelSpec) -> ModelPaths:
    return ModelPaths(out / spec.name, out / f"{spec.name}-f32.gguf", out / f"{spec.name}-f16.gguf")


# --------------------------------------------------------------------------- tokenizer

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are have had not "
    "but were his they one all their there been has more when can who will would so if what about "
    "model token router worker slot batch stream server request cache prompt context memory thread "
    "engine sample logits kernel tensor layer weight python llama vector queue event health sleep "
    "wake load unload spawn kill signal socket header chunk delta choice usage timing latency "
    "hello world yes no maybe please thanks quick brown fox jumps over lazy dog time day year "
    "café naïve résumé über straße 東京 北京 模型 数据 こんにちは мир данные 🙂 🚀 ✨"
).split()
_CODE = [
    "def f(x):\n    return x + 1\n",
    "for i in range(10):\n    print(i)\n",
    '{"key": "value", "n": 42, "ok": true}\n',
    "if (a && b) { return c; }\n",
    "SELECT id, name FROM users WHERE id = 7;\n",
]


def _corpus(seed: int, n_lines: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.75:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 20))]
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
            line = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";", ":"])
        elif kind < 0.9:
            line = rng.choice(_CODE)
        else:
            line = (
                f"<|im_start|>{rng.choice(['user', 'assistant', 'system'])}\n{rng.choice(_WORDS)}<|im_end|>"
            )
        lines.append(line)
    return lines


def train_tokenizer(spec: ModelSpec) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=spec.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    n_lines = 4000 if spec.vocab_size <= 2048 else 40000
    corpus = _corpus(spec.seed, n_lines)
    if spec.arch == "qwen3":  # the reranker's labels are the tokens "yes" and "no"
        corpus += ["yes", "no"] * 200
    if spec.arch == "idefics3":  # libmtmd's idefics3 layout needs "\n\n" to be one token
        corpus += ["What is in this image?\n\n", "A picture.\n"] * 200
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for added in state["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    assert all(tokens), "token ids are not contiguous"
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return tokens, merges


def _special_ids(tok: Tokenizer, specials: list[str] = SPECIAL_TOKENS) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in specials}
    missing = [t for t, i in ids.items() if i is None]
    assert not missing, f"special tokens missing from the vocab: {missing}"
    return {t: int(i) for t, i in ids.items() if i is not None}


# --------------------------------------------------------------------------- weights


def make_weights(spec: ModelSpec, n_vocab: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors. Scales keep activations O(1) and logits peaked (std ~3)."""
    rng = np.random.default_rng(spec.seed)
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim

    def lin(rows: int, cols: int) -> np.ndarray:
        out: np.ndarray = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(
            np.float32
        )
        return out

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((n_vocab, h), dtype=np.float32)
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = lin(h, h)
        w[p + "self_attn.k_proj.weight"] = lin(kv, h)
        w[p + "self_attn.v_proj.weight"] = lin(kv, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = lin(spec.intermediate, h)
        w[p + "mlp.up_proj.weight"] = lin(spec.intermediate, h)
        w[p + "mlp.down_proj.weight"] = lin(h, spec.intermediate)
        if spec.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(spec.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(spec.head_dim)
    w["model.norm.weight"] = norm(h)
    if not spec.tie_embeddings:
        w["lm_head.weight"] = lin(n_vocab, h) * np.float32(3.0)
    return w


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved-pair row order."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------- writers


def write_tokenizer_files(
    out_dir: Path, spec: ModelSpec, tok: Tokenizer, template: str = CHATML_TEMPLATE
) -> None:
    """tokenizer.json and tokenizer_config.json (the chat template, the special tokens)."""
    ids = _special_ids(tok, spec.special_tokens)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_positions,
        "chat_template": template,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False}
            for t in spec.special_tokens
        },
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n"
    )
    tok.save(str(out_dir / "tokenizer.json"))


def text_config(spec: ModelSpec, tok: Tokenizer) -> dict[str, object]:
    """The HF config.json of the text model (a VLM nests it as its text_config)."""
    n_vocab = tok.get_vocab_size()
    ids = _special_ids(tok)
    is_qwen3 = spec.arch == "qwen3"
    return {
        "architectures": ["Qwen3ForCausalLM" if is_qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if is_qwen3 else "llama",
        "vocab_size": n_vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def write_hf(out_dir: Path, spec: ModelSpec, tok: Tokenizer, weights: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    ids = _special_ids(tok)
    is_qwen3 = spec.arch == "qwen3"
    config = text_config(spec, tok)
    gen_config = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    if is_qwen3:
        config["use_sliding_window"] = False
        (out_dir / "README.md").write_text("# Qwen3-Reranker (tiny, random weights, for tests)\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(out_dir, spec, tok)
    (out_dir / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def write_gguf(path: Path, spec: ModelSpec, tok: Tokenizer, weights: dict[str, np.ndarray], f16: bool,
               fim: dict[str, int] | None = None, extra_tokens: tuple[str, ...] = (),
               split_max_tensors: int = 0) -> None:
    """`fim`: {"pre"|"suf"|"mid"|...: token id} written as tokenizer.ggml.fim_*_token_id
    (FIM variant only). `extra_tokens`: appended to the vocabulary (no merge leads to them: the
    tokenizer never makes them, a model may generate them; worker/testing/tiny_lora.py).
    `split_max_tensors`: split as llama.cpp's gguf-split does (`write_split_variant`)."""
    import gguf

    tokens, merges = _vocab_and_merges(tok)
    tokens += extra_tokens
    ids = _special_ids(tok)
    specials = set(spec.special_tokens)
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    # (a split is written in place: gguf names its parts after `path`, `-00001-of-0000N.gguf`)
    tmp = path if split_max_tensors else path.with_suffix(".gguf.tmp")
    is_qwen3 = spec.arch == "qwen3"
    w = gguf.GGUFWriter(str(tmp), "llama" if spec.arch == "idefics3" else spec.arch,  # a VLM's text model
                        split_max_tensors=split_max_tensors)
    w.add_name(spec.name)
    w.add_context_length(spec.max_positions)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.intermediate)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids[BOS])
    w.add_eos_token_id(ids[EOS])
    w.add_pad_token_id(ids[PAD])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    if is_qwen3:  # as llama.cpp's converter writes a Qwen3-Reranker
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "default", "template": CHATML_TEMPLATE},
                             {"name": "rerank", "template": QWEN3_RERANK_TEMPLATE}])
    else:
        w.add_chat_template(CHATML_TEMPLATE)
    for kind, token in (fim or {}).items():
        w.add_uint32(f"tokenizer.ggml.fim_{kind}_token_id", token)

    def put(name: str, arr: np.ndarray) -> None:
        is_matrix = arr.ndim == 2
        w.add_tensor(name, arr.astype(np.float16) if (f16 and is_matrix) else arr.astype(np.float32))

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(spec.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", weights[p + "input_layernorm.weight"])
        q, k = weights[p + "self_attn.q_proj.weight"], weights[p + "self_attn.k_proj.weight"]
        put(
            b + "attn_q.weight", q if is_qwen3 else _permute_qk(q, spec.heads)
        )  # qwen3: NEOX RoPE, HF's layout
        put(b + "attn_k.weight", k if is_qwen3 else _permute_qk(k, spec.kv_heads))
        if is_qwen3:
            put(b + "attn_q_norm.weight", weights[p + "self_attn.q_norm.weight"])
            put(b + "attn_k_norm.weight", weights[p + "self_attn.k_norm.weight"])
        put(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    if is_qwen3:  # the converter's cls.output: the LM head's "yes" and "no" rows, and no output.weight
        head = weights["model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"]
        put("cls.output.weight", np.stack([head[tok.token_to_id("yes")], head[tok.token_to_id("no")]]))
    elif not spec.tie_embeddings:
        put("output.weight", weights["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if not split_max_tensors:
        os.replace(tmp, path)


# --------------------------------------------------------------------------- entry points


def build_once(stamp: Path, key: str, build: Callable[[], None], force: bool = False) -> None:
    """Run `build` unless `stamp` says it already ran for `key` (the generators' idempotence: the
    key names the format version and the specs, so a change of either regenerates)."""
    if not force and stamp.exists() and stamp.read_text() == key:
        return
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    build()
    stamp.write_text(key)


def ensure_model(out: Path, size: str = "tiny", force: bool = False) -> ModelPaths:
    """Generate the model of `size` under `out` unless it is already there (idempotent)."""
    spec = SPECS[size]
    paths = model_paths(out, spec)

    def build() -> None:
        tok = train_tokenizer(spec)
        weights = make_weights(spec, tok.get_vocab_size())
        if paths.hf_dir.exists():
            shutil.rmtree(paths.hf_dir)
        write_hf(paths.hf_dir, spec, tok, weights)
        write_gguf(paths.gguf_f32, spec, tok, weights, f16=False)
        write_gguf(paths.gguf_f16, spec, tok, weights, f16=True)

    build_once(out / f".{size}.done", f"{FORMAT_VERSION}:{spec}", build, force)
    return paths


def write_fim_variant(path: Path, size: str = "tiny") -> dict[str, int]:
    """The `size` model as an F32 GGUF whose metadata names FIM prefix/suffix/middle tokens (for
    /infill): the vocabulary's last three tokens, ordinary ones (the tiny models have no FIM
    tokens, and adding some to their vocabulary would change every tokenization). The usual
    models are untouched. Returns the ids it named."""
    spec = SPECS[size]
    tok = train_tokenizer(spec)
    n = tok.get_vocab_size()
    fim = {"pre": n - 3, "suf": n - 2, "mid": n - 1}
    write_gguf(path, spec, tok, make_weights(spec, n), f16=False, fim=fim)
    return fim


def write_split_variant(path: Path, parts: int, size: str = "tiny") -> list[Path]:
    """The `size` model as an F16 GGUF split in `parts` files the way llama.cpp's gguf-split
    writes them: `<path's stem>-0000i-of-0000N.gguf`, each a valid GGUF with the `split.no`,
    `split.count` and `split.tensors.count` keys, the first holding all the metadata (llama.cpp
    loads the others from the first's name). Returns the parts, in order."""
    spec = SPECS[size]
    tok = train_tokenizer(spec)
    n_tensors = 2 + 9 * spec.layers + (0 if spec.tie_embeddings else 1)  # as write_gguf puts them
    write_gguf(path, spec, tok, make_weights(spec, tok.get_vocab_size()), f16=True,
               split_max_tensors=-(-n_tensors // parts))
    written = sorted(path.parent.glob(f"{path.stem}-0*-of-0*.gguf"))
    assert len(written) == parts, written
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Generate deterministic random-weight test models.")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--size", choices=[*SPECS, "all"], default="tiny")
    ap.add_argument("--force", action="store_true", help="regenerate even if present")
    args = ap.parse_args(argv)
    for size in SPECS if args.size == "all" else [args.size]:
        p = ensure_model(args.out, size, force=args.force)
        print(f"{size}: {p.hf_dir} {p.gguf_f32} {p.gguf_f16}")


if __name__ == "__main__":
    main()
