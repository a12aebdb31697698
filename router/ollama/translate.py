"""Ollama requests -> the worker's bodies, and the worker's stream -> Ollama's objects (pure).

- `/api/chat` -> `/v1/chat/completions`: messages (base64 `images` as image parts, assistant
  `tool_calls` with object arguments as OpenAI's JSON strings and ids, tool results matched to
  their call), `tools`, `format` as `response_format` (the grammar engine enforces it), `think`
  as `reasoning_effort`, the options as sampling fields.
- `/api/generate`: a templated prompt (`system` + `prompt` + `images`) is the same chat; `raw`
  is `/v1/completions` (the prompt as it is); `suffix` is llama-server's `/infill` (the model's
  fill-in-the-middle tokens).
- `Answer` folds the upstream chunks (OpenAI chat or completion chunks, or llama-server's native
  ones) into Ollama's stream objects and the final object with its durations in nanoseconds.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from router.ollama.wire import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    _Generation,
)
from worker.protocol.errors import APIError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
INFILL_PATH = "/infill"
Chunk = dict[str, Any]

_MAGIC = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "image/webp"),
    (b"BM", "image/bmp"),
)


def _image_part(b64: str, index: int) -> dict[str, Any]:
    """One base64 image as a chat image part; its type from its first bytes."""
    try:
        head = base64.b64decode(b64[:32] + "=" * (-len(b64[:32]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise APIError(f"images[{index}] is not base64", param="images") from None
    mime = next((m for magic, m in _MAGIC if head.startswith(magic)), "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}


def _content(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    if not images:
        return text
    return [*(_image_part(b, i) for i, b in enumerate(images)), {"type": "text", "text": text}]


def chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Chat messages; a call without an id gets `call_<n>`, and a tool result without one answers
    the oldest unanswered call of its `tool_name` (else the oldest unanswered call)."""
    out: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, function name)
    n_calls = 0
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": _content(m.content, m.images)}
        if m.role == "assistant" and m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                call_id = c.id or f"call_{n_calls}"
                n_calls += 1
                unanswered.append((call_id, c.function.name))
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)},
                    }
                )
            msg["tool_calls"] = calls
        if m.role == "tool":
            answered = m.tool_call_id
            if answered is None:
                match = next(
                    (u for u in unanswered if u[1] == m.tool_name), unanswered[0] if unanswered else None
                )
                answered = match[0] if match else f"call_{n_calls}"
            unanswered = [u for u in unanswered if u[0] != answered]
            msg["tool_call_id"] = answered
        out.append(msg)
    return out


def sampling(options: OllamaOptions | None) -> dict[str, Any]:
    """The options as the worker's sampling fields (num_ctx and num_keep are not sampling:
    the routes handle num_ctx; num_keep is inert, strict.INERT)."""
    if options is None:
        return {}
    o = options
    out: dict[str, Any] = {
        k: v
        for k, v in (
            ("temperature", o.temperature),
            ("top_k", o.top_k),
            ("top_p", o.top_p),
            ("min_p", o.min_p),
            ("seed", o.seed),
            ("stop", o.stop),
            ("repeat_penalty", o.repeat_penalty),
            ("repeat_last_n", o.repeat_last_n),
            ("presence_penalty", o.presence_penalty),
            ("frequency_penalty", o.frequency_penalty),
        )
        if v is not None
    }
    if o.num_predict is not None and o.num_predict >= 0:
        out["max_tokens"] = o.num_predict  # -1 (no limit) and -2 (fill the context): the context's bound
    return out


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise APIError(f'format must be "json" or a JSON schema, not {fmt!r}', param="format")


def _common(req: _Generation, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling(req.options),
    }
    rf = response_format(req.format)
    if rf is not None:
        body["response_format"] = rf
    if req.think is not None:
        body["reasoning_effort"] = (
            req.think if isinstance(req.think, str) else ("medium" if req.think else "none")
        )
    if req.logprobs or req.top_logprobs:
        body["logprobs"] = True
        if req.top_logprobs:
            body["top_logprobs"] = req.top_logprobs
    return body


def _no_logprobs(req: _Generation, what: str) -> None:
    if req.logprobs or req.top_logprobs:
        raise APIError(f"logprobs are served for templated prompts and chats, not {what}", param="logprobs")


def chat_body(req: OllamaChatRequest, model: str) -> dict[str, Any]:
    messages = chat_messages(req.messages)
    if req.system is not None:
        messages.insert(0, {"role": "system", "content": req.system})
    body = {**_common(req, model), "messages": messages}
    if req.num_predict is not None and req.num_predict >= 0 and "max_tokens" not in body:
        body["max_tokens"] = req.num_predict
    if req.tools:
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return body


def generate_body(req: OllamaGenerateRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The worker path and body for a generate request with a prompt."""
    if req.suffix is not None:
        if req.images or req.format or req.think:
            raise APIError("suffix (fill in the middle) takes no images, format or think", param="suffix")
        _no_logprobs(req, "fill in the middle")
        body = {
            "model": model,
            "stream": True,
            "input_prefix": req.prompt,
            "input_suffix": req.suffix,
            **_native(sampling(req.options)),
        }
        return INFILL_PATH, body
    if req.raw:
        if req.images or req.system or req.think is not None:
            raise APIError(
                "raw prompts take no images, system or think: they go to the model as they are", param="raw"
            )
        _no_logprobs(req, "raw prompts")
        body = {**_common(req, model), "prompt": req.prompt}
        return COMPLETIONS_PATH, body
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": _content(req.prompt, req.images)})
    return CHAT_PATH, {**_common(req, model), "messages": messages}


def _native(fields: dict[str, Any]) -> dict[str, Any]:
    """llama-server's native names for the sampling fields (/infill)."""
    out = dict(fields)
    if "max_tokens" in out:
        out["n_predict"] = out.pop("max_tokens")
    return out


def _logprobs(lp: Any) -> list[dict[str, Any]]:
    """A chat chunk's logprobs as Ollama writes them: token, logprob, top_logprobs."""
    content = lp.get("content") if isinstance(lp, dict) else None
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in e.get("top_logprobs") or []
            ],
        }
        for e in content or []
    ]


def created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _done_reason(reason: str | None) -> str:
    return {"length": "length", "limit": "length"}.get(reason or "stop", "stop")


@dataclass
class Answer:
    """One answer being folded from upstream chunks into Ollama's objects.

    `feed(chunk)` returns the Ollama objects to send now (`{"message": ...}` for chat,
    `{"response": ...}` for generate; tool calls come whole, in one object, once their arguments
    are complete); `final()` the done object."""

    model: str
    is_chat: bool
    started: float  # time.monotonic() when the request came in
    admitted: float = 0.0  # when the model was ready and the upstream answered (load_duration)
    reason: str | None = None
    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def _obj(self, content: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None) -> Chunk:
        head: Chunk = {"model": self.model, "created_at": created_at()}
        if self.is_chat:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            return {**head, "message": msg, "done": False}
        return {**head, "response": content, **({"thinking": thinking} if thinking else {}), "done": False}

    def feed(self, chunk: Chunk) -> list[Chunk]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("timings"):
            self.timings = chunk["timings"]
        if "choices" not in chunk:  # llama-server's native chunk (/infill)
            return self._native(chunk)
        out: list[Chunk] = []
        for choice in chunk["choices"]:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            thinking = delta.get("reasoning_content") or ""
            for c in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(int(c.get("index", 0)), {"name": "", "arguments": ""})
                fn = c.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
                if c.get("id"):
                    slot["id"] = c["id"]
            lps = _logprobs(choice.get("logprobs"))
            self.logprobs += lps
            if text or thinking or lps:
                self.text.append(text or "")
                self.thinking.append(thinking)
                obj = self._obj(text or "", thinking)
                if lps:
                    obj["logprobs"] = lps
                out.append(obj)
            if choice.get("finish_reason"):
                self.reason = choice["finish_reason"]
                if self.calls:
                    out.append(self._obj(calls=self.tool_calls()))
        return out

    def _native(self, chunk: Chunk) -> list[Chunk]:
        out = []
        if chunk.get("content"):
            self.text.append(chunk["content"])
            out.append(self._obj(chunk["content"]))
        if chunk.get("stop"):
            self.reason = chunk.get("stop_type")
            self.usage = {
                "prompt_tokens": chunk.get("tokens_evaluated", self.timings.get("prompt_n", 0)),
                "completion_tokens": chunk.get("tokens_predicted", self.timings.get("predicted_n", 0)),
            }
        return out

    def tool_calls(self) -> list[dict[str, Any]]:
        out = []
        for index, c in sorted(self.calls.items()):
            try:
                args = json.loads(c["arguments"] or "{}")
            except ValueError:
                args = {"_raw": c["arguments"]}  # not JSON: kept, so the client sees what the model wrote
            out.append(
                {
                    "id": c.get("id", f"call_{index}"),
                    "function": {"index": index, "name": c["name"], "arguments": args},
                }
            )
        return out

    def final(self, *, whole: bool = False) -> Chunk:
        """The done object; `whole`: the answer in one object (`stream: false`)."""
        now = time.monotonic()
        t = self.timings
        prompt_n = int(self.usage.get("prompt_tokens", t.get("prompt_n", 0)))
        eval_n = int(self.usage.get("completion_tokens", t.get("predicted_n", 0)))
        done: Chunk = self._obj(
            "".join(self.text) if whole else "",
            "".join(self.thinking) if whole else "",
            self.tool_calls() if whole and self.calls else None,
        )
        if whole and self.logprobs:
            done["logprobs"] = self.logprobs
        done.update(
            done=True,
            done_reason=_done_reason(self.reason),
            total_duration=int((now - self.started) * 1e9),
            load_duration=int(max(0.0, self.admitted - self.started) * 1e9),
            prompt_eval_count=prompt_n,
            prompt_eval_duration=int(float(t.get("prompt_ms", 0.0)) * 1e6),
            eval_count=eval_n,
            eval_duration=int(float(t.get("predicted_ms", 0.0)) * 1e6),
        )
        return done
