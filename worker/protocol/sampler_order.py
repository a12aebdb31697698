"""llama-server's `samplers`: the order of the sampler chain, and which samplers are in it.

A request's `samplers` is a list of names (`["top_k", "top_p", "temperature"]`, with llama.cpp's
spellings: `top-k`, `topk`, `nucleus`, `temp`, `typ`, any case) or a string of llama.cpp's
sampler letters (`"kpmt"`). As in llama-server, the list *is* the chain: a sampler left out is
not applied (its setting is then off: top_k 0, top_p 1, min_p 0, no penalties, and temperature
1, so a request that leaves `temperature` out is not greedy), and the order is the order they
run in. llama.cpp's web UI sends `top_k;typ_p;top_p;min_p;temperature` by default, leaving the
penalties out, and llama-server then applies none; so do we.

The chain's stages that run here are penalties, top_k, top_p, min_p and temperature. `dry`,
`typ_p`, `xtc` and `top_n_sigma` may be named: a request can only set them to their off value
(worker.protocol.strict.NEUTRAL), so they change nothing where they stand. `infill` and
`adaptive_p` are samplers we do not have: a 400 names them, as does a name llama.cpp does not
know (llama-server drops those with a warning in its log; we do not drop a client's words).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.protocol.sampling import SamplingParams

STAGES = ("penalties", "top_k", "top_p", "min_p", "temperature")
DEFAULT_ORDER: tuple[str, ...] = STAGES  # llama-server's default chain, less the samplers that are off
_INERT = frozenset({"dry", "typ_p", "xtc", "top_n_sigma"})  # only ever at their off value here
_MISSING = {"infill": "the infill sampler", "adaptive_p": "the adaptive-p sampler"}
_CANONICAL = (*STAGES, *sorted(_INERT), *_MISSING)
_NAMES: dict[str, str] = {}
for _c in _CANONICAL:
    for _spelling in (_c, _c.replace("_", "-"), _c.replace("_", "")):
        _NAMES[_spelling] = _c
_NAMES |= {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical_p": "typ_p"}
_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
            "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}


def parse(raw: str | list[str]) -> tuple[str, ...]:
    """The chain's stages that run here, in order (inert samplers dropped); ValueError naming what
    is not a sampler, or one not implemented."""
    if isinstance(raw, str):
        names = [_LETTERS.get(ch) for ch in raw]
        unknown = [ch for ch, n in zip(raw, names, strict=True) if n is None]
        if unknown:
            raise ValueError(f"unknown sampler letter(s) {', '.join(map(repr, unknown))} "
                             f"(llama.cpp's letters: {''.join(_LETTERS)})")
    else:
        names = [_NAMES.get(n.strip().lower()) for n in raw]
        unknown = [n for n, c in zip(raw, names, strict=True) if c is None]
        if unknown:
            raise ValueError(f"unknown sampler name(s) {', '.join(map(repr, unknown))} "
                             f"(valid: {', '.join(_CANONICAL)})")
    missing = sorted({_MISSING[n] for n in names if n in _MISSING})
    if missing:
        raise ValueError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not implemented")
    return tuple(n for n in names if n is not None and n not in _INERT)


def penalties_first(params: SamplingParams) -> bool:
    """Whether the penalties, if on, come before every other stage that is on. The torch
    backend's sampler applies them to the whole row first (worker/torch_model/sampler.py), so it
    serves a chain only where this holds; the worker refuses the others there."""
    if not params.has_penalties or "penalties" not in params.order:
        return True
    on = {"top_k": params.top_k > 0, "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0,
          "temperature": not params.is_greedy}
    return not any(on.get(s, False) for s in params.order[: params.order.index("penalties")])
