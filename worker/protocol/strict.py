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

_BEAM = "beam search is set on chat, completion and Responses requests, not on this API"
_MEDIA = ("sglang-omni's audio list is not implemented yet (images and videos are: see `images` and "
          "`videos`; audio goes in chat `input_audio` parts)")

# ---- Not implemented YET. Whoever makes one of these work declares it as a real field on the
# wire model and deletes its line here (and its row in docs/compatibility.md).
# Speculative decoding (issue 29): OpenVINO Model Server's fields, OpenAI's predicted outputs.
SPECULATIVE: dict[str, str] = {
    "prediction": "OpenAI's predicted outputs are not implemented (prompt-lookup speculation drafts from "
                  "the prompt itself: num_assistant_tokens, max_ngram_size)",
    "speculative": "llama-server's speculative settings are flat keys: speculative.n_max, speculative.n_min",
}
# Speculative decoding's request fields (issue 29) are real fields of chat and completion
# requests; a Responses or Messages request does not take them.
_SPEC_ELSEWHERE = "speculative decoding is set on chat and completion requests, not on this API"
# Audio inputs: sglang-omni's top-level audio list (`images` and `videos` are real fields: issues 30, 41).
MEDIA: dict[str, str] = {
    "audios": _MEDIA,
    "use_audio_in_video": "a video's audio track is not used: its frames are (send the audio as an "
                          "`input_audio` part to a model that takes audio)",
}

# Ollama's options (router/ollama/) that are load-time settings here, or samplers we do not have
_OLLAMA_LOAD = ("an Ollama load-time option: a model is loaded once for every client, with its preset's keys "
                "(ctx-size, n-gpu-layers, threads, ...: docs/presets.md)")
OLLAMA: dict[str, str] = {
    **{k: _OLLAMA_LOAD for k in ("num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread",
                                 "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only",
                                 "num_gqa")},
    "mirostat": "Mirostat sampling is not implemented",
    "mirostat_tau": "Mirostat sampling is not implemented",
    "mirostat_eta": "Mirostat sampling is not implemented",
    "tfs_z": "tail-free sampling is not implemented (llama.cpp removed it)",
    "typical_p": "locally typical sampling is not implemented",
    "penalize_newline": "Ollama's deprecated penalize_newline is not implemented",
}

# fields that people send and we do not do -> why (the 400 says it)
REFUSED: dict[str, str] = {
    **SPECULATIVE,
    "num_assistant_tokens": _SPEC_ELSEWHERE,
    "assistant_confidence_threshold": _SPEC_ELSEWHERE,
    "max_ngram_size": _SPEC_ELSEWHERE,
    **MEDIA,
    # sglang-omni
    "stage_sampling": "sglang-omni's per-stage sampling: the models served here have one stage",
    "stage_params": "sglang-omni's per-stage parameters: the models served here have one stage",
    # speech (OpenAI); a `cmd`/`remote` upstream that serves audio gets these untouched
    "audio": ("spoken answers are chat completions' (modalities ['text', 'audio']), served by omni-router "
              "for a chat model whose preset names a speech-model; a worker and this API answer in text"),
    "voice": "a voice is chosen in chat's `audio: {voice, format}` or in POST /v1/audio/speech's body",
    "modalities": "output modalities are chat completions' (OpenAI defines audio output there only)",
    # beam search: real fields of chat, completion and Responses requests (worker/engine/beam.py)
    "best_of": _BEAM,
    "use_beam_search": _BEAM,
    "length_penalty": _BEAM,
    "early_stopping": "beam search runs until every beam has ended (vLLM's beam search): only false",
    # Dynamo
    "annotations": "Dynamo's annotation events (formatted_prompt, token_ids) are not produced here",
    # older OpenAI shapes
    "functions": "the deprecated `functions` form: send `tools`",
    "function_call": "the deprecated `function_call` form: send `tool_choice`",
    "include_stop_str_in_output": "a matched stop string is always left out of the output",
    # llama-server's sampling on the accelerator: sampling here runs in the engine, on the host
    "backend_sampling": "sampling runs in the engine on the host (llama-server's backend sampling "
                        "is not implemented; false is what runs)",
    **OLLAMA,
}

_NO_USERS = "an end-user id: there is no per-user policy or quota here"
_ONE_TIER = "there is one service tier"
_CACHE_KEY = "the prompt cache is keyed by the prompt's tokens themselves, every prefix is reused"
_ONE_VERBOSITY = "only the default ('medium'): no model served here is tuned for verbosity levels"
_REPLAYED = "what a response returns on its items; clients send those items back as input: kept, no effect"
_DRY = "a setting of DRY, which runs only with dry_multiplier > 0 (refused)"
_CACHE_CONTROL = "every prompt prefix is cached anyway (reads show as cache_read_input_tokens)"

# ---- Accepted and inert: "Model.field" -> why accepting it without an effect is honest. The
# field walk (tests/unit/test_field_walk.py) requires every other field of every request model
# to have a test that shows its effect, and docs/compatibility.md to say the same.
INERT: dict[str, str] = {
    "_SamplingRequest.user": _NO_USERS,
    "ChatCompletionRequest.safety_identifier": _NO_USERS,
    "ChatCompletionRequest.prompt_cache_key": _CACHE_KEY,
    "ChatCompletionRequest.service_tier": _ONE_TIER,
    "ChatCompletionRequest.verbosity": _ONE_VERBOSITY,
    "CreateResponse.user": _NO_USERS + " (echoed in the response)",
    "CreateResponse.safety_identifier": _NO_USERS + " (echoed in the response)",
    "CreateResponse.prompt_cache_key": _CACHE_KEY,
    "CreateResponse.service_tier": _ONE_TIER + " (echoed in the response)",
    "TextConfig.verbosity": _ONE_VERBOSITY,
    "TextFormat.description": "the grammar enforces the schema; its description is not shown to the model",
    "ReasoningItem.encrypted_content": "never produced here; a history item's `content` is what is replayed",
    "ThinkingBlock.signature": "never produced here, nothing to verify; the thinking text is replayed",
    "MessageItem.id": _REPLAYED,
    "MessageItem.status": _REPLAYED,
    "FunctionCallItem.id": _REPLAYED,
    "FunctionCallItem.status": _REPLAYED,
    "FunctionCallOutputItem.id": _REPLAYED,
    "FunctionCallOutputItem.status": _REPLAYED,
    "ReasoningItem.id": _REPLAYED,
    "ReasoningItem.status": _REPLAYED,
    "OutputText.annotations": _REPLAYED,
    "OutputText.logprobs": _REPLAYED,
    "Metadata.user_id": _NO_USERS,
    "CacheControl.type": _CACHE_CONTROL,
    "CacheControl.ttl": _CACHE_CONTROL,
    "CountTokensRequest.cache_control": _CACHE_CONTROL,
    "TextBlock.cache_control": _CACHE_CONTROL,
    "ImageBlock.cache_control": _CACHE_CONTROL,
    "Tool.cache_control": _CACHE_CONTROL,
    "ToolResultBlock.cache_control": _CACHE_CONTROL,
    "ToolUseBlock.cache_control": _CACHE_CONTROL,
    "_SamplingRequest.dynatemp_exponent": "a setting of dynamic temperature, which runs only with "
                                          "dynatemp_range > 0 (refused)",
    "_SamplingRequest.xtc_threshold": "a setting of XTC, which runs only with xtc_probability > 0 (refused)",
    "_SamplingRequest.dry_base": _DRY,
    "_SamplingRequest.dry_allowed_length": _DRY,
    "_SamplingRequest.dry_penalty_last_n": _DRY,
    "_SamplingRequest.dry_sequence_breakers": _DRY,
    "_SamplingRequest.reasoning_control": "llama-server makes reasoning endable at run time with it; no "
                                          "route here ends it, and the output is the same either way",
    "TextBlock.citations": "only an empty list (no document blocks are served, so nothing can be cited)",
    "OllamaOptions.num_keep": "the context is never shifted here (a prompt that does not fit is refused), so "
                              "there are no tokens to keep across a shift",
    "OllamaFunctionCall.index": "a call's place is its place in `tool_calls` (Ollama writes it; clients "
                                "send it back)",
    "OllamaToolCall.index": "a call's place is its place in `tool_calls` (Open WebUI writes it; clients "
                            "send it back)",
    "OllamaPullRequest.insecure": "there is no registry of ours to be insecure with: pulls come from the hub "
                                  "over HTTPS",
    "OllamaEmbeddingsRequest.input": "Open WebUI sends the same text as `prompt` too; this older route "
                                     "embeds `prompt` (POST /api/embed takes `input`)",
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
    "backend_sampling": False,
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
