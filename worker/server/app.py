"""The worker's route handlers (Starlette): OpenAI endpoints plus llama-server's extras.

Handlers only: each parses its body at the edge (pydantic wire types, worker/protocol/wire.py),
prepares the request (worker/server/prepare.py: template, tools, grammar, tokens; the checks in
worker/server/context.py), hands a `Generation` to the engine thread and streams or aggregates
its events (worker/server/openai_format.py, native_format.py). The route table and the outer
layers are worker/server/routes.py's; embeddings and rerank are worker/server/embeddings.py's.
Every error is the one envelope from worker/protocol/errors.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from worker.engine.metrics import CONTENT_TYPE
from worker.protocol.errors import APIError, parse_json, parse_model
from worker.protocol.wire import (
    AnthropicCountTokensRequest,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    InfillRequest,
    NativeCompletionRequest,
    ResponsesInputTokensRequest,
    TokenizeRequest,
)
from worker.server import slot_actions, status
from worker.server.context import (
    awake_backend,
    check_prompt,
    check_token_ids,
    loading_error,
    native_tokens,
    not_enabled,
    ready_backend,
    tokenize_text,
    worker_state,
)
from worker.server.cors_proxy import cors_proxy
from worker.server.generation import Generation
from worker.server.infill import InfillParts, infill_prompt
from worker.server.native_format import run_native
from worker.server.openai_format import Choices, error_payload, stream_chat, stream_completion
from worker.server.prepare import (
    count_input_tokens,
    prepare_chat,
    render_chat,
    response_info,
    sampling_params,
    verbose_payload,
    with_output_constraint,
)
from worker.server.sse import aggregated, event_stream

# --------------------------------------------------------------------------- inference


async def chat_completions(request: Request) -> Response:
    state = worker_state(request)
    backend = ready_backend(state)
    req = parse_model(ChatCompletionRequest, await request.body())
    p = await prepare_chat(state, backend, req)
    gen = Generation(state.engine, [p.tokens], p.params, quiet_tokens=not req.stream, media=p.media)
    info = response_info(state, backend, req.model, "chatcmpl", req.request_id)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(gen, stream_chat(gen, info, include_usage=include_usage, chat=p.chat,
                                             timings_per_token=req.timings_per_token))

    verbose = req.verbose or state.is_verbose

    async def build() -> tuple[int, Any]:
        choices = Choices(gen, info, chat=p.chat)
        await choices.collect()
        if choices.error is not None:
            return choices.error.status_code, error_payload(choices.error)
        body = choices.chat_completion()
        if verbose:
            content = body["choices"][0]["message"].get("content") or ""
            body["__verbose"] = verbose_payload(backend, p.text, len(p.tokens), content)
        return 200, body

    return aggregated(gen, build)


async def completions(request: Request) -> Response:
    state = worker_state(request)
    backend = ready_backend(state)
    req = parse_model(CompletionRequest, await request.body())
    params = sampling_params(state, backend, req)
    params = await with_output_constraint(backend, req, params)
    prompts: list[list[int]] = []
    echo: list[str] = []
    for i, p in enumerate(req.prompts()):
        if isinstance(p, str):
            tokens = await tokenize_text(backend, p, True, True)
            echo.append(p)
        else:
            check_token_ids(p, backend, f"prompt[{i}]" if len(req.prompts()) > 1 else "prompt")
            tokens = p
            echo.append(b"".join(backend.token_to_piece(t) for t in p).decode(errors="replace"))
        check_prompt(tokens, backend)
        prompts.append(tokens)
    gen = Generation(state.engine, prompts, params, quiet_tokens=not req.stream)
    info = response_info(state, backend, req.model, "cmpl", req.request_id)
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


async def native_completion(request: Request) -> Response:
    """llama-server's native /completion (and /completions): worker/server/native_format.py."""
    state = worker_state(request)
    backend = ready_backend(state)
    req = parse_model(NativeCompletionRequest, await request.body())
    params = sampling_params(state, backend, req)
    params = await with_output_constraint(backend, req, params)
    try:
        prompts = req.prompts()
    except ValueError as e:
        raise APIError(str(e), param="prompt") from None
    token_prompts: list[list[int]] = []
    for i, p in enumerate(prompts):
        tokens = await native_tokens(backend, p, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
        check_prompt(tokens, backend)
        token_prompts.append(tokens)
    return run_native(state, backend, req, params, token_prompts)


async def infill(request: Request) -> Response:
    """llama-server's /infill: fill in the middle between `input_prefix` and `input_suffix`
    (`prompt`: the start of the middle; `input_extra`: other files), laid out with the model's
    FIM tokens as llama-server does (worker/server/infill.py); the answer is /completion's."""
    state = worker_state(request)
    backend = ready_backend(state)
    missing = backend.meta.fim.missing()
    if missing:
        raise APIError(
            "Infill is not supported by this model: " + " ".join(f"{k} token is missing." for k in missing),
            status_code=501,
            type="not_supported_error",
            code=501,
        )
    req = parse_model(InfillRequest, await request.body())
    params = sampling_params(state, backend, req)
    params = await with_output_constraint(backend, req, params)

    def tokenize(text: str) -> list[int]:
        return backend.tokenize(text, False, False)

    parts = InfillParts(
        prefix=await native_tokens(
            backend, req.input_prefix, "input_prefix", add_special=False, parse_special=False
        ),
        suffix=await native_tokens(
            backend, req.input_suffix, "input_suffix", add_special=False, parse_special=False
        ),
        prompt=tokenize(req.prompt),
        extra=[(c.filename, c.text) for c in req.input_extra],
    )
    n_predict = -1 if state.defaults.max_tokens is None else state.defaults.max_tokens
    tokens = await anyio.to_thread.run_sync(
        lambda: infill_prompt(backend.meta, tokenize, parts, n_batch=backend.n_batch, n_predict=n_predict,
                              n_ctx=backend.n_ctx_seq))
    check_prompt(tokens, backend)
    return run_native(state, backend, req, params, [tokens])


# --------------------------------------------------------------------------- tokenizer & template


async def tokenize(request: Request) -> Response:
    backend = await awake_backend(worker_state(request))
    req = parse_model(TokenizeRequest, await request.body())
    tokens = await tokenize_text(backend, req.content, req.add_special, req.parse_special)
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
    backend = await awake_backend(worker_state(request))
    req = parse_model(DetokenizeRequest, await request.body())
    check_token_ids(req.tokens, backend, "tokens")
    # control tokens as their text, as llama-server's /detokenize (common_token_to_piece, special)
    content = b"".join(backend.token_to_piece(t, special=True) for t in req.tokens).decode(errors="replace")
    return JSONResponse({"content": content})




async def _count(request: Request, messages: list[ChatMessage], tools: list[Any] | None,
                 kwargs: dict[str, Any] | None) -> Response:
    state = worker_state(request)
    backend = await awake_backend(state)
    return JSONResponse({"input_tokens": await count_input_tokens(state, backend, messages, tools, kwargs)})


async def chat_input_tokens(request: Request) -> Response:
    """llama-server's POST /chat/completions/input_tokens: the prompt's length, nothing generated."""
    req = parse_model(ApplyTemplateRequest, await request.body())
    return await _count(request, req.messages, req.tools, req.chat_template_kwargs)


async def responses_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens (OpenAI's): `input` (text or message items) and `instructions`."""
    req = parse_model(ResponsesInputTokensRequest, await request.body())
    return await _count(request, req.chat_messages(), req.tools, None)


async def messages_count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens (Anthropic's): `messages` and `system`."""
    req = parse_model(AnthropicCountTokensRequest, await request.body())
    return await _count(request, req.chat_messages(), req.tools, None)


async def apply_template(request: Request) -> Response:
    state = worker_state(request)
    backend = ready_backend(state)
    req = parse_model(ApplyTemplateRequest, await request.body())
    text = render_chat(
        state, backend, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs
    )
    return JSONResponse({"prompt": text})


# --------------------------------------------------------------------------- status & lifecycle


# --------------------------------------------------------------------------- status & lifecycle


async def health(request: Request) -> Response:
    state = worker_state(request)
    err = loading_error(state)
    if err is not None:
        return JSONResponse(err.body(), status_code=err.status_code)
    backend = state.engine.backend
    return JSONResponse({"status": "ok", "is_sleeping": bool(backend and backend.is_sleeping)})


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [status.model_card(worker_state(request))]})


async def props(request: Request) -> Response:
    state = worker_state(request)
    return JSONResponse(status.props(state, ready_backend(state)))


async def slots(request: Request) -> Response:
    state = worker_state(request)
    if not state.is_slots_on:
        raise not_enabled("slots", "--slots")
    ready_backend(state)
    info = await asyncio.wrap_future(state.engine.call(state.engine.slots_info))
    if request.query_params.get("fail_on_no_slot") and not any(not s["is_processing"] for s in info):
        raise APIError("no slot available", status_code=503, type="unavailable_error", code=503)
    return JSONResponse(info)


async def slot_action(request: Request) -> Response:
    """llama-server's POST /slots/{id_slot}?action=save|restore|erase (worker/server/slot_actions.py)."""
    state = worker_state(request)
    if state.slot_save_path is None:
        raise APIError("This server does not support slots action. Start it with `--slot-save-path`",
                       status_code=501, type="not_supported_error", code=501)
    await awake_backend(state)
    id_slot = slot_actions.slot_id(state, request.path_params["id_slot"])
    action = request.query_params.get("action")
    if action == "erase":
        return JSONResponse(await slot_actions.erase(state, id_slot))
    if action not in ("save", "restore"):
        raise APIError("Invalid action", param="action")
    filename, path = slot_actions.file_path(state, await request.body())
    run = slot_actions.save if action == "save" else slot_actions.restore
    return JSONResponse(await run(state, id_slot, filename, path))


async def cors_proxy_route(request: Request) -> Response:
    return await cors_proxy(request, is_enabled=worker_state(request).is_cors_proxy_on)


async def set_props(request: Request) -> Response:
    """llama-server's POST /props: 501 unless started with --props. llama-server's own handler
    answers success and changes nothing; here no property is settable either, so an empty object
    is a success and a body that asks to change something is a 400 naming the keys (never
    accepted and ignored)."""
    if not worker_state(request).is_props_on:
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
    state = worker_state(request)
    if not state.is_metrics_on:
        raise not_enabled("metrics", "--metrics")
    response = Response(state.metrics.render(), media_type=CONTENT_TYPE)
    response.raw_headers.append(
        (b"Process-Start-Time-Unix", str(state.metrics.t_start).encode())
    )  # llama-server's casing
    return response


async def sleep(request: Request) -> Response:
    state = worker_state(request)
    ready_backend(state)
    await asyncio.wrap_future(state.engine.call_when_idle(state.engine.sleep))
    return JSONResponse({"status": "sleeping"})


async def wake(request: Request) -> Response:
    state = worker_state(request)
    ready_backend(state)
    t0 = time.monotonic()
    try:
        await asyncio.wrap_future(state.engine.call(state.engine.wake))
    except RuntimeError as e:  # the backend stays asleep (a wake is all or nothing): say why
        raise APIError(f"the model could not wake: {e}", status_code=500, type="server_error") from None
    return JSONResponse({"status": "ok", "wake_ms": round((time.monotonic() - t0) * 1e3, 1)})
