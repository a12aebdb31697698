"""What the HTTP handlers share: the engine, metrics, model identity and the chat template.

Kept apart from worker/server/app.py so the CLI can build it and start loading the model before it
imports the (slower to import) HTTP stack.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.engine import Engine
from worker.engine.metrics import WorkerMetrics

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
    created: int = field(default_factory=lambda: int(time.time()))
