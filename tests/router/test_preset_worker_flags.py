"""Presets take any omni-worker flag by its long name (issue 25: `temp`, `top-k`,
`chat-template-file`, `reasoning-format`, cache types were refused), checked with the worker's
own types, and a typo gets "did you mean"."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.lifecycle.process import worker_argv
from router.presets import PresetError, load_presets
from tests.util import ROOT

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"


def _load(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "p.ini"
    path.write_text(f"[a]\nmodel = {GGUF}\n{body}\n")
    (p,) = load_presets(path)
    assert p.name == "a"
    return worker_argv(p, 1234, 1)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("temp = 0.2", ["--temp", "0.2"]),
        ("temperature = 0.2", ["--temp", "0.2"]),  # another spelling of the same flag
        ("top-k = 20", ["--top-k", "20"]),
        ("n = 7", ["--n-predict", "7"]),  # a short name
        ("reasoning-format = none", ["--reasoning-format", "none"]),
        ("cache-type-k = q8_0", ["--cache-type-k", "q8_0"]),
        ("chat-template-file = /tmp/t.jinja", ["--chat-template-file", "/tmp/t.jinja"]),
        ("no-slots = true", ["--no-slots"]),  # a --X/--no-X switch, off
        ("slots = false", ["--no-slots"]),
        ("props = true", ["--props"]),  # a plain switch
        ("props = false", []),
        ("repack = false", ["--no-repack"]),  # llama-server's --repack/--no-repack
        ("nr = true", ["--no-repack"]),  # its short form -nr
        ("LLAMA_ARG_REPACK = false", ["--no-repack"]),  # and its environment name
        ("repack = true", ["--repack"]),
        (
            "LLAMA_ARG_TOP_K = 5",
            None,
        ),  # environment names exist only for the keys llama-server maps (not this one)
    ],
)
def test_a_worker_flag_in_a_preset_reaches_the_worker(
    tmp_path: Path, body: str, expected: list[str] | None
) -> None:
    if expected is None:
        with pytest.raises(PresetError, match="unknown key"):
            _load(tmp_path, body)
        return
    argv = _load(tmp_path, body)
    tail = argv[argv.index("--metrics") + 1:]
    assert tail == expected


@pytest.mark.parametrize(("body", "message"), [
    ("paralel = 2", "did you mean 'parallel'"),
    ("ctx_szie = 2", "did you mean 'ctx-size'"),
    ("temprature = 0.5", "did you mean 'temperature'"),
    ("top-k = many", "invalid value 'many' for 'top-k'"),
    ("top-p = 2", "invalid value '2' for 'top-p'"),
    ("port = 9000", "'port' cannot be set in a preset: the router picks it"),
    ("sleep-idle-seconds = 5", "use 'ttl'"),
    ("api-key = x", "set --api-key on the router"),
])
def test_a_bad_key_or_value_is_named_with_a_hint(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(PresetError, match=message.replace("(", r"\(")):
        _load(tmp_path, body)
