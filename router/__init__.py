"""omni-router's router: one OpenAI-compatible endpoint in front of one worker process per model.

    presets    INI/TOML presets -> validated `ModelPreset`s (errors name file:line / key path)
    state      `ModelState`, the lifecycle enum (transition table in its docstring)
    eviction   the pure policy: admit, evict the LRU idle model, drain the LRU busy one, or wait
    admission  `--models-max` slots and the FIFO of models waiting for one
    model      `ModelHandle`: one owner task per model, commands with reply futures
    process    spawning, readiness polling and stopping one worker subprocess
    pool       all models by name/alias, wired together; started and stopped with the app
    upstream   the lean keep-alive HTTP/1.1 client used on the hot path
    proxy      forwarding one request (JSON whole, SSE chunk by chunk, error event on a crash)
    events     the one place lifecycle and request events are emitted (/models/sse listens)
    app        the ASGI app: auth, CORS, proxied routes, /v1/models, /models/load|unload|sleep|sse
    cli        `omni-router --preset FILE ...`
"""
