"""What Ollama's list, ps and show routes say about a model, known without loading it.

From the model file: its size, a digest, `modified_at`, and for a GGUF its header (every key
but the vocabulary's arrays: `model_info`; architecture, file type and size label: `details`;
the chat template; the FIM token keys). For an HF folder (the torch backend): config.json.
Read in a thread, once per file version (path, size, mtime), and cached.

The digest is sha256 over the file's path, size and mtime, not its bytes: hashing gigabytes
for a listing would cost seconds of disk per model; it changes whenever the file does, which
is what clients use it for (Open WebUI and Continue compare digests to see a model changed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from router.lifecycle.gguf_header import GGUFHeaderError, Value, read_keys
from router.lifecycle.modalities import modalities
from router.presets import ModelPreset
from worker.protocol.fim_tokens import FIM_TOKEN_TEXTS

log = logging.getLogger("omni.router.ollama")

# llama.cpp's LLAMA_FTYPE values (general.file_type) -> Ollama's quantization_level
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4",
}
_VOCAB_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)
_FIM_KEYS = (
    ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
)
_FIM_VOCAB = tuple(FIM_TOKEN_TEXTS[k] for k in ("pre", "suf", "mid"))
_THINKING = ("<think>", "enable_thinking", "reasoning_content", "thinking")


@dataclass(frozen=True)
class FileFacts:
    """What the model file says (see the module docstring)."""

    size: int = 0
    modified: float = 0.0
    digest: str = ""
    format: str = "gguf"
    family: str = ""
    size_label: str = ""
    quantization: str = ""
    context_length: int = 0
    template: str = ""
    eos_text: str = ""
    has_fim: bool = False
    supports_tools: bool = False
    model_info: dict[str, Any] = field(default_factory=dict)


def ollama_name(name: str) -> str:
    """Our name as Ollama writes it: `name:tag`, a bare name being `:latest`."""
    return name if ":" in name else f"{name}:latest"


NEVER = "2318-01-01T00:00:00Z"  # a time that never comes (Ollama's expires_at of a model kept forever)


def iso(ts: float | None) -> str:
    """A wall-clock time as Ollama writes it; None, or past what a date can hold (a keep_alive
    of 1e300 seconds), is NEVER."""
    try:
        return NEVER if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):
        return NEVER


def facts(preset: ModelPreset) -> FileFacts:
    """The model file's facts (blocking: call in a thread); an unreadable file gives what can be told."""
    path = preset.model
    if path is None:
        return FileFacts(format="remote")
    try:
        st = path.stat()
    except OSError:
        return FileFacts()
    return _facts(path, st.st_size, st.st_mtime_ns, preset.chat_template)


@functools.lru_cache(maxsize=64)
def _facts(path: Path, size: int, mtime_ns: int, template_spec: str | None) -> FileFacts:
    digest = hashlib.sha256(f"{path.resolve()}:{size}:{mtime_ns}".encode()).hexdigest()
    if path.is_dir():
        return _folder_facts(path, digest, mtime_ns / 1e9, template_spec)
    try:
        keys = read_keys(
            path,
            lambda k: (
                k != "tokenizer.ggml.scores"
                and k != "tokenizer.ggml.token_type"
                and k != "tokenizer.ggml.merges"
            ),
            stop_when=lambda f: False,
        )
    except (GGUFHeaderError, OSError, ValueError) as e:
        log.warning("%s: cannot read the GGUF header: %s", path, e)
        return FileFacts(size=size, modified=mtime_ns / 1e9, digest=digest)
    arch = str(keys.get("general.architecture", ""))
    tokens = keys.get("tokenizer.ggml.tokens")
    vocab = tokens if isinstance(tokens, list) else []
    eos = keys.get("tokenizer.ggml.eos_token_id")
    eos_text = str(vocab[eos]) if isinstance(eos, int) and 0 <= eos < len(vocab) else ""
    fim = _fim_texts(keys, vocab)
    gguf_template = keys.get("tokenizer.chat_template")
    source = template_source(template_spec, gguf_template if isinstance(gguf_template, str) else None)
    info: dict[str, Any] = {
        k: _json_value(v)
        for k, v in keys.items()
        if k not in _VOCAB_ARRAYS and k != "tokenizer.chat_template"
    }
    info["tokenizer.ggml.tokens"] = None  # the vocabulary: Ollama leaves it out unless verbose
    ctx = keys.get(f"{arch}.context_length", 0)
    ftype = keys.get("general.file_type")
    return FileFacts(
        size=size,
        modified=mtime_ns / 1e9,
        digest=digest,
        format="gguf",
        family=arch,
        size_label=str(keys.get("general.size_label", "")),
        quantization=FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
        context_length=int(ctx) if isinstance(ctx, int) else 0,
        template=source if fim is None else insert_template(fim, source),
        eos_text=eos_text,
        has_fim=fim is not None,
        supports_tools=_mentions_tools(source),
        model_info=info,
    )


def _fim_texts(keys: dict[str, Value], vocab: list[Any]) -> tuple[str, str, str] | None:
    """The model's FIM prefix, suffix and middle tokens (from the header's keys, else by their
    usual texts, as llama.cpp finds them); None without all three."""
    found = []
    for pair, texts in zip(_FIM_KEYS, _FIM_VOCAB, strict=True):
        i = next((keys[k] for k in pair if k in keys), None)
        if isinstance(i, int) and 0 <= i < len(vocab):
            found.append(str(vocab[i]))
        elif isinstance(i, int):
            found.append(f"<token {i}>")
        else:
            text = next((t for t in texts if t in vocab), None)
            if text is None:
                return None
            found.append(text)
    return found[0], found[1], found[2]


def insert_template(fim: tuple[str, str, str], chat: str) -> str:
    """The template as Ollama would show it for a model that fills in the middle: a request with
    a `suffix` is the FIM prompt (llama-server's /infill layout), anything else the chat template.
    Continue looks for `.Suffix` in it to know a model can fill in the middle."""
    pre, suf, mid = fim
    return (
        f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}"
        f"{{{{- else }}}}{chat}{{{{- end }}}}"
    )


def _json_value(v: Value) -> Any:
    return v if not isinstance(v, list) or len(v) <= 64 else None  # long arrays: as Ollama, left out


def template_source(spec: str | None, model_template: str | None) -> str:
    """The chat template the worker will render, read without loading it (the worker's own
    rules, worker/text/chat_template.py: the preset's `chat-template` if given, a file (a .json
    one: its "chat_template" key), inline Jinja, or a builtin name; else the model's own).
    A builtin's source lives in the worker: its name is shown."""
    if not spec:
        return model_template or ""
    path = Path(spec)
    try:
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            if path.suffix.lower() != ".json":
                return text
            value = json.loads(text).get("chat_template")
            if isinstance(value, list):  # HF's named templates: "default", else the first
                named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
                value = named.get("default", next(iter(named.values()), None))
            return value if isinstance(value, str) else ""
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return ""
    if "{{" in spec or "{%" in spec:
        return spec
    return f"{{# omni-worker's builtin chat template {spec!r} #}}"


def _mentions_tools(template: str) -> bool:
    """Whether a template renders `tools`, told from its text before a load (the loaded worker,
    which probes it, has the last word: its card's `tools`)."""
    return "tools" in template


def _folder_facts(path: Path, digest: str, modified: float, spec: str | None) -> FileFacts:
    def read(name: str) -> dict[str, Any]:
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    config, tok = read("config.json"), read("tokenizer_config.json")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    arch = str(config.get("model_type", ""))
    own = tok.get("chat_template")
    template = template_source(spec, own if isinstance(own, str) else None)
    eos = tok.get("eos_token")
    return FileFacts(
        size=size,
        modified=modified,
        digest=digest,
        format="safetensors",
        family=arch,
        quantization=str(config.get("torch_dtype", "")).upper(),
        context_length=int(config.get("max_position_embeddings", 0) or 0),
        template=template,
        eos_text=eos if isinstance(eos, str) else "",
        supports_tools=_mentions_tools(template),
        model_info={f"{arch}.{k}": v for k, v in config.items() if isinstance(v, int | float | str | bool)},
    )


def vocabulary(preset: ModelPreset) -> dict[str, Any]:
    """The header's vocabulary arrays (tokens, scores, token types, merges): `/api/show`'s
    `verbose` (blocking and not cached: megabytes of JSON, asked for rarely)."""
    path = preset.model
    if path is None or path.is_dir():
        return {}
    try:
        return dict(
            read_keys(path, lambda k: k in _VOCAB_ARRAYS, stop_when=lambda f: len(f) == len(_VOCAB_ARRAYS))
        )
    except (GGUFHeaderError, OSError, ValueError):
        return {}


def parameter_size(n_params: int | None, label: str) -> str:
    """Ollama's `parameter_size`: "135M", "7.6B"."""
    if not n_params:
        return label
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n_params >= scale:
            return f"{n_params / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(n_params)


def details(f: FileFacts, n_params: int | None = None) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": f.format,
        "family": f.family,
        "families": [f.family] if f.family else None,
        "parameter_size": parameter_size(n_params, f.size_label),
        "quantization_level": f.quantization,
    }


def capabilities(preset: ModelPreset, f: FileFacts, meta: dict[str, Any] | None) -> list[str]:
    """As the model really supports them: `embedding` for an embedding model; else `completion`,
    `tools` when its chat template renders tools, `vision` when it takes images, `insert` when it
    has fill-in-the-middle tokens, `thinking` when its template thinks. For tools and insert the
    loaded worker's word (its card's meta) wins over what the file says."""
    if preset.embedding:
        return ["embedding"]
    caps = ["completion"]
    tools = meta.get("tools") if meta else None
    if tools if isinstance(tools, bool) else f.supports_tools:
        caps.append("tools")
    if modalities(preset).get("vision"):
        caps.append("vision")
    fim = meta.get("fim") if meta else None
    if fim if isinstance(fim, bool) else f.has_fim:
        caps.append("insert")
    if any(t in f.template for t in _THINKING):
        caps.append("thinking")
    return caps
