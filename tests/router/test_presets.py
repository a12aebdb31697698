"""Preset parsing: table tests, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.lifecycle.process import worker_argv
from router.presets import ModelPreset, PresetError, load_presets, merge, scan_models_dir


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    return p


def write(tmp_path: Path, text: str, suffix: str) -> Path:
    path = tmp_path / f"preset{suffix}"
    path.write_text(text)
    return path


def test_ini_llama_cpp_compatible(tmp_path: Path, gguf: Path) -> None:
    path = write(tmp_path, f"""version = 1
; global defaults
[*]
c = 2048  ; inline comment
ngl = 0
stop-timeout = 3 # another

[chat]
# short aliases like llama.cpp's --models-preset
model = {gguf}
np = 2
t = 1
alias = chatty, c2
load-on-startup = true
chat-template = chatml

[big]
model = {gguf}
ctx-size = 8192
backend = llama_cpp
ttl = 30
pin = yes
""", ".ini")
    chat, big = load_presets(path)
    assert chat == ModelPreset(name="chat", model=gguf, aliases=("chatty", "c2"), ctx_size=2048, parallel=2,
                               n_gpu_layers=0, threads=1, chat_template="chatml", load_on_startup=True,
                               stop_timeout=3.0, source=chat.source)
    assert chat.source.endswith("preset.ini:8")
    assert (big.ctx_size, big.backend, big.ttl, big.pin, big.stop_timeout) == (
        8192,
        "llama_cpp",
        30.0,
        True,
        3.0,
    )


def test_toml_and_precedence(tmp_path: Path, gguf: Path) -> None:
    path = write(tmp_path, f"""
[defaults]
ctx-size = 1024
parallel = 4

[models.a]
model = "{gguf}"
ctx_size = 512
alias = ["x", "y"]

[models.b]
model = "{gguf}"

[models.up]
backend = "remote"
upstream = "http://10.0.0.2:8000/"

[models.ext]
backend = "cmd"
cmd = "llama-server --port ${{PORT}} -m model.gguf"
""", ".toml")
    a, b, up, ext = load_presets(path, {"parallel": 1, "threads": None})
    assert (a.ctx_size, a.parallel, a.aliases) == (512, 1, ("x", "y"))  # model > global; CLI > all
    assert (b.ctx_size, b.parallel) == (1024, 1)
    assert (up.backend, up.upstream, up.is_remote) == ("remote", "http://10.0.0.2:8000", True)
    assert ext.cmd == "llama-server --port ${PORT} -m model.gguf"


def test_relative_model_path_resolves_against_preset_dir(tmp_path: Path, gguf: Path) -> None:
    path = write(tmp_path, "[a]\nmodel = m.gguf\n", ".ini")
    assert load_presets(path)[0].model == gguf.resolve()


E = "{m}"  # replaced by an existing model path

INI_ERRORS = [
    ("[a]\nmodel = {m}\nbogus = 1\n", r"preset\.ini:3: unknown key 'bogus' \(valid: alias, backend, .*\)"),
    (
        "[a]\nmodel = {m}\nc = big\n",
        r"preset\.ini:3: invalid value 'big' for 'ctx-size': expected an integer >= 0",
    ),
    ("[a]\nmodel = {m}\nnp = 0\n", r":3: invalid value '0' for 'parallel': expected an integer >= 1"),
    ("[a]\nmodel = {m}\npin = maybe\n", r":3: invalid value 'maybe' for 'pin': expected one of true, false"),
    (
        "[a]\nmodel = {m}\nbackend = onnx\n",
        r":3: .*'backend': expected one of auto, llama_cpp, torch, piper, cmd, remote",
    ),
    ("[a]\nmodel = {m}\nstop-timeout = 0\n", r":3: .*'stop-timeout': expected a number > 0"),
    ("[a]\nmodel = {m}\nttl = -1\n", r":3: .*'ttl': expected a number >= 0"),
    ("[a]\nc = 10\n", r"preset\.ini:1: missing key 'model'"),
    ("[a]\nmodel = {m}\n[a]\nmodel = {m}\n", r":3: duplicate model name \[a\] \(first defined on line 1\)"),
    ("[a]\nmodel = {m}\nc = 1\nctx-size = 2\n", r":4: key 'ctx-size' given twice in \[a\]"),
    (
        "[a]\nmodel = {m}\nalias = x\n[b]\nmodel = {m}\nalias = x\n",
        r"name or alias 'x' already used by \[a\]",
    ),
    ("[a]\nmodel = {m}\n[b]\nmodel = {m}\nalias = a\n", r"name or alias 'a' already used by \[a\]"),
    ("[a]\nmodel = {m}\nalias = x, x\n", r"alias 'x' repeated"),
    ("[a]\nbackend = cmd\ncmd = server --port 8080\n", r":3: 'cmd' must contain \$\{PORT\}"),
    ("[a]\nbackend = cmd\n", r"backend = cmd needs 'cmd"),
    ("[a]\nmodel = {m}\ncmd = x ${{PORT}}\n", r":3: 'cmd' is only valid with backend = cmd"),
    ("[a]\nbackend = remote\n", r"backend = remote needs 'upstream"),
    ("[a]\nbackend = remote\nupstream = ftp://x\n", r":3: .*'upstream': expected an http:// or https:// URL"),
    ("[a]\nmodel = {m}\nupstream = http://x\n", r":3: 'upstream' is only valid with backend = remote"),
    ("c = 1\n[a]\nmodel = {m}\n", r":1: key 'c' outside a section \(put defaults under \[\*\]\)"),
    ("[a\nmodel = {m}\n", r":1: malformed section header"),
    ("[a b]\nmodel = {m}\n", r":1: invalid model name 'a b'"),
    ("[a]\nmodel\n", r":2: expected 'key = value'"),
    ("[a]\nmodel = {m}\nalias = bad alias\n", r"alias 'bad alias' has characters outside"),
]


@pytest.mark.parametrize(("text", "pattern"), INI_ERRORS)
def test_ini_errors_name_file_line_and_valid_values(
    tmp_path: Path, gguf: Path, text: str, pattern: str
) -> None:
    path = write(tmp_path, text.format(m=gguf), ".ini")
    with pytest.raises(PresetError, match=pattern):
        load_presets(path)


TOML_ERRORS = [
    ('[models.a]\nmodel = "{m}"\nbogus = 1\n', r"preset\.toml: models\.a\.bogus: unknown key 'bogus'"),
    ('[defaults]\nc = "x"\n[models.a]\nmodel = "{m}"\n', r"defaults\.c: invalid value 'x' for 'ctx-size'"),
    (
        '[models.a]\nmodel = "{m}"\nparallel = [1, 2]\n',
        r"models\.a\.parallel: expected a single value, got a list",
    ),
    (
        '[models.a]\nmodel = "{m}"\nctx-size = {{ x = 1 }}\n',
        r"models\.a\.ctx-size: expected a value, got a table",
    ),
    ('[models.a]\nmodel = "{m}"\n[model.b]\n',
     r"unknown top-level key 'model' \(valid: defaults, models, groups\)"),
    ("models = 3\n", r"'models' must be a table"),
    ("[models]\na = 3\n", r"models\.a must be a table"),
    (
        '[models.a]\nmodel = "{m}"\nbackend = "gpu"\n',
        r"models\.a\.backend: .*expected one of auto, llama_cpp",
    ),
    ("[models.a\n", r"invalid TOML"),
    ('[models.a]\nmodel = "{m}"\nc = 1\nctx_size = 2\n', r"key 'ctx_size' given twice"),
    ('[models.a]\nmodel = "{m}"\nalias = ["b"]\n[models.b]\nmodel = "{m}"\n', r"'b' already used by \[a\]"),
]


@pytest.mark.parametrize(("text", "pattern"), TOML_ERRORS)
def test_toml_errors_name_the_key_path(tmp_path: Path, gguf: Path, text: str, pattern: str) -> None:
    path = write(tmp_path, text.format(m=gguf), ".toml")
    with pytest.raises(PresetError, match=pattern):
        load_presets(path)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="preset file not found"):
        load_presets(tmp_path / "missing.ini")
    with pytest.raises(PresetError, match=r"unknown preset format '.yaml' \(valid: .ini, .toml\)"):
        load_presets(write(tmp_path, "a: 1", ".yaml"))


def test_models_dir_scan_and_merge(tmp_path: Path) -> None:
    (tmp_path / "one.gguf").write_bytes(b"GGUF")
    (tmp_path / "mmproj-one.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "voice.onnx").write_bytes(b"onnx")  # a Piper voice: the .onnx and its config
    (tmp_path / "voice.onnx.json").write_text("{}")
    (tmp_path / "lone.onnx").write_bytes(b"onnx")  # no config beside it: not a voice
    scanned = scan_models_dir(tmp_path, {"ctx-size": 256})
    assert [(p.name, p.ctx_size) for p in scanned] == [("hf", 256), ("one", 256), ("voice", 256)]
    assert scanned[2].resolved_backend == "piper"
    mine = ModelPreset(name="one", model=tmp_path / "elsewhere.gguf")
    assert [p.name for p in merge([mine], scanned)] == ["one", "hf", "voice"]
    with pytest.raises(PresetError, match="not a directory"):
        scan_models_dir(tmp_path / "nope")


ARGV_CASES = [
    (
        ModelPreset(name="a", model=Path("/m.gguf")),
        [
            "--model",
            "/m.gguf",
            "--alias",
            "a",
            "--host",
            "127.0.0.1",
            "--port",
            "9",
            "--parent-pid",
            "7",
            "--metrics",
        ],
    ),
    (
        ModelPreset(
            name="a",
            model=Path("/m"),
            backend="torch",
            ctx_size=512,
            parallel=2,
            batch_size=64,
            n_gpu_layers=0,
            threads=1,
            chat_template="chatml",
            cache_ram=512,
            flash_attn="off",
            kv_unified=True,
        ),
        [
            "--model",
            "/m",
            "--alias",
            "a",
            "--host",
            "127.0.0.1",
            "--port",
            "9",
            "--parent-pid",
            "7",
            "--metrics",
            "--backend",
            "torch",
            "--ctx-size",
            "512",
            "--parallel",
            "2",
            "--batch-size",
            "64",
            "--n-gpu-layers",
            "0",
            "--threads",
            "1",
            "--chat-template",
            "chatml",
            "--cache-ram",
            "512",
            "--flash-attn",
            "off",
            "--kv-unified",
        ],
    ),
]


@pytest.mark.parametrize(("preset", "expected"), ARGV_CASES)
def test_worker_argv_maps_preset_keys(preset: ModelPreset, expected: list[str]) -> None:
    assert worker_argv(preset, 9, 7)[3:] == expected  # after `python -m worker.server.cli`


def test_cmd_argv_substitutes_port_and_parent() -> None:
    p = ModelPreset(name="x", backend="cmd", cmd="server --port ${PORT} --watch ${PARENT_PID} -m 'a b'")
    assert worker_argv(p, 1234, 42) == ["server", "--port", "1234", "--watch", "42", "-m", "a b"]


@pytest.mark.parametrize("name", ["demo.toml", "demo.ini"])
def test_demo_presets_parse_to_the_same_models(name: str) -> None:
    root = Path(__file__).resolve().parents[2]
    models = root / "models"
    if not (models / "tiny-llama-f32.gguf").exists() or not (models / "smollm2-135m-instruct").is_dir():
        pytest.skip("demo models not set up (make models)")
    smol, smol_torch, tiny, hf, joe = load_presets(root / "presets" / name)
    assert (smol.name, smol.backend, smol.load_on_startup, smol.ctx_size) == (
        "smollm2",
        "llama_cpp",
        True,
        2048,
    )
    assert smol.model == (models / "smollm2-135m-instruct-q4_1.gguf").resolve()
    assert (smol_torch.name, smol_torch.backend, smol_torch.model) == (
        "smollm2-torch", "torch", (models / "smollm2-135m-instruct").resolve())
    assert (tiny.name, tiny.backend, tiny.aliases, tiny.load_on_startup, tiny.ctx_size) == (
        "tiny-gguf", "llama_cpp", ("tiny",), False, 2048)
    assert tiny.model == (models / "tiny-llama-f32.gguf").resolve()
    assert (hf.name, hf.backend, hf.model) == ("tiny-hf", "torch", (models / "tiny-llama").resolve())
    assert (joe.name, joe.resolved_backend, joe.aliases, smol.speech_model) == (
        "joe", "piper", ("tts",), "joe")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "{bad}"], r"^omni-router: error: .*preset\.ini:3: unknown key 'colour' \(valid: .*\)"),
        (
            ["--preset", "{good}", "--models-max", "-1"],
            r"^omni-router: error: Invalid value for '--models-max'.*$",
        ),
        (["--bogus"], r"^omni-router: error: No such option: --bogus.*$"),
        (
            ["--preset", "{good}", "--ram-budget", "lots"],
            r"^omni-router: error: Invalid value for --ram-budget: "
            r"expected a size like 512M, 20GiB or a number of bytes$",
        ),
        ([], r"^omni-router: error: no models: give --preset FILE and/or --models-dir DIR, or pull one "
         r"first \(omni-router pull ORG/REPO\[:TAG\]\)$"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, gguf: Path, args: list[str], message: str
) -> None:
    import re
    import subprocess
    import sys

    bad = write(tmp_path, f"[a]\nmodel = {gguf}\ncolour = red\n", ".ini")
    good = tmp_path / "good.ini"
    good.write_text(f"[a]\nmodel = {gguf}\n")
    argv = [a.format(bad=bad, good=good) for a in args]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert re.match(message, proc.stderr.strip()) and proc.stderr.count("\n") == 1, proc.stderr


# llama.cpp's tools/server/README.md, "Model presets" (the example as written there), with our
# tiny GGUF for its file paths and a `model` for the section that names a model of llama-server's
# download cache (there is no such cache here).
README_PRESET = """version = 1

; (Optional) This section provides global settings shared across all presets.
; If the same key is defined in a specific preset, it will override the value in this global section.
[*]
c = 8192
n-gpu-layers = 8

; If the key corresponds to an existing model on the server,
; this will be used as the default config for that model
[ggml-org/MY-MODEL-GGUF:Q8_0]
model = {m}
; string value
chat-template = chatml
; numeric value
n-gpu-layers = 123
; flag value (for certain flags, you need to use the "no-" prefix for negation)
jinja = true
; shorthand argument (for example, context size)
c = 4096
; environment variable name
LLAMA_ARG_CACHE_RAM = 0
; file paths are relative to server's CWD
model-draft = {m}
; but it's RECOMMENDED to use absolute path
model-draft = {m}

; If the key does NOT correspond to an existing model,
; you need to specify at least the model path or HF repo
[custom_model]
model = {m}
"""


def test_llama_cpp_readme_preset_loads(tmp_path: Path, gguf: Path) -> None:
    mine, custom = load_presets(write(tmp_path, README_PRESET.format(m=gguf), ".ini"))
    assert (
        mine.name,
        mine.model,
        mine.ctx_size,
        mine.n_gpu_layers,
        mine.chat_template,
        mine.jinja,
        mine.cache_ram,
    ) == ("ggml-org/MY-MODEL-GGUF:Q8_0", gguf, 4096, 123, "chatml", True, 0)
    assert (custom.name, custom.ctx_size, custom.n_gpu_layers, custom.jinja) == (
        "custom_model",
        8192,
        8,
        None,
    )
    argv = worker_argv(mine, 8000, 1)
    assert "--jinja" in argv and argv[argv.index("--cache-ram") + 1] == "0" and str(gguf) in argv
    assert mine.model_draft == str(gguf)  # the worker's draft model (issue 29)
    assert argv[argv.index("--spec-draft-model") + 1] == str(gguf)


@pytest.mark.parametrize(
    ("key", "value", "field", "expected"),
    [
        ("ctx-size", "512", "ctx_size", 512),
        ("c", "512", "ctx_size", 512),
        ("LLAMA_ARG_CTX_SIZE", "512", "ctx_size", 512),
        ("n-gpu-layers", "3", "n_gpu_layers", 3),
        ("gpu-layers", "3", "n_gpu_layers", 3),
        ("ngl", "3", "n_gpu_layers", 3),
        ("LLAMA_ARG_N_GPU_LAYERS", "3", "n_gpu_layers", 3),
        ("parallel", "2", "parallel", 2),
        ("np", "2", "parallel", 2),
        ("LLAMA_ARG_N_PARALLEL", "2", "parallel", 2),
        ("LLAMA_ARG_BATCH", "64", "batch_size", 64),
        ("LLAMA_ARG_THREADS", "1", "threads", 1),
        ("LLAMA_ARG_FLASH_ATTN", "off", "flash_attn", "off"),
        ("kv-unified", "true", "kv_unified", True),
        ("no-kv-unified", "true", "kv_unified", False),
        ("LLAMA_ARG_KV_UNIFIED", "1", "kv_unified", True),
        ("jinja", "false", "jinja", False),
        ("no-jinja", "true", "jinja", False),
        ("LLAMA_ARG_JINJA", "true", "jinja", True),
        ("LLAMA_ARG_CHAT_TEMPLATE", "chatml", "chat_template", "chatml"),
        ("--ctx-size", "7", "ctx_size", 7),
    ],
)
def test_llama_cpp_key_spellings(
    tmp_path: Path, gguf: Path, key: str, value: str, field: str, expected: object
) -> None:
    (preset,) = load_presets(write(tmp_path, f"[a]\nmodel = {gguf}\n{key} = {value}\n", ".ini"))
    assert getattr(preset, field) == expected


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("[a]\nmodel = {m}\nLLAMA_ARG_BOGUS = 1\n", r":3: unknown key 'LLAMA_ARG_BOGUS'"),
        ("[a]\nmodel = {m}\nno-ctx-size = 1\n", r":3: unknown key 'no-ctx-size'"),
        ("[a]\nmodel = {m}\nno-jinja = maybe\n", r":3: invalid value 'maybe' for 'no-jinja'"),
        (
            "[a]\nmodel = {m}\nc = 1\nLLAMA_ARG_CTX_SIZE = 2\n",
            r":4: key 'LLAMA_ARG_CTX_SIZE' given twice in \[a\]",
        ),
    ],
)
def test_llama_cpp_key_errors(tmp_path: Path, gguf: Path, text: str, pattern: str) -> None:
    with pytest.raises(PresetError, match=pattern):
        load_presets(write(tmp_path, text.format(m=gguf), ".ini"))


def test_same_key_twice_the_last_wins(tmp_path: Path, gguf: Path) -> None:
    (preset,) = load_presets(write(tmp_path, f"[a]\nmodel = {gguf}\nc = 1\nc = 2\n", ".ini"))
    assert preset.ctx_size == 2


def test_memory_and_unload_after_keys(tmp_path: Path, gguf: Path) -> None:
    ini = write(
        tmp_path, f"[*]\nunload-after = 600\n[a]\nmodel = {gguf}\nmemory = 1.5GiB\nttl = 60\n", ".ini"
    )
    (a,) = load_presets(ini)
    assert (a.memory, a.ttl, a.unload_after) == (3 << 29, 60.0, 600.0)
    bad = write(tmp_path, f"[models.a]\nmodel = \"{gguf}\"\nmemory = \"lots\"\n", ".toml")
    with pytest.raises(
        PresetError, match=r"models\.a\.memory: invalid value 'lots' for 'memory': expected a size"
    ):
        load_presets(bad)


@pytest.mark.parametrize(("model", "looked"), [("/nope/x.gguf", False), ("sub/x.gguf", True)])
def test_a_missing_model_file_fails_that_model_only_and_says_where_it_looked(
    tmp_path: Path, gguf: Path, model: str, looked: bool
) -> None:
    """Bug (issue 25): one missing file stopped the whole router; the relative-path error did not
    say where it looked."""
    path = write(tmp_path, f"[ghost]\nmodel = {model}\n[a]\nmodel = {gguf}\n", ".ini")
    ghost, a = load_presets(path)
    assert a.model_error is None
    assert ghost.model_error is not None and f":2: model path '{model}' does not exist" in ghost.model_error
    assert ("beside the preset file, " + str(tmp_path.resolve())) in ghost.model_error if looked else \
        "looked" not in ghost.model_error
