"""Every `omni-worker` flag as a preset key, read from the worker's own command line definition.

As llama.cpp's presets take any llama-server argument, a preset takes any omni-worker option by
its long name without dashes (`temp = 0.7`, `top-k = 20`, `chat-template-file = x.jinja`,
`cache-type-k = q8_0`, `reasoning-format = none`), its other spellings (`temperature`, short
names such as `n`), and `no-X = true` for a `--X/--no-X` switch. Values are checked at preset
load with the worker's own parameter types, so a bad value names the key then, not at spawn.
The flags the router sets itself (port, host, parent pid, model, alias, metrics, API keys) are
refused with the preset key to use instead.

Read once, lazily, from `omni-worker --flags-json` (a subprocess, ~1 s): only when a preset key
is not one of the router's own (router.presets._KEYS).
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

# worker flag -> why a preset cannot set it (and what to use)
ROUTER_OWNED = {
    "model": "use 'model'",
    "alias": "use 'alias'",
    "host": "the router picks it",
    "port": "the router picks it",
    "uds": "the router talks to workers over TCP",
    "parent-pid": "the router sets it",
    "metrics": "the router always turns it on",
    "api-key": "set --api-key on the router",
    "api-key-file": "set --api-key on the router",
    "sleep-idle-seconds": "use 'ttl' (idle seconds before the router puts the model to sleep)",
    "version": "it is not a setting",
}


@dataclass(frozen=True)
class WorkerFlag:
    name: str  # the long name without dashes: the preset key
    is_switch: bool  # `--X` (or `--X/--no-X`): the value is true or false
    negation: str | None  # `no-X` when the worker has `--no-X`
    help: str
    kind: str = "str"  # int, float, bool or str: how a value is checked
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class Lookup:
    flag: WorkerFlag
    is_negated: bool  # spelled `no-X`: the value means its opposite


@cache
def _options() -> list[dict[str, Any]]:
    """`omni-worker --flags-json`: the worker's own option list. Read from a subprocess, once: the
    router talks to the worker through its command line (and imports only worker.protocol)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    out = subprocess.run(
        [sys.executable, "-m", "worker.server.cli", "--flags-json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    options: list[dict[str, Any]] = json.loads(out.stdout)
    return options


@cache
def _index() -> dict[str, Lookup]:
    """Every spelling (without dashes, lower case) -> the flag."""
    out: dict[str, Lookup] = {}
    for opt in _options():
        longs = [o[2:] for o in opt["opts"] if o.startswith("--")]
        if not longs or opt["hidden"]:
            continue
        negation = next((o[2:] for o in opt["secondary_opts"] if o.startswith("--")), None)
        flag = WorkerFlag(
            longs[0], bool(opt["is_flag"]), negation, opt["help"], opt["type"], opt["min"], opt["max"]
        )
        for spelling in (*longs, *(o[1:] for o in opt["opts"] if not o.startswith("--"))):
            out.setdefault(spelling, Lookup(flag, False))
        if negation is not None:
            for spelling in (negation, *(o[1:] for o in opt["secondary_opts"] if not o.startswith("--"))):
                out[spelling] = Lookup(flag, True)  # `no-X`, and its short form (`nr`)
    return out


def lookup(spelled: str) -> Lookup | None:
    return _index().get(spelled)


def names() -> list[str]:
    """The long names a preset can use (router-owned ones left out)."""
    return sorted({lk.flag.name for lk in _index().values() if lk.flag.name not in ROUTER_OWNED})


def spellings() -> list[str]:
    """Every spelling a preset can use for a worker flag (for "did you mean")."""
    return sorted(k for k, lk in _index().items() if lk.flag.name not in ROUTER_OWNED)


def convert(flag: WorkerFlag, raw: str) -> str:
    """The value as the worker will get it, checked as the worker checks it; ValueError if bad."""
    if flag.is_switch:
        raise AssertionError("switches are converted by the caller")
    kind = {"int": int, "float": float}.get(flag.kind, str)
    text = str(raw).strip()
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None
    if (flag.min is not None and value < flag.min) or (flag.max is not None and value > flag.max):
        bounds = [
            f">= {flag.min}" if flag.min is not None else "",
            f"<= {flag.max}" if flag.max is not None else "",
        ]
        raise ValueError(f"expected a value {' and '.join(b for b in bounds if b)}")
    return text


def did_you_mean(spelled: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(spelled, candidates, n=1, cutoff=0.75)
    return close[0] if close else None
