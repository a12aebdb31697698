"""Routes other servers have and a text model cannot serve: each answers in the error envelope
(or says it has nothing), never a bare 404.

- OpenAI's audio and image routes: a 400 naming the model (the router sends these paths to a
  `cmd` or `remote` upstream that serves them untouched).
- llama-server's `GET /tools` (its built-in tools, `--tools`): none are configured here, `[]`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from worker.protocol.errors import APIError

NOT_SERVED = {
    "/v1/audio/speech": "text-to-speech",
    "/v1/audio/transcriptions": "speech-to-text",
    "/audio/transcriptions": "speech-to-text",
    "/v1/audio/translations": "speech-to-text",
    "/v1/images/generations": "image generation",
}


def routes(model_id: str) -> list[Route]:
    async def not_served(request: Request) -> Response:
        what = NOT_SERVED[request.url.path]
        raise APIError(f"model {model_id!r} is a text model: it does not serve {request.url.path} ({what}); "
                       "serve such a model as a `cmd` or `remote` upstream of omni-router",
                       param="model", type="not_supported_error", code="model_not_supported")

    async def tools(request: Request) -> Response:
        return JSONResponse([])  # no built-in tools are configured (llama-server's --tools)

    return [*(Route(path, not_served, methods=["POST"]) for path in NOT_SERVED),
            Route("/tools", tools, methods=["GET"])]
