"""Usage per key and model: requests, prompt tokens, completion tokens, counted from each
answer's own usage as router.observability.request_trace reads it on the way out (streams
included, without buffering them). Fed once per request, when it ends (`record`); read by
/metrics (`collect`, a Prometheus collector) and `GET /keys/usage` (`as_json`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, Metric


@dataclass
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class KeyUsage:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], Counts] = {}

    def record(self, key: str, model: str, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        c = self.counts.setdefault((key, model), Counts())
        c.requests += 1
        c.prompt_tokens += prompt_tokens or 0
        c.completion_tokens += completion_tokens or 0

    def by_key(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (key, model), c in sorted(self.counts.items()):
            out.setdefault(key, {})[model] = {
                "requests": c.requests,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
            }
        return out

    # ---- a Prometheus collector (registered in router.observability.metrics' registry)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        families = {
            "requests": CounterMetricFamily(
                "omni_router:key_requests", "Requests by API key and model", labels=["key", "model"]
            ),
            "prompt_tokens": CounterMetricFamily(
                "omni_router:key_prompt_tokens",
                "Prompt tokens by API key and model (the answers' usage)",
                labels=["key", "model"],
            ),
            "completion_tokens": CounterMetricFamily(
                "omni_router:key_completion_tokens",
                "Completion tokens by API key and model (the answers' usage)",
                labels=["key", "model"],
            ),
        }
        for (key, model), c in self.counts.items():
            families["requests"].add_metric([key, model], c.requests)
            families["prompt_tokens"].add_metric([key, model], c.prompt_tokens)
            families["completion_tokens"].add_metric([key, model], c.completion_tokens)
        yield from families.values()


def json_of(usage: KeyUsage, live: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`GET /keys/usage`: per key, its counts by model and its live state (requests running and
    waiting at its concurrency gate, its limits)."""
    by_key = usage.by_key()
    names = sorted(set(by_key) | set(live))
    return {
        "object": "list",
        "data": [{"key": n, "models": by_key.get(n, {}), **live.get(n, {})} for n in names],
    }
