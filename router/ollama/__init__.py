"""Ollama's API (`/api/*`, and "Ollama is running" at `GET /` for clients that do not ask for
HTML), implemented once in the router as a translation onto the worker's streams, as
router/anthropic/ does for Anthropic's Messages API. `POST /api/pull` is the hub's download.

    wire.py       request models (pydantic, the edge; unknown fields and options are 400s)
    translate.py  pure: requests -> the worker's bodies, upstream chunks -> Ollama's objects
    catalog.py    what list, ps and show say about a model, from its file (GGUF header)
    errors.py     Ollama's error body {"error": "..."}
    routes.py     the HTTP routes
"""
