"""Engine events -> llama-server's native `/completion` objects (streamed or one body).

The native shape, as tools/server/server-task.cpp writes it (`to_json_non_oaicompat`): a
partial result per token `{index, content, tokens, stop: false, id_slot, tokens_predicted,
tokens_evaluated[, completion_probabilities]}` and a final one `{..., stop: true, model,
generation_settings, prompt, stop_type, stopping_word, tokens_cached, timings}`. A stream is
`data: {...}` events with no `[DONE]`; in a stream the final object's `content` is empty (the
text went out in the partials). A body is one object, or an array for several prompts.
`tokens` is filled only with `return_tokens`; `completion_probabilities` only with `n_probs`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from worker.backends.base import Vocab
from worker.engine.task import ErrorEvent, FinishEvent, ProgressEvent, TokenEvent
from worker.protocol.sampling import SamplingParams
from worker.protocol.wire import InfillRequest, NativeCompletionRequest
from worker.server.generation import Generation
from worker.server.openai_format import TokenText, error_payload, progress, sse, timings
from worker.server.sse import aggregated, event_stream
from worker.server.state import WorkerState


@dataclass(frozen=True, slots=True)
class NativeInfo:
    model: str
    piece: TokenText  # raw bytes of a token
    prompts: list[str]  # each prompt as text (the final object's `prompt`)
    return_tokens: bool
    is_stream: bool
    timings_per_token: bool = False
    n_ctx: int = 0  # a slot's context: a generation that filled it is `truncated`
    banned: tuple[int, ...] = ()  # ignore_eos: the end-of-generation tokens, never sampled (bias -inf)
    response_fields: tuple[str, ...] = ()  # the final object reduced to these paths (none: whole)


def pick_fields(paths: tuple[str, ...], obj: dict[str, Any]) -> dict[str, Any]:
    """llama-server's response_fields: each path (`a/b/c`) that leads through objects to a value
    becomes a key of the result, the path itself; the others are left out."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def _token(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def token_probs(info: NativeInfo, ev: TokenEvent, post_sampling: bool = False) -> dict[str, Any]:
    """One entry of `completion_probabilities`: llama-server's pre-sampling log-probabilities, or
    with `post_sampling_probs` the probabilities the sampler chain left (`prob`, `top_probs`)."""
    piece = info.piece(ev.token)
    if post_sampling:
        return {
            "id": ev.token, "token": _token(piece), "bytes": list(piece), "prob": ev.prob,
            "top_probs": [
                {"id": t, "token": _token(p), "bytes": list(p), "prob": q}
                for t, p, q in ((t, info.piece(t), q) for t, q in ev.top_probs)
            ],
        }
    return {
        "id": ev.token,
        "token": _token(piece),
        "bytes": list(piece),
        "logprob": ev.logprob,
        "top_logprobs": [
            {"id": t, "token": _token(p), "bytes": list(p), "logprob": lp}
            for t, p, lp in ((t, info.piece(t), lp) for t, lp in ev.top_logprobs)
        ],
    }


def generation_settings(
    p: SamplingParams, *, is_stream: bool, banned: tuple[int, ...] = ()
) -> dict[str, Any]:
    n_predict = -1 if p.max_tokens is None else p.max_tokens
    bias = {**dict.fromkeys(banned, -math.inf), **p.logit_bias}
    return {
        "seed": -1 if p.seed is None else p.seed,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "stop": list(p.stop),
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "ignore_eos": p.ignore_eos,
        "stream": is_stream,
        # -inf (never) is null, as llama-server writes it
        "logit_bias": [{"token": t, "bias": b if math.isfinite(b) else None} for t, b in bias.items()],
        "n_probs": p.top_logprobs,
    }


def _stop_type(ev: FinishEvent) -> str:
    if ev.reason == "length":
        return "limit"
    return "word" if ev.stop_word else "eos"


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    probs: list[dict[str, Any]] = field(default_factory=list)


class NativeResults:
    """Folds a generation's events into llama-server's native objects, one per prompt."""

    def __init__(self, gen: Generation, info: NativeInfo) -> None:
        self.gen = gen
        self.info = info
        self._choices = [_Choice() for _ in gen.tasks]
        self._settings = generation_settings(gen.params, is_stream=info.is_stream, banned=info.banned)

    def partial(self, index: int, ev: TokenEvent) -> dict[str, Any]:
        """The streamed object for one token (also recorded for the final object)."""
        c = self._choices[index]
        c.text.append(ev.text)
        c.tokens.append(ev.token)
        out: dict[str, Any] = {
            "index": index, "content": ev.text, "tokens": [ev.token] if self.info.return_tokens else [],
            "stop": False, "id_slot": self.gen.params.id_slot, "tokens_predicted": len(c.tokens),
            "tokens_evaluated": len(self.gen.prompt_of(index)),
        }
        if self.gen.params.logprobs:
            probs = token_probs(self.info, ev, self.gen.params.post_sampling_probs)
            c.probs.append(probs)
            out["completion_probabilities"] = [probs]
        return out

    def final(self, index: int, ev: FinishEvent) -> dict[str, Any]:
        c = self._choices[index]
        c.text.append(ev.text)
        content = "".join(c.text)
        stream = self.info.is_stream
        out: dict[str, Any] = {
            "index": index,
            "content": "" if stream else content,
            "tokens": c.tokens if self.info.return_tokens and not stream else [],
            "id_slot": self.gen.params.id_slot,
            "stop": True,
            "model": self.info.model,
            "tokens_predicted": ev.stats.n_decoded,
            "tokens_evaluated": ev.stats.n_prompt,
            "generation_settings": self._settings,
            "prompt": self.info.prompts[index // self.gen.params.n],
            "has_new_line": "\n" in content,
            "truncated": ev.reason == "length"
            and ev.stats.n_prompt + ev.stats.n_decoded >= self.info.n_ctx > 0,
            "stop_type": _stop_type(ev),
            "stopping_word": ev.stop_word or "",
            "tokens_cached": ev.stats.n_prompt + ev.stats.n_decoded,
            "timings": timings(ev.stats),
            **({"score": ev.score} if ev.score is not None else {}),
        }
        if not stream and c.probs:
            out["completion_probabilities"] = c.probs
        return pick_fields(self.info.response_fields, out) if self.info.response_fields else out


async def stream_native(gen: Generation, results: NativeResults) -> AsyncIterator[bytes]:
    """`data: {...}` per token and one final object per prompt; no `[DONE]` (llama-server's native stream)."""
    async for index, ev in gen.events():
        if isinstance(ev, TokenEvent):
            yield sse(results.partial(index, ev))
        elif isinstance(ev, FinishEvent):
            if ev.text:  # the held-back tail goes out as text, as llama-server's last partial
                yield sse({"index": index, "content": ev.text, "tokens": [], "stop": False,
                           "id_slot": gen.params.id_slot})
            yield sse(results.final(index, ev))
        elif isinstance(ev, ProgressEvent):
            yield sse(
                {
                    "index": index,
                    "content": "",
                    "tokens": [],
                    "stop": False,
                    "id_slot": gen.params.id_slot,
                    "tokens_predicted": 0,
                    "tokens_evaluated": ev.total,
                    **progress(ev, results.info.timings_per_token),
                }
            )
        else:
            gen.cancel()
            yield sse(error_payload(ev))
            return


async def collect_native(gen: Generation, results: NativeResults) -> tuple[int, Any]:
    """(status, body): one object for one prompt, else an array in prompt order."""
    finals: dict[int, dict[str, Any]] = {}
    async for index, ev in gen.events():
        if isinstance(ev, TokenEvent):
            results.partial(index, ev)
        elif isinstance(ev, FinishEvent):
            finals[index] = results.final(index, ev)
        elif isinstance(ev, ErrorEvent):
            gen.cancel()
            return ev.status_code, error_payload(ev)
    objs = [finals[i] for i in sorted(finals)]
    return 200, objs[0] if len(objs) == 1 else objs


def run_native(state: WorkerState, backend: Vocab, req: NativeCompletionRequest | InfillRequest,
               params: SamplingParams, token_prompts: list[list[int]]) -> Response:
    """Run a native /completion or /infill request: streamed, or aggregated into one body."""
    # The final object's `prompt`: its tokens as text, special ones too (llama-server's
    # detokenize(ctx, true): "<s> I believe ..." for a model that adds a BOS)
    texts = [b"".join(backend.token_to_piece(t, True) for t in p).decode(errors="replace")
             for p in token_prompts]
    gen = Generation(state.engine, token_prompts, params, quiet_tokens=not req.stream)
    banned = state.eog_ids if params.ignore_eos else ()  # the backends ban them: echoed as llama-server does
    info = NativeInfo(
        req.model or state.model_id,
        backend.token_to_piece,
        texts,
        req.return_tokens,
        req.stream,
        req.timings_per_token,
        backend.n_ctx_seq,
        banned,
        tuple(req.response_fields),
    )
    results = NativeResults(gen, info)
    if req.stream:
        return event_stream(gen, stream_native(gen, results))
    return aggregated(gen, lambda: collect_native(gen, results))
