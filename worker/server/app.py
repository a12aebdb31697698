"""The worker's HTTP surface (Starlette): OpenAI endpoints plus llama-server's extras.

Handlers parse and validate at the edge (pydantic wire types -> `SamplingParams`, prompt ->
token ids), then hand a `Generation` to the engine thread and stream or aggregate its events.
Tokenizing and template rendering are thread-safe and cheap; long prompts go to a worker
thread so the event loop never stalls. Every error is the one envelope from worker/errors.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from worker.backends.base import Backend
from worker.engine import slot_file
from worker.engine.grammar import Grammar, compile_grammar
from worker.engine.metrics import CONTENT_TYPE
from worker.engine.sampling_params import SamplingParams
from worker.errors import (
    APIError,
    api_error_handler,
    error_body,
    http_exception_handler,
    parse_json,
    parse_model,
)
from worker.server import profiling
from worker.server.cors_proxy import cors_proxy
from worker.server.generation import Generation
from worker.server.infill import InfillParts, infill_prompt
from worker.server.middleware import Cors, RequireAPIKey
from worker.server.native_format import NativeInfo, NativeResults, collect_native, stream_native
from worker.server.openai_format import Choices, ResponseInfo, error_payload, stream_chat, stream_completion
from worker.server.sse import aggregated, event_stream
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
from worker.server.wire import (
    AnthropicCountTokensRequest,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    InfillRequest,
    NativeCompletionRequest,
    NativePrompt,
    ResponsesInputTokensRequest,
    TokenizeRequest,
    new_id,
    now,
)
from worker.text.chat_output import ChatOutputConfig
from worker.text.chat_template import ChatTemplateError
from worker.text.reasoning import detect_markers, starts_in_reasoning
from worker.text.tool_calls import ToolFormat, detect_format

_LONG_TEXT = 8192  # characters: above this, tokenize off the event loop


# --------------------------------------------------------------------------- helpers


def _state(request: Request) -> WorkerState:
    state: WorkerState = request.app.state.worker
    return state


def _loading_error(state: WorkerState) -> APIError | None:
    st = state.engine.status
    if st.error is not None:
        return APIError(f"Model failed to load: {st.error}", status_code=500, type="server_error", code=500)
    if not st.is_ready:
        return APIError(
            "Loading model",
            status_code=503,
            type="unavailable_error",
            code=503,
            extra={"progress": {"phase": st.phase, "fraction": round(st.fraction, 4)}},
        )
    return None


def _ready(state: WorkerState) -> Backend:
    err = _loading_error(state)
    if err is not None:
        raise err
    backend = state.engine.backend
    assert backend is not None
    return backend


async def _tokenize(backend: Backend, text: str, add_special: bool, parse_special: bool) -> list[int]:
    if len(text) > _LONG_TEXT:
        return await anyio.to_thread.run_sync(backend.tokenize, text, add_special, parse_special)
    return backend.tokenize(text, add_special, parse_special)


def _check_prompt(tokens: list[int], backend: Backend) -> None:
    if not tokens:
        raise APIError("The prompt is empty (no tokens)", param="prompt")
    if len(tokens) >= backend.n_ctx_seq:
        raise APIError(
            f"the request exceeds the available context size ({len(tokens)} prompt tokens, n_ctx {backend.n_ctx_seq}); "
            "try increasing --ctx-size",
            type="exceed_context_size_error",
            extra={"n_prompt_tokens": len(tokens), "n_ctx": backend.n_ctx_seq},
        )


def _check_token_ids(tokens: list[int], backend: Backend, param: str) -> None:
    n_vocab = backend.meta.n_vocab
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is out of range [0, {n_vocab})", param=param)


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
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


def continues_final_message(messages: list[ChatMessage], continue_final: bool | None, add_generation_prompt: bool) -> bool:
    """llama-server's rule (server-common.cpp): a last assistant message is continued (prefill)
    unless continue_final_message says otherwise; two trailing assistant messages, continuing
    while adding a generation prompt, or continuing tool calls are 400s."""
    last = messages[-1]
    if continue_final is None:
        if last.role != "assistant":
            return False
        if len(messages) >= 2 and messages[-2].role == "assistant":
            raise APIError("Cannot have 2 or more assistant messages at the end of the list.", param="messages")
        return True
    if continue_final and add_generation_prompt:
        raise APIError("Cannot set both add_generation_prompt and continue_final_message to true.",
                       param="continue_final_message")
    if continue_final and last.role == "assistant" and last.tool_calls:
        raise APIError("Cannot continue an assistant message that contains tool calls.", param="continue_final_message")
    return continue_final and last.role == "assistant"


def _render_chat(
    state: WorkerState,
    backend: Backend,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any] | None,
    continue_final: bool = False,
) -> str:
    """The prompt text; `continue_final`: it ends inside the last (assistant) message, whose text
    parts are joined with blank lines, so that generation continues it."""
    assert state.template is not None
    dicts = _message_dicts(messages)
    if continue_final:
        last = messages[-1]
        text_of_last = last.content if isinstance(last.content, str) else "\n\n".join(
            str(p.get("text", "")) for p in last.content or [])
        dicts[-1]["content"] = text_of_last + _CONTINUE_MARK
        add_generation_prompt = False
    try:
        text = state.template.render(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **{**state.template_kwargs, **(kwargs or {})})
    except ChatTemplateError as e:
        raise APIError(f"chat template error: {e}", param="messages") from None
    if continue_final:
        if _CONTINUE_MARK not in text:
            raise APIError("the chat template does not render the final assistant message: it cannot be continued",
                           param="messages")
        text = text[: text.index(_CONTINUE_MARK)]
    bos = backend.meta.bos_token
    if backend.meta.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]  # the tokenizer adds it again
    return text


def _info(state: WorkerState, backend: Backend, model: str | None, prefix: str) -> ResponseInfo:
    return ResponseInfo(new_id(prefix), now(), model or state.model_id, backend.token_to_piece)


# --------------------------------------------------------------------------- inference


def _chat_grammar(backend: Backend, tools: ToolSet | None, fmt: ToolFormat, c: Constraint | None) -> Grammar | None:
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


def _reasoning_format(state: WorkerState, value: str | None) -> str:
    fmt = value or state.reasoning_format
    if fmt not in REASONING_FORMATS:
        raise APIError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, not {fmt!r}",
                       param="reasoning_format")
    return fmt


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    backend = _ready(state)
    req = parse_model(ChatCompletionRequest, await request.body())
    params = _sampling_params(state, backend, req)
    tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    constraint = output_constraint(req)
    reasoning = _reasoning_format(state, req.reasoning_format)
    rendered_tools = tools.tools if tools is not None and tools.is_active else None
    nv = req.nvext
    if nv is not None and nv.use_raw_prompt:
        text = "".join(m.text() for m in req.messages)
    else:
        cont = continues_final_message(req.messages, req.continue_final_message, req.add_generation_prompt)
        text = _render_chat(state, backend, req.messages, rendered_tools, req.add_generation_prompt,
                            req.chat_template_kwargs, cont)
    source = state.template.source if state.template is not None else None
    tool_format = detect_format(source)
    if constraint is not None or rendered_tools is not None:
        grammar = await anyio.to_thread.run_sync(_chat_grammar, backend, tools, tool_format, constraint)
        params = dataclasses.replace(params, grammar=grammar)
    markers = detect_markers(source) if reasoning != "none" else None
    output = ChatOutputConfig(
        tool_format=tool_format if rendered_tools is not None else None,
        parallel_tool_calls=req.parallel_tool_calls,
        reasoning=markers,
        starts_in_reasoning=markers is not None and starts_in_reasoning(text, markers),
        legacy_reasoning=reasoning == "deepseek-legacy",
    )
    chat = output if output.tool_format is not None or output.reasoning is not None else None
    tokens = await _tokenize(backend, text, True, True)
    _check_prompt(tokens, backend)
    gen = Generation(state.engine, [tokens], params, quiet_tokens=not req.stream)
    info = _info(state, backend, req.model, "chatcmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(gen, stream_chat(gen, info, include_usage=include_usage, chat=chat,
                                             timings_per_token=req.timings_per_token))

    verbose = req.verbose or state.is_verbose

    async def build() -> tuple[int, Any]:
        choices = Choices(gen, info, chat=chat)
        await choices.collect()
        if choices.error is not None:
            return choices.error.status_code, error_payload(choices.error)
        body = choices.chat_completion()
        if verbose:
            body["__verbose"] = _verbose(backend, text, len(tokens), body["choices"][0]["message"].get("content") or "")
        return 200, body

    return aggregated(gen, build)


def _sampling_params(state: WorkerState, backend: Backend, req: Any) -> SamplingParams:
    """The request's SamplingParams, logit_bias text keys tokenized (no specials)."""
    try:
        params: SamplingParams = req.to_sampling_params(state.defaults, lambda text: backend.tokenize(text, False, False))
    except ValueError as e:
        raise APIError(str(e), param="logit_bias") from None
    return params


def _verbose(backend: Backend, prompt: str, n_prompt: int, content: str) -> dict[str, Any]:
    """llama-server's `__verbose` (request `verbose`, or the server's --verbose): the prompt as
    the model gets it (the rendered template, after the BOS the tokenizer adds) and the generated text."""
    m = backend.meta
    bos = m.bos_token if m.add_bos and m.bos_token and not prompt.startswith(m.bos_token) else ""
    return {"prompt": bos + prompt, "content": content, "tokens_evaluated": n_prompt}


async def _with_output_constraint(backend: Backend, req: Any, params: SamplingParams) -> SamplingParams:
    """`params` with the grammar of the request's response_format / json_schema / grammar, if any."""
    constraint = output_constraint(req)
    if constraint is None:
        return params
    grammar = await anyio.to_thread.run_sync(compile_constraint, backend, constraint)
    return dataclasses.replace(params, grammar=grammar)


async def completions(request: Request) -> Response:
    state = _state(request)
    backend = _ready(state)
    req = parse_model(CompletionRequest, await request.body())
    params = _sampling_params(state, backend, req)
    params = await _with_output_constraint(backend, req, params)
    prompts: list[list[int]] = []
    echo: list[str] = []
    for i, p in enumerate(req.prompts()):
        if isinstance(p, str):
            tokens = await _tokenize(backend, p, True, True)
            echo.append(p)
        else:
            _check_token_ids(p, backend, f"prompt[{i}]" if len(req.prompts()) > 1 else "prompt")
            tokens = p
            echo.append(b"".join(backend.token_to_piece(t) for t in p).decode(errors="replace"))
        _check_prompt(tokens, backend)
        prompts.append(tokens)
    gen = Generation(state.engine, prompts, params, quiet_tokens=not req.stream)
    info = _info(state, backend, req.model, "cmpl")
    echo_texts = echo if req.echo else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(gen, stream_completion(gen, info, include_usage=include_usage, echo=echo_texts,
                                                   timings_per_token=req.timings_per_token))

    async def build() -> tuple[int, Any]:
        choices = Choices(gen, info, echo=echo_texts)
        await choices.collect()
        if choices.error is not None:
            return choices.error.status_code, error_payload(choices.error)
        return 200, choices.completion()

    return aggregated(gen, build)


async def _native_tokens(backend: Backend, prompt: NativePrompt, param: str, *, add_special: bool = True,
                         parse_special: bool = True) -> list[int]:
    """llama-server's tokenize_mixed: specials for the first text part only; ids as they are."""
    if isinstance(prompt, str):
        return await _tokenize(backend, prompt, add_special, parse_special)
    tokens: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            tokens += await _tokenize(backend, part, add_special and i == 0, parse_special)
        else:
            _check_token_ids([part], backend, param)
            tokens.append(part)
    return tokens


async def native_completion(request: Request) -> Response:
    """llama-server's native /completion (and /completions): worker/server/native_format.py."""
    state = _state(request)
    backend = _ready(state)
    req = parse_model(NativeCompletionRequest, await request.body())
    params = _sampling_params(state, backend, req)
    params = await _with_output_constraint(backend, req, params)
    try:
        prompts = req.prompts()
    except ValueError as e:
        raise APIError(str(e), param="prompt") from None
    token_prompts: list[list[int]] = []
    for i, p in enumerate(prompts):
        tokens = await _native_tokens(backend, p, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
        _check_prompt(tokens, backend)
        token_prompts.append(tokens)
    return _run_native(state, backend, req, params, token_prompts)


async def infill(request: Request) -> Response:
    """llama-server's /infill: fill in the middle between `input_prefix` and `input_suffix`
    (`prompt`: the start of the middle; `input_extra`: other files), laid out with the model's
    FIM tokens as llama-server does (worker/server/infill.py); the answer is /completion's."""
    state = _state(request)
    backend = _ready(state)
    missing = backend.meta.fim.missing()
    if missing:
        raise APIError("Infill is not supported by this model: " + " ".join(f"{k} token is missing." for k in missing),
                       status_code=501, type="not_supported_error", code=501)
    req = parse_model(InfillRequest, await request.body())
    params = _sampling_params(state, backend, req)
    params = await _with_output_constraint(backend, req, params)

    def tokenize(text: str) -> list[int]:
        return backend.tokenize(text, False, False)

    parts = InfillParts(
        prefix=await _native_tokens(backend, req.input_prefix, "input_prefix", add_special=False, parse_special=False),
        suffix=await _native_tokens(backend, req.input_suffix, "input_suffix", add_special=False, parse_special=False),
        prompt=tokenize(req.prompt),
        extra=[(c.filename, c.text) for c in req.input_extra],
    )
    n_predict = -1 if state.defaults.max_tokens is None else state.defaults.max_tokens
    tokens = await anyio.to_thread.run_sync(
        lambda: infill_prompt(backend.meta, tokenize, parts, n_batch=backend.n_batch, n_predict=n_predict,
                              n_ctx=backend.n_ctx_seq))
    _check_prompt(tokens, backend)
    return _run_native(state, backend, req, params, [tokens])


def _run_native(state: WorkerState, backend: Backend, req: NativeCompletionRequest | InfillRequest,
                params: SamplingParams, token_prompts: list[list[int]]) -> Response:
    texts = [b"".join(backend.token_to_piece(t) for t in p).decode(errors="replace") for p in token_prompts]
    gen = Generation(state.engine, token_prompts, params, quiet_tokens=not req.stream)
    banned = state.eog_ids(backend) if params.ignore_eos else ()  # the backends ban them: echoed as llama-server does
    info = NativeInfo(req.model or state.model_id, backend.token_to_piece, texts, req.return_tokens, req.stream,
                      req.timings_per_token, backend.n_ctx_seq, banned)
    results = NativeResults(gen, info)
    if req.stream:
        return event_stream(gen, stream_native(gen, results))
    return aggregated(gen, lambda: collect_native(gen, results))


# --------------------------------------------------------------------------- tokenizer & template


async def _awake(state: WorkerState) -> Backend:
    """The backend, woken first if it sleeps: as llama-server, any request but the read-only
    ones (/health, /props, /models, /metrics, /slots) wakes the server."""
    backend = _ready(state)
    if backend.is_sleeping:
        await asyncio.wrap_future(state.engine.call(state.engine.wake))
    return backend


async def tokenize(request: Request) -> Response:
    backend = await _awake(_state(request))
    req = parse_model(TokenizeRequest, await request.body())
    tokens = await _tokenize(backend, req.content, req.add_special, req.parse_special)
    if not req.with_pieces:
        return JSONResponse({"tokens": tokens})
    pieces = []
    for t in tokens:
        raw = backend.token_to_piece(t)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return JSONResponse({"tokens": pieces})


async def detokenize(request: Request) -> Response:
    backend = await _awake(_state(request))
    req = parse_model(DetokenizeRequest, await request.body())
    _check_token_ids(req.tokens, backend, "tokens")
    content = b"".join(backend.token_to_piece(t) for t in req.tokens).decode(errors="replace")
    return JSONResponse({"content": content})


async def _count_input_tokens(state: WorkerState, messages: list[ChatMessage], tools: list[Any] | None,
                              kwargs: dict[str, Any] | None) -> Response:
    backend = await _awake(state)
    cont = continues_final_message(messages, None, True)
    text = _render_chat(state, backend, messages, tools, True, kwargs, cont)
    return JSONResponse({"input_tokens": len(await _tokenize(backend, text, True, True))})


async def chat_input_tokens(request: Request) -> Response:
    """llama-server's POST /chat/completions/input_tokens: the prompt's length, nothing generated."""
    req = parse_model(ApplyTemplateRequest, await request.body())
    return await _count_input_tokens(_state(request), req.messages, req.tools, req.chat_template_kwargs)


async def responses_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens (OpenAI's): `input` (text or message items) and `instructions`."""
    req = parse_model(ResponsesInputTokensRequest, await request.body())
    return await _count_input_tokens(_state(request), req.chat_messages(), req.tools, None)


async def messages_count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens (Anthropic's): `messages` and `system`."""
    req = parse_model(AnthropicCountTokensRequest, await request.body())
    return await _count_input_tokens(_state(request), req.chat_messages(), req.tools, None)


async def apply_template(request: Request) -> Response:
    state = _state(request)
    backend = _ready(state)
    req = parse_model(ApplyTemplateRequest, await request.body())
    text = _render_chat(state, backend, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs)
    return JSONResponse({"prompt": text})


# --------------------------------------------------------------------------- status & lifecycle


async def health(request: Request) -> Response:
    state = _state(request)
    err = _loading_error(state)
    if err is not None:
        return JSONResponse(err.body(), status_code=err.status_code)
    backend = state.engine.backend
    return JSONResponse({"status": "ok", "is_sleeping": bool(backend and backend.is_sleeping)})


def _model_card(state: WorkerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model_id, "aliases": list(state.aliases), "tags": list(state.tags),
                            "object": "model", "created": state.created, "owned_by": "omni-router"}
    backend = state.engine.backend
    if backend is not None:
        m = backend.meta
        card["meta"] = {
            "n_vocab": m.n_vocab,
            "n_ctx_train": m.n_ctx_train,
            "n_ctx": backend.n_ctx_seq,
            "n_params": m.n_params,
            "size": m.size_bytes,
            "backend": state.backend_kind,
        }
    return card


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


def _default_params(d: SamplingParams) -> dict[str, Any]:
    n_predict = -1 if d.max_tokens is None else d.max_tokens
    return {
        "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
        "repeat_penalty": d.repeat_penalty, "repeat_last_n": d.repeat_last_n,
        "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
        "seed": -1 if d.seed is None else d.seed, "n_predict": n_predict, "max_tokens": n_predict,
    }


async def props(request: Request) -> Response:
    state = _state(request)
    backend = _ready(state)
    m = backend.meta
    return JSONResponse(
        {
            "default_generation_settings": {"n_ctx": backend.n_ctx_seq, "params": _default_params(state.defaults)},
            "total_slots": state.engine.n_slots,
            "model_alias": state.model_id,
            "model_path": state.model_path,
            "backend": state.backend_kind,
            "chat_template": state.template.source if state.template else m.chat_template,
            "bos_token": m.bos_token,
            "eos_token": m.eos_token,
            "is_sleeping": backend.is_sleeping,
            "modalities": {"vision": False, "audio": False},
            "build_info": "omni-worker",
        }
    )


def _not_enabled(endpoint: str, flag: str) -> APIError:
    """llama-server's answer for an endpoint its command line left off."""
    return APIError(f"This server does not support {endpoint} endpoint. Start it with `{flag}`",
                    status_code=501, type="not_supported_error", code=501)


async def slots(request: Request) -> Response:
    state = _state(request)
    if not state.is_slots_on:
        raise _not_enabled("slots", "--slots")
    _ready(state)
    info = await asyncio.wrap_future(state.engine.call(state.engine.slots_info))
    if request.query_params.get("fail_on_no_slot") and not any(not s["is_processing"] for s in info):
        raise APIError("no slot available", status_code=503, type="unavailable_error", code=503)
    return JSONResponse(info)


async def slot_action(request: Request) -> Response:
    """llama-server's POST /slots/{id_slot}?action=save|restore|erase (with --slot-save-path):
    a slot's KV cache to a file in that directory and back, into any slot (worker/engine/slot_file.py).
    Each runs once the engine is idle, as llama-server defers it while the slot is busy."""
    state = _state(request)
    if state.slot_save_path is None:
        raise APIError("This server does not support slots action. Start it with `--slot-save-path`",
                       status_code=501, type="not_supported_error", code=501)
    await _awake(state)
    try:
        id_slot = int(request.path_params["id_slot"])
    except ValueError:
        raise APIError("Invalid slot ID", param="id_slot") from None
    if not 0 <= id_slot < state.engine.n_slots:
        raise APIError("Invalid slot ID", param="id_slot")
    action = request.query_params.get("action")
    engine = state.engine
    if action == "erase":
        n = await asyncio.wrap_future(engine.call_when_idle(lambda: engine.erase_slot(id_slot)))
        return JSONResponse({"id_slot": id_slot, "n_erased": n})
    if action not in ("save", "restore"):
        raise APIError("Invalid action", param="action")
    try:
        body = json.loads(await request.body() or b"{}")
        filename = body["filename"]
    except (ValueError, KeyError, TypeError):
        raise APIError("a JSON body with a filename is required", param="filename") from None
    if not isinstance(filename, str) or not slot_file.is_valid_filename(filename):
        raise APIError("Invalid filename", param="filename")
    path = Path(state.slot_save_path) / filename
    model = f"{state.backend_kind}:{os.path.realpath(state.model_path)}"
    t0 = time.perf_counter()
    if action == "save":
        tokens, rows, kv = await asyncio.wrap_future(engine.call_when_idle(lambda: engine.slot_snapshot(id_slot)))
        saved = slot_file.SlotFile(tokens, rows[0], rows[1], model, bytes(kv or b""))
        n_written = await anyio.to_thread.run_sync(slot_file.write, path, saved)
        return JSONResponse({"id_slot": id_slot, "filename": filename, "n_saved": len(tokens), "n_written": n_written,
                             "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})
    try:
        loaded, n_read = await anyio.to_thread.run_sync(slot_file.read, path, model)
    except slot_file.SlotFileError as e:
        raise APIError(str(e), param="filename") from None
    rows = (loaded.n_prompt_rows, loaded.prompt_class)
    if not await asyncio.wrap_future(
        engine.call_when_idle(lambda: engine.restore_slot(id_slot, loaded.tokens, rows, loaded.state))
    ):
        raise APIError("Unable to restore slot, no available space in KV cache or invalid slot save file")
    return JSONResponse({"id_slot": id_slot, "filename": filename, "n_restored": len(loaded.tokens), "n_read": n_read,
                         "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})


async def cors_proxy_route(request: Request) -> Response:
    return await cors_proxy(request, is_enabled=_state(request).is_cors_proxy_on)


async def set_props(request: Request) -> Response:
    """llama-server's POST /props: 501 unless started with --props. llama-server's own handler
    answers success and changes nothing; here no property is settable either, so an empty object
    is a success and a body that asks to change something is a 400 naming the keys (never
    accepted and ignored)."""
    if not _state(request).is_props_on:
        raise APIError("This server does not support changing global properties. Start it with `--props`",
                       status_code=501, type="not_supported_error", code=501)
    body = parse_json(await request.body())
    if not isinstance(body, dict):
        raise APIError("Request body must be a JSON object")
    if body:
        raise APIError(f"no server property can be changed at run time (asked: {', '.join(sorted(body))}); "
                       "restart omni-worker with other flags", param=next(iter(sorted(body))))
    return JSONResponse({"success": True})


async def metrics(request: Request) -> Response:
    state = _state(request)
    if not state.is_metrics_on:
        raise _not_enabled("metrics", "--metrics")
    response = Response(state.metrics.render(), media_type=CONTENT_TYPE)
    response.raw_headers.append((b"Process-Start-Time-Unix", str(state.metrics.t_start).encode()))  # llama-server's casing
    return response


async def sleep(request: Request) -> Response:
    state = _state(request)
    _ready(state)
    await asyncio.wrap_future(state.engine.call_when_idle(state.engine.sleep))
    return JSONResponse({"status": "sleeping"})


async def wake(request: Request) -> Response:
    state = _state(request)
    _ready(state)
    t0 = time.monotonic()
    await asyncio.wrap_future(state.engine.call(state.engine.wake))
    return JSONResponse({"status": "ok", "wake_ms": round((time.monotonic() - t0) * 1e3, 1)})


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(f"internal error: {exc!r}", "server_error", None, 500), status_code=500)


def build_app(state: WorkerState, *, api_keys: tuple[str, ...] = (), cors_origins: str = "*") -> ASGIApp:
    from worker.server.embeddings import RefuseGeneration
    from worker.server.embeddings import routes as embedding_routes  # it imports this module's helpers

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completion", native_completion, methods=["POST"]),  # llama-server's native shape
        Route("/completions", native_completion, methods=["POST"]),  # as llama-server: native, not OpenAI
        Route("/infill", infill, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/slots/{id_slot}", slot_action, methods=["POST"]),
        Route("/props", set_props, methods=["POST"]),
        Route("/cors-proxy", cors_proxy_route, methods=["GET", "POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses_input_tokens, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake", wake, methods=["POST"]),
        *profiling.routes(state.model_id),
        *embedding_routes(),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_exception_handler,
            Exception: _server_error,
        },
    )
    app.state.worker = state
    outer: ASGIApp = profiling.RequestContext(app)  # X-Request-Id for the profiling events
    if state.is_embedding:
        outer = RefuseGeneration(outer)
    if api_keys:
        outer = RequireAPIKey(outer, api_keys)
    return Cors(outer, cors_origins)
