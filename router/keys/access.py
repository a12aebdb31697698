"""Who may call which route: one table, pure. `access_for(method, path)` is what
router.keys.guard asks for every request; tests walk `RouterApp.route_table()` against
`classify`, so a route cannot be added without a line here (the test names the missing one).

    PUBLIC  no key: /health and the web UI's files
    USER    any valid key: inference, model listing, token counts, the Responses store
    ADMIN   an admin key: the models' lifecycle (load, unload, sleep, reload, pull, delete, ...),
            logs (they hold prompts), slots (save and restore write files; their list shows
            prompts), LoRA adapters, profiling, metrics, /keys/usage

A path in no rule is ADMIN (fail closed): a route added without classifying it is for admin
keys until someone says otherwise, and a user key learns nothing from probing (403, not 404).

Templates are the route table's: `{name}` is one path segment; `{model_id}` (a model name, which
may hold `/`) and `{file}` (a web UI file in a subfolder) are the rest of the path. One rule reads
the query: `GET /models?reload=1` (llama.cpp's) reloads the presets, so it is ADMIN.
"""

from __future__ import annotations

import re
from enum import StrEnum
from functools import cache
from urllib.parse import parse_qsl


class Access(StrEnum):
    PUBLIC = "public"
    USER = "user"
    ADMIN = "admin"


P, U, A = Access.PUBLIC, Access.USER, Access.ADMIN
ANY = "*"  # any method

_INFERENCE_POST = (
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/completion",
    "/v1/embeddings",
    "/embeddings",
    "/embedding",
    "/v1/rerank",
    "/rerank",
    "/v1/reranking",
    "/reranking",
    "/v1/audio/speech",
    "/v1/audio/transcriptions",
    "/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/images/generations",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/infill",
    "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens",
    "/v1/responses/input_tokens",
    "/v1/messages",
    "/v1/messages/count_tokens",
    # Ollama's API (router/ollama/)
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
    "/api/show",
)


def _responses(prefix: str) -> list[tuple[str, str, Access]]:
    p = prefix
    return [
        ("POST", f"{p}/responses", U),
        ("GET", f"{p}/responses/{{rid}}", U),
        ("DELETE", f"{p}/responses/{{rid}}", U),
        ("POST", f"{p}/responses/{{rid}}/cancel", U),
        ("GET", f"{p}/responses/{{rid}}/input_items", U),
        ("POST", f"{p}/conversations", U),
        ("GET", f"{p}/conversations/{{cid}}", U),
        ("POST", f"{p}/conversations/{{cid}}", U),
        ("DELETE", f"{p}/conversations/{{cid}}", U),
        ("GET", f"{p}/conversations/{{cid}}/items", U),
        ("POST", f"{p}/conversations/{{cid}}/items", U),
        ("GET", f"{p}/conversations/{{cid}}/items/{{item_id}}", U),
        ("DELETE", f"{p}/conversations/{{cid}}/items/{{item_id}}", U),
    ]


# (method, path template, access): the whole table.
RULES: tuple[tuple[str, str, Access], ...] = (
    # public
    ("GET", "/health", P),
    ("GET", "/", P),
    ("GET", "/index.html", P),
    ("GET", "/favicon.ico", P),
    ("GET", "/static/{file}", P),
    ("GET", "/assets/{file}", P),
    ("GET", "/webui/{file}", P),
    # user: inference (metered by a key's limits: every POST of this class) ...
    *(("POST", path, U) for path in _INFERENCE_POST),
    *(
        rule for prefix in ("/v1", "", "/v3") for rule in _responses(prefix)
    ),  # router.responses.routes' PREFIXES
    # ... and reading what is there (the key's own models only: router.keys.views)
    ("GET", "/v1/models", U),
    ("GET", "/models", U),
    ("GET", "/v1/models/{model_id}", U),
    ("GET", "/models/sse", U),
    ("GET", "/props", U),
    ("GET", "/tools", U),
    ("GET", "/openapi.json", U),
    ("GET", "/dynamo/alpha/list-models", U),
    ("GET", "/api/tags", U),
    ("GET", "/api/ps", U),
    ("GET", "/api/version", U),
    # admin: the models' lifecycle, pulls and deletes
    ("POST", "/models/load", A),
    ("POST", "/models/unload", A),
    ("POST", "/models/sleep", A),
    ("POST", "/models/reload", A),
    (ANY, "/models/pull", A),
    (ANY, "/models/pull/{id}", A),
    (ANY, "/api/pull", A),
    (ANY, "/api/delete", A),
    (ANY, "/api/copy", A),
    (ANY, "/api/create", A),
    (ANY, "/api/push", A),
    (ANY, "/api/blobs/{digest}", A),
    # admin: what the workers hold (logs and slots show prompts; slot files are written to disk)
    ("GET", "/logs", A),
    ("GET", "/logs/stream", A),
    ("GET", "/slots", A),
    ("POST", "/slots/{id_slot}", A),
    ("GET", "/metrics", A),
    ("GET", "/keys/usage", A),
    # admin: LoRA adapters, profiling
    ("GET", "/lora-adapters", A),
    ("POST", "/lora-adapters", A),
    ("POST", "/v1/load_lora_adapter", A),
    ("POST", "/v1/unload_lora_adapter", A),
    ("POST", "/start_profile", A),
    ("POST", "/stop_profile", A),
    ("POST", "/start_request_profile", A),
    ("POST", "/stop_request_profile", A),
)
_RELOADING = frozenset({"/models", "/v1/models"})
UNKNOWN = Access.ADMIN  # a path in no rule (see the module docstring)


def classify(method: str, template: str) -> Access | None:
    """The rule written for a route table entry (method, template), or None: unclassified."""
    for m, t, access in RULES:
        if t == template and m in (method, ANY):
            return access
    return None


def access_for(method: str, path: str, query: str = "") -> Access:
    """Who may call `method path?query` (a concrete path). HEAD is GET's."""
    return rule_for(method, path, query) or UNKNOWN


def rule_for(method: str, path: str, query: str = "") -> Access | None:
    """`access_for`, but None for a request no rule covers (no route: nothing to audit)."""
    method = "GET" if method == "HEAD" else method
    if method == "GET" and path in _RELOADING and is_reload(query):
        return Access.ADMIN
    exact = _EXACT.get((method, path)) or _EXACT.get((ANY, path))
    if exact is not None:
        return exact
    for m, pattern, access in _PATTERNS:
        if m in (method, ANY) and pattern.fullmatch(path):
            return access
    return None


def is_reload(query: str) -> bool:
    """Whether a query asks `GET /models` to reload the presets (router.http.admin's rule)."""
    return any(v.lower() in ("1", "true", "yes", "on") for k, v in parse_qsl(query) if k == "reload")


@cache
def _compile(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[a-z_]+\})", template)
    out = "".join(
        ("(.+)" if p in ("{model_id}", "{file}") else "([^/]+)") if p.startswith("{") else re.escape(p)
        for p in parts
    )
    return re.compile(out)


_EXACT = {(m, t): a for m, t, a in RULES if "{" not in t}
_PATTERNS = [(m, _compile(t), a) for m, t, a in RULES if "{" in t]
