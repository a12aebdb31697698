"""The OpenAI Responses API, implemented once in the router as a translation onto the upstream's
`/v1/chat/completions` stream (so it works for our workers and for `cmd`/`remote` upstreams).

    wire.py       request and item models (pydantic, the edge) and the 400s they raise
    translate.py  pure: request + history -> the chat-completions body
    builder.py    pure: chat-completion chunks -> the response object and its stream events
    store.py      the durable store (stdlib sqlite3): responses, conversations and their items
    service.py    one response's run: history, upstream stream, events, store, background tasks
    routes.py     the HTTP routes (/v1/responses..., /v1/conversations...)
    bridge.py     the way to a model: one chat-completions stream through the router's admission
"""
