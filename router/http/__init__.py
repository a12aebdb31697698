"""The router's HTTP surface.

    app         wiring: the layers and the route table
    front       the raw ASGI front: body limit, dispatch
    forwarding  the proxied request flow: model from the body, admit, forward, release
    proxy       the byte pipe to a worker (JSON whole, SSE chunk by chunk, an error event on a crash)
    error_envelope  error answers on one path prefix rewritten into another API's envelope (Anthropic, Ollama)
    hints       a worker's advice in a proxied error, reworded to name preset keys
    admin       the router's own routes: /v1/models, /models/load|unload|sleep|reload|sse, /props, /metrics
    openapi     /openapi.json, from the route table and worker.protocol.wire
    webui       the bundled chat page's files
    form        one field of a multipart body (the audio uploads' `model`)
    unknown_routes  requests no route serves, logged once per (method, path) with the user-agent
    connection_budget  client connections held at once, from the open-files limit; uvicorn's 503 made ours
"""
