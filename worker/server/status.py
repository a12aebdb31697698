"""The bodies of the worker's status routes: its model card (/v1/models) and the
/props document, as llama-server writes them."""

from __future__ import annotations

from typing import Any

from worker.backends.base import Vocab
from worker.protocol.sampling import SamplingParams
from worker.server.state import WorkerState


def model_card(state: WorkerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model_id, "aliases": list(state.aliases), "tags": list(state.tags),
                            "object": "model", "created": state.created, "owned_by": "omni-router"}
    backend = state.engine.backend
    if backend is not None:
        m = backend.meta
        card["meta"] = {
            "n_vocab": m.n_vocab,
            "n_ctx_train": m.n_ctx_train,
            "n_ctx": backend.n_ctx_seq,
            "n_params": m.n_params,
            "size": m.size_bytes,
            "backend": state.backend_kind,
            "fim": not m.fim.missing(),  # fill in the middle (/infill): Ollama's `insert` capability
            # the chat template renders tools (else the generic tool prompt: worker/text/generic_tools.py)
            "tools": state.template is not None and state.template.caps.supports_tools,
        }
    return card


def _default_params(d: SamplingParams) -> dict[str, Any]:
    n_predict = -1 if d.max_tokens is None else d.max_tokens
    return {
        "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
        "repeat_penalty": d.repeat_penalty, "repeat_last_n": d.repeat_last_n,
        "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
        "seed": -1 if d.seed is None else d.seed, "n_predict": n_predict, "max_tokens": n_predict,
    }


def _weights(backend: Vocab) -> dict[str, Any] | None:
    """The llama.cpp backend's weight placement: the --repack decision and the buffers the weights
    took, in MiB (worker/backends/weight_buffers.py), and the C++ runtime decision."""
    plan = getattr(backend, "repack", None)
    if plan is None:
        return None
    runtime = backend.cxx_runtime  # type: ignore[attr-defined]  # the llama.cpp backend's, as `repack`
    return {
        "repack": plan.mode,
        "extra_buffer_types": list(plan.allowed),
        "left_out": list(plan.left_out),
        "reason": plan.reason,
        "buffers_mib": dict(backend.weight_buffers),  # type: ignore[attr-defined]
        "cxx_runtime": {"preloaded": runtime.preload, "reason": runtime.reason},
    }


def props(state: WorkerState, backend: Vocab) -> dict[str, Any]:
    m = backend.meta
    out = {
        "default_generation_settings": {
            "n_ctx": backend.n_ctx_seq,
            "params": _default_params(state.defaults),
        },
        "total_slots": state.engine.n_slots,
        "model_alias": state.model_id,
        "model_path": state.model_path,
        "backend": state.backend_kind,
        "chat_template": state.template.source if state.template else m.chat_template,
        "bos_token": m.bos_token,
        "eos_token": m.eos_token,
        "is_sleeping": backend.is_sleeping,
        "modalities": {"vision": backend.vision is not None and backend.vision.has_vision,
                       "audio": backend.vision is not None and backend.vision.has_audio},
        "build_info": "omni-worker",
    }
    weights = _weights(backend)
    if weights is not None:
        out["weights"] = weights
    return out
