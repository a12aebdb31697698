"""omni-worker: one model behind an OpenAI-compatible HTTP server, with slot-based continuous batching.

    protocol/     what router and worker share: the error envelope, request types, the CORS/API-key front,
                  profile logs
    media_encoding/  speech samples into wav, mp3, opus, aac..., off the event loop (the router uses it too)
    text/         pure text handling: chat templates, detokenizing, stop strings, tool calls, reasoning
    torch_model/  our own PyTorch Llama-family model (the torch backend's forward pass, KV pages, sampler)
    backends/     the Backend Protocol (engine-only) and its thread-safe Vocab; llama.cpp and torch behind it
    engine/       the engine thread: slots, scheduler, prefix and prompt caches, grammar masks, metrics
    speech/       a speech worker: a Piper voice (ONNX Runtime) behind /v1/audio/speech
    server/       the HTTP side: handlers, request preparation, response formats, the CLI
    testing/      the tiny random-weight model factory (tests, demo, benchmarks)

Layers, lowest first (a module imports its own layer or a lower one; tests/unit/test_layering.py):
protocol, media_encoding, text, torch_model, backends, engine, speech, server, testing.
"""
