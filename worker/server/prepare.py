"""Request preparation: from a parsed request to what the engine runs.

`prepare_chat` is the chat route's whole preparation (sampling params, tools, output
constraint, reasoning format and budget, template rendering, grammar, output parsing, tokens); the other
helpers are the pieces the completion, native and token-count routes share with it. Nothing
here touches the engine; grammar compilation and long tokenizations run off the event loop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from worker.backends.base import Vocab
from worker.backends.media import MediaError, MediaPrompt
from worker.backends.video import Sampling
from worker.engine.grammar import Grammar, compile_grammar
from worker.engine.reasoning_budget import reasoning_budget
from worker.protocol import sampler_order
from worker.protocol.errors import APIError
from worker.protocol.sampling import LoraKey, SamplingParams
from worker.protocol.wire import ChatCompletionRequest, ChatMessage, new_id, now
from worker.server.context import BackendLRU, check_prompt, tokenize_text
from worker.server.media import ChatMedia, check_accepts, expand_videos, extract, load_media, media_kinds
from worker.server.openai_format import ResponseInfo
from worker.server.state import REASONING_FORMATS, WorkerState
from worker.server.structured import (
    Constraint,
    ToolSet,
    check_tool_schemas,
    check_tools,
    compile_constraint,
    output_constraint,
    tool_call_lark,
)
from worker.text.chat_output import ChatOutputConfig
from worker.text.chat_template import ChatTemplateError
from worker.text.generic_tools import with_generic_tools
from worker.text.reasoning import detect_markers, starts_in_reasoning
from worker.text.tool_calls import ToolFormat, detect_format


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request made ready for the engine: the rendered prompt and its tokens, the sampling
    params (with the grammar), and how to parse the output (None: plain text)."""

    text: str
    tokens: list[int]
    params: SamplingParams
    chat: ChatOutputConfig | None
    media: dict[int, Any] = dataclasses.field(default_factory=dict)  # media chunks' embeddings (media ids)


async def prepare_chat(state: WorkerState, backend: Vocab, req: ChatCompletionRequest) -> PreparedChat:
    params = sampling_params(state, backend, req)
    tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    constraint = output_constraint(req)
    reasoning = reasoning_format(state, req.reasoning_format)
    rendered_tools = tools.tools if tools is not None and tools.is_active else None
    nv = req.nvext
    media = chat_media(state, backend, req.messages, req.images, req.videos, video_sampling(state, req))
    messages = media.messages if media is not None else req.messages
    if nv is not None and nv.use_raw_prompt:
        text = "".join(m.text() for m in messages)
    else:
        cont = continues_final_message(messages, req.continue_final_message, req.add_generation_prompt)
        text = render_chat(state, backend, messages, rendered_tools, req.add_generation_prompt,
                           req.template_kwargs(), cont)
    source = state.template.source if state.template is not None else None
    tool_format = detect_format(source)
    if constraint is not None or rendered_tools is not None:
        grammar = await _memo_grammar(backend, _grammar_key(tools, tool_format, constraint),
                                      lambda: _chat_grammar(backend, tools, tool_format, constraint))
        params = dataclasses.replace(params, grammar=grammar)
        beam_with_grammar(params, constraint.param if constraint is not None else "tools")
    markers = detect_markers(source) if reasoning != "none" else None
    output = ChatOutputConfig(
        tool_format=tool_format if rendered_tools is not None else None,
        parallel_tool_calls=req.parallel_tool_calls,
        reasoning=markers,
        starts_in_reasoning=markers is not None and starts_in_reasoning(text, markers),
        legacy_reasoning=reasoning == "deepseek-legacy",
    )
    chat = output if output.tool_format is not None or output.reasoning is not None else None
    budget = reasoning_budget(
        req.thinking_budget_tokens,
        markers,
        output.starts_in_reasoning,
        params.grammar is not None,
        lambda t: backend.tokenize(t, False, True),
    )
    if budget is not None:
        if params.beam_width:
            raise APIError("beam search with a reasoning budget is not implemented",
                           param="thinking_budget_tokens")
        params = dataclasses.replace(params, reasoning_budget=budget)
    if media is not None:
        prompt = await media_prompt(state, backend, text, media)
        check_prompt(prompt.tokens, backend)
        return PreparedChat(text, prompt.tokens, params, chat, prompt.media)
    tokens = await tokenize_text(backend, text, True, True)
    check_prompt(tokens, backend)
    return PreparedChat(text, tokens, params, chat)


def chat_media(state: WorkerState, backend: Vocab, messages: list[ChatMessage], images: list[str] | None,
               videos: list[str] | None = None, sampling: Sampling | None = None) -> ChatMedia | None:
    """The request's images, audio and videos as marker text and what each marker stands for
    (None: it has none). 400s: a model without the encoder (not_supported_error), too many of any."""
    kinds = media_kinds(messages, images, videos)
    if not kinds:
        return None
    check_accepts(backend.vision, kinds, state.model_id, state.backend_kind)
    assert backend.vision is not None
    media = extract(messages, images, backend.vision.marker, videos)
    if sampling is not None:
        media.sampling = sampling
    if media.n_images > state.media.max_images:
        raise APIError(f"{media.n_images} images in one request; this server takes at most "
                       f"{state.media.max_images} (--max-images)", param="messages")
    if media.n_audio > state.media.max_audio:
        raise APIError(f"{media.n_audio} audio parts in one request; this server takes at most "
                       f"{state.media.max_audio} (--max-audio)", param="messages")
    if media.n_videos > state.media.max_videos:
        raise APIError(f"{media.n_videos} videos in one request; this server takes at most "
                       f"{state.media.max_videos} (--max-videos)", param="videos" if videos else "messages")
    return media


def video_sampling(state: WorkerState, req: ChatCompletionRequest) -> Sampling:
    """How the request's videos are sampled: sglang-omni's fields over the server's defaults; a
    request may not take more frames than the server's --video-max-frames (400 naming the field)."""
    base = state.media.video_sampling
    if req.video_max_frames is not None and req.video_max_frames > base.max_frames:
        raise APIError(f"video_max_frames {req.video_max_frames} is over this server's --video-max-frames "
                       f"{base.max_frames}", param="video_max_frames")
    mins, maxs = req.video_min_pixels, req.video_max_pixels
    if mins is not None and maxs is not None and mins > maxs:
        raise APIError("video_min_pixels must not be over video_max_pixels", param="video_min_pixels")
    limit = state.media.video_limits.max_pixels
    if mins is not None and limit and mins > limit:  # frames scaled up past what a header may say
        raise APIError(f"video_min_pixels {mins} is over this server's --image-max-pixels {limit}",
                       param="video_min_pixels")
    return Sampling(
        fps=req.video_fps if req.video_fps is not None else base.fps,
        max_frames=req.video_max_frames if req.video_max_frames is not None else base.max_frames,
        min_pixels=mins if mins is not None else base.min_pixels,
        max_pixels=maxs if maxs is not None else base.max_pixels,
        total_pixels=req.video_total_pixels if req.video_total_pixels is not None else base.total_pixels,
    )


async def media_prompt(state: WorkerState, backend: Vocab, text: str, media: ChatMedia) -> MediaPrompt:
    """Load, decode, tokenize and encode the images, audio and videos' frames (off the event loop;
    cached by their bytes)."""
    vision = backend.vision
    assert vision is not None

    def run() -> MediaPrompt:
        loaded = load_media(media.items, state.media, media.sampling)
        expanded, items = expand_videos(text, vision.marker, loaded)
        try:
            return vision.prepare(expanded, items)
        except MediaError as e:
            raise APIError(str(e), param="messages") from None

    prompt = await anyio.to_thread.run_sync(run)
    m = state.metrics
    m.image_chunks_encoded.inc(prompt.n_encoded)
    m.image_chunks_cached.inc(prompt.n_cached)
    m.image_encode_seconds.inc(prompt.encode_seconds)
    return prompt


def response_info(state: WorkerState, backend: Vocab, model: str | None, prefix: str,
                  rid: str | None = None) -> ResponseInfo:
    """`rid`: the body's `request_id` (sglang's), used as the response id."""
    return ResponseInfo(rid or new_id(prefix), now(), model or state.model_id, backend.token_to_piece)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    for m in messages:
        if isinstance(m.content, list):
            for part in m.content:
                kind = part.get("type")
                if kind not in ("text", "input_text"):
                    raise APIError(
                        f"content part type {kind!r} is not supported by this model (text only)",
                        param="messages",
                        type="not_supported_error",
                    )
    return [m.model_dump(exclude_none=True) for m in messages]


_CONTINUE_MARK = "\u2063omni-continue\u2063"  # cut the rendered prompt here to continue the last message


def continues_final_message(
    messages: list[ChatMessage], continue_final: bool | None, add_generation_prompt: bool
) -> bool:
    """llama-server's rule (server-common.cpp): a last assistant message is continued (prefill)
    unless continue_final_message says otherwise; two trailing assistant messages, continuing
    while adding a generation prompt, or continuing tool calls are 400s."""
    last = messages[-1]
    if continue_final is None:
        if last.role != "assistant":
            return False
        if len(messages) >= 2 and messages[-2].role == "assistant":
            raise APIError(
                "Cannot have 2 or more assistant messages at the end of the list.", param="messages"
            )
        return True
    if continue_final and add_generation_prompt:
        raise APIError("Cannot set both add_generation_prompt and continue_final_message to true.",
                       param="continue_final_message")
    if continue_final and last.role == "assistant" and last.tool_calls:
        raise APIError(
            "Cannot continue an assistant message that contains tool calls.", param="continue_final_message"
        )
    return continue_final and last.role == "assistant"


def render_chat(
    state: WorkerState,
    backend: Vocab,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any] | None,
    continue_final: bool = False,
) -> str:
    """The prompt text; `continue_final`: it ends inside the last (assistant) message, whose text
    parts are joined with blank lines, so that generation continues it."""
    assert state.template is not None
    dicts = message_dicts(messages)
    if continue_final:
        last = messages[-1]
        text_of_last = last.content if isinstance(last.content, str) else "\n\n".join(
            str(p.get("text", "")) for p in last.content or [])
        dicts[-1]["content"] = text_of_last + _CONTINUE_MARK
        add_generation_prompt = False
    caps = state.template.caps
    if tools and not caps.supports_tools:  # a template that drops tools: worker/text/generic_tools.py
        dicts, tools = with_generic_tools(dicts, tools, caps.supports_tool_calls), None
    try:
        text = state.template.render(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **{**state.template_kwargs, **(kwargs or {})})
    except ChatTemplateError as e:
        raise APIError(f"chat template error: {e}", param="messages") from None
    if continue_final:
        if _CONTINUE_MARK not in text:
            raise APIError(
                "the chat template does not render the final assistant message: it cannot be continued",
                param="messages",
            )
        text = text[: text.index(_CONTINUE_MARK)]
    bos = backend.meta.bos_token
    if backend.meta.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]  # the tokenizer adds it again
    return text


# The grammars of recent (tools, tool format, constraint) sets: an agent loop or a chat UI sends
# the same tools and schema with every call. The compiled grammars are kept anyway (LRU in
# worker/engine/grammar.py), but building the tool-call grammar, checking the tools' schemas and
# the hop to a thread and back cost ~0.5 ms of worker time per request; a hit is answered on the
# event loop. Errors are not kept (a bad request is compiled, and refused, again).
_grammars: BackendLRU[str, tuple[Grammar | None]] = BackendLRU(128)


def _grammar_key(tools: ToolSet | None, fmt: ToolFormat | None, c: Constraint | None) -> str:
    t = None if tools is None else [tools.tools, tools.choice.mode, tools.choice.name, tools.parallel]
    return json.dumps([t, fmt, None if c is None else [c.kind, c.text, c.param]], ensure_ascii=False)


async def _memo_grammar(backend: Vocab, key: str, build: Callable[[], Grammar | None]) -> Grammar | None:
    hit = _grammars.get(backend, key)
    if hit is not None:
        return hit[0]
    grammar = await anyio.to_thread.run_sync(build)
    _grammars.put(backend, key, (grammar,))
    return grammar


def _chat_grammar(
    backend: Vocab, tools: ToolSet | None, fmt: ToolFormat, c: Constraint | None
) -> Grammar | None:
    """The chat request's one grammar: a forced tool call, a JSON answer or a call (tool_choice
    auto with a JSON schema), or the output constraint alone. Blocking: run it in a thread."""
    if tools is None or not tools.is_active:
        return compile_constraint(backend, c) if c is not None else None
    check_tool_schemas(backend, tools)
    if not tools.choice.is_forced and c is None:
        return None  # free text, parsed for calls afterwards
    if c is not None and (tools.choice.is_forced or c.kind != "json_schema"):
        raise APIError(f"{c.param} cannot be combined with tool_choice {tools.choice.mode!r}", param=c.param)
    lark = tool_call_lark(backend, fmt, tools, c)
    return compile_grammar(backend.grammar_tokenizer(), "lark", lark)


def reasoning_format(state: WorkerState, value: str | None) -> str:
    fmt = value or state.reasoning_format
    if fmt not in REASONING_FORMATS:
        raise APIError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, not {fmt!r}",
                       param="reasoning_format")
    return fmt


def request_lora(state: WorkerState, req: Any) -> LoraKey:
    """The request's LoRA adapter set (worker/engine/adapters.py): its `lora` list, else the
    adapter its `model` names ("<model>:<adapter>", at scale 1), else the global scales. A
    `model` of this worker's name and an adapter that is not loaded is a 400 (param `model`)."""
    adapters = state.engine.adapters
    listed = getattr(req, "lora", None)
    model = getattr(req, "model", None) or ""
    prefix, sep, name = model.rpartition(":")
    adapter = adapters.by_name(name) if sep else None
    if sep and adapter is None and prefix in (state.model_id, *state.aliases):
        raise APIError(f"model {model!r}: no LoRA adapter named {name!r} is loaded (GET /lora-adapters)",
                       param="model")
    try:
        if listed is not None:
            return adapters.resolve((x.id, x.scale) for x in listed)
        if adapter is not None:
            return adapters.resolve([(adapter.id, 1.0)])
        return adapters.resolve(None)
    except ValueError as e:
        raise APIError(str(e), param="lora") from None


def sampling_params(state: WorkerState, backend: Vocab, req: Any) -> SamplingParams:
    """The request's SamplingParams, logit_bias text keys tokenized (no specials)."""
    try:
        params: SamplingParams = req.to_sampling_params(
            state.defaults, lambda text: backend.tokenize(text, False, False)
        )
    except ValueError as e:
        raise APIError(str(e), param="logit_bias") from None
    params = dataclasses.replace(params, lora=request_lora(state, req))
    if state.backend_kind == "torch" and not sampler_order.penalties_first(params):
        raise APIError("the torch backend applies the penalties first in the sampler chain: "
                           "put `penalties` before the other samplers that are on", param="samplers")
    if params.beam_width:
        check_beam_search(state, params)
    return params


def check_beam_search(state: WorkerState, params: SamplingParams) -> None:
    """What beam search (worker/engine/beam.py) does not combine with: 400s naming the field.
    A grammar is checked where it is compiled (`beam_with_grammar`)."""
    n_slots = state.engine.n_slots
    if params.beam_width > n_slots:
        raise APIError(f"a beam search of width {params.beam_width} needs {params.beam_width} slots; this "
                       f"worker has {n_slots} (--parallel)", param="best_of")
    if params.has_penalties:
        name = ("repeat_penalty" if params.repeat_penalty != 1.0 else
                "presence_penalty" if params.presence_penalty != 0.0 else "frequency_penalty")
        raise APIError("beam search ranks the model's own log-probabilities: repetition penalties are "
                       f"not applied to it, so {name} must be left at its off value", param=name)
    if params.speculative is not None:
        raise APIError("beam search does not speculate: leave the speculative-decoding settings out",
                       param="num_assistant_tokens")
    if params.post_sampling_probs:
        raise APIError("beam search runs no sampler chain: its logprobs are the model's own "
                       "(leave post_sampling_probs out)", param="post_sampling_probs")


def beam_with_grammar(params: SamplingParams, param: str) -> None:
    """Constrained output is not searched in beams: a 400 naming the constraint's field."""
    if params.beam_width and params.grammar is not None:
        raise APIError("beam search with constrained output (a grammar, a JSON schema, forced tool "
                       "calls) is not implemented", param=param)


def verbose_payload(backend: Vocab, prompt: str, n_prompt: int, content: str) -> dict[str, Any]:
    """llama-server's `__verbose` (request `verbose`, or the server's --verbose): the prompt as
    the model gets it (the rendered template, after the BOS the tokenizer adds) and the generated text."""
    m = backend.meta
    bos = m.bos_token if m.add_bos and m.bos_token and not prompt.startswith(m.bos_token) else ""
    return {"prompt": bos + prompt, "content": content, "tokens_evaluated": n_prompt}


async def with_output_constraint(backend: Vocab, req: Any, params: SamplingParams) -> SamplingParams:
    """`params` with the grammar of the request's response_format / json_schema / grammar, if any."""
    constraint = output_constraint(req)
    if constraint is None:
        return params
    grammar = await _memo_grammar(backend, _grammar_key(None, None, constraint),
                                  lambda: compile_constraint(backend, constraint))
    params = dataclasses.replace(params, grammar=grammar)
    beam_with_grammar(params, constraint.param)
    return params


async def count_input_tokens(state: WorkerState, backend: Vocab, messages: list[ChatMessage],
                             tools: list[Any] | None, kwargs: dict[str, Any] | None) -> int:
    """The prompt length a chat request with these messages would have (nothing generated)."""
    media = chat_media(state, backend, messages, None)
    if media is not None:
        messages = media.messages
    cont = continues_final_message(messages, None, True)
    text = render_chat(state, backend, messages, tools, True, kwargs, cont)
    if media is not None:
        return len((await media_prompt(state, backend, text, media)).tokens)
    return len(await tokenize_text(backend, text, True, True))
