"""A speech worker: one Piper voice (ONNX Runtime) behind OpenAI's `POST /v1/audio/speech`,
with the worker's contract towards the router (/health with `is_sleeping`, /sleep, /wake,
/v1/models, /metrics), so the router serves it like any other model.

    voice       the Piper voice: load it, speak one sentence (the only module that runs ONNX Runtime)
    synth       `Synthesizer`: the thread that owns the voice (load, sleep, wake, one job at a time)
    metrics     the worker's /metrics counters for speech
    app         the routes: /v1/audio/speech (raw audio or SSE, sentence by sentence) and status
    serve       `omni-worker -m VOICE.onnx`: flags in, the server up, the same ways out as a text worker
"""
