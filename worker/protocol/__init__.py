"""The worker's public contract: what the router may import from `worker` (and nothing else).

    strict       the one rule for request bodies: an unknown field is a 400 naming it
                 (`StrictModel`), the fields refused with a reason, the dropped "off" values
    errors       the one error envelope (`APIError`) and request-body parsing
    wire         the request models of every route the worker serves (the router's OpenAPI schemas)
    sampling     `SamplingParams`, the plain value the request models convert themselves into
    sampler_order  llama-server's `samplers`: the sampler chain's order and members
    front        the CORS and API-key ASGI layers, llama-server's rules, used by both servers
    profile_log  profiling runs and their JSONL event format (/start_profile, /stop_profile)
    modalities   what an HF model folder takes as input (images: an Idefics3), for both sides
    fim_tokens   the fill-in-the-middle token texts (the worker's tokenizers, the router's /api/show)
    speech       text to speech: /v1/audio/speech's body, a voice's description, the sentence splitter
    model_names  "<model>:<adapter>": an adapter's default name, for the router's routing and the worker
    defaults     the worker's command-line defaults the router relies on (--parallel, --ctx-size)
"""
