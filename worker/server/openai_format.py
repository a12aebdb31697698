"""Engine events -> OpenAI chat / completion objects (streamed chunks or one aggregated body).

Internally every request streams; a non-streaming response is the fold of the same events
(`Choices`). Objects are plain dicts shaped like the models in worker/protocol/wire.py (built per token,
so no pydantic on this path). `timings` is llama-server's; `usage` is OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from worker.engine.task import ErrorEvent, FinishEvent, ProgressEvent, TaskStats, TokenEvent
from worker.protocol.errors import error_body
from worker.server.generation import Generation
from worker.text.chat_output import (
    ChatOutputConfig,
    ChatOutputStream,
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)

TokenText = Callable[[int], bytes]


@dataclass(frozen=True, slots=True)
class ResponseInfo:
    id: str
    created: int
    model: str
    piece: TokenText  # raw bytes of a token, for logprobs


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
_MARK = "@@omni-text@@"


class _TextChunks:
    """The hot path of streaming: one token's text in a fixed chunk shape.

    The chunk around the text is serialized once per choice index; each token then costs one
    `json.dumps` of its text instead of one of the whole chunk.
    """

    def __init__(self, make: Callable[[int, str], dict[str, Any]]) -> None:
        self._make = make
        self._frames: dict[int, tuple[bytes, bytes]] = {}

    def __call__(self, index: int, text: str) -> bytes:
        frame = self._frames.get(index)
        if frame is None:
            prefix, _, suffix = sse(self._make(index, _MARK)).partition(json.dumps(_MARK).encode())
            frame = self._frames[index] = (prefix, suffix)
        return frame[0] + json.dumps(text, ensure_ascii=False).encode() + frame[1]


def timings(stats: TaskStats) -> dict[str, Any]:
    pn, pms = stats.n_evaluated, stats.prompt_ms
    gn, gms = stats.n_decoded, stats.predicted_ms
    return {
        "cache_n": stats.n_cached,
        "prompt_n": pn,
        "prompt_ms": pms,
        "prompt_per_token_ms": pms / pn if pn else 0.0,
        "prompt_per_second": pn * 1e3 / pms if pms > 0 else 0.0,
        "predicted_n": gn,
        "predicted_ms": gms,
        # as llama-server: over the decode steps, n - 1 (the first token comes with the prompt)
        "predicted_per_token_ms": gms / (gn - 1) if gn > 1 else 0.0,
        "predicted_per_second": (gn - 1) * 1e3 / gms if gn > 1 and gms > 0 else 0.0,
        # as llama-server: only when something was drafted
        **({"draft_n": stats.n_draft, "draft_n_accepted": stats.n_draft_accepted} if stats.n_draft else {}),
    }


def progress(ev: ProgressEvent, with_timings: bool) -> dict[str, Any]:
    """llama-server's `prompt_progress` (and, with timings_per_token, the timings so far)."""
    out: dict[str, Any] = {
        "prompt_progress": {
            "total": ev.total,
            "cache": ev.cache,
            "processed": ev.processed,
            "time_ms": ev.time_ms,
        }
    }
    if with_timings:
        n = ev.processed - ev.cache
        out["timings"] = {
            "cache_n": ev.cache, "prompt_n": n, "prompt_ms": ev.time_ms,
            "prompt_per_token_ms": ev.time_ms / n if n else 0.0,
            "prompt_per_second": n * 1e3 / ev.time_ms if ev.time_ms > 0 else 0.0,
            "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0,
        }
    return out


def usage(
    gen: Generation, finishes: dict[int, FinishEvent], n_reasoning: int | None = None
) -> dict[str, Any]:
    """`n_reasoning`: the reasoning tokens of a chat completion's choices (None: not a chat)."""
    n_prompt = sum(len(p) for p in gen.prompts)
    n_completion = sum(f.stats.n_decoded for f in finishes.values())
    n_cached = sum(f.stats.n_cached for i, f in finishes.items() if i % gen.params.n == 0)
    out: dict[str, Any] = {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_completion,
        "total_tokens": n_prompt + n_completion,
        "prompt_tokens_details": {"cached_tokens": n_cached},
    }
    if n_reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": n_reasoning}
    return out


class ChatParse:
    """One choice's output parser (reasoning, tool calls) and its count of reasoning tokens."""

    __slots__ = ("n_reasoning", "stream")

    def __init__(self, config: ChatOutputConfig) -> None:
        self.stream = ChatOutputStream(config)
        self.n_reasoning = 0

    def token(self, text: str) -> list[Delta]:
        was_reasoning = self.stream.in_reasoning
        deltas = self.stream.feed(text)
        if was_reasoning or self.stream.in_reasoning:
            self.n_reasoning += 1
        return deltas

    def finish(self, text: str) -> list[Delta]:
        return [*self.stream.feed(text), *self.stream.finish()]


def message(parsed: ParsedMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        out["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return out


def _score(finish: FinishEvent | None) -> dict[str, Any]:
    """A beam search's answer carries its score (worker/engine/beam.py); a sampled one nothing."""
    return {"score": finish.score} if finish is not None and finish.score is not None else {}


def error_payload(ev: ErrorEvent) -> dict[str, Any]:
    return error_body(ev.message, ev.type, None, ev.status_code)


# --------------------------------------------------------------------------- logprobs


def _token_str(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprob(info: ResponseInfo, ev: TokenEvent) -> dict[str, Any]:
    piece = info.piece(ev.token)
    return {
        "token": _token_str(piece),
        "logprob": ev.logprob,
        "bytes": list(piece),
        "top_logprobs": [
            {"token": _token_str(p), "logprob": lp, "bytes": list(p)}
            for p, lp in ((info.piece(t), lp) for t, lp in ev.top_logprobs)
        ],
    }


@dataclass(slots=True)
class CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, info: ResponseInfo, ev: TokenEvent, offset: int) -> None:
        self.tokens.append(_token_str(info.piece(ev.token)))
        self.token_logprobs.append(ev.logprob)
        self.top_logprobs.append({_token_str(info.piece(t)): lp for t, lp in ev.top_logprobs})
        self.text_offset.append(offset)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


# --------------------------------------------------------------------------- aggregation


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    n_chars: int = 0
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    finish: FinishEvent | None = None


class Choices:
    """The fold of a generation's events into final choices (non-streaming responses).

    `chat`: parse each chat choice's text into reasoning, content and tool calls."""

    def __init__(
        self,
        gen: Generation,
        info: ResponseInfo,
        *,
        echo: list[str] | None = None,
        chat: ChatOutputConfig | None = None,
    ) -> None:
        self.gen = gen
        self.info = info
        self.choices = [_Choice() for _ in gen.tasks]
        self.parses = [ChatParse(chat) for _ in gen.tasks] if chat is not None else None
        if echo:
            for i, c in enumerate(self.choices):
                c.text.append(echo[i // gen.params.n])
                c.n_chars = len(c.text[0])
        self.error: ErrorEvent | None = None

    async def collect(self) -> None:
        want_lp = self.gen.params.logprobs
        async for index, ev in self.gen.events():
            c = self.choices[index]
            if isinstance(ev, TokenEvent):
                if want_lp:
                    c.chat_logprobs.append(chat_logprob(self.info, ev))
                    c.completion_logprobs.add(self.info, ev, c.n_chars)
                c.text.append(ev.text)
                c.n_chars += len(ev.text)
                if self.parses is not None:
                    self.parses[index].token(ev.text)
            elif isinstance(ev, FinishEvent):
                c.text.append(ev.text)
                c.finish = ev
                if self.parses is not None:
                    self.parses[index].finish(ev.text)
            elif isinstance(ev, ErrorEvent):
                self.error = ev
                self.gen.cancel()
                return

    def finishes(self) -> dict[int, FinishEvent]:
        return {i: c.finish for i, c in enumerate(self.choices) if c.finish is not None}

    def _timings(self) -> dict[str, Any] | None:
        first = self.choices[0].finish
        return timings(first.stats) if first else None

    def _body(
        self, object: str, choices: list[dict[str, Any]], n_reasoning: int | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.info.id,
            "object": object,
            "created": self.info.created,
            "model": self.info.model,
            "choices": choices,
            "usage": usage(self.gen, self.finishes(), n_reasoning),
            "timings": self._timings(),
        }

    def chat_completion(self) -> dict[str, Any]:
        want_lp = self.gen.params.logprobs
        out = []
        for i, c in enumerate(self.choices):
            reason: str | None = c.finish.reason if c.finish else None
            if self.parses is None:
                msg: dict[str, Any] = {"role": "assistant", "content": "".join(c.text)}
            else:
                parsed = self.parses[i].stream.result()
                msg = message(parsed)
                if parsed.tool_calls:
                    reason = "tool_calls"
            out.append({
                "index": i,
                "message": msg,
                "finish_reason": reason,
                "stop_reason": c.finish.stop_word if c.finish else None,
                "logprobs": {"content": c.chat_logprobs} if want_lp else None,
                **_score(c.finish),
            })
        n_reasoning = sum(p.n_reasoning for p in self.parses) if self.parses is not None else 0
        return self._body("chat.completion", out, n_reasoning)

    def completion(self) -> dict[str, Any]:
        want_lp = self.gen.params.logprobs
        return self._body("text_completion", [
            {
                "index": i,
                "text": "".join(c.text),
                "finish_reason": c.finish.reason if c.finish else None,
                "logprobs": c.completion_logprobs.as_dict() if want_lp else None,
                **_score(c.finish),
            }
            for i, c in enumerate(self.choices)
        ])


# --------------------------------------------------------------------------- streaming


async def stream_chat(
    gen: Generation, info: ResponseInfo, *, include_usage: bool, chat: ChatOutputConfig | None = None,
    timings_per_token: bool = False,
) -> AsyncIterator[bytes]:
    """`chat`: split reasoning and tool calls out of the text (`delta.reasoning_content`,
    `delta.tool_calls`: index, id and name first, then argument fragments)."""
    want_lp = gen.params.logprobs
    head = {"id": info.id, "object": "chat.completion.chunk", "created": info.created, "model": info.model}

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": None, **extra}
        return sse({**head, "choices": [choice]})

    text_chunk = _TextChunks(lambda index, text: {**head, "choices": [
        {"index": index, "delta": {"content": text}, "finish_reason": None}]})

    def delta_chunks(index: int, deltas: list[Delta], lp: dict[str, Any] | None) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            extra = {"logprobs": lp} if lp is not None and not out else {}
            if isinstance(d, ContentDelta):
                out.append(chunk(index, {"content": d.text}, **extra) if extra else text_chunk(index, d.text))
            elif isinstance(d, ReasoningDelta):
                out.append(chunk(index, {"reasoning_content": d.text}, **extra))
            elif isinstance(d, ToolCallStart):
                call = {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": ""},
                }
                out.append(chunk(index, {"tool_calls": [call]}, **extra))
            elif isinstance(d, ToolArgsDelta):
                out.append(
                    chunk(
                        index,
                        {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]},
                        **extra,
                    )
                )
        if lp is not None and not out:
            out.append(chunk(index, {}, logprobs=lp))
        return out

    parses = [ChatParse(chat) for _ in gen.tasks] if chat is not None else None
    for i in range(len(gen.tasks)):
        yield chunk(i, {"role": "assistant", "content": None})  # as llama-server and OpenAI: no text yet
    finishes: dict[int, FinishEvent] = {}
    async for index, ev in gen.events():
        if isinstance(ev, TokenEvent):
            lp = {"content": [chat_logprob(info, ev)]} if want_lp else None
            if parses is not None:
                for frame in delta_chunks(index, parses[index].token(ev.text), lp):
                    yield frame
            elif lp is not None:
                yield chunk(index, {"content": ev.text}, logprobs=lp)
            elif ev.text:
                yield text_chunk(index, ev.text)
        elif isinstance(ev, FinishEvent):
            finishes[index] = ev
            reason: str = ev.reason
            if parses is not None:
                for frame in delta_chunks(index, parses[index].finish(ev.text), None):
                    yield frame
                if parses[index].stream.result().tool_calls:
                    reason = "tool_calls"
            elif ev.text:
                yield text_chunk(index, ev.text)
            # vLLM's `stop_reason`: the stop string that ended the choice (None: EOS, length, grammar)
            yield sse({**head, "choices": [{"index": index, "delta": {}, "finish_reason": reason,
                                            "stop_reason": ev.stop_word, **_score(ev)}],
                       "timings": timings(ev.stats)})
        elif isinstance(ev, ProgressEvent):  # as llama-server: a role delta carrying the progress
            choice = {"index": index, "delta": {"role": "assistant", "content": None}, "finish_reason": None}
            yield sse({**head, "choices": [choice], **progress(ev, timings_per_token)})
        else:
            gen.cancel()
            yield sse(error_payload(ev))
            return
    if include_usage:
        n_reasoning = sum(p.n_reasoning for p in parses) if parses is not None else 0
        first = finishes.get(0)
        yield sse({**head, "choices": [], "usage": usage(gen, finishes, n_reasoning),
                   **({"timings": timings(first.stats)} if first is not None else {})})
    yield SSE_DONE


async def stream_completion(
    gen: Generation,
    info: ResponseInfo,
    *,
    include_usage: bool,
    echo: list[str] | None,
    timings_per_token: bool = False,
) -> AsyncIterator[bytes]:
    want_lp = gen.params.logprobs
    head = {"id": info.id, "object": "text_completion", "created": info.created, "model": info.model}
    offsets = [0] * len(gen.tasks)

    def chunk(index: int, text: str, finish_reason: str | None = None, lp: Any = None, **extra: Any) -> bytes:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return sse({**head, "choices": [choice], **extra})

    text_chunk = _TextChunks(lambda index, text: {**head, "choices": [
        {"index": index, "text": text, "logprobs": None, "finish_reason": None}]})

    if echo:
        for i in range(len(gen.tasks)):
            text = echo[i // gen.params.n]
            offsets[i] = len(text)
            yield chunk(i, text)
    finishes: dict[int, FinishEvent] = {}
    async for index, ev in gen.events():
        if isinstance(ev, TokenEvent):
            if want_lp:
                lp = CompletionLogprobs()
                lp.add(info, ev, offsets[index])
                yield chunk(index, ev.text, lp=lp.as_dict())
            elif ev.text:
                yield text_chunk(index, ev.text)
            offsets[index] += len(ev.text)
        elif isinstance(ev, FinishEvent):
            finishes[index] = ev
            choice = {"index": index, "text": ev.text, "logprobs": None, "finish_reason": ev.reason,
                      **_score(ev)}
            yield sse({**head, "choices": [choice], "timings": timings(ev.stats)})
        elif isinstance(ev, ProgressEvent):
            yield chunk(index, "", **progress(ev, timings_per_token))
        else:
            gen.cancel()
            yield sse(error_payload(ev))
            return
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(gen, finishes)})
    yield SSE_DONE
