"""Constrained decoding: a grammar's next-token mask per slot, the same in both backends.

One grammar engine, llguidance, serves every form a request can constrain its output with:
OpenAI's `response_format` (json_object, json_schema), llama-server's `json_schema` and
`grammar` (GBNF) fields, and the grammars we build to force a tool call. Why llguidance
rather than xgrammar:

- It takes all of those forms itself: JSON schema, llama.cpp's GBNF (converted to its Lark
  dialect, which also embeds JSON schemas with `%json`, what a tool-call grammar needs), Lark,
  regular expressions. xgrammar's GBNF dialect is its own EBNF, and tool-call grammars would
  have to be spelled out rule by rule.
- It needs no ahead-of-time compilation of a grammar against the vocabulary: it computes each
  mask when asked (an Earley parser walking a token trie, ~50 us per mask on our vocabularies),
  so a request's fresh schema costs nothing before its first token. xgrammar compiles each
  grammar for the vocabulary first (milliseconds to seconds for large schemas) and caches it.
- It is llama.cpp's own optional grammar engine (LLAMA_LLGUIDANCE), so the GBNF a llama-server
  user sends means the same here; its wheel is abi3, pure Rust, with no torch dependency.

Flow. The HTTP handler compiles a request's constraint with `compile_grammar` (an invalid
schema or grammar is a 400 there) and each task gets its own matcher (`Grammar.matcher()`).
The engine thread asks `MaskBatch.start` for the masks of the slots that sample in a step
before it runs the step's decode; a helper thread fills them (llguidance drops the GIL) while
the decode runs, and `MaskBatch.wait` turns them into `SampleItem.mask`s after it. The sampled
token is then consumed by the task's matcher (worker/engine/engine.py); when the grammar is
complete the task finishes with "stop", as llama-server's does when its grammar only allows
end-of-generation.

JSON schemas are applied as llama.cpp applies them: an object schema without
`additionalProperties` allows no other properties (JSON Schema's default would allow any,
which a model at temperature 1 happily produces), and whitespace is fixed (`", "` between
items, `": "` after keys, no newlines), so output stays short and parseable whatever the
weights say.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

GRAMMAR_KINDS = ("json_schema", "gbnf", "lark", "regex")
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message says why."""


def strict_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say
    otherwise (llama.cpp's and xgrammar's reading of a schema for generation)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (
        (is_object or "properties" in out)
        and "additionalProperties" not in out
        and "patternProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: Any) -> str:
    """The llguidance grammar for a JSON schema (a dict or a bool), in our whitespace style."""
    if schema is True or schema == {}:
        schema = {}
    elif not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    schema = {**strict_schema(schema), "x-guidance": _JSON_STYLE}
    return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))


def json_schema_lark(schema: Any) -> str:
    """A Lark expression matching `schema` (for embedding in a larger Lark grammar)."""
    body = {**strict_schema(schema), "x-guidance": _JSON_STYLE} if isinstance(schema, dict) else schema
    return "%json " + json.dumps(body)


class Grammar:
    """A compiled, validated constraint; `matcher()` gives each task its own parser state."""

    def __init__(self, kind: str, source: str, template: llguidance.LLMatcher) -> None:
        self.kind = kind
        self.source = source
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {len(self.source)} chars)"


def compile_grammar(tokenizer: llguidance.LLTokenizer, kind: str, text: Any) -> Grammar:
    """`kind`: json_schema (`text` is the schema, a dict), gbnf, lark or regex (`text` a string).
    Slow for very large grammars (up to ~1 s): call it off the event loop. A compiled grammar is
    kept (LRU) and given again for the same text: an agent loop or a chat UI sends the same
    tools and schema with every call, and compiling them was most of such a request's overhead."""
    key = text if isinstance(text, str) else json.dumps(text)  # key order kept: it orders the output
    return _compile_cached(tokenizer, kind, key, isinstance(text, str))


@functools.lru_cache(maxsize=128)
def _compile_cached(tokenizer: llguidance.LLTokenizer, kind: str, key: str, is_text: bool) -> Grammar:
    text = key if is_text else json.loads(key)
    try:
        if kind == "json_schema":
            source = json_schema_grammar(text)
        elif kind == "gbnf":
            source = llguidance.grammar_from("gbnf", text)
        elif kind == "lark":
            source = llguidance.LLMatcher.grammar_from_lark(text)
        elif kind == "regex":
            source = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    return Grammar(kind, source, matcher)


class MaskBatch:
    """The next-token masks of one step's constrained slots, computed beside the decode.

    `start` hands the matchers to a helper thread (llguidance computes several masks in
    parallel and without the GIL) and returns at once; `wait` returns one bool[n_vocab] mask
    per matcher (None for unconstrained items), True = allowed. Engine thread only.
    """

    def __init__(self, n_vocab: int, n_rows: int) -> None:
        self.n_vocab = n_vocab
        self._words = np.zeros((n_rows, (n_vocab + 31) // 32), dtype=np.int32)
        self._executor = llguidance.LLExecutor()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pending: concurrent.futures.Future[None] | None = None
        self._rows: list[int | None] = []
        # Totals, for /metrics: masks, seconds computing them, seconds the engine waited for them.
        self.n_masks = 0
        self.compute_seconds = 0.0
        self.wait_seconds = 0.0

    def start(self, matchers: Sequence[llguidance.LLMatcher | None], *, overlap: bool = True) -> None:
        """Begin computing masks for `matchers` (in sample order). `overlap=False` (no decode to
        overlap with, e.g. a cached answer sampled from saved logits): compute them now, on this
        thread; the hop to the helper thread and back cost more than the mask itself."""
        self._rows = []
        jobs: list[tuple[llguidance.LLMatcher, int]] = []
        for m in matchers:
            if m is None:
                self._rows.append(None)
            else:
                self._rows.append(len(jobs))
                jobs.append((m, len(jobs)))
        if not jobs:
            return
        if len(jobs) > self._words.shape[0]:
            self._words = np.zeros((len(jobs), self._words.shape[1]), dtype=np.int32)
        words = self._words
        if overlap:
            self._pending = self._pool.submit(self._compute, jobs, words)
        else:
            self._compute(jobs, words)
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            self._pending = done
        self.n_masks += len(jobs)

    def _compute(self, jobs: list[tuple[llguidance.LLMatcher, int]], words: np.ndarray) -> None:
        t0 = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(jobs, words.ctypes.data, words.shape[1] * 4, len(jobs))
        self.compute_seconds += time.perf_counter() - t0

    def wait(self) -> list[np.ndarray | None]:
        if self._pending is None:
            return [None] * len(self._rows)
        t0 = time.perf_counter()
        self._pending.result()
        self.wait_seconds += time.perf_counter() - t0
        self._pending = None
        n = self.n_vocab
        return [
            None if row is None
            else np.unpackbits(self._words[row].view(np.uint8), count=n, bitorder="little").view(np.bool_)
            for row in self._rows
        ]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True, slots=True)
class TokenOutcome:
    """What consuming a sampled token did to a task's grammar."""

    is_complete: bool  # nothing more may follow: the task is done
    error: str | None = None  # the grammar rejected the token (a bug if the mask was applied)


def consume(matcher: llguidance.LLMatcher, token: int) -> TokenOutcome:
    if not matcher.consume_token(token):
        return TokenOutcome(True, matcher.get_error() or f"the grammar rejected token {token}")
    return TokenOutcome(matcher.is_stopped())
