"""Prometheus metrics of one worker (llama-server's names, `llamacpp:` prefix).

Counters are bumped by the engine thread; gauges are set by it once per step. prometheus-client
is thread-safe, and `render()` (the /metrics handler) only reads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # type: ignore[no-untyped-call]  # the *_created series are noise for a scrape of one process


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt processing time", registry=r)
        self.tokens_predicted = Counter("llamacpp:tokens_predicted", "Generated tokens", registry=r)
        self.tokens_predicted_seconds = Counter(
            "llamacpp:tokens_predicted_seconds", "Generation time", registry=r
        )
        self.n_decode = Counter("llamacpp:n_decode", "llama_decode() calls", registry=r)
        self.n_preempted = Counter("omni:preemptions", "Requests preempted for KV space", registry=r)
        self.requests = Counter("omni:requests", "Generation tasks finished", ["reason"], registry=r)
        self.embeddings = Counter("omni:embeddings", "Embedding and rerank inputs evaluated", registry=r)
        self.busy_slots = Gauge("llamacpp:n_busy_slots_per_decode", "Busy slots", registry=r)
        self.requests_processing = Gauge("llamacpp:requests_processing", "Tasks in a slot", registry=r)
        self.requests_deferred = Gauge("llamacpp:requests_deferred", "Tasks waiting for a slot", registry=r)
        self.kv_cells_used = Gauge("llamacpp:kv_cache_tokens", "KV cells in use", registry=r)
        self.kv_usage_ratio = Gauge("llamacpp:kv_cache_usage_ratio", "KV cells in use / KV cells in all", registry=r)
        self.prefix_hit_tokens = Counter(
            "omni:prefix_cache_hit_tokens", "Prompt tokens found in a slot's KV cache (not decoded again)", registry=r
        )
        self.prompt_cache_bytes = Gauge("omni:prompt_cache_bytes", "Host RAM held by the prompt cache", registry=r)
        self.prompt_cache_entries = Gauge("omni:prompt_cache_entries", "Prompts saved in the prompt cache", registry=r)
        self.prompt_cache_restored = Counter(
            "omni:prompt_cache_reused_tokens", "Prompt tokens reused from the prompt cache", registry=r
        )
        self.prompt_rows_evaluated = Counter(
            "omni:prompt_rows_evaluated", "Prompt rows decoded (counted as they are decoded)", registry=r
        )
        self.prompt_rows_shared = Counter(
            "omni:prompt_rows_shared", "Prompt rows taken from another slot instead of being decoded", registry=r
        )
        self.requests_parked = Counter(
            "omni:requests_parked", "Requests prefilled while every slot was busy (first token sent early)", registry=r
        )
        self.grammar_masks = Counter("omni:grammar_masks", "Next-token masks computed for constrained slots", registry=r)
        self.grammar_mask_seconds = Counter(
            "omni:grammar_mask_seconds", "Time spent computing grammar masks (beside the decode)", registry=r
        )
        self.grammar_wait_seconds = Counter(
            "omni:grammar_wait_seconds", "Time the engine waited for grammar masks after its decode", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
