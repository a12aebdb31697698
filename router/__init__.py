"""omni-router's router: one OpenAI-compatible endpoint in front of one worker process per model.

    cli            `omni-router --preset FILE ...` (and `profile-report`)
    banner         the startup summary: models found, UI and API URLs, where the logs are
    presets        INI/TOML presets -> validated `ModelPreset`s (errors name file:line / key path)
    variants       request defaults a preset sets per request, and the variants (`variant-of`) built on them
    worker_flags   every omni-worker flag as a preset key (read from `omni-worker --flags-json`)
    events         the one place lifecycle and request events are emitted (/models/sse, metrics listen)
    log_ring       bounded line rings: each worker's output and the router's own log
    endless        the event streams that never end by themselves (/models/sse, /logs/stream), ended at a stop
    upstream       the lean keep-alive HTTP/1.1 client to the workers (the hot path)
    prompt_cache_dir  each model's disk prompt-cache folder (default under the data dir) and its size
    discovery/     models already on this disk for other tools (the hub cache, Ollama's store, LM Studio)
    hub/           models from a Hugging Face-style hub (`hf-repo` presets, `omni-router pull`)
    lifecycle/     one owner task per model: phases, spawning, admission, eviction, memory
    placement/     workers on a Ray cluster (`--ray`; imported only then): actors, per-node admission
    observability/ metrics, logs, request traces, profiling
    responses/     the OpenAI Responses API, translated onto the workers' chat completions
    anthropic/     Anthropic's Messages API, translated onto the workers' chat completions
    ollama/        Ollama's API (`/api/*`), translated onto the workers' routes
    speech/        chat answers spoken: a chat model paired with a voice (`speech-model`)
    keys/          keys for a team (`--keys`): the route-access table, the middleware, limits, usage
    http/          the ASGI app: the front (auth, CORS, body limit), proxying, the router's own routes

Layers, lowest first (a module imports its own layer or a lower one; tests/unit/test_layering.py):
presets/variants/worker_flags/events/endless/log_ring/upstream/prompt_cache_dir/hub/discovery (and keys'
keyfile and context), lifecycle, placement, observability, keys, responses, anthropic, ollama and speech,
http, cli/banner. From `worker` the router imports `worker.protocol` and `worker.media_encoding`
(spoken answers) only, and it launches workers by command line.
"""
