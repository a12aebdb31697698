"""Prometheus metrics of one worker: llama-server's `llamacpp:` set, then our own `omni:` ones.

The `llamacpp:` block is written the way llama-server writes it (server-task.cpp `to_metrics`):
each name in full on its `# HELP` and `# TYPE` lines (`llamacpp:prompt_tokens_total counter`,
not prometheus-client's `llamacpp:prompt_tokens` + `_total` sample), and its two throughput
gauges averaged over the window between two scrapes: every render starts a new window
(`prompt_tokens_seconds`, `predicted_tokens_seconds`; the generation rate counts decode steps,
a request's first token costs none). The `omni:` metrics come from prometheus-client.

The engine thread is the only writer of the `llamacpp:` values (the disk prompt cache's threads
also count into their `omni:` counters, which prometheus-client locks); `render()` (the /metrics
handler) reads, and resets the window under the lock.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4"  # llama-server's
disable_created_metrics()  # type: ignore[no-untyped-call]  # the *_created series are noise for a scrape of one process


class Value:
    """One `llamacpp:` number (a counter's inc, a gauge's set); the engine thread writes it."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, n: float = 1.0) -> None:
        self.value += n

    def set(self, v: float) -> None:
        self.value = v


class _Window:
    """Work done since the last scrape: (count, seconds) of prompt rows and of decode steps."""

    __slots__ = ("decode_seconds", "decode_steps", "prompt_seconds", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.decode_steps = 0
        self.decode_seconds = 0.0


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


class WorkerMetrics:
    def __init__(self) -> None:
        self.t_start = int(time.time())  # llama-server's Process-Start-Time-Unix header
        self._lock = threading.Lock()
        self._window = _Window()
        self.prompt_tokens = Value()  # prompt tokens decoded (cached ones apart)
        self.prompt_tokens_cached = Value()
        self.prompt_seconds = Value()
        self.tokens_predicted = Value()
        self.tokens_predicted_seconds = Value()
        self.n_decode = Value()
        self.n_tokens_max = Value()
        self.n_busy_slots = Value()  # summed over decodes: / n_decode is the average
        self.requests_processing = Value()
        self.requests_deferred = Value()
        self.registry = CollectorRegistry()
        r = self.registry
        self.n_preempted = Counter("omni:preemptions", "Requests preempted for KV space", registry=r)
        self.requests = Counter("omni:requests", "Generation tasks finished", ["reason"], registry=r)
        self.embeddings = Counter("omni:embeddings", "Embedding and rerank inputs evaluated", registry=r)
        self.kv_cells_used = Gauge("omni:kv_cache_tokens", "KV cells in use", registry=r)
        self.image_chunks_encoded = Counter(
            "omni:image_chunks_encoded", "Image and audio chunks run through the projector's encoder",
            registry=r,
        )
        self.image_chunks_cached = Counter("omni:image_chunks_cached", "Image and audio chunks whose "
                                           "embeddings came from the cache of encoded chunks (same bytes)",
                                           registry=r)
        self.image_encode_seconds = Counter("omni:image_encode_seconds",
                                            "Time spent encoding images and audio", registry=r)
        self.kv_usage_ratio = Gauge(
            "omni:kv_cache_usage_ratio", "KV cells in use / KV cells in all", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "omni:prefix_cache_hit_tokens",
            "Prompt tokens found in a slot's KV cache (not decoded again)",
            registry=r,
        )
        self.prompt_cache_bytes = Gauge(
            "omni:prompt_cache_bytes", "Host RAM held by the prompt cache", registry=r
        )
        self.prompt_cache_entries = Gauge(
            "omni:prompt_cache_entries", "Prompts saved in the prompt cache", registry=r
        )
        self.prompt_cache_restored = Counter(
            "omni:prompt_cache_reused_tokens", "Prompt tokens reused from the prompt cache", registry=r
        )
        self.prompt_cache_disk_hits = Counter(
            "omni:prompt_cache_disk_hits", "Prompts whose prefix was read from the disk prompt cache",
            registry=r,
        )
        self.prompt_cache_disk_misses = Counter(
            "omni:prompt_cache_disk_misses",
            "Prompts looked up in the disk prompt cache that found no longer prefix there",
            registry=r,
        )
        self.prompt_cache_disk_writes = Counter(
            "omni:prompt_cache_disk_writes", "Entries written to the disk prompt cache", registry=r
        )
        self.prompt_cache_disk_bytes = Counter(
            "omni:prompt_cache_disk_bytes", "Bytes written to the disk prompt cache", registry=r
        )
        self.prompt_cache_disk_size = Gauge(
            "omni:prompt_cache_disk_size_bytes", "Size of the model's disk prompt-cache folder", registry=r
        )
        self.decode_seconds = Counter(
            "omni:decode_seconds",
            "Seconds the engine spent in the backend's decode calls (the model's forward passes): the "
            "kernel time every step pays, the rest of a request's time is the server's",
            registry=r,
        )
        self.prompt_rows_evaluated = Counter(
            "omni:prompt_rows_evaluated", "Prompt rows decoded (counted as they are decoded)", registry=r
        )
        self.prompt_rows_shared = Counter(
            "omni:prompt_rows_shared",
            "Prompt rows taken from another slot instead of being decoded",
            registry=r,
        )
        self.requests_parked = Counter(
            "omni:requests_parked",
            "Requests prefilled while every slot was busy (first token sent early)",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "omni:spec_draft_tokens", "Speculative draft tokens verified (prompt lookup)", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "omni:spec_accepted_tokens", "Speculative draft tokens accepted", registry=r
        )
        self.spec_drafts = Counter("omni:spec_drafts", "Speculative verify steps (slots x steps)", registry=r)
        self._spec_totals = (Value(), Value(), Value())  # the same, under vLLM's names
        self.grammar_masks = Counter(
            "omni:grammar_masks", "Next-token masks computed for constrained slots", registry=r
        )
        self.grammar_mask_seconds = Counter(
            "omni:grammar_mask_seconds", "Time spent computing grammar masks (beside the decode)", registry=r
        )
        self.grammar_wait_seconds = Counter(
            "omni:grammar_wait_seconds",
            "Time the engine waited for grammar masks after its decode",
            registry=r,
        )

    def on_task_done(
        self,
        *,
        n_evaluated: int,
        n_cached: int,
        prompt_s: float,
        n_decoded: int,
        predicted_s: float,
        n_tokens: int,
    ) -> None:
        """A task finished (engine thread): its prompt and generation go into the totals and the window."""
        self.prompt_tokens.inc(n_evaluated)
        self.prompt_tokens_cached.inc(n_cached)
        self.prompt_seconds.inc(prompt_s)
        self.tokens_predicted.inc(n_decoded)
        self.tokens_predicted_seconds.inc(predicted_s)
        self.n_tokens_max.set(max(self.n_tokens_max.value, n_tokens))
        with self._lock:
            w = self._window
            w.prompt_tokens += n_evaluated
            w.prompt_seconds += prompt_s
            w.decode_steps += max(n_decoded - 1, 0)  # the first token comes with the prompt's last batch
            w.decode_seconds += predicted_s

    def on_spec(self, n_draft: int, n_accepted: int, n_verifies: int) -> None:
        """One step's speculative verifies (engine thread)."""
        self.spec_draft_tokens.inc(n_draft)
        self.spec_accepted_tokens.inc(n_accepted)
        self.spec_drafts.inc(n_verifies)
        for v, n in zip(self._spec_totals, (n_draft, n_accepted, n_verifies), strict=True):
            v.inc(n)

    def render(self) -> bytes:
        """The scrape: llama-server's block, then ours; starts a new throughput window."""
        with self._lock:
            w, self._window = self._window, _Window()
        counters = [
            (
                "prompt_tokens_total",
                "Number of prompt tokens processed, excluding cached tokens",
                self.prompt_tokens,
            ),
            (
                "prompt_tokens_cached_total",
                "Number of prompt tokens reused from the cache",
                self.prompt_tokens_cached,
            ),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt_seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", self.tokens_predicted),
            (
                "tokens_predicted_seconds_total",
                "Total time spent generating tokens",
                self.tokens_predicted_seconds,
            ),
            ("n_decode_total", "Total number of llama_decode() calls", self.n_decode),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max),
        ]
        spec = [
            (
                "spec_decode_num_draft_tokens_total",
                "Speculative: Total draft tokens generated",
                self._spec_totals[0],
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "Speculative: Total draft tokens accepted by the target model",
                self._spec_totals[1],
            ),
            (
                "spec_decode_num_drafts_total",
                "Speculative: Total speculative decoding verification steps",
                self._spec_totals[2],
            ),
        ]
        gauges = [
            (
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s",
                _rate(w.prompt_tokens, w.prompt_seconds),
            ),
            (
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s",
                _rate(w.decode_steps, w.decode_seconds),
            ),
            ("requests_processing", "Number of requests processing", self.requests_processing.value),
            ("requests_deferred", "Number of requests deferred", self.requests_deferred.value),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                self.n_busy_slots.value / max(self.n_decode.value, 1.0),
            ),
        ]
        lines: list[str] = []

        def add(kind: str, name: str, help: str, value: float) -> None:
            lines.extend(
                (
                    f"# HELP llamacpp:{name} {help}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {_number(value)}",
                )
            )

        for name, help, v in counters:
            add("counter", name, help, v.value)
        for name, help, v in spec:  # the same counts as omni:spec_* (vLLM's names)
            add("counter", name, help, v.value)
        for name, help, value in gauges:
            add("gauge", name, help, value)
        return ("\n".join(lines) + "\n").encode() + generate_latest(self.registry)
