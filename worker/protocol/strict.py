"""One rule for every request body: a field we do not know is refused by name, never ignored.

Every request model (the worker's wire types, the router's Responses API, the profiling
bodies) derives from `StrictModel`: pydantic's `extra="forbid"`, and `worker.protocol.errors.parse_model`
turns the refusal into one 400 that names every unknown field, with the reason when the field
is one we know of and do not do (`REFUSED`). Open namespaces are typed as dicts on the model
(`chat_template_kwargs`, `metadata`), never as extra fields.

One exception, and it is not "accepted and ignored": a field listed in `NEUTRAL` is dropped when
its value is the one that turns its feature off (`typical_p: 1.0`, `best_of: 1`), because the
output is then exactly what a server implementing it returns. Any other value is refused as
above. Clients that send every sampler knob at its default (llama.cpp's web UI, vLLM clients)
keep working; a client that asks for the feature learns it is not there.

docs/compatibility.md lists each field; tests/unit/test_field_walk.py checks that list.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

_BEAM = "beam search is not implemented"
_SPEC = "speculative decoding is not implemented"
_TEXT_ONLY = "the models served here take text only (sglang-omni's multimodal inputs)"

# fields that people send and we do not do -> why (the 400 says it)
REFUSED: dict[str, str] = {
    # sglang-omni
    "images": _TEXT_ONLY,
    "audios": _TEXT_ONLY,
    "videos": _TEXT_ONLY,
    "video_fps": _TEXT_ONLY,
    "stage_sampling": "sglang-omni's per-stage sampling: the models served here have one stage",
    "stage_params": "sglang-omni's per-stage parameters: the models served here have one stage",
    # speech (OpenAI); a `cmd`/`remote` upstream that serves audio gets these untouched
    "audio": "this model does not produce audio (no text-to-speech here)",
    "voice": "this model does not produce audio (no text-to-speech here)",
    # beam search
    "best_of": _BEAM,
    "use_beam_search": _BEAM,
    "length_penalty": _BEAM,
    "early_stopping": _BEAM,
    # speculative decoding (OpenVINO Model Server, OpenAI's predicted outputs)
    "num_assistant_tokens": _SPEC,
    "assistant_confidence_threshold": _SPEC,
    "max_ngram_size": _SPEC,
    "prediction": _SPEC,
    # Dynamo
    "annotations": "Dynamo's annotation events (formatted_prompt, token_ids) are not produced here",
    # older OpenAI shapes
    "functions": "the deprecated `functions` form: send `tools`",
    "function_call": "the deprecated `function_call` form: send `tool_choice`",
    "include_stop_str_in_output": "a matched stop string is always left out of the output",
}

# field -> the value that turns its feature off: dropped when sent with that value
NEUTRAL: dict[str, Any] = {
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "early_stopping": False,
    "include_stop_str_in_output": False,
    "typical_p": 1.0,
    "typ_p": 1.0,
    "tfs_z": 1.0,
    "mirostat": 0,
    "dynatemp_range": 0.0,
    "xtc_probability": 0.0,
    "dry_multiplier": 0.0,
    "top_n_sigma": -1.0,
}


def _is_neutral(name: str, value: Any) -> bool:
    if name not in NEUTRAL:
        return False
    want = NEUTRAL[name]
    if isinstance(want, bool) or isinstance(value, bool):
        return value is want
    return isinstance(value, int | float) and value == want


class StrictModel(BaseModel):
    """A request body: unknown fields are a 400 naming them (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in NEUTRAL and k not in cls.model_fields for k in data):
            return {k: v for k, v in data.items() if k in cls.model_fields or not _is_neutral(k, v)}
        return data


def unknown_fields_message(paths: list[str]) -> str:
    """The 400's message for unknown fields (full paths, e.g. `nvext.annotations`)."""
    names = ", ".join(f"'{p}'" for p in paths)
    reasons = []
    for p in paths:
        leaf = p.rsplit(".", 1)[-1]
        if leaf in REFUSED:
            neutral = f" (accepted only as {NEUTRAL[leaf]!r})" if leaf in NEUTRAL else ""
            reasons.append(f"'{p}': {REFUSED[leaf]}{neutral}")
    head = f"Unrecognized request argument{'s' if len(paths) > 1 else ''} supplied: {names}"
    return head + (" (" + "; ".join(reasons) + ")" if reasons else "")
