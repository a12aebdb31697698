"""The router's OpenAPI 3.1 document (`GET /openapi.json`), built from its route table.

Every route is listed (a new route appears by itself); request bodies that have a pydantic
model at the edge (the worker's wire models, the Responses API's) carry its JSON schema, with
`model` narrowed to the configured names. Every route documents the one error envelope for
4xx and 5xx, so a client (or schemathesis) can check that errors keep their shape.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from router.anthropic.errors import PATH_PREFIX as ANTHROPIC_PREFIX
from router.anthropic.wire import CountTokensRequest, CreateMessage
from router.ollama.errors import PATH_PREFIX as OLLAMA_PREFIX
from router.ollama.wire import (
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from router.responses.wire import AddItems, CreateConversation, CreateResponse
from worker.protocol.speech import SpeechRequest
from worker.protocol.wire import (
    ApplyTemplateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NativeCompletionRequest,
    TokenizeRequest,
)

REF = "#/components/schemas/{model}"
BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/completions": CompletionRequest,
    "/completion": NativeCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/apply-template": ApplyTemplateRequest,
    "/v1/responses": CreateResponse,
    "/responses": CreateResponse,
    "/v1/conversations": CreateConversation,
    "/conversations": CreateConversation,
    "/v1/conversations/{cid}/items": AddItems,
    "/conversations/{cid}/items": AddItems,
    "/v1/messages": CreateMessage,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/audio/speech": SpeechRequest,
    "/api/chat": OllamaChatRequest,
    "/api/generate": OllamaGenerateRequest,
    "/api/embed": OllamaEmbedRequest,
    "/api/embeddings": OllamaEmbeddingsRequest,
    "/api/show": OllamaShowRequest,
    "/api/copy": OllamaCopyRequest,
}
MODEL_ONLY = frozenset({"/models/load", "/models/unload", "/models/sleep"})
ERROR_ENVELOPE: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR: dict[str, Any] = {  # the Messages API's routes answer in Anthropic's envelope
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}
OLLAMA_ERROR: dict[str, Any] = {  # Ollama's routes (/api/*) answer {"error": "..."}
    "type": "object", "required": ["error"], "properties": {"error": {"type": "string"}},
}
ANY_BODY: dict[str, Any] = {"schema": {}}
OK_CONTENT = {"application/json": ANY_BODY, "text/event-stream": ANY_BODY, "*/*": ANY_BODY}


def openapi_document(routes: list[tuple[str, str]], model_names: list[str]) -> dict[str, Any]:
    """The document for `routes` ((method, path) pairs) with `model` one of `model_names`."""
    schemas: dict[str, Any] = {"Error": ERROR_ENVELOPE, "AnthropicError": ANTHROPIC_ERROR,
                               "OllamaError": OLLAMA_ERROR}
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, model_names, schemas)
    return {"openapi": "3.1.0", "info": {"title": "omni-router", "version": "0.1.0"},
            "paths": paths, "components": {"schemas": schemas}}


def _operation(method: str, path: str, model_names: list[str], schemas: dict[str, Any]) -> dict[str, Any]:
    envelope = ("AnthropicError" if path.startswith(ANTHROPIC_PREFIX)
                else "OllamaError" if path.startswith(OLLAMA_PREFIX) else "Error")
    error = {"description": "the error envelope",
             "content": {"application/json": {"schema": {"$ref": REF.format(model=envelope)}}}}
    op: dict[str, Any] = {
        "operationId": f"{method.lower()} {path}",
        "responses": {
            "200": {"description": "success", "content": OK_CONTENT},
            "204": {"description": "no content"},
            "304": {"description": "not modified"},
            "4XX": error,
            "501": {
                **error,
                "description": "the model or server lacks the feature "
                "(llama-server's not_supported_error: no --embedding, no FIM tokens...)",
            },
            "5XX": error,
        },
    }
    params = [p[1:-1] for p in path.split("/") if p.startswith("{")]
    op["parameters"] = [
        {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params
    ]
    if method == "POST":
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _body_schema(path, model_names, schemas)}}}
    return op


def _body_schema(path: str, model_names: list[str], schemas: dict[str, Any]) -> dict[str, Any]:
    model_prop = {"type": "string", "enum": model_names} if model_names else {"type": "string"}
    if path in MODEL_ONLY:
        return {"type": "object", "required": ["model"], "properties": {"model": model_prop},
                "additionalProperties": False}  # router.http.admin.ModelRef
    cls = BODY_MODELS.get(path)
    if cls is None:
        return {"type": "object"}
    schema = cls.model_json_schema(ref_template=REF)
    schemas.update(schema.pop("$defs", {}))
    if "model" in schema.get("properties", {}):
        schema["properties"]["model"] = model_prop
        schema["required"] = sorted({*schema.get("required", []), "model"})
    return schema
