"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), implemented once in
the router as a translation onto the upstream's `/v1/chat/completions` stream, as
router/responses/ does for OpenAI's Responses API.

    wire.py       request models (pydantic, the edge; unknown fields and block types are 400s)
    translate.py  pure: request -> the chat-completions body, and the token-count body
    builder.py    pure: chat-completion chunks -> the message and its stream events
    errors.py     Anthropic's error envelope and status codes (529 for our 503)
    routes.py     the HTTP routes
"""
