"""Model presets: INI (llama.cpp `--models-preset` compatible) and TOML -> validated dataclasses.

INI: `[*]` holds global defaults, one `[name]` section per model, keys are llama-server option
names without dashes, long or short (`ctx-size` or `c`, `n-gpu-layers`, `gpu-layers` or `ngl`),
or their environment names (`LLAMA_ARG_CTX_SIZE`), `;` / `#` comments; a file written for
llama-server's `--models-preset` loads as it is (`version = 1`, `jinja = true`, `no-` flags, a
key repeated in a section: the last one wins). `model-draft` is the worker's
`--spec-draft-model` (speculative decoding with a draft model of the same vocabulary).
TOML: `[defaults]` and `[models.NAME]` tables with the same keys (`-` or `_` both accepted).
Precedence: router CLI overrides > model section > global defaults > built-in defaults.

Any other omni-worker flag is a key too, by its long name without dashes (`temp`, `top-k`,
`reasoning-format`, `no-slots`; router.worker_flags), checked with the worker's own types and
passed through to its command line.

LoRA adapters: `lora` lists a model's adapter files (comma-separated or a TOML list; paths as
`model`'s), passed to the worker as `--lora` (ids 0, 1, ... in order; `lora-scaled`,
`lora-init-without-apply` and `lora-runtime` pass through as worker flags). A client reaches an
adapter by `model`: "<name>:<adapter>" (the adapter's file stem, or the name it was loaded
under at run time), or by an alias of `lora-alias` ("NAME=ADAPTER,..." or a TOML table), which
the router turns into "<name>:<adapter>" before forwarding (router/http/forwarding.py).

Every error is a `PresetError` whose message names the file, the line (INI) or the key path
(TOML), and the valid values. Unknown keys ("did you mean 'parallel'?") and duplicate
names/aliases are errors.

Why one file of over 500 lines: INI and TOML, llama.cpp's key spellings (long, short,
environment names, `no-X`), precedence and validation with file:line errors are one parser over
one key table; omni-worker's own flags are read by router/worker_flags.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from router import variants
from router.variants import RequestDefaults

Backend = Literal["auto", "llama_cpp", "torch", "piper", "cmd", "remote"]
BACKENDS: tuple[str, ...] = ("auto", "llama_cpp", "torch", "piper", "cmd", "remote")
PLACEMENTS: tuple[str, ...] = ("local", "ray")  # where a worker runs (docs/ray.md)
POOLINGS: tuple[str, ...] = ("none", "mean", "cls", "last", "rank")  # worker --pooling
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
_INI_GROUP = "group:"  # an INI section [group:NAME] is a group of models, not a model
_INLINE_COMMENT = re.compile(r"\s+[;#].*$")  # `c = 2048 ; comment` (unquoted values only)
log = logging.getLogger("router.presets")


class PresetError(ValueError):
    """A bad preset; the message is one line fit for the user."""


@dataclass(frozen=True)
class GroupRule:
    """A group of models (llama-swap's `groups`, same meanings and defaults; the swap scheduler,
    router/lifecycle/swap.py, keeps them): `swap`: at most one member holds a slot at a time;
    `exclusive`: loading a member unloads the models of other groups (waiting for busy ones);
    `persistent`: its members are never unloaded to make room for a model of another group."""

    name: str
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False


@dataclass(frozen=True)
class ModelPreset:
    name: str
    backend: Backend = "auto"
    model: Path | None = None
    aliases: tuple[str, ...] = ()
    ctx_size: int | None = None
    parallel: int | None = None
    batch_size: int | None = None
    n_gpu_layers: int | None = None
    threads: int | None = None
    chat_template: str | None = None
    cache_ram: int | None = None  # MiB of host-RAM prompt cache (worker --cache-ram)
    kv_unified: bool | None = None  # one KV cache for all slots (worker --kv-unified)
    flash_attn: str | None = None  # auto | on | off (worker --flash-attn)
    jinja: bool | None = None  # worker --jinja / --no-jinja (templates are Jinja either way)
    model_draft: str | None = None  # llama-server's speculative draft model (--spec-draft-model)
    mmproj: Path | None = None  # a GGUF model's multimodal projector: image input (worker --mmproj)
    lora: tuple[Path, ...] = ()  # LoRA adapter files (worker --lora), ids 0, 1, ... in order
    lora_aliases: tuple[tuple[str, str], ...] = ()  # model name -> adapter name (see module doc), sorted
    embedding: bool | None = None  # an embedding model (worker --embedding)
    pooling: str | None = None  # none | mean | cls | last | rank (worker --pooling)
    reranking: bool | None = None  # a reranker (worker --reranking)
    slot_save_path: str | None = (
        None  # folder for POST /slots/{id}?action=save|restore (worker --slot-save-path)
    )
    cache_dir: str | None = None  # the disk prompt cache (worker --cache-dir; router.prompt_cache_dir)
    speech_model: str | None = None  # the voice (a piper model's name) that speaks this chat model's answers
    load_on_startup: bool = False
    stop_timeout: float = 10.0
    load_timeout: float = 300.0
    cmd: str | None = None
    upstream: str | None = None
    ttl: float | None = None  # idle seconds before sleep; None = router default, 0 = never
    unload_after: float | None = (
        None  # idle seconds before the process stops; None = router default, 0 = never
    )
    memory: int | None = None  # bytes the model needs (replaces the estimate)
    pin: bool = False
    worker_args: tuple[tuple[str, str], ...] = ()  # any other omni-worker flag: (long name, value), sorted
    model_error: str | None = (
        None  # the model file is missing: this model is failed, the router serves the rest
    )
    # ---- from a hub (router/hub): `hf-repo = "org/repo[:TAG]"` (llama-server's -hf) and `hf-file`,
    # fetched into the hub cache at the model's first load; `model` is then the file it brought
    hf_repo: str | None = None
    hf_file: str | None = None
    placement: str | None = None  # local | ray; None: ray with `omni-router --ray`, else local
    ray_resources: tuple[tuple[str, float], ...] = ()  # Ray resources its actor needs, sorted
    ray_node_labels: tuple[tuple[str, str], ...] = ()  # node labels it must land on, sorted
    # GPU placement (router.lifecycle.gpu_placement, docs/gpu-placement.md)
    devices: tuple[int, ...] = ()  # the GPUs it runs on, as given (nvidia-smi's indices); (): placed
    vram: int | None = None  # bytes of GPU memory it needs, over all its devices (replaces the estimate)
    fit: str = "full"  # full | partial: fewer GPU layers where no set of GPUs has room for all
    env: tuple[tuple[str, str], ...] = ()  # extra environment for its worker, sorted
    source: str = ""  # where it was defined, for messages
    # ---- groups, variants and the swap scheduler (router/variants.py, router/lifecycle/swap.py)
    group: GroupRule | None = None  # the group it is a member of ([groups.NAME])
    variant_of: str | None = None  # served by that model's worker with `request_defaults`
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)  # into each request (variants)
    priority: int = 0  # which waiting model loads first (higher first, within the fairness bound)
    concurrency_limit: int | None = None  # requests forwarded at once at most; past it they queue
    load_delay: float = 0.0  # seconds added to each load: for tests and benchmarks of tiny models

    def worker_arg(self, name: str) -> str | None:
        return next((v for k, v in self.worker_args if k == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that routes here: the name, its aliases and its adapters' aliases."""
        return (self.name, *self.aliases, *(n for n, _ in self.lora_aliases))

    def adapter_for(self, name: str) -> str | None:
        """The worker's model name for `name` when it is a LoRA alias ("<name>:<adapter>"), else None."""
        adapter = next((a for n, a in self.lora_aliases if n == name), None)
        return f"{self.name}:{adapter}" if adapter is not None else None

    @property
    def is_remote(self) -> bool:
        return self.backend == "remote"

    @property
    def resolved_backend(self) -> str:
        """`auto` as the worker resolves it: piper for a `.onnx` voice, llama.cpp for a file
        (GGUF), torch for a folder."""
        if self.backend != "auto":
            return self.backend
        if self.model is not None and self.model.suffix.lower() == ".onnx":
            return "piper"
        return (
            "llama_cpp"
            if self.model is None or self.model.suffix.lower() == ".gguf" or self.model.is_file()
            else "torch"
        )


# --------------------------------------------------------------------------- keys


def _int(lo: int) -> Callable[[str], int]:
    def conv(raw: str) -> int:
        try:
            v = int(str(raw).strip())
        except ValueError:
            raise ValueError(f"expected an integer >= {lo}") from None
        if v < lo:
            raise ValueError(f"expected an integer >= {lo}")
        return v

    return conv


def _float(lo: float, *, strict: bool = False) -> Callable[[str], float]:
    def conv(raw: str) -> float:
        try:
            v = float(str(raw).strip())
        except ValueError:
            raise ValueError(f"expected a number {'>' if strict else '>='} {lo:g}") from None
        if v < lo or (strict and v == lo):
            raise ValueError(f"expected a number {'>' if strict else '>='} {lo:g}")
        return v

    return conv


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(raw: str) -> bool:
    s = str(raw).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError("expected one of true, false, 1, 0, yes, no, on, off")


def _backend(raw: str) -> str:
    s = str(raw).strip()
    if s not in BACKENDS:
        raise ValueError(f"expected one of {', '.join(BACKENDS)}")
    return s


def _text(raw: str) -> str:
    s = str(raw).strip()
    if not s:
        raise ValueError("expected a non-empty string")
    return s


def _aliases(raw: str | list[str]) -> tuple[str, ...]:
    items = raw if isinstance(raw, list) else str(raw).split(",")
    out = tuple(str(a).strip() for a in items if str(a).strip())
    for a in out:
        if not NAME_RE.match(a):
            raise ValueError(f"alias {a!r} has characters outside [A-Za-z0-9._:/@+-]")
    return out


def _lora_files(raw: str | list[str]) -> tuple[str, ...]:
    items = raw if isinstance(raw, list) else str(raw).split(",")
    out = tuple(str(a).strip() for a in items if str(a).strip())
    if not out:
        raise ValueError("expected one or more adapter paths")
    return out


def _lora_aliases(raw: Any) -> tuple[tuple[str, str], ...]:
    """"NAME=ADAPTER,..." or a TOML table {NAME = "ADAPTER"}."""
    if isinstance(raw, dict):
        pairs = [(str(k), str(v)) for k, v in raw.items()]
    else:
        pairs = []
        for item in str(raw).split(","):
            name, sep, adapter = item.strip().partition("=")
            if not sep:
                raise ValueError(f"{item.strip()!r}: expected NAME=ADAPTER")
            pairs.append((name.strip(), adapter.strip()))
    for name, adapter in pairs:
        if not NAME_RE.match(name) or not adapter or ":" in adapter:
            raise ValueError(f"{name}={adapter}: a model name ([A-Za-z0-9._:/@+-]) = an adapter name")
    return tuple(sorted(pairs))


def _flash_attn(raw: str) -> str:
    s = str(raw).strip().lower()
    if s not in ("auto", "on", "off"):
        raise ValueError("expected one of auto, on, off")
    return s


def _pooling(raw: str) -> str:
    s = str(raw).strip().lower()
    if s not in POOLINGS:
        raise ValueError(f"expected one of {', '.join(POOLINGS)}")
    return s


_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)$", re.IGNORECASE)


def parse_size(raw: str) -> int:
    """`512M`, `20GiB`, `1.5g`, `4096` (bytes) -> bytes; K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024."""
    m = _SIZE_RE.match(str(raw).strip())
    if m is None:
        raise ValueError("expected a size like 512M, 20GiB or a number of bytes")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def _placement(raw: str) -> str:
    s = str(raw).strip().lower()
    if s not in PLACEMENTS:
        raise ValueError(f"expected one of {', '.join(PLACEMENTS)}")
    return s


def _pairs(raw: Any) -> list[tuple[str, Any]]:
    """A TOML table, or INI text: `{"GPU": 1}` (JSON) or `GPU=1, vram_gib=24`."""
    if isinstance(raw, dict):
        return [(str(k), v) for k, v in raw.items()]
    text = str(raw).strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            raise ValueError('expected a table like {"GPU": 1, "vram_gib": 24}') from None
        if not isinstance(data, dict):
            raise ValueError('expected a table like {"GPU": 1, "vram_gib": 24}')
        return [(str(k), v) for k, v in data.items()]
    out = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"expected NAME=VALUE items, got {item!r}")
        out.append((key.strip(), value.strip()))
    return out


def _ray_resources(raw: Any) -> tuple[tuple[str, float], ...]:
    out = []
    for name, value in _pairs(raw):
        try:
            amount = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"resource {name!r}: expected a number, got {value!r}") from None
        if amount < 0:
            raise ValueError(f"resource {name!r}: expected a number >= 0")
        out.append((name, amount))
    return tuple(sorted(out))


def _ray_node_labels(raw: Any) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, str(value)) for name, value in _pairs(raw)))


def _hub_ref(raw: str) -> str:
    """`org/repo[:TAG]`, checked as router.hub reads it."""
    from router.hub.choice import parse_ref

    s = _text(raw)
    parse_ref(s)
    return s


# ---- GPU placement keys (devices, vram, fit, env)

FITS: tuple[str, ...] = ("full", "partial")


def _devices(raw: Any) -> tuple[int, ...]:
    """`[0, 2]` (TOML), `0,2` or `[0, 2]` (INI): distinct GPU indices."""
    items = raw if isinstance(raw, list) else str(raw).strip().strip("[]").split(",")
    try:
        out = tuple(int(str(i).strip()) for i in items if str(i).strip())
    except ValueError:
        raise ValueError("expected GPU indices like [0, 2]") from None
    if not out or min(out) < 0 or len(set(out)) != len(out):
        raise ValueError("expected distinct GPU indices >= 0 like [0, 2]")
    return out


def _fit(raw: str) -> str:
    s = str(raw).strip().lower()
    if s not in FITS:
        raise ValueError(f"expected one of {', '.join(FITS)}")
    return s


def _env(raw: Any) -> tuple[tuple[str, str], ...]:
    """A TOML table, or INI `NAME=VALUE, ...`: variables for the worker's environment."""
    out = []
    for name, value in _pairs(raw):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ValueError(f"{name!r} is not an environment variable name")
        out.append((name, str(value)))
    return tuple(sorted(out))


def _signed_int(raw: str) -> int:
    try:
        return int(str(raw).strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _json_table(raw: Any) -> dict[str, Any]:
    """A TOML table, or JSON object text (INI): `{"enable_thinking": false}`."""
    if isinstance(raw, dict):
        return dict(raw)
    try:
        data = json.loads(str(raw))
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ValueError('expected a table (TOML) or a JSON object like {"enable_thinking": false}')
    return data


def _lora_scale(raw: Any) -> tuple[tuple[int, float], ...]:
    """`0=0.5, 1=1.0` or a table {"0" = 0.5}: adapter id -> scale."""
    out = []
    for key, value in _pairs(raw):
        try:
            out.append((int(key), float(value)))
        except (TypeError, ValueError):
            raise ValueError(f"expected ID=SCALE items (adapter id, number), got {key}={value}") from None
        if out[-1][0] < 0:
            raise ValueError(f"adapter id {key}: expected an integer >= 0")
    return tuple(sorted(out))


def _upstream(raw: str) -> str:
    s = str(raw).strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", s):
        raise ValueError("expected an http:// or https:// URL")
    return s


# canonical key -> (dataclass field, converter)
_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model": ("model", _text),
    "backend": ("backend", _backend),
    "alias": ("aliases", _aliases),
    "ctx-size": ("ctx_size", _int(0)),
    "parallel": ("parallel", _int(1)),
    "batch-size": ("batch_size", _int(1)),
    "n-gpu-layers": ("n_gpu_layers", _int(-1)),
    "threads": ("threads", _int(-1)),
    "chat-template": ("chat_template", _text),
    "cache-ram": ("cache_ram", _int(-1)),
    "kv-unified": ("kv_unified", _bool),
    "flash-attn": ("flash_attn", _flash_attn),
    "embedding": ("embedding", _bool),
    "pooling": ("pooling", _pooling),
    "reranking": ("reranking", _bool),
    "slot-save-path": ("slot_save_path", _text),
    "cache-dir": ("cache_dir", _text),
    "load-on-startup": ("load_on_startup", _bool),
    "stop-timeout": ("stop_timeout", _float(0, strict=True)),
    "load-timeout": ("load_timeout", _float(0, strict=True)),
    "cmd": ("cmd", _text),
    "upstream": ("upstream", _upstream),
    "ttl": ("ttl", _float(0)),
    "unload-after": ("unload_after", _float(0)),
    "memory": ("memory", parse_size),
    "pin": ("pin", _bool),
    "jinja": ("jinja", _bool),
    "model-draft": ("model_draft", _text),
    "placement": ("placement", _placement),
    "ray-resources": ("ray_resources", _ray_resources),
    "ray-node-labels": ("ray_node_labels", _ray_node_labels),
    "mmproj": ("mmproj", _text),
    "lora": ("lora", _lora_files),
    "lora-alias": ("lora_aliases", _lora_aliases),
    "speech-model": ("speech_model", _text),
    "hf-repo": ("hf_repo", lambda raw: _hub_ref(raw)),
    "hf-file": ("hf_file", _text),
    "devices": ("devices", _devices),
    "vram": ("vram", parse_size),
    "fit": ("fit", _fit),
    "env": ("env", _env),
    # groups, variants, the swap scheduler (router/variants.py, router/lifecycle/swap.py)
    "variant-of": ("variant_of", _text),
    "system-prompt": ("system_prompt", _text),
    "chat-template-kwargs": ("chat_template_kwargs", _json_table),
    "reasoning-budget": ("reasoning_budget", _int(-1)),
    "lora-scale": ("lora_scale", _lora_scale),
    "priority": ("priority", _signed_int),
    "concurrency-limit": ("concurrency_limit", _int(1)),
    "load-delay": ("load_delay", _float(0)),
}
# keys whose TOML value is a table
_TABLES = ("ray-resources", "ray-node-labels", "lora-alias", "env", "chat-template-kwargs", "lora-scale")
_DEFAULTS_KEYS = ("system_prompt", "chat_template_kwargs", "reasoning_budget", "lora_scale")  # variants.py
_SHORT = {"m": "model", "a": "alias", "c": "ctx-size", "np": "parallel", "b": "batch-size",
          "ngl": "n-gpu-layers", "gpu-layers": "n-gpu-layers", "t": "threads",
          "cram": "cache-ram", "kvu": "kv-unified", "fa": "flash-attn",
          "embeddings": "embedding", "rerank": "reranking",
          "md": "model-draft", "spec-draft-model": "model-draft", "mm": "mmproj",
          "hf": "hf-repo", "hfr": "hf-repo", "hff": "hf-file"}
# llama-server's environment names (LLAMA_ARG_X, lowered, `_` -> `-`, prefix off) of the keys above
_ENV = {
    "model": "model",
    "alias": "alias",
    "ctx-size": "ctx-size",
    "n-parallel": "parallel",
    "batch": "batch-size",
    "n-gpu-layers": "n-gpu-layers",
    "threads": "threads",
    "chat-template": "chat-template",
    "cache-ram": "cache-ram",
    "kv-unified": "kv-unified",
    "flash-attn": "flash-attn",
    "jinja": "jinja",
    "spec-draft-model": "model-draft",
    "embeddings": "embedding",
    "pooling": "pooling",
    "reranking": "reranking",
    "slot-save-path": "slot-save-path",
    "mmproj": "mmproj",
    "hf-repo": "hf-repo",
    "hf-file": "hf-file",
}
# ... and of the omni-worker flags that read one (typer's envvar), passed through as worker flags
_ENV_WORKER = {"repack": "repack"}
_NEGATABLE = ("kv-unified", "jinja")  # llama-server's `--no-X` switches: `no-X = true` means X = false
VALID_KEYS = ", ".join(sorted(_KEYS))


def _spelling(key: str) -> str:
    return key.strip().lower().replace("_", "-").lstrip("-")


def canonical_key(key: str) -> str | None:
    k = _spelling(key)
    if k.startswith("llama-arg-"):
        return _ENV.get(k[len("llama-arg-"):])
    k = _SHORT.get(k, k)
    return k if k in _KEYS else None


def _negated(key: str) -> str | None:
    """`no-kv-unified` -> `kv-unified` (the value is then inverted), else None."""
    k = _spelling(key)
    return k[3:] if k.startswith("no-") and k[3:] in _NEGATABLE else None


_WORKER_PREFIX = "worker:"  # a canonical key outside _KEYS: an omni-worker flag passed through


def _worker_key(key: str, value: Any, where: str) -> tuple[str, Any]:
    """A key that is one of omni-worker's flags (router.worker_flags): its canonical name and value;
    else a PresetError that names the closest valid key."""
    from router import worker_flags

    spelled = _spelling(key)
    if spelled.startswith("llama-arg-"):  # llama-server's environment name of a worker flag
        spelled = _ENV_WORKER.get(spelled[len("llama-arg-"):], spelled)
    found = worker_flags.lookup(spelled)
    if found is not None and found.flag.name in worker_flags.ROUTER_OWNED:
        raise PresetError(f"{where}: {key!r} cannot be set in a preset: "
                          f"{worker_flags.ROUTER_OWNED[found.flag.name]}")
    if found is None:
        everything = [*_KEYS, *_SHORT, *worker_flags.spellings()]
        guess = worker_flags.did_you_mean(spelled, everything)
        hint = f"; did you mean {_SHORT.get(guess, guess)!r}?" if guess else ""
        raise PresetError(
            f"{where}: unknown key {key!r}{hint} (valid: {VALID_KEYS}; short: c, np, ngl, t, b, "
            "a, m, fa, kvu; LLAMA_ARG_* names; and any omni-worker flag by its long name, see "
            "omni-worker --help)"
        )
    if found.is_negated:
        try:
            value = not (value if isinstance(value, bool) else _bool(value))
        except ValueError as e:
            raise PresetError(f"{where}: invalid value {value!r} for {key!r}: {e}") from None
    return _WORKER_PREFIX + found.flag.name, value


def _worker_value(name: str, raw: Any) -> str:
    from router import worker_flags

    found = worker_flags.lookup(name)
    assert found is not None
    if found.flag.is_switch:
        if not found.flag.negation and not _bool(raw):
            return "false"  # (a switch with no --no-X: false is its default, nothing to pass)
        return "true" if _bool(raw) else "false"
    return worker_flags.convert(found.flag, raw)


# --------------------------------------------------------------------------- raw sections


@dataclass
class _RawSection:
    """Key -> (value, where) for one section, before validation."""

    name: str
    where: str
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    spellings: dict[str, str] = field(default_factory=dict)  # canonical key -> as written


def _parse_ini(path: Path) -> tuple[_RawSection, list[_RawSection], list[_RawSection]]:
    glob = _RawSection("*", f"{path}")
    sections: list[_RawSection] = []
    groups: list[_RawSection] = []
    current: _RawSection | None = None
    is_group = False
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for lineno, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s or s[0] in ";#":
            continue
        where = f"{path}:{lineno}"
        if s.startswith("["):
            if not s.endswith("]"):
                raise PresetError(f"{where}: malformed section header {s!r} (expected [name])")
            name = s[1:-1].strip()
            is_group = name.startswith(_INI_GROUP)
            if name == "*":
                current = glob
                continue
            if is_group:  # [group:NAME]: a group of models (GroupRule), not a model
                current = _RawSection(name[len(_INI_GROUP):].strip(), f"{where} [{name}]")
                groups.append(current)
                continue
            if not name or not NAME_RE.match(name):
                raise PresetError(f"{where}: invalid model name {name!r} (use letters, digits and ._:/@+-)")
            if name in seen:
                raise PresetError(
                    f"{where}: duplicate model name [{name}] (first defined on line {seen[name]})"
                )
            seen[name] = lineno
            current = _RawSection(name, where)
            sections.append(current)
            continue
        if "=" not in s:
            raise PresetError(f"{where}: expected 'key = value', got {s!r}")
        key, _, value = s.partition("=")
        key = key.strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        else:
            value = _INLINE_COMMENT.sub("", value)
        if key == "version" and current is None:
            continue  # llama.cpp's preset files start with `version = 1`
        if current is None:
            raise PresetError(f"{where}: key {key!r} outside a section (put defaults under [*])")
        if is_group:
            current.values[key] = (value, where)
            continue
        _put(current, key, value, where)
    return glob, sections, groups


def _parse_toml(path: Path) -> tuple[_RawSection, list[_RawSection], list[_RawSection]]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path}: invalid TOML: {e}") from None
    for top in data:
        if top not in ("defaults", "models", "groups", "version"):
            raise PresetError(f"{path}: unknown top-level key {top!r} (valid: defaults, models, groups)")
    glob = _RawSection("*", f"{path}: defaults")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise PresetError(f"{path}: 'defaults' must be a table")
    for key, value in defaults.items():
        _put(glob, key, value, f"{path}: defaults.{key}")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise PresetError(f"{path}: 'models' must be a table of [models.NAME] tables")
    sections = []
    for name, table in models.items():
        if not isinstance(table, dict):
            raise PresetError(f"{path}: models.{name} must be a table")
        if not NAME_RE.match(name):
            raise PresetError(f"{path}: models.{name}: invalid model name (use letters, digits and ._:/@+-)")
        sec = _RawSection(name, f"{path}: models.{name}")
        for key, value in table.items():
            _put(sec, key, value, f"{path}: models.{name}.{key}")
        sections.append(sec)
    return glob, sections, _toml_groups(path, data.get("groups", {}))


def _put(sec: _RawSection, key: str, value: Any, where: str) -> None:
    canon = canonical_key(key)
    if canon is None and (positive := _negated(key)) is not None:
        try:
            canon, value = positive, not (value if isinstance(value, bool) else _bool(value))
        except ValueError as e:
            raise PresetError(f"{where}: invalid value {value!r} for {key!r}: {e}") from None
    if canon is None:
        canon, value = _worker_key(key, value, where)
    if canon in sec.values and sec.spellings.get(canon) != key:
        raise PresetError(
            f"{where}: key {key!r} given twice in [{sec.name}] (first at {sec.values[canon][1]})"
        )
    sec.spellings[canon] = key  # the same key again: the last one wins, as in llama-server's parser
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif isinstance(value, (int, float)):
        value = str(value)
    elif isinstance(value, list) and canon not in ("alias", "lora", "devices"):
        raise PresetError(f"{where}: expected a single value, got a list")
    elif isinstance(value, dict) and canon not in _TABLES:
        raise PresetError(f"{where}: expected a value, got a table")
    sec.values[canon] = (value, where)


# --------------------------------------------------------------------------- validation


def _resolve_model(raw: str, base_dir: Path) -> Path:
    """An absolute path, else relative to the current directory, else to the preset file's folder
    (where a missing relative path is then expected: the message says both places)."""
    p = Path(os.path.expanduser(raw))
    if p.is_absolute() or p.exists():
        return p.resolve() if p.exists() else p
    alt = base_dir / p
    return alt.resolve() if alt.exists() else alt


def _looked_in(raw: str, base_dir: Path) -> str:
    p = Path(os.path.expanduser(raw))
    if p.is_absolute():
        return ""
    return f" (looked in the current directory, {Path.cwd()}, and beside the preset file, {base_dir})"


def _build(name: str, layers: list[_RawSection], base_dir: Path, where: str) -> ModelPreset:
    kwargs: dict[str, Any] = {}
    origin: dict[str, str] = {}
    worker_args: dict[str, str] = {}
    for layer in layers:
        for canon, (value, at) in layer.values.items():
            if canon.startswith(_WORKER_PREFIX):
                flag = canon[len(_WORKER_PREFIX):]
                try:
                    worker_args[flag] = _worker_value(flag, value)
                except ValueError as e:
                    raise PresetError(f"{at}: invalid value {value!r} for {flag!r}: {e}") from None
                continue
            fname, conv = _KEYS[canon]
            try:
                kwargs[fname] = conv(value)
            except ValueError as e:
                raise PresetError(f"{at}: invalid value {value!r} for {canon!r}: {e}") from None
            origin[fname] = at
    model = kwargs.pop("model", None)
    mmproj = kwargs.pop("mmproj", None)
    kwargs["request_defaults"] = _request_defaults(kwargs, {})
    if kwargs.get("lora"):  # adapter files: found as `model` is
        kwargs["lora"] = tuple(_resolve_model(f, base_dir) for f in kwargs["lora"])
    if kwargs.get("model_draft"):  # the worker's --spec-draft-model (speculative decoding, draft-simple)
        kwargs["model_draft"] = str(_resolve_model(kwargs["model_draft"], base_dir))
    preset = ModelPreset(name=name, source=where, worker_args=tuple(sorted(worker_args.items())), **kwargs)
    if model is not None:
        preset = replace(preset, model=_resolve_model(model, base_dir))
    if mmproj is not None:
        preset = replace(preset, mmproj=_resolve_model(mmproj, base_dir))
    _check(preset, origin)
    if preset.backend not in ("cmd", "remote") and preset.model is not None and not preset.model.exists():
        # That model fails (and is tried again once the file is there); the others serve.
        error = (f"{origin.get('model', where)}: model path {str(model)!r} does not exist"
                 f"{_looked_in(str(model), base_dir)}")
        log.warning("%s", error)
        preset = replace(preset, model_error=error)
    elif preset.mmproj is not None and not preset.mmproj.is_file():
        error = (f"{origin.get('mmproj', where)}: mmproj path {str(mmproj)!r} does not exist"
                 f"{_looked_in(str(mmproj), base_dir)}")
        log.warning("%s", error)
        preset = replace(preset, model_error=error)
    return preset


def _check(p: ModelPreset, origin: Mapping[str, str]) -> None:
    at = p.source
    if p.backend == "remote" and p.placement is not None:
        raise PresetError(f"{origin['placement']}: 'placement' does not apply to backend = remote "
                          "(the router starts no process for it)")
    if p.placement == "local":
        for key, field_name in (("ray-resources", "ray_resources"), ("ray-node-labels", "ray_node_labels")):
            if getattr(p, field_name):
                raise PresetError(f"{origin[field_name]}: {key!r} needs placement = \"ray\" "
                                  "(this model runs on the router's own box)")
    if p.backend == "remote":
        if not p.upstream:
            raise PresetError(f"{at}: backend = remote needs 'upstream = http://host:port'")
        return
    if p.upstream:
        raise PresetError(f"{origin['upstream']}: 'upstream' is only valid with backend = remote")
    if p.backend == "cmd":
        if not p.cmd:
            raise PresetError(f"{at}: backend = cmd needs 'cmd = \"server --port ${{PORT}} ...\"'")
        if "${PORT}" not in p.cmd:
            raise PresetError(f"{origin['cmd']}: 'cmd' must contain ${{PORT}} (the port the router assigns)")
        return
    if p.cmd:
        raise PresetError(f"{origin['cmd']}: 'cmd' is only valid with backend = cmd")
    if p.hf_repo is not None or p.hf_file is not None:
        _check_hub(p, origin)
        return
    if p.model is None:
        raise PresetError(f"{at}: missing key 'model' (a .gguf file or a Hugging Face model folder), "
                          "or 'hf-repo' (org/repo[:TAG] on a hub)")


def _check_hub(p: ModelPreset, origin: Mapping[str, str]) -> None:
    """`hf-repo` (with `hf-file`) names the model instead of `model`; the hub's files decide the
    backend (a GGUF repo: llama.cpp, a safetensors one: torch) unless the preset says it."""
    if p.hf_repo is None:
        raise PresetError(f"{origin['hf_file']}: 'hf-file' needs 'hf-repo' (the repo the file is in)")
    if "model" in origin:
        raise PresetError(f"{origin['hf_repo']}: give 'model' (a file here) or 'hf-repo' (from a hub), "
                          "not both")
    if p.backend not in ("auto", "llama_cpp", "torch"):
        raise PresetError(f"{origin['hf_repo']}: 'hf-repo' needs backend = auto, llama_cpp or torch")


# --------------------------------------------------------------------------- groups and variants
#
# TOML:  [groups.NAME]  members = ["a", "b"]  swap = true  exclusive = true  persistent = false
# INI:   [group:NAME]   members = a, b        (the same keys; a model cannot be named "group:...")
# A model is a member of one group at most; a model in none behaves as if groups did not exist.
# A variant: [models.X] variant-of = "base" and its own request defaults (router/variants.py).

_GROUP_KEYS = ("members", "swap", "exclusive", "persistent")


def _toml_groups(path: Path, groups: Any) -> list[_RawSection]:
    if not isinstance(groups, dict):
        raise PresetError(f"{path}: 'groups' must be a table of [groups.NAME] tables")
    out = []
    for name, table in groups.items():
        if not isinstance(table, dict):
            raise PresetError(f"{path}: groups.{name} must be a table (members, swap, exclusive, persistent)")
        out.append(_RawSection(name, f"{path}: groups.{name}",
                               {k: (v, f"{path}: groups.{name}.{k}") for k, v in table.items()}))
    return out


def _with_groups(presets: list[ModelPreset], groups: list[_RawSection]) -> list[ModelPreset]:
    """Each member's preset with its group's rule; errors name the key path."""
    by_name = {p.name: p for p in presets}
    owner: dict[str, str] = {}
    for sec in groups:
        if not NAME_RE.match(sec.name):
            raise PresetError(f"{sec.where}: invalid group name {sec.name!r} (letters, digits and ._:/@+-)")
        for key, (_, at) in sec.values.items():
            if key not in _GROUP_KEYS:
                guess = next(iter(difflib_close(key, _GROUP_KEYS)), None)
                hint = f"; did you mean {guess!r}?" if guess else ""
                raise PresetError(f"{at}: unknown group key {key!r}{hint} (valid: {', '.join(_GROUP_KEYS)})")
        flags = {}
        for key in ("swap", "exclusive", "persistent"):
            if key in sec.values:
                value, at = sec.values[key]
                try:
                    flags[key] = value if isinstance(value, bool) else _bool(value)
                except ValueError as e:
                    raise PresetError(f"{at}: invalid value {value!r} for {key!r}: {e}") from None
        if "members" not in sec.values:
            raise PresetError(f"{sec.where}: missing key 'members' (the models of this group)")
        raw, at = sec.values["members"]
        members = _aliases(raw) if isinstance(raw, (str, list)) else ()
        if not members:
            raise PresetError(f"{at}: expected a list of model names")
        rule = GroupRule(sec.name, **flags)
        for m in members:
            p = by_name.get(m)
            if p is None:
                raise PresetError(f"{at}: {m!r} is not a model of this preset file (members are model names)")
            if p.variant_of is not None:
                raise PresetError(f"{at}: {m!r} is a variant of {p.variant_of!r}: put {p.variant_of!r} in "
                                  "the "
                                  "group (a variant is served by its base's worker)")
            if m in owner:
                raise PresetError(f"{at}: {m!r} is already a member of group {owner[m]!r} (one group each)")
            owner[m] = sec.name
            by_name[m] = replace(p, group=rule)
    return [by_name[p.name] for p in presets]


def difflib_close(word: str, choices: tuple[str, ...]) -> list[str]:
    import difflib

    return difflib.get_close_matches(word, choices, n=1, cutoff=0.6)


def _request_defaults(kwargs: dict[str, Any], worker_args: dict[str, str]) -> RequestDefaults:
    """Pops the router-side request defaults out of `kwargs` (system-prompt, ...)."""
    own = {k: kwargs.pop(k) for k in _DEFAULTS_KEYS if k in kwargs}
    return variants.build(worker_args, system_prompt=own.get("system_prompt"),
                          template_kwargs=own.get("chat_template_kwargs") or {},
                          reasoning_budget=own.get("reasoning_budget"),
                          lora_scale=own.get("lora_scale") or ())


def _build_variant(sec: _RawSection) -> ModelPreset:
    """A variant from its own section only ([*] / [defaults] and the command line are its base's:
    they configure a worker, and a variant has none of its own)."""
    kwargs: dict[str, Any] = {}
    worker_args: dict[str, str] = {}
    valid = (f"valid in a variant: {', '.join(variants.VARIANT_KEYS)}, and the sampling flags "
             f"{', '.join(sorted([*variants.PER_REQUEST, 'reasoning']))}")
    for canon, (value, at) in sec.values.items():
        flag = canon[len(_WORKER_PREFIX):] if canon.startswith(_WORKER_PREFIX) else None
        if flag is not None and (flag in variants.PER_REQUEST or flag == "reasoning"):
            try:
                worker_args[flag] = _worker_value(flag, value)
            except ValueError as e:
                raise PresetError(f"{at}: invalid value {value!r} for {flag!r}: {e}") from None
            continue
        if canon not in variants.VARIANT_KEYS:
            key = sec.spellings.get(canon, flag or canon)
            raise PresetError(f"{at}: {key!r} cannot be applied per request: a "
                              f"variant is served by its base model's worker ({valid})")
        fname, conv = _KEYS[canon]
        try:
            kwargs[fname] = conv(value)
        except ValueError as e:
            raise PresetError(f"{at}: invalid value {value!r} for {canon!r}: {e}") from None
    defaults = _request_defaults(kwargs, worker_args)
    return ModelPreset(name=sec.name, source=sec.where, request_defaults=defaults, **kwargs)


def _key_at(p: ModelPreset, key: str) -> str:
    """`file: models.NAME.KEY` (TOML) or `file:LINE: KEY` (INI, the section's line)."""
    return f"{p.source}.{key}" if ": models." in p.source else f"{p.source}: {key}"


def _linked_variants(presets: list[ModelPreset]) -> list[ModelPreset]:
    """Each variant checked against its base, its defaults put on top of the base's."""
    by_name = {p.name: p for p in presets}
    out = []
    for p in presets:
        if p.variant_of is not None:
            base = by_name.get(p.variant_of)
            if base is None or base.variant_of is not None:
                what = "a variant itself" if base is not None else "not a model of this preset file"
                raise PresetError(f"{_key_at(p, 'variant-of')}: {p.variant_of!r} is {what} (variant-of names "
                                  "a model with its own worker)")
            lora = dict(p.request_defaults.fields).get("lora")
            has_lora = base.lora or base.worker_arg("lora-scaled") or base.worker_arg("lora-runtime")
            if lora is not None and not has_lora:
                raise PresetError(f"{_key_at(p, 'lora-scale')}: {p.variant_of!r}: no LoRA adapter ('lora')")
            p = replace(p, request_defaults=p.request_defaults.over(base.request_defaults))
        out.append(p)
    return out


def load_presets(path: str | Path, overrides: Mapping[str, Any] | None = None) -> list[ModelPreset]:
    """Read and validate a preset file; `overrides` (router CLI, canonical keys) win over it."""
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"{path}: preset file not found")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        glob, sections, groups = _parse_toml(path)
    elif suffix in (".ini", ".cfg", ".conf", ""):
        glob, sections, groups = _parse_ini(path)
    else:
        raise PresetError(f"{path}: unknown preset format {suffix!r} (valid: .ini, .toml)")
    cli = _cli_section(overrides)
    base_dir = path.parent.resolve()
    presets = [_build_variant(s) if "variant-of" in s.values
               else _build(s.name, [glob, s, cli], base_dir, s.where) for s in sections]
    check_unique(presets)
    return _with_groups(_linked_variants(presets), groups)


def _cli_section(overrides: Mapping[str, Any] | None) -> _RawSection:
    cli = _RawSection("command line", "command line")
    for key, value in (overrides or {}).items():
        if value is not None:
            _put(cli, key, value, f"command line --{key}")
    return cli


def scan_models_dir(directory: str | Path, overrides: Mapping[str, Any] | None = None) -> list[ModelPreset]:
    """One preset per `*.gguf` file and per Hugging Face folder (has config.json) in `directory`,
    and, as llama.cpp's router, per folder of GGUF files: its model (the first shard of a split
    one) with the `mmproj*.gguf` beside it as its projector. A projector alone is no model. A
    Piper voice (`NAME.onnx` with its `NAME.onnx.json`) is a model too (docs/speech.md)."""
    d = Path(directory)
    if not d.is_dir():
        raise PresetError(f"--models-dir {d}: not a directory")
    cli = _cli_section(overrides)
    found: list[ModelPreset] = []
    for entry in sorted(d.iterdir()):
        is_gguf = entry.is_file() and entry.suffix == ".gguf" and "mmproj" not in entry.name
        is_gguf = is_gguf or (entry.suffix == ".onnx" and entry.is_file() and Path(f"{entry}.json").is_file())
        is_hf = entry.is_dir() and (entry / "config.json").is_file()
        gguf_dir = _gguf_folder(entry) if entry.is_dir() and not is_hf else None
        if not (is_gguf or is_hf or gguf_dir):
            continue
        name = entry.stem if is_gguf else entry.name
        if not NAME_RE.match(name):
            continue
        model, mmproj = gguf_dir or (entry, None)
        values = {"model": (str(model), str(entry))}
        if mmproj is not None:
            values["mmproj"] = (str(mmproj), str(entry))
        sec = _RawSection(name, str(entry), values)
        found.append(_build(name, [sec, cli], d, str(entry)))
    return found


def discovered_preset(name: str, model: Path, where: str, *, mmproj: Path | None = None,
                      worker_args: Mapping[str, str] | None = None, ctx_size: int | None = None,
                      overrides: Mapping[str, Any] | None = None) -> ModelPreset:
    """A GGUF model found in another tool's store (router/discovery), built as a --models-dir entry is:
    its store's settings (sampling, context) as preset keys, the router's CLI overrides on top."""
    # GGUF, whatever its file is called (Ollama's blobs have no suffix)
    sec = _RawSection(name, where, {"model": (str(model), where), "backend": ("llama_cpp", where)})
    if mmproj is not None:
        sec.values["mmproj"] = (str(mmproj), where)
    if ctx_size is not None:
        _put(sec, "ctx-size", str(ctx_size), where)
    for key, value in (worker_args or {}).items():
        _put(sec, key, value, where)
    return _build(name, [sec, _cli_section(overrides)], model.parent, where)


def _gguf_folder(d: Path) -> tuple[Path, Path | None] | None:
    """A folder's GGUF model and its projector, as llama.cpp's router scans a models folder."""
    files = sorted(f for f in d.iterdir() if f.is_file() and f.suffix == ".gguf")
    mmproj = next((f for f in files if "mmproj" in f.name), None)
    models = [f for f in files if "mmproj" not in f.name]
    model = next((f for f in models if "-00001-of-" in f.name), models[-1] if models else None)
    return (model, mmproj) if model is not None else None


def merge(presets: list[ModelPreset], scanned: list[ModelPreset]) -> list[ModelPreset]:
    """Presets win over `--models-dir` entries with the same name or model path."""
    taken = {n for p in presets for n in p.names}
    paths = {p.model for p in presets if p.model is not None}
    out = list(presets)
    out.extend(s for s in scanned if s.name not in taken and s.model not in paths)
    check_unique(out)
    return out


def check_unique(presets: list[ModelPreset]) -> None:
    owner: dict[str, ModelPreset] = {}
    for p in presets:
        for n in p.names:
            if n in owner and owner[n] is not p:
                raise PresetError(
                    f"{p.source}: name or alias {n!r} already used by [{owner[n].name}] ({owner[n].source})"
                )
            if n in owner:
                raise PresetError(f"{p.source}: alias {n!r} repeated")
            owner[n] = p
    for p in presets:
        voice = owner.get(p.speech_model) if p.speech_model is not None else None
        if p.speech_model is not None and (voice is None or voice.resolved_backend != "piper"):
            raise PresetError(f"{p.source}: speech-model {p.speech_model!r} is not a voice in these presets "
                              f"(a model whose `model` is a Piper .onnx voice)")
