"""The disk prompt cache's files, index and budget (worker/engine/disk_cache.py), without a model:
entries are written and read back with made-up states."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from worker.backends import BackendOptions
from worker.engine.disk_cache import DiskCache, entry_name, fingerprint, kv_settings, parse_size
from worker.engine.metrics import WorkerMetrics
from worker.engine.prompt_cache import CachedPrompt

FP = "f" * 32


def _prompt(first: int, n: int = 40, state_bytes: int = 1000) -> CachedPrompt:
    rng = np.random.default_rng(first)
    return CachedPrompt(tuple(range(first, first + n)), bytearray(rng.bytes(state_bytes)), (n, 2),
                        rng.standard_normal(16).astype(np.float32))


def _cache(root: Path, limit: int = 1 << 20, fp: str = FP) -> DiskCache:
    return DiskCache(root, limit, fp, WorkerMetrics(), decode_class=3)


def _written(cache: DiskCache, *prompts: CachedPrompt) -> None:
    cache.put(prompts)
    assert cache.wait_written(10)


def test_an_entry_is_read_back_as_written_and_found_by_its_prefix(tmp_path: Path) -> None:
    p = _prompt(100)
    _written(_cache(tmp_path), p)
    cache = _cache(tmp_path)  # a new process: indexed from the folder
    entry, n = cache.best([*p.tokens[:30], 7, 7], (32, 2), any_class=True)
    assert entry is not None and n == 30
    got = cache.read(entry)
    assert got is not None and got.tokens == p.tokens and got.state == p.state and got.rows == p.rows
    assert got.logits is not None and p.logits is not None and np.array_equal(got.logits, p.logits)
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temp name, then renamed


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_file_is_skipped_with_a_log_line_and_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    p = _prompt(1)
    _written(_cache(tmp_path), p)
    path = tmp_path / entry_name(FP, p.tokens, p.rows)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF  # in the state: only the checksum tells
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(b"not a cache file at all")
    path.write_bytes(raw)
    caplog.set_level(logging.INFO, "omni.worker.disk_cache")
    cache = _cache(tmp_path)
    entry, _ = cache.best(p.tokens, (40, 2), any_class=True)
    if entry is not None:  # the header survived: the payload check at load catches it
        assert cache.read(entry) is None
    assert any("skipping" in r.getMessage() and path.name in r.getMessage() for r in caplog.records)
    assert not path.exists() and cache.best(p.tokens, (40, 2), any_class=True) == (None, 0)


def test_a_full_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache = _cache(tmp_path, limit=3 * 1400)  # room for two entries of ~1.1 KB and their headers
    old, used, new = _prompt(1), _prompt(200), _prompt(400)
    _written(cache, old)
    _written(cache, used)
    for i, p in enumerate((old, used)):  # mtimes a second apart: `old` is the oldest
        os.utime(tmp_path / entry_name(FP, p.tokens, p.rows), (1000 + i, 1000 + i))
    entry, _ = cache.best(used.tokens, (40, 2), any_class=True)
    assert entry is not None and cache.read(entry) is not None  # a read makes it the most recent
    _written(cache, new)
    names = {f.name for f in tmp_path.glob("*.kv")}
    assert names == {entry_name(FP, p.tokens, p.rows) for p in (used, new)}
    assert cache.n_bytes() <= cache.limit_bytes


def test_entries_of_another_fingerprint_are_not_used(tmp_path: Path) -> None:
    p = _prompt(5)
    _written(_cache(tmp_path, fp="a" * 32), p)
    assert _cache(tmp_path, fp="b" * 32).best(p.tokens, (40, 2), any_class=True) == (None, 0)
    assert len(list(tmp_path.glob("*.kv"))) == 1  # left alone: another worker's, maybe


def test_two_writers_of_one_entry_leave_one_whole_file(tmp_path: Path) -> None:
    p = _prompt(9, state_bytes=200_000)
    a, b = _cache(tmp_path), _cache(tmp_path)
    a.put([p])
    b.put([p])
    assert a.wait_written(10) and b.wait_written(10)
    reader = _cache(tmp_path)
    entry, _ = reader.best(p.tokens, (40, 2), any_class=True)
    assert entry is not None and (got := reader.read(entry)) is not None and got.state == p.state
    assert [f.name for f in tmp_path.iterdir()] == [entry_name(FP, p.tokens, p.rows)]


def test_the_fingerprint_changes_with_the_model_file_and_the_kv_settings(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(5000))
    settings = {"backend": "llama_cpp", "cache_type_k": "f16"}
    fp = fingerprint(str(model), settings)
    assert fingerprint(str(model), settings) == fp
    assert fingerprint(str(model), {**settings, "cache_type_k": "q8_0"}) != fp
    assert kv_settings("llama_cpp", BackendOptions(), 16) != kv_settings("llama_cpp", BackendOptions(), 0)
    no_repack = BackendOptions(repack="off")
    assert kv_settings("llama_cpp", no_repack) != kv_settings("llama_cpp", BackendOptions())
    model.write_bytes(b"GGUF" + bytes(4999) + b"\x01")  # same size, new weights
    assert fingerprint(str(model), settings) != fp
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(model, folder / "model.safetensors")
    fp_dir = fingerprint(str(folder), settings)
    os.utime(folder / "model.safetensors", (1, 1))
    assert fingerprint(str(folder), settings) != fp_dir


@pytest.mark.parametrize(
    ("raw", "n"), [("4096", 4096), ("512M", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29)]
)
def test_parse_size(raw: str, n: int) -> None:
    assert parse_size(raw) == n
