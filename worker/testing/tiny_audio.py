"""A deterministic random-weight Ultravox-style audio model for the audio tests: a text GGUF and
an audio mmproj, as llama.cpp's converter writes them.

    models/tiny-ultravox-f32.gguf         the text model (a llama, ChatML template)
    models/mmproj-tiny-ultravox-f32.gguf  the audio encoder and projector (projector type ultravox)

The audio side is what libmtmd runs for `ultravox` (tools/mtmd/models/whisper-enc.cpp): a
Whisper encoder (two 1-D convolutions with GELU, the second of stride 2; learned positions;
pre-norm blocks with biases except attn_k, erf GELU; a final LayerNorm), then Ultravox's
projector: stack `stack_factor` frames, RMS norm, a matrix, SwiGLU (the second half gated),
RMS norm, a matrix into the text model's width. The keys and tensor names are what
`convert_hf_to_gguf.py --mmproj` writes for `UltravoxModel` (conversion/ultravox.py and
MmprojModel): clip.has_audio_encoder, clip.projector_type ultravox, clip.audio.* (embedding
length, feed-forward length, block count, head count, projection dim, layer-norm epsilon,
num_mel_bins, projector.stack_factor), tensors a.conv1d.{1,2}, a.position_embd, a.blk.N.*,
a.post_ln, mm.a.norm_pre, mm.a.mlp.{1,2}, mm.a.norm_mid; conv weights in F16 as the converter
forces them, the rest F32.

libmtmd's Whisper preprocessing is fixed for these projectors: 16 kHz mono, 25 ms windows
(n_fft 400) every 10 ms, the mel bins from `num_mel_bins`, and the audio cut in 30 s windows of
3000 frames (the last padded with silence), each window one chunk. The encoder halves the
frames (1500 positions a window), stacking divides them by `stack_factor`: one chunk is
3000 / stack_factor / 2 = 150 prompt rows here. (`stack_factor` must divide 1500: libmtmd
counts the rows before stacking pads, and aborts when the two disagree.)

Usage:  python -m worker.testing.tiny_audio --out models
"""

from __future__ import annotations

import argparse
import io
import os
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.testing.tiny_models import ModelSpec, build_once, make_weights, train_tokenizer, write_gguf

FORMAT_VERSION = 1  # bump to force regeneration when the layout changes
SAMPLE_RATE = 16000  # libmtmd's for Whisper encoders
_WINDOW_FRAMES = 3000  # mel frames in one 30 s window: one audio chunk


@dataclass(frozen=True)
class AudioSpec:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    n_mel: int
    stack_factor: int
    proj_hidden: int  # the projector's SwiGLU width (its first matrix makes twice this)
    layer_norm_eps: float = 1e-5

    @property
    def n_positions(self) -> int:
        return _WINDOW_FRAMES // 2

    @property
    def rows_per_chunk(self) -> int:
        return self.n_positions // self.stack_factor


TEXT = ModelSpec("tiny-ultravox", 1024, 64, 2, 4, 2, 192, 4096, tie_embeddings=False, seed=3579)
AUDIO = AudioSpec(hidden=32, intermediate=64, layers=2, heads=2, n_mel=80, stack_factor=10, proj_hidden=64)


@dataclass(frozen=True)
class AudioModelPaths:
    gguf: Path
    mmproj: Path


def audio_paths(out: Path) -> AudioModelPaths:
    return AudioModelPaths(out / f"{TEXT.name}-f32.gguf", out / f"mmproj-{TEXT.name}-f32.gguf")


def make_audio_weights(a: AudioSpec, n_embd_text: int, seed: int) -> dict[str, np.ndarray]:
    """The encoder's and projector's tensors under their GGUF names, numpy shapes (ggml's
    reversed): a matrix is [out, in], a convolution [out channels, in channels, kernel]."""
    rng = np.random.default_rng(seed + 2)
    h = a.hidden

    def lin(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        out: np.ndarray = scale * rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        return out.astype(np.float32)

    def vec(n: int, scale: float = 0.1, base: float = 0.0) -> np.ndarray:
        return (base + scale * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def conv(out_ch: int, in_ch: int) -> np.ndarray:  # kernel 3
        out: np.ndarray = rng.standard_normal((out_ch, in_ch, 3), dtype=np.float32) / np.sqrt(3 * in_ch)
        return out.astype(np.float32)

    w: dict[str, np.ndarray] = {
        "a.conv1d.1.weight": conv(h, a.n_mel),
        "a.conv1d.1.bias": vec(h).reshape(h, 1),  # [1, h] in ggml: added along the frames
        "a.conv1d.2.weight": conv(h, h),
        "a.conv1d.2.bias": vec(h).reshape(h, 1),
        "a.position_embd.weight": vec(a.n_positions * h, 0.5).reshape(a.n_positions, h),
    }
    for i in range(a.layers):
        b = f"a.blk.{i}."
        w[b + "attn_q.weight"], w[b + "attn_q.bias"] = lin(h, h), vec(h)
        w[b + "attn_k.weight"] = lin(h, h)  # Whisper's k_proj has no bias
        w[b + "attn_v.weight"], w[b + "attn_v.bias"] = lin(h, h), vec(h)
        w[b + "attn_out.weight"], w[b + "attn_out.bias"] = lin(h, h), vec(h)
        w[b + "ln1.weight"], w[b + "ln1.bias"] = vec(h, base=1.0), vec(h)
        w[b + "ln2.weight"], w[b + "ln2.bias"] = vec(h, base=1.0), vec(h)
        w[b + "ffn_up.weight"], w[b + "ffn_up.bias"] = lin(a.intermediate, h), vec(a.intermediate)
        w[b + "ffn_down.weight"], w[b + "ffn_down.bias"] = lin(h, a.intermediate), vec(h)
    w["a.post_ln.weight"], w["a.post_ln.bias"] = vec(h, base=1.0), vec(h)
    stacked = h * a.stack_factor
    w["mm.a.norm_pre.weight"] = vec(stacked, base=1.0)
    w["mm.a.mlp.1.weight"] = lin(2 * a.proj_hidden, stacked)
    w["mm.a.norm_mid.weight"] = vec(a.proj_hidden, base=1.0)
    # Scaled so that audio rows are of the size of token embeddings (std ~1).
    w["mm.a.mlp.2.weight"] = lin(n_embd_text, a.proj_hidden, 2.0)
    return w


def write_audio_mmproj(path: Path, weights: dict[str, np.ndarray], n_embd_text: int, a: AudioSpec = AUDIO,
                       name: str = TEXT.name) -> None:
    import gguf

    tmp = path.with_suffix(".gguf.tmp")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_audio_encoder(True)
    w.add_audio_projection_dim(n_embd_text)
    w.add_audio_embedding_length(a.hidden)
    w.add_audio_feed_forward_length(a.intermediate)
    w.add_audio_block_count(a.layers)
    w.add_audio_head_count(a.heads)
    w.add_clip_projector_type(gguf.VisionProjectorType.ULTRAVOX)
    w.add_audio_num_mel_bins(a.n_mel)
    w.add_audio_attention_layernorm_eps(a.layer_norm_eps)
    w.add_audio_stack_factor(a.stack_factor)
    for name_, t in weights.items():
        is_conv = name_.startswith("a.conv1d.") and name_.endswith(".weight")  # F16, as the converter
        w.add_tensor(name_, t.astype(np.float16 if is_conv else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def wav(seconds: float, seed: int, freq: float = 440.0, rate: int = SAMPLE_RATE) -> bytes:
    """A mono 16-bit PCM WAV: a sine of `freq` Hz under a little noise (the tests' audio)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.size)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return buf.getvalue()


def ensure_audio_model(out: Path, force: bool = False) -> AudioModelPaths:
    """Generate the tiny audio model under `out` unless it is already there (idempotent)."""
    paths = audio_paths(out)

    def build() -> None:
        tok = train_tokenizer(TEXT)
        write_gguf(paths.gguf, TEXT, tok, make_weights(TEXT, tok.get_vocab_size()), f16=False)
        write_audio_mmproj(paths.mmproj, make_audio_weights(AUDIO, TEXT.hidden, TEXT.seed), TEXT.hidden)

    build_once(out / ".tiny-audio.done", f"{FORMAT_VERSION}:{TEXT}:{AUDIO}", build, force)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Generate the deterministic random-weight tiny audio model.")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--force", action="store_true", help="regenerate even if present")
    args = ap.parse_args(argv)
    p = ensure_audio_model(args.out, force=args.force)
    print(f"tiny-audio: {p.gguf} {p.mmproj}")


if __name__ == "__main__":
    main()
