"""Media encoding: speech samples into the file formats the APIs name. Not part of the worker's
protocol: the router imports it on purpose, for spoken chat answers (router/speech/), and with
it numpy, soundfile and PyAV (tests/unit/test_layering.py lists what the router may import).

    audio    speech samples -> wav, pcm, flac, mp3, opus (libsndfile), aac (PyAV); whole or by piece
    offload  `AudioEncoder`: those encodes (and their base64) in a bounded thread pool, off the event loop
"""
