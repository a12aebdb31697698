"""The worker's HTTP side (Starlette, on the event loop): it never calls the engine-only Backend.

    cli            `omni-worker`: flags, loading, serving
    routes         the ASGI app: the route table and the outer layers
    app            the route handlers (chat, completions, native, tokenizer, status, admin)
    embeddings     the embedding and rerank handlers
    context        what each handler needs first: state, a ready backend (`Vocab`), checked tokens
    media          image parts and sglang-omni's `images`: URLs, local/remote policy, limits, 400s
    remote_media   fetching an http(s) media URL: public addresses only, pinned, each redirect
                   checked, one deadline and a size bound for the whole fetch
    prepare        request preparation: template, tools, grammar, sampling params, tokens
    state          `WorkerState`, what the handlers share
    generation     the bridge between one request and the engine thread
    sse            responses that run a generation and cancel it when the client leaves
    openai_format  engine events -> OpenAI chat / completion objects
    native_format  engine events -> llama-server's /completion objects
    structured     response_format / json_schema / grammar and tools -> one grammar
    infill         /infill's prompt, llama-server's layout
    adapters       LoRA adapters: GET/POST /lora-adapters, POST /v1/load_lora_adapter and unload
    slot_actions   POST /slots/{id}?action=save|restore|erase
    status         /v1/models and /props bodies
    profiling      /start_profile, /stop_profile and the request context
    cors_proxy     llama-server's /cors-proxy
    extras         routes a text model cannot serve (audio, images: a clear 400) and /tools
"""
