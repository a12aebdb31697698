"""Request defaults a model's preset sets per request, and the variants built on them.

A variant (`[models.precise] variant-of = "qwen"`) is a name for its base model's worker with
its own defaults: no second process, no second load. The router writes the defaults into the
request body before forwarding (router/http/forwarding.py, router/responses/bridge.py), each
under a field the request leaves out, so that:

    the request's own fields  >  the variant's defaults  >  the base's router-side defaults
                              >  the base worker's flags (`temp = 0.2` on the base: the worker's)

What a default can be (a key of the variant's section; anything else is refused at preset load,
since it would need a worker of its own):
- a sampling flag of omni-worker that a request also carries (`PER_REQUEST`: `temp`, `top-k`,
  `top-p`, `min-p`, `n-predict`, `seed`, penalties, `reasoning-format`, `reasoning`);
- `system-prompt`: put first in a chat that has no system (or developer) message of its own;
- `chat-template-kwargs` (a TOML table or JSON object text): merged under the request's own;
- `reasoning-budget` (llama.cpp's thinking budget: the request's `thinking_budget_tokens`);
- `lora-scale` ("ID=SCALE,..." or a table): the request's `lora` list (adapters not listed run
  at scale 0, llama-server's rule).

The last four are router keys of any model (a base model's own chat defaults too). The
defaults go to the generating routes only: sampling ones to chat and text completions, the chat
ones (system prompt, template kwargs, reasoning) to chat completions. KV reuse across variants
of one base: one worker, one prompt cache, so a prompt the same up to a point is reused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# omni-worker flag (its long name) -> (the request field, its type): defaults a request can carry
PER_REQUEST: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temp": ("temperature", float),
    "top-k": ("top_k", int),
    "top-p": ("top_p", float),
    "min-p": ("min_p", float),
    "repeat-penalty": ("repeat_penalty", float),
    "repeat-last-n": ("repeat_last_n", int),
    "presence-penalty": ("presence_penalty", float),
    "frequency-penalty": ("frequency_penalty", float),
    "seed": ("seed", int),
    "n-predict": ("n_predict", int),
    "reasoning-format": ("reasoning_format", str),
}
CHAT_ONLY = frozenset({"reasoning_format", "chat_template_kwargs", "thinking_budget_tokens"})
# The router keys a variant's section may hold besides PER_REQUEST flags and `reasoning`.
VARIANT_KEYS = (
    "variant-of",
    "alias",
    "system-prompt",
    "chat-template-kwargs",
    "reasoning-budget",
    "lora-scale",
)
CHAT_PATHS = frozenset({"/v1/chat/completions"})
TEXT_PATHS = frozenset({"/v1/completions", "/completions", "/completion"})


@dataclass(frozen=True)
class RequestDefaults:
    """Fields written into a request that leaves them out. Values are JSON text (hashable)."""

    fields: tuple[tuple[str, str], ...] = ()  # request field -> JSON value, sorted
    system_prompt: str | None = None
    template_kwargs: tuple[tuple[str, str], ...] = ()  # chat_template_kwargs key -> JSON value

    def __bool__(self) -> bool:
        return bool(self.fields or self.system_prompt is not None or self.template_kwargs)

    def over(self, base: RequestDefaults) -> RequestDefaults:
        """These defaults on top of `base`'s (a variant's over its base model's)."""
        return RequestDefaults(
            tuple(sorted({**dict(base.fields), **dict(self.fields)}.items())),
            self.system_prompt if self.system_prompt is not None else base.system_prompt,
            tuple(sorted({**dict(base.template_kwargs), **dict(self.template_kwargs)}.items())),
        )

    def view(self) -> dict[str, Any]:
        """For the model's card in /v1/models."""
        out: dict[str, Any] = {k: json.loads(v) for k, v in self.fields}
        if self.system_prompt is not None:
            out["system_prompt"] = self.system_prompt
        if self.template_kwargs:
            out["chat_template_kwargs"] = {k: json.loads(v) for k, v in self.template_kwargs}
        return out


def build(
    worker_args: dict[str, str],
    *,
    system_prompt: str | None,
    template_kwargs: dict[str, Any],
    reasoning_budget: int | None,
    lora_scale: tuple[tuple[int, float], ...],
) -> RequestDefaults:
    """A variant's defaults from its section (worker flags already checked by the worker's own
    types); a flag outside PER_REQUEST is a ValueError naming it."""
    fields: dict[str, Any] = {}
    kwargs = dict(template_kwargs)
    for flag, raw in worker_args.items():
        if flag == "reasoning":  # the worker's --reasoning on|off|auto: the template's enable_thinking
            if raw in ("on", "off"):
                kwargs.setdefault("enable_thinking", raw == "on")
            continue
        if flag not in PER_REQUEST:
            raise ValueError(flag)
        name, kind = PER_REQUEST[flag]
        fields[name] = kind(raw)
    if reasoning_budget is not None:
        fields["thinking_budget_tokens"] = reasoning_budget
    if lora_scale:
        fields["lora"] = [{"id": i, "scale": s} for i, s in lora_scale]
    return RequestDefaults(
        tuple(sorted((k, json.dumps(v)) for k, v in fields.items())),
        system_prompt,
        tuple(sorted((k, json.dumps(v)) for k, v in kwargs.items())),
    )


def apply(body: dict[str, Any], defaults: RequestDefaults, path: str) -> dict[str, Any]:
    """`body` with `defaults` under its own fields, for the worker route `path` (a new dict)."""
    is_chat = path in CHAT_PATHS
    if not defaults or not (is_chat or path in TEXT_PATHS):
        return body
    out = dict(body)
    for name, value in defaults.fields:
        if name not in out and (is_chat or name not in CHAT_ONLY):
            if name == "n_predict" and ("max_tokens" in out or "max_completion_tokens" in out):
                continue
            out[name] = json.loads(value)
    if not is_chat:
        return out
    if defaults.template_kwargs:
        own = out.get("chat_template_kwargs")
        if own is None or isinstance(own, dict):  # (anything else: the worker's 400)
            out["chat_template_kwargs"] = {
                **{k: json.loads(v) for k, v in defaults.template_kwargs},
                **(own or {}),
            }
    messages = out.get("messages")
    if (
        defaults.system_prompt is not None
        and isinstance(messages, list)
        and not any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in messages)
    ):
        out["messages"] = [{"role": "system", "content": defaults.system_prompt}, *messages]
    return out
