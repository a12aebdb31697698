"""llama.cpp's -hf file choice (router/hub/choice.py): a table, no I/O."""

from __future__ import annotations

import pytest

from router.hub.choice import Choice, ChoiceError, choose, parse_ref, quant_of, tags_of

QUANTS = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-F16.gguf", "mmproj-m-F16.gguf",
          "mmproj-m-Q8_0.gguf", "generation_config.json"]
NO_DEFAULT = ["b-F16.gguf", "a-IQ2_XS.gguf", "a-BF16.gguf"]
SPLIT = ["big-Q4_K_M-00002-of-00003.gguf", "big-Q4_K_M-00001-of-00003.gguf",
         "big-Q4_K_M-00003-of-00003.gguf", "big-Q8_0.gguf"]
TORCH = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json", "README.md", "pytorch_model.bin", "onnx/model.onnx"]


@pytest.mark.parametrize(("ref", "files", "model", "mmproj", "count"), [
    ("o/m", QUANTS, "m-Q4_K_M.gguf", "mmproj-m-F16.gguf", 2),  # default Q4_K_M; F16 projector
    ("o/m:q8_0", QUANTS, "m-Q8_0.gguf", "mmproj-m-Q8_0.gguf", 2),  # case-insensitive; same-quant projector
    ("o/m:F16", QUANTS, "m-F16.gguf", "mmproj-m-F16.gguf", 2),
    ("o/m", [f for f in QUANTS if "Q4_K_M" not in f], "m-Q8_0.gguf", "mmproj-m-Q8_0.gguf", 2),
    ("o/m", NO_DEFAULT, "a-BF16.gguf", None, 1),  # neither Q4_K_M nor Q8_0: the first by name
    ("o/m", SPLIT, "big-Q4_K_M-00001-of-00003.gguf", None, 3),  # every part, the first first
    ("o/m:iq2_xs", NO_DEFAULT, "a-IQ2_XS.gguf", None, 1),
])
def test_gguf_choice(ref: str, files: list[str], model: str, mmproj: str | None, count: int) -> None:
    c = choose(parse_ref(ref), files)
    assert (c.backend, c.model, c.mmproj) == ("llama_cpp", model, mmproj)
    assert c.files[0] == model and len([f for f in c.files if f.endswith(".gguf")]) == count
    assert ("generation_config.json" in c.files) == ("generation_config.json" in files)


def test_split_parts_in_order_and_missing_part_refused() -> None:
    c = choose(parse_ref("o/m"), SPLIT)
    assert c.files == tuple(f"big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3))
    with pytest.raises(ChoiceError, match=r"missing parts: big-Q4_K_M-00002-of-00003\.gguf"):
        choose(parse_ref("o/m"), [f for f in SPLIT if "00002" not in f])


def test_hf_file_wins_over_tag() -> None:
    c = choose(parse_ref("o/m:Q8_0", file="m-F16.gguf"), QUANTS)
    assert c.model == "m-F16.gguf"
    with pytest.raises(ChoiceError, match=r"no file 'x\.gguf'"):
        choose(parse_ref("o/m", file="x.gguf"), QUANTS)


def test_unknown_tag_lists_the_tags() -> None:
    with pytest.raises(ChoiceError) as e:
        choose(parse_ref("o/m:Q2_K"), QUANTS)
    assert e.value.tags == ("F16", "Q4_K_M", "Q8_0")
    assert "tags: F16, Q4_K_M, Q8_0" in str(e.value)


def test_safetensors_repo_runs_on_torch_with_config_tokenizer_and_weights_only() -> None:
    c = choose(parse_ref("o/t"), TORCH)
    assert c == Choice("torch", "", tuple(sorted(set(TORCH) - {"README.md", "pytorch_model.bin",
                                                                "onnx/model.onnx"})))
    with pytest.raises(ChoiceError, match="no quantisation tags"):
        choose(parse_ref("o/t:Q4_K_M"), TORCH)
    with pytest.raises(ChoiceError, match=r"no \.gguf model"):
        choose(parse_ref("o/t"), ["README.md"])


@pytest.mark.parametrize(("name", "quant"), [
    ("x-Q4_K_M.gguf", "Q4_K_M"), ("x.q8_0.gguf", "Q8_0"), ("Q5_K_S/x-Q5_K_S-00001-of-00002.gguf", "Q5_K_S"),
    ("tiny-llama-f32.gguf", "F32"), ("x-UD-IQ1_M.gguf", "IQ1_M"), ("model.gguf", None)])
def test_quant_of(name: str, quant: str | None) -> None:
    assert quant_of(name) == quant


def test_tags_skip_projectors() -> None:
    assert tags_of(["mmproj-x-F32.gguf", "x-Q4_0.gguf"]) == ["Q4_0"]


@pytest.mark.parametrize("raw", ["repo", "o/r/x", "o/r:Q4 K", "/r", ""])
def test_bad_refs(raw: str) -> None:
    with pytest.raises(ValueError, match=r"org/repo|quantisation"):
        parse_ref(raw)
