"""A worker's advice, reworded for a model served through the router. Pure: bytes in, bytes out.

A worker speaks to whoever started it: "Start it with `--embeddings`", "try increasing
--ctx-size". Behind the router, the user's lever is the model's preset, and the context limit is
per slot (ctx-size / parallel, unless kv-unified), so the error of a proxied request names the
preset key and the figures instead. Only small JSON error bodies pass through here.
"""

from __future__ import annotations

import json
import re

from router.presets import ModelPreset, canonical_key
from worker.protocol.defaults import DEFAULT_CTX, DEFAULT_PARALLEL

_START_WITH = re.compile(r"Start it with `--([\w-]+)`")
_START_WITHOUT = re.compile(r"Start it without `--([\w-]+)`")
_CTX = "try increasing --ctx-size"
MAX_BODY = 64 * 1024


def _key(flag: str) -> str:
    return canonical_key(flag) or flag


def _where(p: ModelPreset) -> str:
    return f"the preset of model {p.name!r}" + (f" ({p.source})" if p.source else "")


def reword(message: str, p: ModelPreset, n_ctx: int | None = None) -> str:
    def with_flag(m: re.Match[str]) -> str:
        key = _key(m.group(1))
        value = "DIR" if key == "slot-save-path" else "true"
        return f"Set `{key} = {value}` in {_where(p)}"

    def without_flag(m: re.Match[str]) -> str:
        return f"Remove `{_key(m.group(1))} = true` from {_where(p)}"

    message = _START_WITH.sub(with_flag, message)
    message = _START_WITHOUT.sub(without_flag, message)
    if _CTX in message:
        ctx = p.ctx_size or DEFAULT_CTX
        parallel = p.parallel or DEFAULT_PARALLEL
        share = ctx // parallel
        per_slot = f"{share} cells"
        if n_ctx is not None and n_ctx != share:
            per_slot += f", {n_ctx} as the backend rounds it"  # llama.cpp: a multiple of 256
        limit = ("the whole `ctx-size` is shared by its slots (kv-unified)" if p.kv_unified else
                 f"the limit is per slot: ctx-size {ctx} / parallel {parallel} = {per_slot}")
        message = message.replace(_CTX, f"raise `ctx-size` (or lower `parallel`) in {_where(p)}; {limit}")
    return message


def reword_body(body: bytes, p: ModelPreset) -> bytes:
    """An error envelope with its message reworded; anything else unchanged."""
    if len(body) > MAX_BODY or b"--" not in body:
        return body
    try:
        data = json.loads(body)
        err = data["error"]
        message = err["message"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(message, str):
        return body
    n_ctx = err.get("n_ctx") if isinstance(err.get("n_ctx"), int) else None
    new = reword(message, p, n_ctx)
    if new == message:
        return body
    err["message"] = new
    return json.dumps(data).encode()
