"""A deterministic random-weight SmolVLM (Idefics3) for the vision tests: one spec, three forms.

    models/tiny-smolvlm/                 HF: Idefics3ForConditionalGeneration (config.json,
                                         model.safetensors float32, tokenizer, preprocessor_config.json)
    models/tiny-smolvlm-f32.gguf         the text model (a llama), as llama.cpp's converter writes it
    models/mmproj-tiny-smolvlm-f32.gguf  the vision tower and projector (projector type idefics3)

The same weights on every side. The vision side is SmolVLM's: a SigLIP encoder (patch
convolution, learned position embeddings, pre-norm blocks with biases, tanh GELU, a final
LayerNorm), then the connector: pixel shuffle by `scale_factor` and one matrix into the text
model's width. The mmproj GGUF holds what `convert_hf_to_gguf.py --mmproj` writes for
`Idefics3ForConditionalGeneration` (conversion/smolvlm.py and MmprojModel): general.type
mmproj, clip.projector_type idefics3, the clip.vision.* hyperparameters, the tensors renamed by
gguf-py's MMPROJ map (v.patch_embd, v.position_embd, v.blk.N.{attn_q,attn_k,attn_v,attn_out,
ln1,ln2,ffn_up,ffn_down}, v.post_ln, mm.model.fc). Written in F32 so that both backends read
the same numbers.

The vocabulary holds the tokens libmtmd's idefics3 layout looks up ("\\n\\n", "\\n",
<fake_token_around_image>, <global-img>, <row_R_col_C>). One image tile is
(image_size / patch_size / scale_factor)^2 = 16 tokens; with `longest_edge` equal to the tile
size, libmtmd gives an image an overview tile and one slice.

Usage:  python -m worker.testing.tiny_vlm --out models [--size small]   (small: benchmarks)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.testing.tiny_models import (
    CHATML_TEMPLATE,
    ModelSpec,
    _special_ids,
    build_once,
    make_weights,
    text_config,
    train_tokenizer,
    write_gguf,
    write_tokenizer_files,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

FORMAT_VERSION = 1  # bump to force regeneration when the layout changes


@dataclass(frozen=True)
class VisionSpec:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    image_size: int
    patch_size: int
    scale_factor: int
    layer_norm_eps: float = 1e-6

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        return self.n_patches // self.scale_factor**2


TEXT = ModelSpec(
    "tiny-smolvlm", 1024, 64, 2, 4, 2, 192, 4096, tie_embeddings=False, seed=1357, arch="idefics3"
)
VISION = VisionSpec(
    hidden=64, intermediate=128, layers=2, heads=4, image_size=64, patch_size=8, scale_factor=2
)
# Benchmarks only (`make bench`): a SigLIP-base-wide tower of 6 blocks on 384-pixel tiles (576
# patches, 64 rows a tile) beside the small text model; GGUF + mmproj in F16, no HF folder.
SMALL_TEXT = ModelSpec(
    "small-smolvlm", 8192, 768, 12, 12, 4, 1536, 8192, tie_embeddings=True, seed=4322, arch="idefics3"
)
SMALL_VISION = VisionSpec(
    hidden=768, intermediate=3072, layers=6, heads=12, image_size=384, patch_size=16, scale_factor=3
)
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class VlmPaths:
    hf_dir: Path
    gguf: Path
    mmproj: Path


def vlm_paths(out: Path) -> VlmPaths:
    name = TEXT.name
    return VlmPaths(out / name, out / f"{name}-f32.gguf", out / f"mmproj-{name}-f32.gguf")


def make_vision_weights(v: VisionSpec, n_embd_text: int, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of the vision tower and the connector."""
    rng = np.random.default_rng(seed + 1)
    h = v.hidden

    def lin(rows: int, cols: int) -> np.ndarray:
        out: np.ndarray = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(
            np.float32
        )
        return out

    def vec(n: int, scale: float = 0.1, base: float = 0.0) -> np.ndarray:
        return (base + scale * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    p = "model.vision_model."
    w: dict[str, np.ndarray] = {
        p + "embeddings.patch_embedding.weight": (
            rng.standard_normal((h, 3, v.patch_size, v.patch_size), dtype=np.float32) / v.patch_size
        ).astype(np.float32),
        p + "embeddings.patch_embedding.bias": vec(h),
        p + "embeddings.position_embedding.weight": vec(v.n_patches * h, 0.5).reshape(v.n_patches, h),
    }
    for i in range(v.layers):
        b = f"{p}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{b}self_attn.{name}.weight"] = lin(h, h)
            w[f"{b}self_attn.{name}.bias"] = vec(h)
        w[b + "layer_norm1.weight"], w[b + "layer_norm1.bias"] = vec(h, base=1.0), vec(h)
        w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"] = lin(v.intermediate, h), vec(v.intermediate)
        w[b + "mlp.fc2.weight"], w[b + "mlp.fc2.bias"] = lin(h, v.intermediate), vec(h)
        w[b + "layer_norm2.weight"], w[b + "layer_norm2.bias"] = vec(h, base=1.0), vec(h)
    w[p + "post_layernorm.weight"], w[p + "post_layernorm.bias"] = vec(h, base=1.0), vec(h)
    # Scaled so that image embeddings are of the size of token embeddings (std ~1).
    w["model.connector.modality_projection.proj.weight"] = lin(n_embd_text, h * v.scale_factor**2) * 2.0
    return w


def hf_weights(text: dict[str, np.ndarray], vision: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The text model's tensors under Idefics3's names (model.text_model.*, lm_head), plus vision."""
    out = dict(vision)
    for k, t in text.items():
        out[k if k == "lm_head.weight" else "model.text_model." + k.removeprefix("model.")] = t
    return out


def write_hf_vlm(out_dir: Path, tok: Tokenizer, weights: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    ids = _special_ids(tok, TEXT.special_tokens)
    tc = text_config(TEXT, tok)
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": ids["<image>"],
        "scale_factor": VISION.scale_factor,
        "tie_word_embeddings": TEXT.tie_embeddings,
        "vocab_size": tc["vocab_size"],
        "pad_token_id": tc["pad_token_id"],
        "torch_dtype": "float32",
        "dtype": "float32",
        "text_config": tc,
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": VISION.hidden,
            "intermediate_size": VISION.intermediate,
            "num_hidden_layers": VISION.layers,
            "num_attention_heads": VISION.heads,
            "image_size": VISION.image_size,
            "patch_size": VISION.patch_size,
            "num_channels": 3,
            "layer_norm_eps": VISION.layer_norm_eps,
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    size = {"longest_edge": VISION.image_size}
    preprocessor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_convert_rgb": True, "do_resize": True, "size": size, "resample": 1,
        "do_image_splitting": True, "max_image_size": size,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "do_pad": True,
    }
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": VISION.tokens_per_tile}
    gen_config = {"bos_token_id": tc["bos_token_id"], "eos_token_id": tc["eos_token_id"],
                  "pad_token_id": tc["pad_token_id"]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    write_tokenizer_files(out_dir, TEXT, tok, CHATML_TEMPLATE)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def write_mmproj(path: Path, vision: dict[str, np.ndarray], n_embd_text: int, v: VisionSpec = VISION,
                 name: str = TEXT.name, f16: bool = False, longest_edge: int | None = None) -> None:
    """The vision tower and projector as convert_hf_to_gguf.py --mmproj writes them: F32, or F16
    matrices (norms, biases and the embeddings stay F32, as the converter keeps them).
    `longest_edge`: the preprocessor's size.longest_edge (default: one tile)."""
    import gguf

    tmp = path.with_suffix(".gguf.tmp")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_size(v.image_size)
    w.add_vision_patch_size(v.patch_size)
    w.add_vision_embedding_length(v.hidden)
    w.add_vision_feed_forward_length(v.intermediate)
    w.add_vision_block_count(v.layers)
    w.add_vision_head_count(v.heads)
    w.add_vision_image_mean(IMAGE_MEAN)
    w.add_vision_image_std(IMAGE_STD)
    w.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    w.add_vision_attention_layernorm_eps(v.layer_norm_eps)
    w.add_vision_projector_scale_factor(v.scale_factor)
    w.add_vision_use_gelu(True)
    w.add_vision_preproc_image_size(longest_edge or v.image_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v.layers)
    for hf_name, t in vision.items():
        stem, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        half = f16 and t.ndim >= 2 and ".embeddings." not in hf_name
        w.add_tensor(f"{mapped}.{suffix}", t.astype(np.float16 if half else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB PNG (no imaging library needed): the tests' and benchmarks' images."""
    import struct
    import zlib

    rng = np.random.default_rng(seed)
    px = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + px[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def data_url(image: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def ensure_vlm(out: Path, force: bool = False) -> VlmPaths:
    """Generate the tiny VLM under `out` unless it is already there (idempotent)."""
    paths = vlm_paths(out)

    def build() -> None:
        tok = train_tokenizer(TEXT)
        text = make_weights(TEXT, tok.get_vocab_size())
        vision = make_vision_weights(VISION, TEXT.hidden, TEXT.seed)
        if paths.hf_dir.exists():
            shutil.rmtree(paths.hf_dir)
        write_hf_vlm(paths.hf_dir, tok, hf_weights(text, vision))
        write_gguf(paths.gguf, TEXT, tok, text, f16=False)
        write_mmproj(paths.mmproj, vision, TEXT.hidden)

    build_once(out / ".tiny-vlm.done", f"{FORMAT_VERSION}:{TEXT}:{VISION}", build, force)
    return paths


def ensure_small_vlm(out: Path) -> VlmPaths:
    """The benchmarks' VLM (SMALL_*): F16 text GGUF and mmproj only (`hf_dir` is not written)."""
    name = SMALL_TEXT.name
    paths = VlmPaths(out / name, out / f"{name}-f16.gguf", out / f"mmproj-{name}-f16.gguf")

    def build() -> None:
        tok = train_tokenizer(SMALL_TEXT)
        text = make_weights(SMALL_TEXT, tok.get_vocab_size())
        write_gguf(paths.gguf, SMALL_TEXT, tok, text, f16=True)
        vision = make_vision_weights(SMALL_VISION, SMALL_TEXT.hidden, SMALL_TEXT.seed)
        write_mmproj(paths.mmproj, vision, SMALL_TEXT.hidden, SMALL_VISION, name, f16=True)

    build_once(out / ".small-vlm.done", f"{FORMAT_VERSION}:{SMALL_TEXT}:{SMALL_VISION}", build)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Generate the deterministic random-weight tiny VLM.")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--force", action="store_true", help="regenerate even if present")
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    args = ap.parse_args(argv)
    p = ensure_vlm(args.out, force=args.force) if args.size == "tiny" else ensure_small_vlm(args.out)
    print(f"tiny-vlm: {p.hf_dir} {p.gguf} {p.mmproj}")


if __name__ == "__main__":
    main()
