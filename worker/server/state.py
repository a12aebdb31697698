"""What the HTTP handlers share: the engine, metrics, model identity and the chat template.

Kept apart from worker/server/app.py so the CLI can build it and start loading the model before it
imports the (slower to import) HTTP stack.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.engine.engine import Engine
from worker.engine.metrics import WorkerMetrics
from worker.protocol.sampling import SamplingParams
from worker.server.media import MediaPolicy

REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")

if TYPE_CHECKING:
    from worker.text.chat_template import ChatTemplate


@dataclass(slots=True)
class WorkerState:
    engine: Engine
    metrics: WorkerMetrics
    model_id: str
    model_path: str
    backend_kind: str
    template: ChatTemplate | None = None  # set by the loader once the model's metadata is known
    reasoning_format: str = "auto"  # the default of requests' reasoning_format
    defaults: SamplingParams = field(default_factory=SamplingParams)  # --temp, -n, ...: what requests omit
    tags: tuple[str, ...] = ()  # --tags: informational, reported in /v1/models
    aliases: tuple[str, ...] = ()  # -a a,b: every name the model answers to (model_id is the first, sorted)
    is_slots_on: bool = True  # GET /slots (--slots / --no-slots)
    is_metrics_on: bool = True  # GET /metrics (omni-worker --metrics; the CLI's default is off)
    template_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # --reasoning on|off: enable_thinking (a request's win)
    is_cors_proxy_on: bool = False  # --ui-mcp-proxy: GET/POST /cors-proxy (403 without it, as llama-server)
    is_lora_runtime_on: bool = False  # --lora-runtime: POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    lora_allowed_path: str | None = None  # --lora-allowed-path: the folder those adapters come from
    is_props_on: bool = False  # --props: POST /props answers (501 without it, as llama-server)
    slot_save_path: str | None = None  # --slot-save-path: POST /slots/{id}?action=save|restore
    is_verbose: bool = False  # --verbose: every response carries `__verbose`, as llama-server's
    is_embedding: bool = False  # --embedding: embeddings/rerank only (worker/server/embeddings.py)
    embd_normalize: int = 2  # requests' default embd_normalize (llama-server's: Euclidean)
    created: int = field(default_factory=lambda: int(time.time()))
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where images may come from, how many
    # The model's end-of-generation tokens: a scan of the whole vocabulary, done by the loader
    # (off the event loop) once the model is known.
    eog_ids: tuple[int, ...] = ()
