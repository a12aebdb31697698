"""The worker's ASGI application: its route table (handlers in worker/server/app.py and
worker/server/embeddings.py) and the outer layers, outside in: CORS and the API key (the rules
shared with the router, worker/protocol/front.py), an embedding worker's refusal of generation
routes, and the request context that tags profiling events with the request id."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from worker.protocol.errors import APIError, api_error_handler, error_body, http_exception_handler
from worker.protocol.front import Cors, RequireAPIKey
from worker.server import adapters, app, extras, profiling
from worker.server.embeddings import RefuseGeneration
from worker.server.embeddings import routes as embedding_routes
from worker.server.state import WorkerState


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(f"internal error: {exc!r}", "server_error", None, 500), status_code=500)


def build_app(state: WorkerState, *, api_keys: tuple[str, ...] = (), cors_origins: str = "*") -> ASGIApp:
    routes = [
        Route("/v1/chat/completions", app.chat_completions, methods=["POST"]),
        Route("/chat/completions", app.chat_completions, methods=["POST"]),
        Route("/v1/completions", app.completions, methods=["POST"]),
        Route("/completion", app.native_completion, methods=["POST"]),  # llama-server's native shape
        Route("/completions", app.native_completion, methods=["POST"]),  # as llama-server: native, not OpenAI
        Route("/infill", app.infill, methods=["POST"]),
        Route("/v1/models", app.models, methods=["GET"]),
        Route("/models", app.models, methods=["GET"]),
        Route("/health", app.health, methods=["GET"]),
        Route("/v1/health", app.health, methods=["GET"]),
        Route("/props", app.props, methods=["GET"]),
        Route("/slots", app.slots, methods=["GET"]),
        Route("/slots/{id_slot}", app.slot_action, methods=["POST"]),
        Route("/props", app.set_props, methods=["POST"]),
        Route("/cors-proxy", app.cors_proxy_route, methods=["GET", "POST"]),
        Route("/tokenize", app.tokenize, methods=["POST"]),
        Route("/detokenize", app.detokenize, methods=["POST"]),
        Route("/apply-template", app.apply_template, methods=["POST"]),
        Route("/chat/completions/input_tokens", app.chat_input_tokens, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", app.chat_input_tokens, methods=["POST"]),
        Route("/v1/responses/input_tokens", app.responses_input_tokens, methods=["POST"]),
        Route("/v1/messages/count_tokens", app.messages_count_tokens, methods=["POST"]),
        Route("/metrics", app.metrics, methods=["GET"]),
        Route("/sleep", app.sleep, methods=["POST"]),
        Route("/wake", app.wake, methods=["POST"]),
        *profiling.routes(state.model_id),
        *extras.routes(state.model_id),
        *embedding_routes(),
        *adapters.routes(),
    ]
    starlette = Starlette(
        routes=routes,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_exception_handler,
            Exception: _server_error,
        },
    )
    starlette.state.worker = state
    outer: ASGIApp = profiling.RequestContext(starlette)  # X-Request-Id for the profiling events
    if state.is_embedding:
        outer = RefuseGeneration(outer)
    if api_keys:
        outer = RequireAPIKey(outer, api_keys)
    return Cors(outer, cors_origins)
